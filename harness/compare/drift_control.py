"""Load drift between the runs of a comparison, which are launched one after another: either every run
in alternating rounds, compared round by round (measure_rounds, `harness compare --rounds N`), or,
by default, the first finished run measured again after the last (load_drift_check), whose change
widens every pair's ratio interval in the report (harness.report.drift.load_drift_factor)."""

from __future__ import annotations

import math
import time

from harness.compare.spec import CompareSpec

DRIFT_METHOD = (
    "runs are launched one after another; the first finished run is measured again after the last "
    "(same spec, steps and threads) and its second measurement set against its first by the ratio "
    "interval of their step times: where it finds the machine's speed changed, every pair's ratio "
    "interval is widened by the drift's far end either way before it decides"
)


def load_drift_check(cs: CompareSpec, entries: list[dict], launch, sweep: str, **launch_kw) -> dict:
    """The first finished run (the single-device reference where it finished: one process, the cheapest)
    launched again after the last run; its step times against its first measurement's
    (measure.stats.compare_times, repeat over first), with the method stated. A note instead where no
    run finished with step times, or the repeat failed."""
    from harness.measure.stats import compare_times

    timed = [(e, p) for e, p in zip(entries, cs.runs, strict=True) if e["status"] == "ok"]
    timed = [(e, p) for e, p in timed if (e["metrics"].get("step_times_s") or [])]
    if not timed:
        return {"method": DRIFT_METHOD, "note": "Load drift: not checked (no run finished with step times)."}
    entry, plan = next(((e, p) for e, p in timed if p.is_reference), timed[0])
    spec = plan.spec.to_dict()
    spec["store"] = launch_kw["store_path"]
    started = time.monotonic()
    record = launch(
        spec,
        nproc=plan.nproc,
        launcher=plan.launcher,
        sweep=f"{sweep}:load-drift",
        point_key=f"{plan.label} (load drift check)",
        **launch_kw,
    )
    again = ((record.get("metrics") or {}).get("step_times_s") or []) if record.get("status") == "ok" else []
    if not again:
        return {
            "method": DRIFT_METHOD,
            "run": plan.label,
            "note": f"Load drift: not checked ({plan.label}'s repeat failed).",
        }
    return {
        **compare_times(again, entry["metrics"]["step_times_s"]),
        "method": DRIFT_METHOD,
        "run": plan.label,
        "repeat_step_times_s": again,
        "repeat_run_id": record.get("run_id"),
        "wall_s": round(time.monotonic() - started, 1),
    }


ROUNDS_METHOD = (
    "every run is launched {rounds} times, in alternating order (the plan's order, then reversed, ...); "
    "each run's step times are every round's, and two runs are compared round by round: the round is the "
    "unit (the steps of one launch share its load), each round's own ratio, the interval across rounds "
    "(measure.blocks: Student's t below 6 rounds, the sign test's from 6); each run's "
    "breakdown is the clocked median step of its round nearest the pooled median"
)


def _scaled(values, factor: float):
    if isinstance(values, dict):
        return {k: _scaled(v, factor) for k, v in values.items()}
    return values * factor if isinstance(values, (int, float)) and not isinstance(values, bool) else values


def pool_rounds(entry: dict, rounds: list[list[float]]) -> None:
    """A run's figures over every round's measured steps: the step-time summary, and each rate taken at
    the median step (tokens/s, MFU, TFLOP/s) rescaled to the pooled median; the rounds kept apart."""
    from harness.measure.stats import summarize

    times = [x for r in rounds for x in r]
    m, row = entry["metrics"], entry["row"]
    st = summarize(times)
    factor = m["step_time_s"]["median"] / st["median"]
    m.update(step_times_s=times, step_time_s=st)
    for key in ("tokens_per_s", "tokens_per_s_per_device", "mfu", "mfu_vs_measured_matmul"):
        m[key] = _scaled(m.get(key), factor)
    m["achieved_tflops_per_device"] = _scaled(m.get("achieved_tflops_per_device"), factor)
    for key in ("tokens_per_s", "tokens_per_s_per_device", "mfu_palm", "mfu_megatron", "hfu"):
        row[key] = _scaled(row.get(key), factor)
    row.update(
        step_time_median_s=st["median"],
        step_time_ci95_s=(st["ci95_low"], st["ci95_high"]),
        step_time_ci95_low_s=st["ci95_low"],
        step_time_ci95_high_s=st["ci95_high"],
        steps_measured=st["n"],
        step_time_ci_coverage=st["ci_coverage"],
    )
    entry["step_time_rounds_s"] = rounds


