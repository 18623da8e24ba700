"""Tokens/s of the own engine against DeepSpeed and native PyTorch at the same layouts (dp2, tp2,
pp2) on one tiny workload, measured in one run.

For each layout, its engines are built in the same 2 gloo processes and their steps are
interleaved round-robin (own, DeepSpeed, FSDP2, own, ...), so machine noise (other processes,
frequency changes) hits all of them alike; each layout is its own launch (DeepSpeed makes its
tensor-parallel groups once per process). Warm-up steps are excluded; each step's time is the
slowest rank's; the median is reported with its 95% confidence interval. Losses are checked to
agree (fp32) so the engines are known to do the same work.

    python benchmarks/frameworks_cpu.py [--model tiny-4l] [--seq-len 128] [--steps 20]

Last line: `ratio own/deepspeed dp2: X tp2: Y pp2: Z  own/fsdp2 dp2: ... ` (tokens/s ratios,
> 1 means the own engine is faster).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# layout -> engine -> layout fields (the same parallel layout under each engine)
LAYOUTS = {
    "dp2": {"own": {"dp": 2}, "deepspeed": {"dp": 2, "zero_stage": 1},
            "fsdp2": {"dp": 2, "reshard_after_forward": True},
            "fsdp2 no-reshard": {"dp": 2, "reshard_after_forward": False}},
    "tp2": {"own": {"tp": 2}, "deepspeed": {"tp": 2, "zero_stage": 1}, "fsdp2": {"tp": 2}},
    "pp2": {"own": {"pp": 2}, "deepspeed": {"pp": 2, "zero_stage": 1}, "fsdp2": {"pp": 2}},
}
ENGINE = {"own": "own", "deepspeed": "deepspeed", "fsdp2": "fsdp", "fsdp2 no-reshard": "fsdp"}


def _bench(ctx, a: dict, engines_of_layout: dict) -> dict:
    import torch
    import torch.distributed as dist

    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.measure import summarize
    from harness.spec import parse_spec

    workload = {"model": a["model"], "seq_len": a["seq_len"], "global_batch_size": a["global_batch"],
                "steps": a["steps"], "warmup_steps": a["warmup"], "device": "cpu", "precision": "fp32"}
    engines = {}
    for name, fields in engines_of_layout.items():
        spec = parse_spec({"workload": workload,
                           "layout": {"engine": ENGINE[name], "micro_batch_size": a["mbs"], **fields}})
        engines[name] = build_engine(spec, spec.shape(), ctx)
    source = token_source(spec.workload, spec.shape().vocab)
    times = {k: [] for k in engines}
    losses = {k: [] for k in engines}
    for step in range(a["warmup"] + a["steps"]):
        batch = source.global_batch_at(step)
        for name, engine in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(float(engine.train_step(batch)))
            if step >= a["warmup"]:
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name in engines:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
        out[name] = {"stats": summarize(t.tolist()), "losses": losses[name]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-4l")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()

    from harness.testing.spawn import spawn

    a = {"model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch, "mbs": args.mbs,
         "steps": args.steps, "warmup": args.warmup}
    t0 = time.monotonic()
    results = {layout: spawn(_bench, 2, a, engines, timeout_s=900) for layout, engines in LAYOUTS.items()}
    tokens = args.global_batch * args.seq_len
    print(f"workload: {args.model}, seq {args.seq_len}, global batch {args.global_batch}, micro-batch {args.mbs}, "
          f"fp32, 2 gloo processes x {max(1, (os.cpu_count() or 1) // 2)} threads; {args.warmup} warm-up + "
          f"{args.steps} measured steps per engine, interleaved within each layout ({time.monotonic() - t0:.0f} s)")
    print(f"{'layout':7s} {'engine':18s} {'median ms':>10s} {'95% CI ms':>17s} {'tokens/s':>10s}")
    tps, worst = {}, 0.0
    for layout, res in results.items():
        first = next(iter(res.values()))["losses"]
        for name, r in res.items():
            st = r["stats"]
            tps[layout, name] = tokens / st["median"]
            worst = max([worst] + [abs(x - y) / abs(y) for x, y in zip(r["losses"], first)])
            print(f"{layout:7s} {name:18s} {st['median'] * 1e3:10.1f} {st['ci95_low'] * 1e3:8.1f}-"
                  f"{st['ci95_high'] * 1e3:<8.1f} {tps[layout, name]:10,.0f}")
    print(f"losses agree across engines at each layout: max relative difference {worst:.1e}")
    ratio = lambda other: " ".join(f"{lay}: {tps[lay, 'own'] / tps[lay, other]:.3f}"  # noqa: E731
                                   for lay in LAYOUTS if (lay, other) in tps)
    print(f"ratio own/deepspeed {ratio('deepspeed')}  own/fsdp2 {ratio('fsdp2')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
