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

    python benchmarks/frameworks_cpu.py [--model tiny-4l] [--seq-len 128] [--steps 20] [--layouts dp2]

Megatron-core runs Megatron's local layer spec, whose one core attention is naive: it is measured
against the own engine with the same kernel ("own naive"), the others keep the default (sdpa). On
a CPU Megatron runs inside harness/frameworks/megatron_shim.py, which cannot be left off there; its
cost is the torch calls its TorchFunctionMode intercepts in a step (counted in one extra, untimed
step) times what one intercepted call costs above a plain one (a microbenchmark of small calls in
and out of the shim), plus entering and leaving it once per step.

Last lines: `ratio own/deepspeed dp2: X tp2: Y pp2: Z  own/fsdp2 dp2: ...  own/megatron (both
naive attention) dp2: ...` (tokens/s ratios, > 1 means the own engine is faster), the shim's cost
per layout, then `dp2 / no-communication limit (step time): own: A deepspeed: B ...` (target for
own: <= 1.05), and the own engine's step breakdown at dp2 and at its limit.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron-core's local layer spec has one core attention (naive): it runs beside the own engine with the
# same kernel ("own naive"), the pair own/megatron is measured on; the other engines keep the default (sdpa).
NAIVE = {"attention": "naive"}
# layout -> engine -> layout fields (the same parallel layout under each engine)
LAYOUTS = {
    "dp2": {"own": {"dp": 2}, "deepspeed": {"dp": 2, "zero_stage": 1},
            "fsdp2": {"dp": 2, "reshard_after_forward": True},
            "fsdp2 no-reshard": {"dp": 2, "reshard_after_forward": False},
            "own naive": {"dp": 2, **NAIVE}, "megatron": {"dp": 2, **NAIVE}},
    "tp2": {"own": {"tp": 2}, "deepspeed": {"tp": 2, "zero_stage": 1}, "fsdp2": {"tp": 2},
            "own naive": {"tp": 2, **NAIVE}, "megatron": {"tp": 2, **NAIVE}},
    "pp2": {"own": {"pp": 2}, "deepspeed": {"pp": 2, "zero_stage": 1}, "fsdp2": {"pp": 2},
            "own naive": {"pp": 2, **NAIVE}, "megatron": {"pp": 2, **NAIVE}},
}
ENGINE = {"own": "own", "deepspeed": "deepspeed", "fsdp2": "fsdp", "fsdp2 no-reshard": "fsdp", "own naive": "own",
          "megatron": "megatron"}
# the layout whose engines are set against their no-communication limit
LIMIT_LAYOUT = "dp2"
# dp2 engine -> the harness engine its dp=1 limit runs (world of one, no process group) and its attention
# (None: the default); Megatron needs a process group, so its limit is the plain model, as DeepSpeed's
LIMIT = {"own": ("own", None), "deepspeed": ("single", None), "fsdp2": ("single", None),
         "fsdp2 no-reshard": ("single", None), "own naive": ("own", "naive"), "megatron": ("single", "naive")}


def _limit_name(engine: str) -> str:
    """The limit's row: one per harness engine (and kernel) run at dp=1, shared by the dp2 engines it is
    the limit of."""
    limit, attention = LIMIT[engine]
    return f"limit {limit} dp1" + (f" {attention}" if attention else "")


def _shim_calls_per_step(engine, batch) -> int:
    """The torch calls megatron_shim's TorchFunctionMode intercepts in one of this engine's steps (an
    untimed step, its handler wrapped by a counter)."""
    from harness.frameworks import megatron_shim

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

    from harness.frameworks import megatron_shim

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


