"""Tokens/s of the own engine against DeepSpeed, native PyTorch and Megatron-core at the same layouts
(dp2, tp2, pp2) on one tiny workload, measured in one run; each dp2 engine against its
no-communication limit; and what Megatron's CPU device shim costs per step.

For each layout, its engines are built in the same 2 gloo processes and their steps are
interleaved round-robin (own, DeepSpeed, FSDP2, own, ...), so machine noise (other processes,
frequency changes) hits all of them alike; each layout is its own launch (DeepSpeed makes its
tensor-parallel groups once per process). Warm-up steps are excluded; each step's time is the
slowest rank's; the median is reported with its 95% confidence interval. Losses are checked to
agree (fp32) so the engines are known to do the same work.

The no-communication limit of a dp2 engine: in the same launch, interleaved with the dp2 steps,
both ranks at the same time run a dp=1 engine on their own per-rank batch (the rank's share of
the global batch) in a world of one, with no process group: every byte the dp2 step moves (and
every wait on the other rank) is gone, the compute per rank is the same. A dp2 step / limit of
1.00 means data parallelism costs nothing. The limit runs the engine itself at dp=1 where that
engine builds without a process group (own); DeepSpeed and FSDP2 need one, so theirs is the
plain model they wrap (engine single, same model code and AdamW): LIMIT says which.

Megatron-core runs Megatron's local layer spec, whose one core attention is naive: it is measured
against the own engine with the same kernel ("own naive"; its limit the plain model with it), the
others keep the default (sdpa). On a CPU Megatron runs inside harness/frameworks/megatron/shim.py,
which cannot be left off there; its cost is the torch calls its TorchFunctionMode intercepts in a
step (counted in one extra, untimed step) times what one intercepted call costs above a plain one
(a microbenchmark of small calls in and out of the shim), plus entering and leaving it once per step.

    python benchmarks/frameworks_cpu.py [--model tiny-4l] [--seq-len 128] [--steps 20] [--layouts dp2]

Last lines: `ratio own/deepspeed dp2: X tp2: Y pp2: Z  own/fsdp2 dp2: ... ` (tokens/s ratios,
> 1 means the own engine is faster; "own" is ZeRO-0, the row "own ZeRO-1" is DeepSpeed's stage),
`own/megatron (both naive attention) dp2: ...`, the shim's cost per layout, then `dp2 /
no-communication limit (step time): own: A  own ZeRO-1: B  deepspeed: C ...` (target for the own
engine: <= 1.05), the same in CPU time per rank (what the step costs the processes, not their
waits: on a machine shared with other work it moves less), and the own engine's step breakdown
at dp2 and at its limit. To add an engine: a row in LAYOUTS, its harness engine in
ENGINE and its limit in LIMIT.
"""

from __future__ import annotations

import os
import sys
import time

from _common import workload_parser

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAIVE = {"attention": "naive"}  # Megatron's local spec's one core attention, for megatron and "own naive"


# layout -> engine -> layout fields (the same parallel layout under each engine)
def _model_parallel(axis: str) -> dict:
    """Each engine's layout at 2 ranks of `axis` (tp or pp); DeepSpeed's needs ZeRO-1."""
    return {
        "own": {axis: 2},
        "deepspeed": {axis: 2, "zero_stage": 1},
        "fsdp2": {axis: 2},
        "own naive": {axis: 2, **NAIVE},
        "megatron": {axis: 2, **NAIVE},
    }


