"""`harness plan` speed: the whole process (interpreter start, imports, every layout, the table).

The largest published case: paper-65b, sequence 2048, 2048 sequences, 4096 A100-80GB in 8-GPU nodes
(43,680 layouts under the default engine own, interleaved schedules included; 16,032 with
1F1B only). Target: under 1 s for the whole process. Each round runs the command as a user
does (`python -m harness.cli plan ...`, output discarded) and also in this process, split into
what the command spends on imports and on predictions. The CPU time of the process is printed
beside its wall time (steadier on a shared machine). Last line: `ratio: <median wall seconds / 1 s>`.

    python benchmarks/plan_speed.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

ARGS = [
    *(
        "plan --model paper-65b --seq-len 2048 --global-batch-size 2048 --gpus 4096 --gpus-per-node 8 --hardware "
        "a100-80gb"
    ).split()
]
TARGET_S = 1.0


def whole_process() -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one `harness plan` process. On a shared
    machine the CPU time is the steadier figure: other processes stretch the wall time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "harness.cli", *ARGS], capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        raise SystemExit(f"harness plan failed: {r.stderr}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def imports_in_a_fresh_process() -> float:
    code = (
        "import time; t = time.perf_counter(); import harness.cli, harness.commands.plan, "
        "harness.planner.predict, harness.planner.candidates, harness.planner.output; "
        "print(time.perf_counter() - t)"
    )
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def predictions_here() -> tuple[float, int]:
    from harness.model.presets import resolve_shape
    from harness.planner import candidates as en
    from harness.planner.hardware import load_profile
    from harness.planner.layout import Workload
    from harness.planner.predict import predict_many

    prof = load_profile("a100-80gb")
    shape, wl = resolve_shape("paper-65b"), Workload(2048, 2048)
    t = time.perf_counter()
    lays = en.layouts(
        shape,
        wl,
        4096,
        8,
        attention=[a for a in en.DEFAULTS["attention"] if a in prof.attention_kernels],
        rmsnorm=en.DEFAULTS["rmsnorm"],
        micro_batch_sizes=en.DEFAULTS["micro_batch_sizes"],
        checkpointing=en.DEFAULTS["checkpointing"],
        sequence_parallel=en.DEFAULTS["sequence_parallel"],
        zero_stage=1,
        engine="own",  # the command's default engine: its candidates, interleaved schedules included
        fsdp=False,
    )
    preds = predict_many(shape, lays, wl, prof)
    return time.perf_counter() - t, len(preds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    whole_process()  # warm the file cache and the bytecode
    totals, cpu, imports, preds = [], [], [], []
    n = 0
    for _ in range(args.rounds):
        wall, used = whole_process()
        totals.append(wall)
        cpu.append(used)
        imports.append(imports_in_a_fresh_process())
        t, n = predictions_here()
        preds.append(t)
    med = statistics.median
    print(f"harness {' '.join(ARGS)}")
    print(
        f"whole process:        median {med(totals):.3f} s (min {min(totals):.3f}, max {max(totals):.3f}, "
        f"{args.rounds} rounds); CPU time median {med(cpu):.3f} s"
    )
    print(f"imports of the plan path: median {med(imports):.3f} s")
    print(f"{n} predictions:   median {med(preds):.3f} s ({1e6 * med(preds) / n:.0f} us per layout)")
    print(f"target {TARGET_S:.1f} s; ratio: {med(totals) / TARGET_S:.2f}")


if __name__ == "__main__":
    main()