def _nearest_breakdown(entry: dict, rounds: list[dict]) -> None:
    """The breakdown of the round whose median step lies nearest the pooled median (each round clocks its
    own median step), so that the breakdown the report sets against the pooled median describes a step
    like it; the round is named (breakdown_round, 1-based)."""
    from harness.profiling import MEASURED_SOURCE

    pooled = entry["metrics"]["step_time_s"]["median"]
    med = [((m.get("step_time_s") or {}).get("median") or math.inf) for m in rounds]
    r = min(range(len(rounds)), key=lambda j: abs(med[j] - pooled))
    entry["breakdown_round"] = r + 1
    if r == 0 or not rounds[r].get("breakdown_measured_ms"):
        entry["breakdown_round"] = 1
        return
    for key in ("breakdown_measured_ms", "breakdown_measured_ms_by_rank", "breakdown_measured_steps"):
        entry["metrics"][key] = rounds[r].get(key)
    entry.update(breakdown_ms=rounds[r]["breakdown_measured_ms"], breakdown_source=MEASURED_SOURCE)


def measure_rounds(cs: CompareSpec, entries: list[dict], launch, rounds: int, sweep: str, **launch_kw) -> dict:
    """Rounds 2..`rounds` of every run that finished (alternating order, ROUNDS_METHOD), each round's
    record in the store under the sweep tag `<sweep>:round<r>`; every run's figures pooled over its
    rounds (pool_rounds). The summary's `load_drift`: the method and how far each run's median moved
    from its first round to its last."""
    from harness.measure.stats import summarize

    order = [i for i, e in enumerate(entries) if e["status"] == "ok" and e["metrics"].get("step_times_s")]
    times = {i: [list(entries[i]["metrics"]["step_times_s"])] for i in order}
    metrics: dict = {
        i: [dict(entries[i]["metrics"])] for i in order
    }  # each round's, for its breakdown (a copy: pooled below)
    failed: list[str] = []
    for r in range(2, rounds + 1):
        for i in order[::-1] if r % 2 == 0 else order:
            if i not in times:
                continue
            plan = cs.runs[i]
            spec = plan.spec.to_dict()
            spec["store"] = launch_kw["store_path"]
            rec = launch(
                spec,
                nproc=plan.nproc,
                launcher=plan.launcher,
                sweep=f"{sweep}:round{r}",
                point_key=plan.label,
                **launch_kw,
            )
            got = (rec.get("metrics") or {}).get("step_times_s") if rec.get("status") == "ok" else None
            if got:
                times[i].append(list(got))
                metrics[i].append(rec.get("metrics") or {})
            else:  # a run whose later round failed keeps its first round alone
                failed.append(f"{plan.label} (round {r})")
                del times[i]
    moved = {}
    for i, rs in times.items():
        pool_rounds(entries[i], rs)
        moved[entries[i]["label"]] = summarize(rs[-1])["median"] / summarize(rs[0])["median"]
        _nearest_breakdown(entries[i], metrics[i])
    note = f"Load drift: {ROUNDS_METHOD.format(rounds=rounds)}."
    if moved:
        note += (
            f" Each run's median step moved from its first round to its last by {min(moved.values()):.2f}x "
            f"to {max(moved.values()):.2f}x."
        )
    if failed:
        note += " A later round failed for " + ", ".join(failed) + ": those runs keep their first round alone."
    return {"method": ROUNDS_METHOD.format(rounds=rounds), "rounds": rounds, "moved": moved, "note": note}
