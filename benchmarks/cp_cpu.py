"""Context parallelism at a long sequence on this CPU: the own engine's cp2 ring against cp1, measured
side by side in one launch, and how much of the ring's communication the attention hides.

What is compared, and why that is fair:
- cp2 (2 ranks, a world of two, each holding half of every sequence) against cp1 on one rank (the
  same engine at cp1 dp1 in a world of one, with no process group, training the whole global batch).
  The cp1 engine runs on both processes at the same time, so every engine's step sees the same
  machine: both processes busy, the same threads per process. tokens/s(cp2) / tokens/s(cp1) is what
  the second rank buys (2.00 is perfect scaling); per rank, that over 2 (1.00: no loss).
- cp2 against dp2 on the same 2 ranks and global batch: what splitting each sequence costs against
  splitting the batch, the usual way to use two ranks (cp's reason is memory: each rank keeps the
  activations of half a sequence; dp2 keeps whole sequences).
Steps interleave round-robin (cp2, dp2, cp1, cp2, ...), each engine starting on both ranks together
(a barrier), so noise from other processes hits all of them alike; warm-up excluded; a step lasts
until its slowest rank finishes; the median with its 95% CI. The losses must agree (fp32).

The share hidden: after the timed steps, a few profiled cp2 steps (torch.profiler and the harness's
analysis, as `harness train` runs them: harness.profiling) give the exposed cp communication per
step (the time a rank was blocked on K/V or gradient blocks, the mean over ranks as a record's
breakdown_ms); the engine's counters over the same steps give the same waits (breakdown_s cp_comm,
printed beside it as a check) and the ring's traffic (exchanges and bytes, comm["cp"]: the profiler
counts a batch_isend_irecv as one call, not its bytes). The ring's traffic sent alone between the
two ranks with nothing to overlap it (the same number of exchanges of the same size, one
batch_isend_irecv each, waited on) is what it costs when nothing hides it. Hidden share =
1 - exposed / alone (0: nothing hidden, 1: all of it); on a loaded machine a rank's waits also hold
its peer's lateness, which counts against the share.

    python benchmarks/cp_cpu.py [--model tiny-256] [--layers 1] [--seq-len 4096] [--global-batch 2] [--steps 3]
                                [--impls ring,allgather,ulysses] [--attention sdpa|naive]

Every engine runs the same attention kernel: sdpa by default (torch's CPU flash kernel; the ring
runs it per block and merges the blocks by online softmax), or naive (materialised, fp32, explicit
mask). Naive computes the whole s x s score matrix and masks half of it, while the ring's blocks
skip the key blocks wholly in a query block's future (at cp2, 6 of the 16 chunk pairs): under naive
cp2 does less attention arithmetic than cp1 and dp2, and part of its lead is that, not parallelism.
The model is tiny-256's layer shape, one layer by default (--layers): at 4,096 tokens naive
attention keeps 512 MiB of scores per layer and micro-batch, and this benchmark runs on a 2-core
machine whose memory other work shares.
A sequence longer than the preset's max_position_embeddings raises it (model_overrides.max_positions).
Last lines: `tokens/s cp2 ring / cp1 ...`, `... / dp2 ...`, and `cp2 ring communication ... hidden ...`.
"""

from __future__ import annotations

import os
import sys
import time

from _common import workload_parser

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ALONE = "cp1 (1 rank)"
DP2 = "dp2"


def _workload(a: dict) -> dict:
    from harness.model.presets import resolve_shape

    overrides = {"layers": a["layers"]} if a["layers"] else {}
    if a["seq_len"] > resolve_shape(a["model"], {}).max_positions:
        overrides["max_positions"] = a["seq_len"]
    return {
        "model": a["model"],
        "model_overrides": overrides,
        "seq_len": a["seq_len"],
        "global_batch_size": a["global_batch"],
        "steps": a["steps"],
        "warmup_steps": a["warmup"],
        "device": "cpu",
        "precision": "fp32",
    }


def _spec(a: dict, **layout):
    from harness.spec import parse_spec

    return parse_spec(
        {
            "workload": _workload(a),
            "layout": {"engine": "own", "attention": a["attention"], "micro_batch_size": a["mbs"], **layout},
        }
    )


