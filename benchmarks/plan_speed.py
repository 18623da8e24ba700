"""`harness plan` speed on three plans with a target each (large dense, 70B, MoE), each the whole process
as a user runs it (`python -m harness.cli plan ...`, interpreter start and imports included, output discarded):

    paper-65b, seq 2048, batch 2048, 4096 A100-80GB (43,680 layouts)      target 0.5 s
    llama3-70b, seq 8192, batch 128, 64 H100 (115,920 layouts)             target 1 s
    qwen3-30b-a3b, seq 4096, batch 512, 64 H100 (99,120 layouts, MoE)     target 2 s

Bytecode: each tree's modules compiled once, by a warm-up round, into a private cache (PYTHONPYCACHEPREFIX, a
temporary directory; the trees are not written to), as an installed package runs from the bytecode pip compiles;
PYTHONDONTWRITEBYTECODE, set in some shells, would otherwise have every round compile every harness module
(about 0.07 s of CPU a plan here). --no-bytecode measures that instead.

Per plan: the median wall time over the rounds, the process's CPU time beside it (steadier on a
shared machine: other processes stretch the wall time), the load average, and the ratio to the target.
With --baseline DIR (another checkout, e.g. main's) each round runs that tree's plan too, alternating,
and prints the ratio of the two medians, measured side by side.

Predictions: --save FILE writes every candidate's prediction of the three plans (every field, floats
by repr) of the tree this Python imports harness from (PYTHONPATH); --check FILE compares this tree's
with a saved one and exits 1 at the first difference. The speed work must leave them identical:

    PYTHONPATH=../main python benchmarks/plan_speed.py --save /tmp/before.json --rounds 0   # the tree before
    PYTHONPATH=$PWD python benchmarks/plan_speed.py --check /tmp/before.json --baseline ../main
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "paper-65b on 4096 A100": (
        "--model paper-65b --seq-len 2048 --global-batch-size 2048 --gpus 4096 --gpus-per-node 8 --hardware a100-80gb",
        0.5,
    ),
    "llama3-70b on 64 H100": (
        "--model llama3-70b --seq-len 8192 --global-batch-size 128 --gpus 64 --hardware h100-sxm",
        1.0,
    ),
    "qwen3-30b-a3b on 64 H100": (
        "--model qwen3-30b-a3b --seq-len 4096 --global-batch-size 512 --gpus 64 --hardware h100-sxm",
        2.0,
    ),
}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout


PYCACHE: str | None = None  # the private bytecode cache (main(); None: as the environment says)


def whole_process(flags: str, tree: str | None = None) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of one `harness plan` process of `tree` (a checkout's
    root; default this one)."""
    tree = os.path.abspath(tree or ROOT)
    env = {**os.environ, "PYTHONPATH": tree}
    if PYCACHE:  # each tree's own (the prefix mirrors the sources' absolute paths)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = PYCACHE
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    # run in the tree: `python -m` puts the working directory first on sys.path, before PYTHONPATH
    r = subprocess.run(
        [sys.executable, "-m", "harness.cli", "plan", *flags.split()], capture_output=True, text=True, env=env, cwd=tree
    )
    elapsed = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"harness plan {flags} failed: {r.stderr}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def predictions() -> dict[str, list]:
    """Every candidate's prediction of each plan, in the plan's ranking, every field (floats by repr)."""
    from harness.cli import build_parser
    from harness.commands.plan import plan_of
    from harness.model.presets import resolve_shape
    from harness.planner.hardware import load_profile

    out = {}
    for name, (flags, _) in CASES.items():
        argv = ["plan", *flags.split()]
        args = build_parser(argv)[0].parse_args(argv)
        _, _, preds = plan_of(args, resolve_shape(args.model), load_profile(args.hardware))
        out[name] = [
            [
                repr(p.layout),
                p.fits,
                p.available,
                repr(p.memory_gib),
                repr(p.step_time_s),
                repr(p.mfu),
                repr(p.tokens_per_s),
                p.worst_stage,
                {k: repr(v) for k, v in p.memory_breakdown_gib.items()},
                {k: repr(v) for k, v in p.time_breakdown_s.items()},
                p.why_unavailable,
            ]
            for p in preds
        ]
    return out


def check(path: str) -> bool:
    saved, now = json.load(open(path)), predictions()
    same = True
    for name in CASES:
        a, b = saved.get(name, []), now[name]
        if a == b:
            print(f"{name}: {len(b)} predictions identical to {path}")
            continue
        same = False
        i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        print(f"{name}: DIFFERENT from {path} ({len(a)} saved, {len(b)} now; first at {i})")
        for row in (a[i : i + 1], b[i : i + 1]):
            print(f"  {row}")
    return same


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", metavar="DIR", help="another checkout to time side by side (its root)")
    p.add_argument("--save", metavar="FILE", help="write every candidate's prediction of the three plans")
    p.add_argument("--check", metavar="FILE", help="compare every candidate's prediction with a saved FILE")
    p.add_argument("--no-bytecode", action="store_true", help="compile the modules in every round (no cache)")
    args = p.parse_args()
    global PYCACHE
    if not args.no_bytecode and args.rounds:
        import tempfile

        PYCACHE = tempfile.mkdtemp(prefix="plan-speed-pycache-")
    print(f"bytecode: {'cached in ' + PYCACHE if PYCACHE else 'as the environment has it'}")
    if args.save:
        json.dump(predictions(), open(args.save, "w"))
        print(f"saved the predictions of {len(CASES)} plans to {args.save}")
    same = check(args.check) if args.check else True
    med = statistics.median
    for name, (flags, target) in CASES.items() if args.rounds else ():
        whole_process(flags)  # warm the file cache and the bytecode
        wall, cpu, base_wall, base_cpu, loads = [], [], [], [], []
        for _ in range(args.rounds):
            w, c = whole_process(flags)
            wall.append(w)
            cpu.append(c)
            loads.append(os.getloadavg()[0])
            if args.baseline:
                w, c = whole_process(flags, args.baseline)
                base_wall.append(w)
                base_cpu.append(c)
        print(f"{name}: harness plan {flags}")
        print(
            f"  this tree: median {med(wall):.2f} s wall (min {min(wall):.2f}), CPU {med(cpu):.2f} s; "
            f"load {min(loads):.1f}-{max(loads):.1f}; target {target:g} s; ratio: {med(wall) / target:.2f}"
        )
        if args.baseline:
            print(
                f"  {args.baseline}: median {med(base_wall):.2f} s wall, CPU {med(base_cpu):.2f} s; "
                f"this tree / it: {med(wall) / med(base_wall):.2f} wall, {med(cpu) / med(base_cpu):.2f} CPU"
            )
    if PYCACHE:
        import shutil

        shutil.rmtree(PYCACHE, ignore_errors=True)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
