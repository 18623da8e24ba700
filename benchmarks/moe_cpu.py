"""Expert parallelism on this CPU: the own engine's MoE at ep2 against ep1 on the same 2 gloo ranks (dp2),
and the dense model of the same active width beside them, side by side in one run.

One launch of 2 processes (one thread each) builds every variant of VARIANTS on the same workload (tiny-moe
by default: 8 experts, top-2; the dense twin has ffn = experts_per_token x moe_ffn, so the same FLOPs per
token in its feed-forward, without the router and the all-to-all) and runs their steps round-robin (each
step of each in turn), so machine noise hits all alike. A step's time is the slowest rank's, after a
barrier; warm-up steps are excluded; medians and the middle half's spread are printed. The own engine
counts its communication: the exposed ep time (its all-to-all dispatch and combine, blocked) is its
breakdown's ep_comm, beside the dp gradient reduction's dp_comm; the router's load per step
(harness.model.moe: tokens per expert, max over mean) is what each rank's layers routed, summed.

    python benchmarks/moe_cpu.py [--model tiny-moe] [--seq-len 128] [--batch 8] [--steps 10]

Prints, per variant: median step ms, tokens/s, exposed ep and dp communication ms per step, and the
router's imbalance; then ep2 against ep1 (tokens/s ratio) and MoE against its dense twin.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from _common import workload_parser

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = [("moe ep1", 1, False), ("moe ep2", 2, False), ("dense twin", 1, True)]  # (name, ep, dense)


def _spec(args, ep: int, dense: bool):
    from harness.model.presets import resolve_shape
    from harness.spec import parse_spec

    shape = resolve_shape(args.model)
    overrides = (
        {"experts": 0, "experts_per_token": 0, "moe_ffn": 0, "ffn": shape.experts_per_token * shape.moe_ffn}
        if dense
        else {}
    )
    return parse_spec(
        {
            "workload": {
                "model": args.model,
                "model_overrides": overrides,
                "seq_len": args.seq_len,
                "global_batch_size": args.batch,
                "precision": "fp32",
                "device": "cpu",
            },
            "layout": {"engine": "own", "dp": 2, "ep": ep, "micro_batch_size": args.batch // 2},
        }
    )


def _bench(ctx, args) -> dict:
    import torch.distributed as dist

    from harness.data.source import token_source
    from harness.frameworks import build_engine

    engines, sources = [], []
    for _, ep, dense in VARIANTS:
        spec = _spec(args, ep, dense)
        shape = spec.shape()
        engines.append(build_engine(spec, shape, ctx))
        sources.append(token_source(spec.workload, shape.vocab))
    out = {i: {"step_s": [], "breakdown": [], "counts": []} for i in range(len(VARIANTS))}
    for step in range(args.warmup + args.steps):
        for i, eng in enumerate(engines):
            dist.barrier()
            t0 = time.perf_counter()
            eng.train_step(sources[i].global_batch_at(step))
            dt = time.perf_counter() - t0
            stats = eng.router_stats()
            if step < args.warmup:
                continue
            out[i]["step_s"].append(dt)
            out[i]["breakdown"].append(eng.last_step_details().get("breakdown_s") or {})
            out[i]["counts"].append({name: s["counts"] for name, s in stats.items()})
    return out


def _spread(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"[{q[0] * 1e3:.1f}, {q[2] * 1e3:.1f}]"


def _comm(per_rank: list, i: int, axis: str, steps: int) -> float:
    """Median over steps of the slowest rank's exposed communication on `axis` (ms)."""
    return (
        statistics.median(max(r[i]["breakdown"][k].get(f"{axis}_comm", 0.0) for r in per_rank) for k in range(steps))
        * 1e3
    )


def _load(per_rank: list, i: int, steps: int) -> str:
    """Median over steps of the worst layer's tokens per expert, max over mean, the ranks' counts summed."""
    from harness.model.moe import imbalance

    loads = []
    for k in range(steps):
        layers = per_rank[0][i]["counts"][k]
        if layers:
            summed = {n: [sum(c) for c in zip(*(r[i]["counts"][k][n] for r in per_rank), strict=True)] for n in layers}
            loads.append(max(imbalance(c) for c in summed.values()))
    return f"{statistics.median(loads):.2f}" if loads else "-"


def main() -> int:
    args = workload_parser(__doc__, "tiny-moe", steps=10, warmup=2, seq_len=128, batch=8).parse_args()

    from harness.testing.spawn import spawn

    per_rank = spawn(_bench, 2, args, timeout_s=1800, threads=1, every_rank=True)
    tokens = args.batch * args.seq_len
    print(
        f"model {args.model} seq {args.seq_len}, {args.batch} sequences a step over dp2, {args.steps} steps "
        f"after {args.warmup} warm-up, one thread per rank, engine own, fp32"
    )
    medians = {}
    for i, (name, _, _) in enumerate(VARIANTS):
        steps = [max(r[i]["step_s"][k] for r in per_rank) for k in range(args.steps)]
        medians[name] = statistics.median(steps)
        ep, dp = (_comm(per_rank, i, axis, args.steps) for axis in ("ep", "dp"))
        load = _load(per_rank, i, args.steps)
        print(
            f"  {name:10s} step {medians[name] * 1e3:7.1f} ms {_spread(steps)}  {tokens / medians[name]:8.0f} "
            f"tokens/s  exposed ep {ep:6.1f} ms  dp {dp:6.1f} ms  imbalance (worst layer) {load}"
        )
    print(f"ep2 / ep1 tokens/s: {medians['moe ep1'] / medians['moe ep2']:.3f}")
    print(f"moe ep1 / dense twin tokens/s: {medians['dense twin'] / medians['moe ep1']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