LAYOUTS = {
    "dp2": {
        "own": {"dp": 2},
        "own ZeRO-1": {"dp": 2, "zero_stage": 1},
        "deepspeed": {"dp": 2, "zero_stage": 1},
        "fsdp2": {"dp": 2, "reshard_after_forward": True},
        "fsdp2 no-reshard": {"dp": 2, "reshard_after_forward": False},
        "own naive": {"dp": 2, **NAIVE},
        "megatron": {"dp": 2, **NAIVE},
    },
    "tp2": _model_parallel("tp"),
    "pp2": _model_parallel("pp"),
}
ENGINE = {
    "own": "own",
    "own ZeRO-1": "own",
    "deepspeed": "deepspeed",
    "fsdp2": "fsdp",
    "fsdp2 no-reshard": "fsdp",
    "own naive": "own",
    "megatron": "megatron",
}
# the layout whose engines are set against their no-communication limit
LIMIT_LAYOUT = "dp2"
# dp2 engine -> the harness engine its dp=1 limit runs (world of one, no process group), and the kernel
# where it is not the default; Megatron needs a process group, so its limit is the plain model, as DeepSpeed's
LIMIT = {
    "own": "own",
    "own ZeRO-1": "own",
    "deepspeed": "single",
    "fsdp2": "single",
    "fsdp2 no-reshard": "single",
    "own naive": "own naive",
    "megatron": "single naive",
}


def _limit_name(engine: str) -> str:
    """The limit's row: one per harness engine (and kernel) run at dp=1, shared by the dp2 engines it is
    the limit of."""
    return f"limit {LIMIT[engine]} dp1"


def _shim_calls_per_step(engine, batch) -> int:
    """The torch calls megatron_shim's TorchFunctionMode intercepts in one of this engine's steps (an
    untimed step, its handler wrapped by a counter)."""
    from harness.frameworks.megatron import shim as megatron_shim

    original, calls = megatron_shim._CudaToCpu.__torch_function__, [0]

    def counted(self, func, types, args=(), kwargs=None):
        calls[0] += 1
        return original(self, func, types, args, kwargs)

    megatron_shim._CudaToCpu.__torch_function__ = counted
    try:
        engine.train_step(batch)
    finally:
        megatron_shim._CudaToCpu.__torch_function__ = original
    return calls[0]


def _shim_cost_per_call(n: int = 20000, repeats: int = 5) -> dict:
    """What one intercepted call costs: a loop of small torch calls (a factory with a device, a tensor
    method, an op) inside megatron_shim.active() against the same loop outside it (best of `repeats`),
    and what entering and leaving active() costs (the engine does it once per step)."""
    import torch

    from harness.frameworks.megatron import shim as megatron_shim

    x = torch.ones(8)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.empty(8, device="cpu")
            x.view(-1)
            torch.add(x, x)
        return (time.perf_counter() - t0) / (3 * n)

    plain = min(loop() for _ in range(repeats))
    with megatron_shim.active():
        shimmed = min(loop() for _ in range(repeats))
    t0 = time.perf_counter()
    for _ in range(200):
        with megatron_shim.active():
            pass
    return {"per_call_s": shimmed - plain, "plain_call_s": plain, "enter_exit_s": (time.perf_counter() - t0) / 200}


