"""How close the own engine's 1F1B pipeline gets to its ideal on this machine.

pp=2 gloo processes (one thread each) train `tiny-256` (seq 256) with 8 micro-batches per step. Each
stage measures its own forward+backward compute in the same steps; the ideal 1F1B step is
(m + p - 1) / m x the slower stage's compute (the textbook bubble, nothing else). Prints
the medians and, last, `ratio: <measured step / ideal>` (target within 1.15).

    python benchmarks/pipeline_efficiency.py [--schedule 1f1b] [--micro-batches 8] [--steps 12]
    python benchmarks/pipeline_efficiency.py --schedule interleaved --virtual-stages 2
"""

from __future__ import annotations

import statistics

from _common import workload_parser


def _bench(ctx, args):
    """One rank: the own engine at pp = the world, its steps' breakdowns after warm-up."""
    import torch.distributed as dist

    from harness.data.source import token_source
    from harness.engine.adapter import build
    from harness.model.presets import resolve_shape
    from harness.spec import parse_spec

    spec = parse_spec(
        {
            "workload": {
                "model": args.model,
                "seq_len": args.seq,
                "global_batch_size": args.micro_batches,
                "precision": "fp32",
                "device": "cpu",
            },
            "layout": {
                "engine": "own",
                "pp": ctx.world_size,
                "pipeline_schedule": args.schedule,
                "virtual_stages": args.virtual_stages,
            },
        }
    )
    shape = resolve_shape(args.model)
    eng = build(spec, shape, ctx)
    src = token_source(spec.workload, shape.vocab)
    rows = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        eng.train_step(src.global_batch_at(step))
        if step >= args.warmup:
            b = eng.last_step_details()["breakdown_s"]
            rows.append((b["total"], b["compute"], b["bubble"], b["optimizer"], b["dp_comm"], b["tp_comm"]))
    return {"rows": rows, "stages": eng.describe()["stages"]}


def main() -> None:
    ap = workload_parser(__doc__, "tiny-256", steps=12, warmup=2, seq=256, pp=2, micro_batches=8)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    ap.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    args = ap.parse_args()

    from harness.testing.spawn import spawn

    ranks = spawn(_bench, args.pp, args, timeout_s=1800, threads=1, every_rank=True)
    m, p, v = args.micro_batches, args.pp, args.virtual_stages
    # ideal: the slower stage computes all the time except the fill/drain bubble, which
    # interleaving divides by the number of chunks per rank (Narayanan et al. 2021)
    factor = 1 + (p - 1) / (v * m)
    step = [max(r["rows"][i][0] for r in ranks) for i in range(args.steps)]
    compute = [max(r["rows"][i][1] for r in ranks) for i in range(args.steps)]
    ratios = [s / (factor * c) for s, c in zip(step, compute, strict=True)]
    print(
        f"model {args.model} seq {args.seq} pp {p} micro-batches {m} schedule {args.schedule}; "
        f"stages {[s['layers'] for s in ranks[0]['stages']]} on rank 0"
    )
    for r, rk in enumerate(ranks):
        med = [statistics.median(x[i] for x in rk["rows"]) for i in range(6)]
        other = statistics.median(x[0] - sum(x[1:]) for x in rk["rows"])
        print(
            f"rank {r}: median step {med[0] * 1e3:.1f} ms: compute {med[1] * 1e3:.1f}, "
            f"pipeline p2p + wait {med[2] * 1e3:.1f}, optimizer {med[3] * 1e3:.1f}, other {other * 1e3:.1f}"
        )
    ideal = factor * statistics.median(compute)
    print(
        f"median step {statistics.median(step) * 1e3:.1f} ms; ideal {ideal * 1e3:.1f} ms "
        f"((m+(p-1)/v)/m x slower stage's compute); per-step ratios p10..p90 "
        f"{sorted(ratios)[len(ratios) // 10]:.3f}..{sorted(ratios)[(9 * len(ratios)) // 10]:.3f}"
    )
    print(f"ratio: {statistics.median(ratios):.4f}")


if __name__ == "__main__":
    main()