def _bench(ctx, a: dict, engines_of_layout: dict, limits: dict) -> dict:
    """Every engine of one layout, and the limits asked for ({name: harness engine}), stepped
    round-robin on both ranks; per engine the slowest rank's step times, losses and (own engine)
    the per-step breakdown."""
    import torch
    import torch.distributed as dist

    from harness.data.source import dp_slice, token_source
    from harness.frameworks import build_engine
    from harness.measure import summarize
    from harness.runtime import RunContext
    from harness.spec import parse_spec

    workload = {"model": a["model"], "seq_len": a["seq_len"], "global_batch_size": a["global_batch"],
                "steps": a["steps"], "warmup_steps": a["warmup"], "device": "cpu", "precision": "fp32"}
    engines = {}
    for name, fields in engines_of_layout.items():
        spec = parse_spec({"workload": workload,
                           "layout": {"engine": ENGINE[name], "micro_batch_size": a["mbs"], **fields}})
        engines[name] = build_engine(spec, spec.shape(), ctx)
    source = token_source(spec.workload, spec.shape().vocab)
    dp = spec.layout.dp
    alone = RunContext(0, 1, 0, ctx.device, None)   # a world of one: no process group, no communication
    for name, (engine, attention) in limits.items():
        lim = parse_spec({"workload": {**workload, "global_batch_size": a["global_batch"] // dp},
                          "layout": {"engine": engine, "micro_batch_size": a["mbs"],
                                     **({"attention": attention} if attention else {})}})
        engines[name] = build_engine(lim, lim.shape(), alone)
    times = {k: [] for k in engines}
    losses = {k: [] for k in engines}
    breakdowns = {k: [] for k in engines}
    for step in range(a["warmup"] + a["steps"]):
        batch = source.global_batch_at(step)
        mine = dp_slice(batch, ctx.rank, dp)  # this rank's share, what its dp2 engines train on
        for name, engine in engines.items():
            dist.barrier()   # both ranks start each engine's step together, limits too
            t0 = time.perf_counter()
            losses[name].append(float(engine.train_step(mine if name in limits else batch)))
            if step >= a["warmup"]:
                times[name].append(time.perf_counter() - t0)
                b = getattr(engine, "last_step_details", lambda: {})().get("breakdown_s")
                if b:
                    breakdowns[name].append(b)
    shim = {}
    if "megatron" in engines:  # after the timed steps: what the device shim intercepts and costs
        calls = torch.tensor([float(_shim_calls_per_step(engines["megatron"], batch))], dtype=torch.float64)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
        cost = _shim_cost_per_call()
        per_call = torch.tensor([cost["per_call_s"], cost["enter_exit_s"]], dtype=torch.float64)
        dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
        shim = {"calls_per_step": int(calls.item()), "per_call_s": per_call[0].item(),
                "enter_exit_s": per_call[1].item(), "plain_call_s": cost["plain_call_s"]}
    out = {"_shim": shim}
    for name in engines:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts until its slowest rank is done
        parts = {}
        for key in (breakdowns[name][0] if breakdowns[name] else {}):
            v = torch.tensor([b[key] for b in breakdowns[name]], dtype=torch.float64)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            parts[key] = summarize(v.tolist())["median"]
        out[name] = {"stats": summarize(t.tolist()), "losses": losses[name], "breakdown": parts,
                     "limit": name in limits}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-4l")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    args = p.parse_args()
    chosen = [x for x in args.layouts.split(",") if x]
    for lay in chosen:
        if lay not in LAYOUTS:
            print(f"error: --layouts: {lay!r} is not one of {', '.join(LAYOUTS)}", file=sys.stderr)
            return 2

    from harness.testing.spawn import spawn

    a = {"model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch, "mbs": args.mbs,
         "steps": args.steps, "warmup": args.warmup}
    t0 = time.monotonic()
    results = {}
    for layout in chosen:
        engines = LAYOUTS[layout]
        limits = {_limit_name(e): LIMIT[e] for e in engines} if layout == LIMIT_LAYOUT else {}
        results[layout] = spawn(_bench, 2, a, engines, limits, timeout_s=900)
    shims = {layout: res.pop("_shim") for layout, res in results.items()}
    tokens = args.global_batch * args.seq_len
    print(f"workload: {args.model}, seq {args.seq_len}, global batch {args.global_batch}, micro-batch {args.mbs}, "
          f"fp32, 2 gloo processes x {max(1, (os.cpu_count() or 1) // 2)} threads; {args.warmup} warm-up + "
          f"{args.steps} measured steps per engine, interleaved within each layout ({time.monotonic() - t0:.0f} s)")
    print(f"{'layout':7s} {'engine':22s} {'median ms':>10s} {'95% CI ms':>17s} {'tokens/s':>10s}")
    tps, median, worst = {}, {}, 0.0
    for layout, res in results.items():
        first = next(r for r in res.values() if not r["limit"])["losses"]
        first_limit = next((r["losses"] for r in res.values() if r["limit"]), None)
        for name, r in res.items():
            st = r["stats"]
            median[layout, name] = st["median"]
            tps[layout, name] = tokens / st["median"]   # a limit's tokens: both ranks' shares, the same total
            ref = first_limit if r["limit"] else first
            worst = max([worst] + [abs(x - y) / abs(y) for x, y in zip(r["losses"], ref)])
            print(f"{layout:7s} {name:22s} {st['median'] * 1e3:10.1f} {st['ci95_low'] * 1e3:8.1f}-"
                  f"{st['ci95_high'] * 1e3:<8.1f} {tps[layout, name]:10,.0f}")
    print(f"losses agree across engines at each layout (limits among themselves): max relative difference "
          f"{worst:.1e}")
    ratio = lambda other: " ".join(f"{lay}: {tps[lay, 'own'] / tps[lay, other]:.3f}"  # noqa: E731
                                   for lay in results if (lay, other) in tps)
    naive = " ".join(f"{lay}: {tps[lay, 'own naive'] / tps[lay, 'megatron']:.3f}" for lay in results
                     if (lay, "megatron") in tps)
    print(f"ratio own/deepspeed {ratio('deepspeed')}  own/fsdp2 {ratio('fsdp2')}  own/megatron (both naive "
          f"attention) {naive}")
    for layout, shim in shims.items():  # what the CPU's device shim adds to megatron's step
        if shim:
            cost = shim["calls_per_step"] * shim["per_call_s"] + shim["enter_exit_s"]
            print(f"megatron {layout}: its device shim intercepts {shim['calls_per_step']:,} torch calls per step, "
                  f"{shim['per_call_s'] * 1e6:.2f} us each above a plain call ({shim['plain_call_s'] * 1e6:.2f} us), "
                  f"{shim['enter_exit_s'] * 1e6:.0f} us to enter and leave: {cost * 1e3:.1f} ms per step, "
                  f"{cost / median[layout, 'megatron']:.1%} of its step")
    if LIMIT_LAYOUT in results:
        res = results[LIMIT_LAYOUT]
        print(f"{LIMIT_LAYOUT} / no-communication limit (step time; limit engine in brackets): " + "  ".join(
            f"{e}: {median[LIMIT_LAYOUT, e] / median[LIMIT_LAYOUT, _limit_name(e)]:.3f} "
            f"[{_limit_name(e).removeprefix('limit ')}]"
            for e in LAYOUTS[LIMIT_LAYOUT]))
        for name in ("own", _limit_name("own")):   # where the own engine's time goes
            parts = res[name]["breakdown"]
            if parts:
                print(f"  {name} breakdown, median ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in parts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