def _profiled(engine, spec, ctx, source, first: int, steps: int) -> dict:
    """Mean over `steps` profiled steps (after the timed ones) of this rank's breakdown (ms), and of the
    engine's own count of its ring waits (breakdown_s cp_comm) over the same steps."""
    from harness.parallel_dims import ParallelDims
    from harness.profiling import trace as profile_trace
    from harness.profiling.analysis import breakdown, mean_step

    waits = []

    def one(i: int) -> None:
        engine.train_step(source.global_batch_at(first + i))
        waits.append(((engine.last_step_details() or {}).get("breakdown_s") or {}).get("cp_comm", 0.0))

    trace = profile_trace.record(one, steps, ParallelDims.of(spec.layout), ctx.rank, ctx.device)
    found = breakdown(trace, ctx.device.type)
    step = mean_step(found["steps"])
    return {
        "exposed_cp_ms": step["exposed_comm"].get("cp", 0.0),
        "step_ms": step["step"],
        "exposed_dp_ms": step["exposed_comm"].get("dp", 0.0),
        "counted_cp_ms": 1e3 * sum(waits) / len(waits),
        "collectives": [c for c in found["collectives"] if c["axis"] == "cp"],
    }


def _alone_exchanges(count: int, nbytes: int, repeats: int = 3) -> float:
    """Seconds for `count` exchanges of nbytes/count bytes each with the other rank (one batch_isend_irecv
    per exchange, waited on before the next, as the ring waits on each hop), nothing to overlap them:
    the best of `repeats`."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    n = max(1, nbytes // max(1, count) // 4)
    send, recv = torch.ones(n), torch.empty(n)
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(count):
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            )
            for w in works:
                w.wait()
        best = min(best, time.perf_counter() - t0)
    return best


def _bench(ctx, a: dict) -> dict:
    import torch
    import torch.distributed as dist

    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.measure.stats import summarize
    from harness.runtime import RunContext

    specs = {f"cp2 {impl}": _spec(a, cp=2, cp_impl=impl) for impl in a["impls"]}
    specs[DP2] = _spec(a, dp=2)
    engines = {name: build_engine(spec, spec.shape(), ctx) for name, spec in specs.items()}
    alone = _spec(a)  # cp1 dp1: the whole global batch on one rank, a world of one
    specs[ALONE] = alone
    engines[ALONE] = build_engine(alone, alone.shape(), RunContext(0, 1, 0, ctx.device, None))
    source = token_source(alone.workload, alone.shape().vocab)
    times = {k: [] for k in engines}
    losses = {k: [] for k in engines}
    counted = {k: [] for k in engines}
    total = a["warmup"] + a["steps"]
    for step in range(total):
        batch = source.global_batch_at(step)
        for name, engine in engines.items():
            dist.barrier()  # both ranks start each engine's step together, the cp1 engines too
            t0 = time.perf_counter()
            losses[name].append(float(engine.train_step(batch)))
            if step >= a["warmup"]:
                times[name].append(time.perf_counter() - t0)
                counted[name].append(((engine.last_step_details() or {}).get("comm") or {}).get("cp") or {})
    out = {}
    for name in engines:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
        out[name] = {"stats": summarize(t.tolist()), "losses": losses[name], "world": 1 if name == ALONE else 2}
        if name.startswith("cp2"):
            sends = counted[name][-1].get("send") or {}
            prof = _profiled(engines[name], specs[name], ctx, source, total, a["profile_steps"])
            # exposed time: the mean over ranks, as a record's breakdown_ms is
            shared = torch.tensor(
                [prof["exposed_cp_ms"], prof["counted_cp_ms"], prof["step_ms"], prof["exposed_dp_ms"]],
                dtype=torch.float64,
            )
            dist.all_reduce(shared)
            shared /= ctx.world_size
            count, nbytes = int(sends.get("count") or 0), int(sends.get("bytes") or 0)
            alone_s = torch.tensor([_alone_exchanges(count, nbytes) if count else 0.0], dtype=torch.float64)
            dist.all_reduce(alone_s, op=dist.ReduceOp.MAX)
            out[name].update(
                exchanges=count,
                bytes=nbytes,
                exposed_ms=shared[0].item(),
                counted_ms=shared[1].item(),
                profiled_step_ms=shared[2].item(),
                exposed_dp_ms=shared[3].item(),
                collectives=prof["collectives"],
                alone_s=alone_s.item(),
            )
    return out


def main() -> int:
    p = workload_parser(__doc__, "tiny-256", steps=3, warmup=1, seq_len=4096, global_batch=2, mbs=1)
    p.add_argument("--layers", type=int, default=1, help="the model's layers (0: the preset's); see above")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--impls", default="ring", help="comma-separated cp2 implementations: ring, allgather, ulysses")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "naive"))
    p.add_argument("--timeout-s", type=float, default=3000)
    args = p.parse_args()
    from harness.errors import SpecError
    from harness.spec import CP_IMPLS

    impls = [x for x in args.impls.split(",") if x]
    bad = [x for x in impls if x not in CP_IMPLS]
    if bad or not impls or args.profile_steps < 1:
        what = (
            "--profile-steps: at least 1"
            if args.profile_steps < 1
            else f"--impls: {', '.join(bad) or 'none'} not of {', '.join(CP_IMPLS)}"
        )
        print(f"error: {what}", file=sys.stderr)
        return 2
    passed = ("model", "layers", "seq_len", "global_batch", "mbs", "steps", "warmup", "attention", "profile_steps")
    a = {**{key: getattr(args, key) for key in passed}, "impls": impls}
    try:
        for impl in impls:  # the spec's own checks (and the engine's refusals), before anything starts
            _spec(a, cp=2, cp_impl=impl)
        _spec(a, dp=2)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from harness.testing.spawn import spawn

    load = os.getloadavg()
    t0 = time.monotonic()
    res = spawn(_bench, 2, a, timeout_s=args.timeout_s)
    tokens = args.global_batch * args.seq_len
    layers = f" with {args.layers} layer(s)" if args.layers else ""
    print(
        f"workload: {args.model}{layers}, seq {args.seq_len}, global batch {args.global_batch}, "
        f"micro-batch {args.mbs}, fp32, attention {args.attention}, own engine; 2 gloo processes x "
        f"{max(1, (os.cpu_count() or 1) // 2)} threads; "
        f"{args.warmup} warm-up + {args.steps} measured steps per engine, interleaved; then {args.profile_steps} "
        f"profiled cp2 steps ({time.monotonic() - t0:.0f} s; load average before "
        f"{' '.join(f'{x:.2f}' for x in load)}, after {' '.join(f'{x:.2f}' for x in os.getloadavg())})"
    )
    print(f"{'engine':14s} {'ranks':>5s} {'median ms':>10s} {'95% CI ms':>19s} {'tokens/s':>9s} {'per rank':>9s}")
    tps = {}
    first = res[ALONE]["losses"]
    worst = 0.0
    for name, r in res.items():
        st = r["stats"]
        tps[name] = tokens / st["median"]
        worst = max([worst] + [abs(x - y) / abs(y) for x, y in zip(r["losses"], first, strict=False)])
        print(
            f"{name:14s} {r['world']:5d} {st['median'] * 1e3:10.1f} {st['ci95_low'] * 1e3:9.1f}-"
            f"{st['ci95_high'] * 1e3:<9.1f} {tps[name]:9,.0f} {tps[name] / r['world']:9,.0f}"
        )
    print(f"losses agree (every engine against {ALONE}): max relative difference {worst:.1e}")
    for name, r in res.items():
        if not name.startswith("cp2"):
            continue
        print(
            f"tokens/s {name} (2 ranks) / {ALONE}: {tps[name] / tps[ALONE]:.3f} "
            f"(per rank {tps[name] / 2 / tps[ALONE]:.3f}; 2.000 / 1.000 is perfect scaling)"
        )
        print(f"tokens/s {name} / {DP2} (both 2 ranks, the same global batch): {tps[name] / tps[DP2]:.3f}")
        alone_ms = r["alone_s"] * 1e3
        hidden = max(0.0, min(1.0, 1 - r["exposed_ms"] / alone_ms)) if alone_ms > 0 else None
        coll = "; ".join(f"{c['kind']} x{c['count']:g} ({c['bytes'] / 2**20:,.1f} MiB)" for c in r["collectives"])
        print(
            f"{name} traffic per step (engine counters): {r['exchanges']} exchanges, "
            f"{r['bytes'] / 2**20:,.1f} MiB sent per rank; the same exchanges alone, nothing to overlap them: "
            f"{alone_ms:.1f} ms"
        )
        print(
            f"{name} exposed cp communication per profiled step (profiler, mean over ranks): "
            f"{r['exposed_ms']:.1f} ms of {r['profiled_step_ms']:.1f} ms (its cp calls: {coll or 'none'}; "
            f"exposed dp, the gradients' reduction: {r['exposed_dp_ms']:.1f} ms); the engine's counted ring "
            f"waits over the same steps: {r['counted_ms']:.1f} ms"
        )
        print(
            f"{name} communication hidden behind the attention: "
            + (
                f"{100 * hidden:.0f}% (1 - exposed waits / the exchanges alone)"
                if hidden is not None
                else "n/a (no cp traffic counted)"
            )
        )
        if alone_ms and r["exposed_ms"] > alone_ms:  # what else the waits hold
            print(
                f"  of the {r['exposed_ms']:.1f} ms exposed, at most {alone_ms:.1f} ms can be moving the bytes; "
                f"the rest is a rank waiting for the other to reach the same hop ({r['exchanges']} per step)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
