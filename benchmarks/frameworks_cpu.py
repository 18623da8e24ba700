"""Tokens/s of the own engine dp2 against DeepSpeed ZeRO-1 dp2 and FSDP2 dp2, on one tiny
workload, measured in one run.

All engines are built in the same 2 gloo processes and their steps are interleaved round-robin
(own, ZeRO-1, FSDP2, own, ...), so machine noise (other processes, frequency changes) hits
all of them alike. Warm-up steps are excluded; each step's time is the slowest rank's; the
median is reported with its 95% confidence interval. Losses are checked to agree (fp32) so the
engines are known to do the same work.

    python benchmarks/frameworks_cpu.py [--model tiny-4l] [--seq-len 128] [--steps 20]

If the own engine is not present in this checkout, the single-device engine (on each rank,
the whole global batch) stands in for it, and the output says so. Last line:
`ratio own/zero1: X  own/fsdp2: Y` (tokens/s ratios, > 1 means the own engine is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(ctx, args_dict: dict) -> dict:
    import torch
    import torch.distributed as dist

    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.frameworks.single import SingleDeviceEngine
    from harness.measure import summarize
    from harness.spec import parse_spec

    a = args_dict
    workload = {"model": a["model"], "seq_len": a["seq_len"], "global_batch_size": a["global_batch"],
                "steps": a["steps"], "warmup_steps": a["warmup"], "device": "cpu", "precision": "fp32"}
    layouts = {}
    if a["own_available"]:
        layouts["own dp2"] = {"engine": "own", "dp": 2, "micro_batch_size": a["mbs"]}
    layouts["deepspeed ZeRO-1 dp2"] = {"engine": "deepspeed", "dp": 2, "zero_stage": 1, "micro_batch_size": a["mbs"]}
    layouts["FSDP2 dp2 (reshard)"] = {"engine": "fsdp", "dp": 2, "micro_batch_size": a["mbs"],
                                      "reshard_after_forward": True}
    layouts["FSDP2 dp2 (no reshard)"] = {"engine": "fsdp", "dp": 2, "micro_batch_size": a["mbs"],
                                         "reshard_after_forward": False}
    engines, shape = {}, None
    for label, lay in layouts.items():
        spec = parse_spec({"workload": workload, "layout": lay})
        shape = spec.shape()
        engines[label] = build_engine(spec, shape, ctx)
    if not a["own_available"]:
        spec = parse_spec({"workload": workload, "layout": {"engine": "single", "micro_batch_size": a["mbs"]}})
        engines = {"single device (each rank, whole batch)": SingleDeviceEngine(spec, shape, ctx.device), **engines}
    source = token_source(parse_spec({"workload": workload}).workload, shape.vocab)
    times = {k: [] for k in engines}
    losses = {k: [] for k in engines}
    for step in range(a["warmup"] + a["steps"]):
        batch = source.global_batch_at(step)
        for label, engine in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine.train_step(batch)
            dt = time.perf_counter() - t0
            losses[label].append(loss)
            if step >= a["warmup"]:
                times[label].append(dt)
    out = {}
    for label in engines:
        t = torch.tensor(times[label], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
        out[label] = {"stats": summarize(t.tolist()), "losses": losses[label]}
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

    own = importlib.util.find_spec("harness.frameworks.own") is not None
    if not own:
        print("note: the own engine (harness/frameworks/own.py) is not available in this checkout; "
              "the single-device engine stands in for it", flush=True)
    a = {"model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch, "mbs": args.mbs,
         "steps": args.steps, "warmup": args.warmup, "own_available": own}
    t0 = time.monotonic()
    res = spawn(_bench, 2, a, timeout_s=900)
    tokens = args.global_batch * args.seq_len
    print(f"workload: {args.model}, seq {args.seq_len}, global batch {args.global_batch}, micro-batch {args.mbs}, "
          f"fp32, 2 gloo processes x {max(1, (os.cpu_count() or 1) // 2)} threads; {args.warmup} warm-up + "
          f"{args.steps} measured steps per engine, interleaved ({time.monotonic() - t0:.0f} s)")
    print(f"{'engine':40s} {'median ms':>10s} {'95% CI ms':>17s} {'tokens/s':>10s}")
    tps = {}
    for label, r in res.items():
        st = r["stats"]
        tps[label] = tokens / st["median"]
        print(f"{label:40s} {st['median'] * 1e3:10.1f} {st['ci95_low'] * 1e3:8.1f}-{st['ci95_high'] * 1e3:<8.1f} "
              f"{tps[label]:10,.0f}")
    labels = list(res)
    first = res[labels[0]]["losses"]
    worst = max(abs(x - y) / abs(y) for lab in labels[1:] for x, y in zip(res[lab]["losses"], first))
    print(f"losses agree across engines: max relative difference {worst:.1e}")
    base = labels[0]
    name = "own" if own else "single"
    zero1 = tps["deepspeed ZeRO-1 dp2"]
    fsdp_r, fsdp_n = tps["FSDP2 dp2 (reshard)"], tps["FSDP2 dp2 (no reshard)"]
    print(f"ratio {name}/zero1: {tps[base] / zero1:.3f}  {name}/fsdp2: {tps[base] / fsdp_r:.3f}  "
          f"{name}/fsdp2-noreshard: {tps[base] / fsdp_n:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
