"""Own engine at tp=pp=dp=1 against the single-device reference engine, same process.

Both engines train the same model on the same batches; their steps are interleaved (A, B,
A, B, ...) so drift of the machine hits both alike. Prints each engine's median step time
and, last, `ratio: <own median / single median>` (target <= 1.03).

    python benchmarks/engine_overhead.py [--model tiny-256] [--seq 128] [--batch 4] [--steps 20] [--threads 1]
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import workload_parser


def main() -> None:
    ap = workload_parser(__doc__, "tiny-256", steps=20, warmup=3, seq=128, batch=4, micro=1)
    ap.add_argument("--threads", type=int, default=1, help="0: torch default")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from harness.data.source import token_source
    from harness.engine.adapter import build
    from harness.frameworks.single.engine import SingleDeviceEngine
    from harness.model.presets import resolve_shape
    from harness.runtime import RunContext
    from harness.spec import parse_spec

    def spec(engine):
        return parse_spec(
            {
                "workload": {
                    "model": args.model,
                    "seq_len": args.seq,
                    "global_batch_size": args.batch,
                    "precision": "fp32",
                    "device": "cpu",
                },
                "layout": {"engine": engine, "micro_batch_size": args.micro},
            }
        )

    s_own, s_single = spec("own"), spec("single")
    shape = resolve_shape(args.model)
    own = build(s_own, shape, RunContext(0, 1, 0, torch.device("cpu"), None))
    single = SingleDeviceEngine(s_single, shape, torch.device("cpu"))
    src = token_source(s_own.workload, shape.vocab)
    times = {"own": [], "single": []}
    for step in range(args.warmup + args.steps):
        batch = src.global_batch_at(step)
        for name, eng in (("own", own), ("single", single)) if step % 2 else (("single", single), ("own", own)):
            t0 = time.perf_counter()
            loss = float(eng.train_step(batch))
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"model {args.model} seq {args.seq} batch {args.batch} micro {args.micro} threads {torch.get_num_threads()}"
        f" steps {args.steps} (last loss {loss:.4f})"
    )
    for k, v in times.items():
        print(
            f"{k:>6}: median {med[k] * 1e3:.1f} ms  p10 {sorted(v)[len(v) // 10] * 1e3:.1f}  "
            f"p90 {sorted(v)[(9 * len(v)) // 10] * 1e3:.1f}"
        )
    print(f"ratio: {med['own'] / med['single']:.4f}")


if __name__ == "__main__":
    main()
