"""Every engine this machine has, at world size 1 on LLaMA-13B-shaped layers: the CUDA allocator peak a
real run measures beside `harness memory`'s traced peak and the planner's prediction, so the tracer and
the planner are checked against a real allocator.

For each engine (own, FSDP2, Megatron-core where megatron.core imports, DeepSpeed where deepspeed imports):
  measured  `harness train` under the engine's launcher (1 process): torch.cuda.max_memory_allocated over
            the measured steps (the record's peak_memory_bytes), its census, step time and losses;
  traced    `harness memory`'s trace of the same spec (fake tensors on the CPU, engines own and fsdp
            only): its live-tensor peak (what the allocator counts) and its total (with the CUDA context
            and fragmentation terms);
  planner   `harness plan`'s memory model of the same layout and engine (harness/planner/memory.py):
            its tensors (the total less the context and fragmentation it adds) and its total.
Every engine runs the same workload (the same weights, tokens and attention: naive, the one Megatron's
local spec has). A row is written after each engine (a killed run keeps what it measured); engines are
not started once the time budget is spent. `--device cpu` is this script's smoke test (a tiny shape; the
peak is then the process's RSS, not comparable).

The variants (FP8, compile, cp ring blocks, zero-bubble), each beside its baseline, are
scripts/gpu_variants.py: scripts/gpu_engines.sh runs it after this one, within one deadline.

    python scripts/gpu_engines.py --out gpu-out                    # on the GPU (scripts/gpu_engines.sh)
    python scripts/gpu_engines.py --out /tmp/x --device cpu         # smoke test, tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024**3


def gib(nbytes: float) -> float:
    """GiB to 4 significant figures (13B-shaped layers: tens of GiB; the CPU smoke test: a few MiB)."""
    return float(f"{nbytes / GIB:.4g}")


# engine -> its layout fields at world size 1
ENGINES = {
    "own": {"engine": "own"},
    "fsdp": {"engine": "fsdp"},
    "megatron": {"engine": "megatron"},
    "deepspeed": {"engine": "deepspeed", "zero_stage": 1},
}
NEEDS = {"megatron": "megatron.core", "deepspeed": "deepspeed"}  # the package an engine imports


def missing(engine: str) -> str:
    """Empty when the engine's package imports here, else why not."""
    module = NEEDS.get(engine)
    if module and importlib.util.find_spec(module.split(".")[0]) is None:
        return f"{module} is not installed (carry its wheel in wheels/, scripts/gpu_engines.sh)"
    return ""


def raw_spec(args, engine: str, store: str) -> dict:
    return {
        "name": f"gpu-engines-{engine}",
        "store": store,
        "workload": {
            "model": args.model,
            "model_overrides": {"layers": args.layers},
            "seq_len": args.seq_len,
            "global_batch_size": args.global_batch_size,
            "steps": args.steps,
            "warmup_steps": 2,
            "precision": "bf16",
            "device": args.device,
            "seed": 1234,
        },
        "layout": {**ENGINES[engine], "micro_batch_size": 1, "attention": "naive", "rmsnorm": "torch"},
    }


def planner(spec) -> dict:
    """The planner's worst stage for this layout under this engine's memory model."""
    from harness.planner.layout import PlannerLayout, Workload
    from harness.planner.memory import worst_stage_memory

    lay = spec.layout
    planned = dataclasses.replace(PlannerLayout.from_spec(dataclasses.asdict(lay)), engine=lay.engine)
    _, parts = worst_stage_memory(
        spec.shape(), planned, Workload(spec.workload.seq_len, spec.workload.global_batch_size, 2)
    )
    return {
        "planner_tensors_gib": gib(parts["total"] - parts["overhead"]),
        "planner_total_gib": gib(parts["total"]),
        "planner_model_states_gib": gib(parts["weights"] + parts["gradients"] + parts["optimizer"]),
    }


def traced(spec) -> dict:
    from harness.memtrace.result import trace_spec
    from harness.memtrace.trace import traced_engines

    if spec.layout.engine not in traced_engines():  # what the engines' facts say harness memory traces
        return {"traced": f"not traced: harness memory traces engines {' and '.join(traced_engines())}"}
    t0 = time.monotonic()
    result = trace_spec(spec)
    (rank,) = result["ranks"]  # world size 1: one stage
    live = rank["live_peak_gib"] * GIB  # trace_spec's GiB to 3 decimals (1 MiB): enough at 13B shapes
    states = sum(sum(by.values()) for by in rank["census"].values())  # its census, in bytes
    return {
        "traced_live_peak_gib": gib(live),
        "traced_total_gib": result["traced_peak_gib"],
        "traced_model_states_gib": gib(states),
        "trace_s": round(time.monotonic() - t0, 1),
    }