def _shim_cost(engine, batch) -> dict:
    """megatron_shim's cost in this engine's step, the slowest rank's (after the timed steps)."""
    import torch
    import torch.distributed as dist

    cost = _shim_cost_per_call()
    t = torch.tensor(
        [float(_shim_calls_per_step(engine, batch)), cost["per_call_s"], cost["enter_exit_s"], cost["plain_call_s"]],
        dtype=torch.float64,
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {
        "calls_per_step": int(t[0]),
        "per_call_s": t[1].item(),
        "enter_exit_s": t[2].item(),
        "plain_call_s": t[3].item(),
    }


def _bench(ctx, a: dict, engines_of_layout: dict, limits: dict) -> dict:
    """Every engine of one layout, and the limits asked for ({name: harness engine}), stepped
    round-robin on both ranks; per engine the slowest rank's step times, losses and (own engine)
    the per-step breakdown."""
    import torch
    import torch.distributed as dist

    from harness.data.source import dp_slice, token_source
    from harness.frameworks import build_engine
    from harness.measure.stats import summarize
    from harness.runtime import RunContext
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
    engines = {}
    for name, fields in engines_of_layout.items():
        spec = parse_spec(
            {"workload": workload, "layout": {"engine": ENGINE[name], "micro_batch_size": a["mbs"], **fields}}
        )
        engines[name] = build_engine(spec, spec.shape(), ctx)
    source = token_source(spec.workload, spec.shape().vocab)
    dp = spec.layout.dp
    alone = RunContext(0, 1, 0, ctx.device, None)  # a world of one: no process group, no communication
    for name, engine in limits.items():
        engine, *kernel = engine.split()  # "single naive": the plain model with naive attention
        lim = parse_spec(
            {
                "workload": {**workload, "global_batch_size": a["global_batch"] // dp},
                "layout": {
                    "engine": engine,
                    "micro_batch_size": a["mbs"],
                    **({"attention": kernel[0]} if kernel else {}),
                },
            }
        )
        engines[name] = build_engine(lim, lim.shape(), alone)
    times = {k: [] for k in engines}
    cpu = {k: [] for k in engines}  # this process's CPU seconds (every thread: gloo's too), not waits
    losses = {k: [] for k in engines}
    breakdowns = {k: [] for k in engines}
    for step in range(a["warmup"] + a["steps"]):
        batch = source.global_batch_at(step)
        mine = dp_slice(batch, ctx.rank, dp)  # this rank's share, what its dp2 engines train on
        for name, engine in engines.items():
            dist.barrier()  # both ranks start each engine's step together, limits too
            t0, c0 = time.perf_counter(), time.process_time()
            losses[name].append(float(engine.train_step(mine if name in limits else batch)))
            if step >= a["warmup"]:
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                b = engine.last_step_details().get("breakdown_s")
                if b:
                    breakdowns[name].append(b)
    out = {"_shim": _shim_cost(engines["megatron"], batch) if "megatron" in engines else {}}
    for name in engines:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
        c = torch.tensor(cpu[name], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        parts = {}
        for key in breakdowns[name][0] if breakdowns[name] else {}:
            v = torch.tensor([b[key] for b in breakdowns[name]], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            parts[key] = summarize(v.tolist())["median"]
        out[name] = {
            "stats": summarize(t.tolist()),
            "cpu": summarize(c.tolist())["median"],
            "losses": losses[name],
            "breakdown": parts,
            "limit": name in limits,
        }
    return out


def _print_limits(res: dict, median: dict, cpu: dict) -> None:
    """Each engine of LIMIT_LAYOUT over its limit, in step time and in CPU time, and where the own
    engine's time goes (its breakdown at dp2 and at the limit)."""
    engines = LAYOUTS[LIMIT_LAYOUT]

    def over(table):
        return "  ".join(f"{e}: {table[LIMIT_LAYOUT, e] / table[LIMIT_LAYOUT, _limit_name(e)]:.3f}" for e in engines)

    print(
        f"{LIMIT_LAYOUT} / no-communication limit (step time): {over(median)}  "
        f"(limits: {', '.join(f'{e} [{LIMIT[e]}]' for e in engines)})"
    )
    print(
        f"{LIMIT_LAYOUT} / limit in CPU time per rank (every thread, waits excluded; less sensitive to other "
        f"load): {over(cpu)}"
    )
    for name in ("own", "own ZeRO-1", _limit_name("own")):
        if res.get(name, {}).get("breakdown"):
            print(
                f"  {name} breakdown, median ms: "
                + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res[name]["breakdown"].items())
            )


def main() -> int:
    p = workload_parser(__doc__, "tiny-4l", steps=20, warmup=3, seq_len=128, global_batch=8, mbs=2)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    args = p.parse_args()
    chosen = [x for x in args.layouts.split(",") if x]
    for lay in chosen:
        if lay not in LAYOUTS:
            print(f"error: --layouts: {lay!r} is not one of {', '.join(LAYOUTS)}", file=sys.stderr)
            return 2

    from harness.testing.spawn import spawn

    a = {key: getattr(args, key) for key in ("model", "seq_len", "global_batch", "mbs", "steps", "warmup")}
    t0 = time.monotonic()
    results = {}
    for layout in chosen:
        engines = LAYOUTS[layout]
        limits = {_limit_name(e): LIMIT[e] for e in engines} if layout == LIMIT_LAYOUT else {}
        results[layout] = spawn(_bench, 2, a, engines, limits, timeout_s=900)
    shims = {layout: res.pop("_shim") for layout, res in results.items()}
    tokens = args.global_batch * args.seq_len
    print(
        f"workload: {args.model}, seq {args.seq_len}, global batch {args.global_batch}, micro-batch {args.mbs}, "
        f"fp32, 2 gloo processes x {max(1, (os.cpu_count() or 1) // 2)} threads; {args.warmup} warm-up + "
        f"{args.steps} measured steps per engine, interleaved within each layout ({time.monotonic() - t0:.0f} s)"
    )
    print(f"{'layout':7s} {'engine':22s} {'median ms':>10s} {'95% CI ms':>17s} {'tokens/s':>10s} {'cpu ms':>8s}")
    tps, median, cpu, worst = {}, {}, {}, 0.0
    for layout, res in results.items():
        first = next(r for r in res.values() if not r["limit"])["losses"]
        first_limit = next((r["losses"] for r in res.values() if r["limit"]), None)
        for name, r in res.items():
            st = r["stats"]
            median[layout, name], cpu[layout, name] = st["median"], r["cpu"]
            tps[layout, name] = tokens / st["median"]  # a limit's tokens: both ranks' shares, the same total
            ref = first_limit if r["limit"] else first
            worst = max([worst] + [abs(x - y) / abs(y) for x, y in zip(r["losses"], ref, strict=False)])
            print(
                f"{layout:7s} {name:22s} {st['median'] * 1e3:10.1f} {st['ci95_low'] * 1e3:8.1f}-"
                f"{st['ci95_high'] * 1e3:<8.1f} {tps[layout, name]:10,.0f} {r['cpu'] * 1e3:8.1f}"
            )
    print(f"losses agree across engines at each layout (limits among themselves): max relative difference {worst:.1e}")

    def ratio(other):
        return " ".join(f"{lay}: {tps[lay, 'own'] / tps[lay, other]:.3f}" for lay in results if (lay, other) in tps)

    print(
        f"ratio own/deepspeed {ratio('deepspeed')}  own/fsdp2 {ratio('fsdp2')}"
        + (
            f"  own ZeRO-1/deepspeed dp2: {tps['dp2', 'own ZeRO-1'] / tps['dp2', 'deepspeed']:.3f}"
            if ("dp2", "own ZeRO-1") in tps and ("dp2", "deepspeed") in tps
            else ""
        )
    )
    if any(lay for lay, name in tps if name == "megatron"):
        print(
            "own/megatron (both naive attention) "
            + " ".join(
                f"{lay}: {tps[lay, 'own naive'] / tps[lay, 'megatron']:.3f}"
                for lay in results
                if (lay, "megatron") in tps
            )
        )
    for layout, shim in shims.items():  # what the CPU's device shim adds to megatron's step
        if shim:
            cost = shim["calls_per_step"] * shim["per_call_s"] + shim["enter_exit_s"]
            print(
                f"megatron {layout}: its device shim intercepts {shim['calls_per_step']:,} torch calls per step, "
                f"{shim['per_call_s'] * 1e6:.2f} us each above a plain call ({shim['plain_call_s'] * 1e6:.2f} us), "
                f"{shim['enter_exit_s'] * 1e6:.0f} us to enter and leave: {cost * 1e3:.1f} ms per step, "
                f"{cost / median[layout, 'megatron']:.1%} of its step"
            )
    if LIMIT_LAYOUT in results:
        _print_limits(results[LIMIT_LAYOUT], median, cpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
