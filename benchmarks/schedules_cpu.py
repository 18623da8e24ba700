"""The pipeline schedules against 1F1B, per engine (own, fsdp), side by side in one run, with the simulator's
prediction beside each measurement.

One launch of pp=2 gloo processes (one thread each) builds every (engine, schedule) of SCHEDULES on the same
workload (tiny-256: 4 layers, so a V or 2 virtual stages give each chunk one layer; 8 micro-batches of 1
sequence; engine fsdp with reshard_after_forward false throughout, which its zero-bubble schedules need)
and runs their steps round-robin (each step of each in turn), so machine noise hits all alike.
A step's time is the slowest rank's, after a barrier; warm-up steps are excluded; medians are reported.

Own engine: its breakdown's measured bubble per rank (p2p waits, send drains, waiting for the slowest stage)
beside the simulator's: harness.engine.schedules.simulate runs the same programs with each (kind, stage)
costing its measured median (F, B, and for zbv B's input-gradient part and W apart), so the predicted bubble
of a rank is the simulated pipeline time less that rank's compute. Then each schedule's step against 1F1B's:
measured, and predicted (simulated pipeline time plus the measured optimizer and reduction time).
Engine fsdp (torch.distributed.pipelining): step time against its 1F1B; its prediction is the own
engine's simulation of the same schedule at the own engine's measured costs where the own engine has the
program (every schedule here: harness/engine/zero_bubble.py follows torch's orders).

    python benchmarks/schedules_cpu.py [--model tiny-256] [--seq-len 128] [--steps 8] [--micro-batches 8]

Then `own <schedule>/1f1b: measured X predicted Y` and `fsdp <schedule>/1f1b: measured X predicted Y`, and
last the planner's bubble factors (harness/planner/schedules.py) beside the simulator's at the planner's
convention (F = t/3, backward 2t/3, W = g t/3, g the GEMMs' share): no processes, exact.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from _common import workload_parser

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (engine, schedule, virtual_stages)
SCHEDULES = [
    ("own", "1f1b", 1),
    ("own", "interleaved", 2),
    ("own", "zbv", 1),
    ("own", "zero_bubble", 2),
    ("own", "dualpipev", 1),
    ("fsdp", "1f1b", 1),
    ("fsdp", "interleaved", 2),
    ("fsdp", "zbv", 1),
    ("fsdp", "zero_bubble", 2),
    ("fsdp", "dualpipev", 1),
]


def _spec(args, engine: str, schedule: str, v: int):
    from harness.spec import parse_spec

    return parse_spec(
        {
            "workload": {
                "model": args.model,
                "seq_len": args.seq_len,
                "global_batch_size": args.micro_batches,
                "precision": "fp32",
                "device": "cpu",
            },
            "layout": {
                "engine": engine,
                "pp": 2,
                "pipeline_schedule": schedule,
                "virtual_stages": v,
                **({"reshard_after_forward": False} if engine == "fsdp" else {}),
            },
        }
    )


def _bench(ctx, args) -> dict:
    import torch.distributed as dist

    from harness.data.source import token_source
    from harness.frameworks import build_engine

    engines, sources = [], []
    for engine, schedule, v in SCHEDULES:
        spec = _spec(args, engine, schedule, v)
        shape = spec.shape()
        engines.append(build_engine(spec, shape, ctx))
        sources.append(token_source(spec.workload, shape.vocab))
    out = {i: {"step_s": [], "breakdown": [], "timeline": []} for i in range(len(SCHEDULES))}
    for step in range(args.warmup + args.steps):
        for i, eng in enumerate(engines):
            dist.barrier()
            t0 = time.perf_counter()
            eng.train_step(sources[i].global_batch_at(step))
            dt = time.perf_counter() - t0
            if step < args.warmup:
                continue
            out[i]["step_s"].append(dt)
            if SCHEDULES[i][0] == "own":
                d = eng.last_step_details()
                out[i]["breakdown"].append(d["breakdown_s"])
                out[i]["timeline"] += d["pipeline_timeline"]
    return out


def _own_costs(per_rank: list[dict], i: int) -> dict:
    """Median seconds of each (kind, stage) over every measured step."""
    seen: dict[tuple, list] = {}
    for r in per_rank:
        for e in r[i]["timeline"]:
            seen.setdefault((e["kind"], e["stage"]), []).append(e["end_s"] - e["start_s"])
    return {k: statistics.median(v) for k, v in seen.items()}


def _simulate(schedule: str, v: int, micro: int, costs: dict):
    from harness.engine.schedules import all_programs, simulate

    progs = all_programs(schedule, 2, micro, v)
    sim = simulate(progs, costs=costs)
    busy = [sum(end - start for _k, _c, _m, start, end in sim.timeline[r]) for r in range(2)]
    return sim.finish, [sim.finish - b for b in busy]


def main() -> int:
    args = workload_parser(__doc__, "tiny-256", steps=8, warmup=2, seq_len=128, micro_batches=8).parse_args()

    from harness.testing.spawn import spawn

    per_rank = spawn(_bench, 2, args, timeout_s=1800, threads=1, every_rank=True)
    n = len(SCHEDULES)
    step = {i: statistics.median(max(r[i]["step_s"][k] for r in per_rank) for k in range(args.steps)) for i in range(n)}
    print(
        f"model {args.model} seq {args.seq_len} pp 2, {args.micro_batches} micro-batches of 1, "
        f"{args.steps} steps after {args.warmup} warm-up, one thread per rank"
    )
    own_sim: dict[tuple, float] = {}  # (schedule, v) -> predicted step seconds at the own engine's costs
    print("\nown engine: bubble per rank, measured (breakdown) | simulated at the measured F/B/W costs")
    for i, (engine, schedule, v) in enumerate(SCHEDULES):
        if engine != "own":
            continue
        costs = _own_costs(per_rank, i)
        finish, sim_bubble = _simulate(schedule, v, args.micro_batches, costs)
        measured = [statistics.median(b["bubble"] for b in r[i]["breakdown"]) for r in per_rank]
        rest = statistics.median(
            max(r[i]["breakdown"][k]["optimizer"] + r[i]["breakdown"][k]["dp_comm"] for r in per_rank)
            for k in range(args.steps)
        )
        own_sim[(schedule, v)] = finish + rest
        per_kind = " ".join(f"{k}{s} {c * 1e3:.1f}" for (k, s), c in sorted(costs.items(), key=lambda x: x[0][::-1]))
        print(
            f"  {schedule + (f' v{v}' if v > 1 else ''):14s} step {step[i] * 1e3:7.1f} ms  bubble rank0/rank1 "
            f"{measured[0] * 1e3:6.1f}/{measured[1] * 1e3:6.1f} ms | simulated {sim_bubble[0] * 1e3:6.1f}/"
            f"{sim_bubble[1] * 1e3:6.1f} ms\n      median ms per (kind, stage): {per_kind}"
        )
    print("\nschedule step time / the same engine's 1F1B: measured | predicted (simulator, own engine's costs)")
    for engine in ("own", "fsdp"):
        base = next(i for i, s in enumerate(SCHEDULES) if s[0] == engine and s[1] == "1f1b")
        for i, (e, schedule, v) in enumerate(SCHEDULES):
            if e != engine or i == base:
                continue
            pred = own_sim.get((schedule, v))
            shown = f"{pred / own_sim[('1f1b', 1)]:.3f}" if pred is not None else "-"
            name = schedule + (f" v{v}" if v > 1 else "")
            print(
                f"{engine} {name}/1f1b: measured {step[i] / step[base]:.3f} predicted {shown}  "
                f"({step[i] * 1e3:.1f} / {step[base] * 1e3:.1f} ms)"
            )
    print(
        "\nbubble as a fraction of 1F1B's, pp 4, 32 micro-batches, F = t/3, backward 2t/3, W = g t/3: "
        "planner | simulator"
    )
    from harness.engine.schedules import all_programs, simulate
    from harness.planner.schedules import bubble_factor

    base = simulate(all_programs("1f1b", 4, 32), 1 / 3, 2 / 3).finish - 32
    for g in (0.5, 0.75, 1.0):
        cells = []
        for schedule, v in (("interleaved", 2), ("zero_bubble", 2), ("zbv", 1)):
            c = 2 if schedule == "zbv" else v
            sim = simulate(all_programs(schedule, 4, 32, c), 1 / 3 / c, 2 / 3 / c, g / 3 / c).finish - 32
            cells.append(f"{schedule} {bubble_factor(schedule, v, 4, g):.3f} | {sim / base:.3f}")
        print(f"  g {g}: " + ";  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
