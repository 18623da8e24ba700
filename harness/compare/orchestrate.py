"""Run a comparison: one workload under several engines and layouts, each run in its own
launcher process group (harness.launch.run_spec), a loss-parity check across all of them and a
fingerprint check. The report is written from the returned summary (harness.report.compare).

The verdict is recorded twice: in the report's JSON summary, and in every run's record in the
results store (a `comparison` section: name, id, verdict, this run's parity, tolerance).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
import uuid

from harness.compare.drift_control import load_drift_check, measure_rounds
from harness.compare.groups import check_groups, check_policies
from harness.compare.parity import PASS, compare_fingerprints, max_rel_diff
from harness.compare.spec import BF16_BASELINE, CompareSpec, PlannedRun
from harness.errors import SpecError
from harness.model.training import precision_policy
from harness.profiling import MEASURED_SOURCE
from harness.spec import parse_spec
from harness.store.fields import row


def _loadavg() -> list[float] | None:
    """1/5/15-minute load: other work on the machine shows up in step times, so the report says it."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def comparison_threads(cs: CompareSpec) -> int:
    """Threads per process for every run of a comparison: cores // the comparison's largest
    process count (OMP_NUM_THREADS where the user set it). The single-device reference then
    runs with the threads one rank of a multi-process run has, not with every core: otherwise
    its step time measures another thread count (and, on a shared machine, other load)."""
    from harness.launch import threads_per_process

    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return threads_per_process(max([cs.nproc or 1] + [p.nproc for p in cs.runs]))