def measured(spec, raw: dict, store: str, log_dir: str, timeout_s: float) -> dict:
    from harness import launch, registry

    rec = launch.run_spec(
        raw,
        nproc=1,
        launcher=registry.facts(spec.layout.engine).launcher,
        store_path=store,
        timeout_s=timeout_s,
        log_dir=log_dir,
        run_id=f"gpu-engines-{spec.layout.engine}",
    )
    if rec.get("status") != "ok":
        return {"status": rec.get("status"), "error": (rec.get("error") or "")[:300]}
    m = rec["metrics"]
    census = m.get("memory_census") or {}
    return {
        "status": "ok",
        "measured_peak_gib": gib(m["peak_memory_bytes"]),
        "memory_kind": m["memory_kind"],
        "measured_model_states_gib": gib(sum(sum(v.values()) for v in census.values())),
        "step_time_ms": round(m["step_time_s"]["median"] * 1e3, 2),
        "losses": m["losses"][:3],
        "framework": (m.get("engine") or {}).get("framework") or spec.layout.engine,
    }


def one(args, engine: str, store: str) -> dict:
    from harness.errors import SpecError
    from harness.spec import parse_spec

    row = {"engine": engine}
    why = missing(engine)
    if why:
        return {**row, "status": "not installed", "error": why}
    raw = raw_spec(args, engine, store)
    try:
        spec = parse_spec(raw)
    except SpecError as e:
        return {**row, "status": "not runnable", "error": str(e)}
    row.update(planner(spec))
    try:
        row.update(traced(spec))
    except Exception as e:  # noqa: BLE001 - a failed trace is a row's finding, not the end of the script
        row["traced"] = f"trace failed: {type(e).__name__}: {str(e)[:200]}"
    row.update(measured(spec, raw, store, os.path.join(args.out, "logs"), args.timeout_s))
    if row.get("status") == "ok":  # the checks this script exists for, as ratios
        for name in ("traced_live_peak_gib", "planner_tensors_gib"):
            if isinstance(row.get(name), float) and row["measured_peak_gib"]:
                row[name.replace("_gib", "_over_measured")] = round(row[name] / row["measured_peak_gib"], 3)
    return row


def write(args, rows: list[dict], device: str) -> None:
    from harness.memtrace.trace import traced_engines
    from harness.report.render import markdown
    from harness.report.sections import Items, Section, Table

    with open(os.path.join(args.out, "engines.json"), "w") as f:
        json.dump(
            {
                "device": device,
                "model": f"{args.model} layer shapes, {args.layers} layers",
                "seq_len": args.seq_len,
                "global_batch_size": args.global_batch_size,
                "precision": "bf16",
                "rows": rows,
            },
            f,
            indent=2,
        )
    cols = (
        *(
            "engine status measured_peak_gib traced_live_peak_gib planner_tensors_gib measured_model_states_gib "
            "traced_model_states_gib planner_model_states_gib traced_total_gib planner_total_gib step_time_ms"
        ).split(),
    )
    kinds = ", ".join(sorted({r["memory_kind"] for r in rows if "memory_kind" in r}))
    title = (
        f"Engines at world size 1 on {device}: {args.model} layer shapes ({args.layers} layers), seq "
        f"{args.seq_len}, global batch {args.global_batch_size}, bf16, naive attention"
    )
    legend = (
        f"GiB. measured: the run's peak ({kinds}) and its census; traced: `harness memory` (engines "
        f"{' and '.join(traced_engines())}); planner: its "
        "tensors (total less context and fragmentation) and model states. Totals add the CUDA context and "
        "fragmentation."
    )
    notes = [
        f"{r['engine']}: {r.get('error') or r.get('traced')}"
        for r in rows
        if r.get("error") or isinstance(r.get("traced"), str)
    ]
    table = Table(list(cols), [[str(r.get(c, "-")) for c in cols] for r in rows])
    with open(os.path.join(args.out, "engines.md"), "w") as f:
        f.write(markdown(title, [Section("engines", "", body=[legend, table, Items(notes)])], "", contents=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test (tiny shape)")
    ap.add_argument("--model", help="whose layer shapes (default llama-13b; tiny on cpu)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, help="default 2048 (64 on cpu)")
    ap.add_argument("--global-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {','.join(ENGINES)}")
    ap.add_argument("--budget-s", type=float, default=240, help="no engine is started after this many seconds")
    ap.add_argument("--timeout-s", type=float, default=150, help="per engine's run")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.model = args.model or ("tiny" if cpu else "llama-13b")
    args.seq_len = args.seq_len or (64 if cpu else 2048)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        print(f"error: --engines: {unknown[0]!r} is not one of {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    store = os.path.join(args.out, "results.sqlite")
    import torch

    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    start, rows = time.monotonic(), []
    for engine in engines:
        if time.monotonic() - start > args.budget_s:
            rows.append({"engine": engine, "status": "not run (time budget)"})
        else:
            rows.append(one(args, engine, store))
        print(json.dumps(rows[-1]), flush=True)
        write(args, rows, device)
    print(f"wrote {os.path.join(args.out, 'engines.json')} and engines.md in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
