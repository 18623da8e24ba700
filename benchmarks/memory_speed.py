"""`harness memory` speed: one full-size trace per layout, as the command runs it (trace_spec).

Target: under 120 s per layout on 2 cores (a traced layout is every pipeline stage built and
stepped on fake tensors in this one process). The layouts are the heaviest of the agreement cases
in tests/test_memory_trace.py: the own engine at 65B (tp8 pp2 dp8) and at 30B with sequence 8192,
SP and selective checkpointing, and engine fsdp at 7B (dp8, blocks kept gathered). Per layout the
wall and CPU seconds (the CPU time is the steadier figure on a shared machine) and each stage's
seconds are printed. Last line: `ratio: <slowest layout's wall seconds / 120 s>`.

    python benchmarks/memory_speed.py [--rounds 1] [--only INDEX ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET_S = 120.0
LAYOUTS = [  # (model, seq_len, global batch, layout)
    ("paper-65b", 2048, 2048, {"engine": "own", "zero_stage": 1, "tp": 8, "pp": 2, "dp": 8}),
    (
        "paper-30b",
        8192,
        512,
        {
            "engine": "own",
            "zero_stage": 1,
            "tp": 4,
            "pp": 2,
            "dp": 8,
            "sequence_parallel": True,
            "activation_checkpointing": "selective",
        },
    ),
    ("llama2-7b", 2048, 512, {"engine": "fsdp", "dp": 8, "reshard_after_forward": False}),
]


def trace_once(model: str, seq: int, gbs: int, layout: dict) -> tuple[float, float, dict]:
    from harness.memtrace.result import trace_spec
    from harness.spec import parse_spec

    spec = parse_spec(
        {
            "workload": {"model": model, "seq_len": seq, "global_batch_size": gbs, "precision": "bf16"},
            "layout": {"attention": "sdpa", "rmsnorm": "torch", **layout},
        }
    )
    before = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    result = trace_spec(spec)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_SELF)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", type=int, action="append", help="index into the layouts (default: all)")
    args = p.parse_args()
    chosen = [LAYOUTS[i] for i in args.only] if args.only else LAYOUTS
    slowest = 0.0
    for model, seq, gbs, layout in chosen:
        walls, cpus, result = [], [], None
        for _ in range(args.rounds):
            wall, cpu, result = trace_once(model, seq, gbs, layout)
            walls.append(wall)
            cpus.append(cpu)
        stages = ", ".join(f"stage {r['stage']} {r['seconds']:.1f} s" for r in result["ranks"])
        label = " ".join(f"{k}={v}" for k, v in layout.items())
        print(
            f"{model} seq {seq} {label}: wall median {statistics.median(walls):.1f} s "
            f"(max {max(walls):.1f}, {args.rounds} rounds); CPU median {statistics.median(cpus):.1f} s; {stages}"
        )
        slowest = max(slowest, statistics.median(walls))
    print(f"target {TARGET_S:.0f} s per layout; ratio: {slowest / TARGET_S:.2f}")


if __name__ == "__main__":
    main()