def comparison_matmul_peak(workload: dict, threads: int) -> dict | None:
    """The one matmul peak every run's "MFU vs measured matmul" divides by, measured once per
    comparison before its runs with the runs' threads per process and compute dtype: a peak each
    run measured for itself moved with the load of its moment, so runs could not be compared on
    it. On a GPU in a fresh process (this one must hold no CUDA context while the runs use the
    devices); None where the microbenchmark could not run (the column is then left out)."""
    import torch

    from harness.measure.mfu import measure_matmul_tflops

    policy = precision_policy(parse_spec({"workload": workload}).workload)  # the workload checked, as compare/spec's
    dtype = str(policy.peak_matmul_dtype).removeprefix("torch.")
    device = workload.get("device") or "cpu"
    if device == "cpu":
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            tflops = measure_matmul_tflops(torch.device("cpu"), getattr(torch, dtype))
        finally:
            torch.set_num_threads(before)
    else:
        import subprocess

        code = (
            "import torch; from harness.measure.mfu import measure_matmul_tflops; "
            f"print(measure_matmul_tflops(torch.device({device!r}), torch.{dtype}))"
        )
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            tflops = float(out.stdout.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None
    return {"tflops": tflops, "dtype": dtype, "device": device, "threads": threads}


def with_comparison_peak(entry: dict, peak: dict | None) -> dict:
    """The run's table row and metrics with "MFU vs measured matmul" against the comparison's one peak (PaLM
    FLOPs in the row, every convention in the metrics; per device: a run's tokens/s over its processes)."""
    m = entry["metrics"]
    fpt, tps = m.get("flops_per_token") or {}, m.get("tokens_per_s")
    ok = peak and fpt.get("palm") and tps and entry["status"] == "ok"
    mfu = {k: v * tps / (entry["nproc"] * peak["tflops"] * 1e12) for k, v in fpt.items() if v} if ok else None
    entry["row"]["mfu_vs_measured_matmul"] = mfu["palm"] if mfu else None
    # one definition in the JSON too: the run's metrics hold the same figure (every FLOP convention), not the
    # one against the peak the run measured for itself (its measured_matmul_tflops stays, as measured)
    m["mfu_vs_measured_matmul"] = mfu
    return entry


def _first_error_line(error: str | None) -> str:
    if not error:
        return ""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    return lines[0][:200] if lines else ""


def _breakdown_fields(m: dict) -> dict:
    """A run's breakdown for the summary: the measured steps' where the run has it, so that the
    JSON's `breakdown_ms` sums to the measured median the report sets it against, not to the
    profiled steps' longer ones (kept as `breakdown_profiled_ms`)."""
    measured = m.get("breakdown_measured_ms")
    return {
        "breakdown_ms": measured or m.get("breakdown_ms"),
        "breakdown_source": MEASURED_SOURCE if measured else m.get("breakdown_source"),
        "breakdown_profiled_ms": m.get("breakdown_ms") if measured else None,
        "collectives": m.get("collectives"),
    }


def _run_entry(plan: PlannedRun, record: dict) -> dict:
    m = record.get("metrics") or {}
    describe = m.get("engine") or {}
    return {
        "label": plan.label,
        "engine": plan.spec.layout.engine,
        "layout": plan.spec.to_dict()["layout"],
        "launcher": plan.launcher,
        "nproc": plan.nproc,
        "is_reference": plan.is_reference,
        "baseline": plan.baseline,
        "status": record.get("status"),
        "run_id": record.get("run_id"),
        "error": record.get("error"),
        "error_line": (record.get("error_line") or _first_error_line(record.get("error")))
        if record.get("status") != "ok"
        else "",
        "log": (record.get("launch") or {}).get("log"),
        "command": (record.get("launch") or {}).get("command"),  # the launcher's, as the record keeps it
        "spec": plan.spec.to_dict(),  # the run's resolved spec: what its launch command's spec file held
        "wall_s": (record.get("launch") or {}).get("wall_s"),
        "losses": m.get("losses") or [],
        "metrics": {k: v for k, v in m.items() if k not in ("losses", "engine")},  # those two: just above and below
        "row": row(record),  # what the report's table of runs shows (harness.store.fields)
        "describe": describe,
        "precision_policy": describe.get("precision_policy"),
        "workload_override": plan.workload_override,
        "override_note": (
            "workload overridden: " + ", ".join(f"{k}={v}" for k, v in plan.workload_override.items())
            if plan.workload_override
            else ""
        ),
        "fingerprint": record.get("fingerprint") or {},
        # where the step goes, for machines (null where the run did not measure it): the breakdown the
        # report shows (the measured steps' where the run clocked them, else the profiled steps'), the
        # profiled steps' apart, the collectives and the kept traces
        **_breakdown_fields(m),
        "traces": record.get("traces") or [],
    }


def fp8_vs_bf16(entries: list[dict], cs: CompareSpec) -> dict | None:
    """What FP8 costs, measured: the fp8 reference's losses against the bf16 reference's (the same
    workload, weights and batches) over the parity steps; None without an fp8 workload's bf16 baseline (where
    a bf16 precision group's reference is that same run, that reference: harness.compare.groups)."""
    ref = next((e for e, p in zip(entries, cs.runs, strict=True) if p.is_reference), None)
    base = next((e for e, p in zip(entries, cs.runs, strict=True) if p.baseline), None)
    if base is None and cs.runs and cs.runs[0].spec.workload.precision == "fp8":
        base = next((e for e in entries if e["label"] == BF16_BASELINE and e["is_reference"]), None)
    if ref is None or base is None or not ref["losses"] or not base["losses"]:
        return None
    n = min(cs.parity_steps, len(ref["losses"]), len(base["losses"]))
    worst, at = max_rel_diff(ref["losses"], base["losses"], n)
    return {"max_rel_diff": worst, "worst_step": at, "steps": n, "fp8": ref["label"], "bf16": base["label"]}


def _groups_info(cs: CompareSpec) -> dict:
    """{"precision_groups": [each group's name, reference, tolerance, labels, policy]} where the runs hold
    several precision policies (harness.compare.groups); nothing for one."""
    if len(cs.groups) < 2:
        return {}
    specs = {p.label: p.spec for p in cs.runs}
    return {
        "precision_groups": [
            g.info(precision_policy(specs[g.labels[0]].workload).describe(), specs[g.labels[0]].workload)
            for g in cs.groups
            if g.labels
        ]
    }


def check_before_launch(cs: CompareSpec) -> None:
    """What the plan can tell before the first launch: that something is compared with the
    reference (a matrix whose every cell cannot run is a mistake, not a failed comparison), that
    each run's launcher can start its processes, and that this machine runs every run's kernels
    (harness.launch.machine.check_machine). A SpecError line; nothing launched."""
    from harness.launch import check_launcher
    from harness.launch.machine import check_machine

    if not [p for p in cs.runs if not p.is_reference and not p.baseline]:
        left = [(c["label"], c["why"]) for c in cs.not_runnable] + list(cs.skipped)
        first = (
            f": {left[0][0]}: {left[0][1]}" + (f" (and {len(left) - 1} more)" if len(left) > 1 else "") if left else ""
        )
        raise SpecError("matrix" if cs.not_runnable else "runs", f"no run can be launched besides the reference{first}")
    for p in cs.runs:
        check_launcher(p.launcher, p.nproc, field=f"launcher (run {p.label!r})")
    check_machine([(f"run {p.label!r}", p.spec) for p in cs.runs])


def _with_turns(run_spec, env: dict, spec, *, turn_env: dict, **kw) -> dict:
    """launch.run_spec with the turn variables (compare.interleave) in the run's environment."""
    return run_spec(spec, extra_env={**env, **turn_env}, **kw)


def _turn_blocks(entries: list[dict], cs: CompareSpec, k: int) -> None:
    """Each interleaved run's measured step times grouped by the turn they were measured in."""
    from harness.compare.interleave import turn_blocks

    for e, plan in zip(entries, cs.runs, strict=True):
        times = e["metrics"].get("step_times_s") or []
        if e["status"] == "ok" and times:
            e["step_time_rounds_s"] = turn_blocks(times, plan.spec.workload.warmup_steps, k)
            e["step_time_unit"] = "turn"


def run_comparison(
    cs: CompareSpec,
    *,
    store_path: str,
    log_dir: str | None = None,
    progress: bool = True,
    launch_fn=None,
    profile_steps: int | None = None,
    drift_check: bool = False,
    rounds: int = 1,
    interleave: int = 0,
) -> dict:
    """Launch every planned run in turn, check parity and fingerprints; the summary the report
    (harness.report.compare) is written from. `profile_steps`: each run's profiled steps after
    its measured ones (None: the runs' default, harness.profiling.DEFAULT_STEPS). `drift_check`:
    measure the first finished run again after the last (load_drift_check; `harness compare` asks for
    it, the tests' comparisons do not pay its launch). `rounds` > 1: every run launched
    that many times in alternating order (measure_rounds; its later rounds unprofiled), no drift check.
    `interleave` K > 0: every run kept alive side by side and measured in turns of K steps (compare.interleave;
    `launch_fn` then takes turn_env), no drift check."""
    from tqdm import tqdm

    from harness.launch import cpu_cores
    from harness.store import ResultsStore, now_iso
    from harness.store.record import harness_version

    threads = comparison_threads(cs)
    peak = comparison_matmul_peak(cs.workload, threads) if launch_fn is None else None
    if launch_fn is None:  # every run, the 1-process reference included, gets the same threads per process
        from harness.launch import run_spec
        from harness.profiling import ENV

        env = {"OMP_NUM_THREADS": str(threads)}
        if profile_steps is not None:
            env[ENV] = str(profile_steps)
        later = functools.partial(run_spec, extra_env={**env, ENV: "0"})  # later rounds: measured steps only
        launch_fn = functools.partial(run_spec, extra_env=env)
        turned = functools.partial(_with_turns, run_spec, env)
    else:
        later = turned = launch_fn
    comparison_id = uuid.uuid4().hex[:12]
    sweep = f"compare:{cs.name}:{comparison_id}"
    log_dir = log_dir or os.path.join(tempfile.gettempdir(), f"harness-compare-{cs.name}-{comparison_id}")
    for label, why in cs.skipped:
        print(f"note: skipping {label}: {why}", file=sys.stderr)
    entries, records = [], []
    bar = tqdm(
        cs.runs,
        desc="compare",
        unit="run",
        disable=not progress,
        file=sys.stderr,
        bar_format="{l_bar}{bar:20}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]",
    )
    started = time.monotonic()
    load_before = _loadavg()
    kw = {"store_path": store_path, "timeout_s": cs.timeout_s, "log_dir": log_dir}
    interleaved, load_drift = None, None
    if interleave > 0:
        from harness.compare.interleave import run_interleaved

        interleaved, load_drift = run_interleaved(cs, turned, interleave, sweep=sweep, **kw)
    for i, plan in enumerate(bar):
        bar.set_description(f"compare: {plan.label}")
        spec = plan.spec.to_dict()
        spec["store"] = store_path  # as given: relative stays relative (the runs share this cwd)
        record = (
            interleaved[i]
            if interleaved
            else launch_fn(spec, nproc=plan.nproc, launcher=plan.launcher, sweep=sweep, point_key=plan.label, **kw)
        )
        entry = with_comparison_peak(_run_entry(plan, record), peak)
        entries.append(entry)
        records.append(record)
        st = (entry["metrics"].get("step_time_s") or {}).get("median")
        msg = (
            f"{plan.label}: {entry['status']}"
            + (f", step {st * 1e3:.1f} ms" if st else "")
            + (f" ({entry['error_line']})" if entry["error_line"] else "")
        )
        bar.write(msg, file=sys.stderr)
    bar.close()
    if interleaved:
        _turn_blocks(entries, cs, interleave)
    elif rounds > 1:
        load_drift = measure_rounds(cs, entries, later, rounds, sweep, **kw)
        entries = [with_comparison_peak(e, peak) for e in entries]
    elif drift_check:
        load_drift = load_drift_check(cs, entries, launch_fn, sweep, **kw)
        if load_drift.get("verdict"):
            print(f"load drift check ({load_drift['run']} again): {load_drift['verdict']}", file=sys.stderr)

    if len(cs.groups) > 1:  # which runs may be set side by side (harness.compare.groups)
        for e, p in zip(entries, cs.runs, strict=True):
            e["precision_group"] = p.group
            if e["workload_override"] and not p.is_reference:
                e["override_note"] += f" (precision group {p.group}: compared within it only)"
    compared = [e for e, p in zip(entries, cs.runs, strict=True) if not p.baseline]
    parity = check_groups(compared, cs)  # each run against its precision group's reference
    fingerprints = compare_fingerprints(entries)
    failed = [e["label"] for e in compared if e["status"] != "ok"]
    workload = parse_spec({"workload": cs.workload}).workload
    policy = check_policies(compared, cs, workload.precision)  # what each run held, not what the spec asked for
    verdict = PASS if parity["verdict"] == PASS and not failed and policy["same"] else "FAIL"
    summary = {
        "name": cs.name,
        "comparison_id": comparison_id,
        "created_at": now_iso(),
        "verdict": verdict,
        "store": store_path,
        "sweep_tag": sweep,
        "nproc": cs.nproc,
        "workload": cs.workload,
        "tolerance_source": cs.tolerance_source,
        "parity": parity,
        "fingerprints": fingerprints,
        "failed_runs": failed,
        "skipped": cs.skipped,
        "not_runnable": cs.not_runnable,
        "precision_policy": precision_policy(workload).describe(),
        "policy": policy,
        "fp8_vs_bf16": fp8_vs_bf16(entries, cs),
        "load_average": {"before": load_before, "after": _loadavg()},
        "load_drift": load_drift,
        **_groups_info(cs),
        "threads_per_process": threads,
        "cpu_cores": cpu_cores(),  # this process's affinity: a run with more busy threads is oversubscribed
        "versions": harness_version(),  # with the runs' fingerprints (torch, each framework): what measured it
        "matmul_peak": peak,
        "wall_s": round(time.monotonic() - started, 1),
        "runs": [{k: v for k, v in e.items() if k != "losses"} for e in entries],
        "loss_table": {e["label"]: e["losses"][: cs.parity_steps] for e in entries if e["losses"]},
        "loss_curves": {e["label"]: e["losses"] for e in entries if e["losses"]},  # every step, for the plot
    }
    # the compared workload is the one without overrides: take it from a run that has none
    base = next((r for r, e in zip(records, entries, strict=True) if not e["workload_override"]), None)
    if base is not None:
        summary["workload"] = (base.get("spec") or {}).get("workload")

    store = ResultsStore(store_path)
    by_label = {p["label"]: p for p in parity["runs"]}
    tolerance_of = {label: g.tolerance for g in cs.groups for label in g.labels}
    for record, entry in zip(records, entries, strict=True):
        record["comparison"] = {
            "name": cs.name,
            "id": comparison_id,
            "verdict": verdict,
            "parity": by_label.get(entry["label"]),
            "tolerance": tolerance_of.get(entry["label"], cs.tolerance),  # its precision group's
            "parity_steps": cs.parity_steps,
            "fingerprints_same": fingerprints["same"],
            "label": entry["label"],
        }
        store.write(record)
    return summary
