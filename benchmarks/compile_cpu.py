"""torch.compile per transformer block (layout.compile: blocks) against eager (none), side by side, for
every engine that compiles: the step-time speed-up and what compiling cost, per engine, in one run.

For each engine, its eager and its compiled run are built in the same processes (one for single, 2 gloo
processes for the others, each process with half the CPU's cores) through the runner's Trainer, and
their steps are interleaved (eager, compiled, eager, ...), so machine noise hits both alike. The
compiled run compiles in its warm-up step (the spec requires one); its compile time is dynamo's and
inductor's own wall time in that step (CompileWatch's compile_s, the slowest rank's), reported apart and
never in a measured step. Each measured step's time is the slowest rank's; medians with their 95%
confidence interval. The losses of the two runs are checked to agree (fp32, 1e-5 relative:
tests/test_compile.py derives it), so both do the same work. Inductor's on-disk cache is this user's
(TORCHINDUCTOR_CACHE_DIR): a graph compiled by an earlier run is loaded, so compile_s depends on what
ran before (its cache hits and misses are shown).

    python benchmarks/compile_cpu.py [--model tiny-4l] [--seq-len 64] [--steps 10] [--engines single,fsdp]

One row per engine and mode: the median measured step, its CI, the first (warm-up) step's wall time, and
for the compiled run compile_s, graphs, graph breaks and inductor cache hits/misses (in a pipeline the
first step exceeds compile_s: each stage compiles while the others wait for it). Last lines: the losses'
largest difference, `speed-up (eager / compiled step time): single: X  own pp2: Y ...` (> 1: compiled is
faster), and the compile time per engine. Exit 1 when the losses differ beyond 1e-5.
"""

from __future__ import annotations

import os
import sys
import time

from _common import workload_parser

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (processes, layout fields): each engine that honours layout.compile, at one small layout
ENGINES = {
    "single": (1, {"engine": "single"}),
    "own pp2": (2, {"engine": "own", "pp": 2}),
    "own tp2": (2, {"engine": "own", "tp": 2}),
    "fsdp dp2": (2, {"engine": "fsdp", "dp": 2}),
    "deepspeed dp2 ZeRO-1": (2, {"engine": "deepspeed", "dp": 2, "zero_stage": 1}),
}
MODES = ("none", "blocks")


def _pair(ctx, a: dict, fields: dict) -> dict:
    """The engine eager and compiled, steps interleaved; per mode its metrics' step times, losses and
    compile fields, and its warm-up steps' times (the slowest rank's)."""
    from harness import gather
    from harness.run import Trainer
    from harness.spec import parse_spec

    workload = {
        "model": a["model"],
        "seq_len": a["seq_len"],
        "global_batch_size": a["global_batch"],
        "steps": a["steps"],
        "warmup_steps": a["warmup"],
        "device": "cpu",
        "precision": "fp32",
    }
    trainers = {}
    for mode in MODES:
        spec = parse_spec({"workload": workload, "layout": {**fields, "micro_batch_size": a["mbs"], "compile": mode}})
        trainers[mode] = Trainer(spec, ctx, spec.shape(), progress=False)
    warm = {mode: [] for mode in MODES}
    try:
        for step in range(a["warmup"] + a["steps"]):
            for mode, trainer in trainers.items():
                ctx.barrier()  # both ranks start each run's step together
                seconds = trainer.step(step)
                if step < a["warmup"]:
                    warm[mode].append(seconds)
    finally:
        for trainer in trainers.values():
            trainer.close_stream()
    out = {}
    for mode, trainer in trainers.items():
        m = trainer.metrics(measure_matmul=False)
        out[mode] = {
            "stats": m["step_time_s"],
            "losses": m["losses"],
            "compile": m.get("compile"),
            "warmup_s": gather.max_across_ranks(warm[mode], ctx),
        }
    return out


def main() -> int:
    p = workload_parser(__doc__, "tiny-4l", steps=10, warmup=1, seq_len=64, global_batch=8, mbs=2)
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated, of " + ", ".join(ENGINES))
    args = p.parse_args()
    chosen = [x for x in args.engines.split(",") if x]
    for name in chosen:
        if name not in ENGINES:
            print(f"error: --engines: {name!r} is not one of {', '.join(ENGINES)}", file=sys.stderr)
            return 2
    if args.warmup < 1:
        print("error: --warmup: compile: blocks compiles in the first step: needs at least 1", file=sys.stderr)
        return 2

    from harness.testing.spawn import spawn

    a = {key: getattr(args, key) for key in ("model", "seq_len", "global_batch", "mbs", "steps", "warmup")}
    t0 = time.monotonic()
    threads = max(1, (os.cpu_count() or 1) // 2)  # every process the same, single's one too
    results = {}
    for name in chosen:
        world, fields = ENGINES[name]
        results[name] = spawn(_pair, world, a, fields, timeout_s=1800, threads=threads)
    print(
        f"workload: {args.model}, seq {args.seq_len}, global batch {args.global_batch}, micro-batch {args.mbs}, "
        f"fp32, {threads} thread(s) a process; {args.warmup} warm-up + {args.steps} measured steps per run, "
        "eager and compiled interleaved "
        f"({time.monotonic() - t0:.0f} s; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})"
    )
    print(
        f"{'engine':22s} {'compile':8s} {'median ms':>10s} {'95% CI ms':>17s} {'first step s':>13s} "
        f"{'compile_s':>10s} {'graphs':>7s} {'breaks':>7s} {'cache hit/miss':>15s}"
    )
    speedups, worst = {}, 0.0
    for name, res in results.items():
        for mode in MODES:
            r = res[mode]
            st, c = r["stats"], r["compile"] or {}
            ci = f"[{1e3 * st['ci95_low']:.1f}, {1e3 * st['ci95_high']:.1f}]" if "ci95_low" in st else ""
            compiled = (
                f"{c['compile_s']:10.1f} {c['graphs']:7d} {c['graph_breaks']:7d} "
                f"{c['inductor_cache_hits']:>7d}/{c['inductor_cache_misses']:<7d}"
                if c
                else ""
            )
            print(f"{name:22s} {mode:8s} {1e3 * st['median']:10.1f} {ci:>17s} {r['warmup_s'][0]:13.2f} {compiled}")
        eager, comp = res["none"], res["blocks"]
        speedups[name] = eager["stats"]["median"] / comp["stats"]["median"]
        for x, y in zip(eager["losses"], comp["losses"], strict=True):
            worst = max(worst, abs(x - y) / abs(x))
    print(f"losses eager vs compiled: max relative difference {worst:.1e} (tolerance 1e-5)")
    print("speed-up (eager / compiled step time): " + "  ".join(f"{n}: {s:.2f}" for n, s in speedups.items()))
    print(
        "compile time (s, in the warm-up step): "
        + "  ".join(f"{n}: {results[n]['blocks']['compile']['compile_s']:.1f}" for n in results)
    )
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
