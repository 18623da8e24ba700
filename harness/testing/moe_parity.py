"""The engines' MoE parity tests' common parts: each rank's training with its router statistics, the
single-device reference's, and the check an engine's per-rank statistics sum to them (the runner's sum over
ranks: harness.model.moe.combine_router_stats), and where a layout's roundings may move a top-k choice (bf16,
fp8 under expert parallelism) the bound on how far the counts may move (near_ties, check_router_counts_near)."""

from __future__ import annotations

import contextlib
import math
import statistics

BF16_ULP = 2.0**-8  # bf16's spacing relative to a value (8 bits of significand)


def rounding_step(precision: str, recipe: str | None = None) -> float:
    """The relative rounding each factor of a router logit carries under `precision` (0: fp32, exact). The router
    never runs in FP8 (its logits are fp32 products of the bf16 residual stream and the fp32 weight), so fp8's is
    bf16's amplified as harness.testing.equivalence derives its fp8 tolerances from bf16's (x 2^2.5: a bf16
    difference moves an e4m3 cast by one step with probability 2^-5), and mxfp8's by its block-scale term
    (x sqrt(1 + 2^-4))."""
    from harness.testing.equivalence import BF16_WEIGHTS_RTOL, FP8_WEIGHTS_RTOL, MXFP8_WEIGHTS_RTOL

    if precision == "fp8":
        return BF16_ULP * (MXFP8_WEIGHTS_RTOL if recipe == "mxfp8" else FP8_WEIGHTS_RTOL) / BF16_WEIGHTS_RTOL
    return BF16_ULP if precision == "bf16" else 0.0


def tail(routed: int) -> float:
    """How many standard deviations a gap's change exceeds with probability 1e-3 / routed (two-sided normal
    tail): over `routed` tokens (every routed token of a run, summed over the layers) a near tie is missed with
    probability below 1e-3."""
    return statistics.NormalDist().inv_cdf(1 - 1e-3 / (2 * routed))


def near_ties(layer, x2, logits, step: float, tail_sd: float) -> int:
    """Tokens whose k-th and (k+1)-th logits lie within the rounding bound of their gap: each factor of each
    term t_ej = W_ej x_j of a logit off by an independent rounding, uniform within `step` (relative: variance
    step^2/3), x_j's shared by both logits, so the gap l_k - l_m moves by a sum of independent terms of variance
    step^2/3 (sum_j (t_kj - t_mj)^2 + t_kj^2 + t_mj^2), normal by the central limit over the hidden size (the
    probabilistic rounding analysis of Higham and Mary, 2019, in place of the worst case, which adds every
    term's bound as if all roundings had one sign); a tie is near when the gap is within tail_sd of its sd."""
    import torch

    terms = x2.detach().float().unsqueeze(1) * layer.router.weight.detach().float()  # (tokens, experts, hidden)
    top = torch.topk(logits, layer.k + 1, dim=-1).indices
    t_k = terms.gather(1, top[:, -2, None, None].expand(-1, 1, terms.shape[-1])).squeeze(1)
    t_m = terms.gather(1, top[:, -1, None, None].expand(-1, 1, terms.shape[-1])).squeeze(1)
    var = step**2 / 3 * ((t_k - t_m).square() + t_k.square() + t_m.square()).sum(-1)
    gap = logits.gather(1, top[:, -2:-1]).squeeze(1) - logits.gather(1, top[:, -1:]).squeeze(1)
    return int((gap <= tail_sd * var.sqrt()).sum())


def counting_near_ties(model, step: float, tail_sd: float, ties: dict) -> dict:
    """Every MoEFeedForward of `model` made to add its near ties (near_ties) to `ties` (returned), by layer
    name, at each forward from now on."""
    from harness.model.moe import MoEFeedForward

    def watch(name, layer):
        def gate(x2):
            out = MoEFeedForward.gate(layer, x2)
            ties[name] = ties.get(name, 0) + near_ties(layer, x2, out[3].detach(), step, tail_sd)
            return out

        layer.gate = gate

    for name, layer in model.named_modules():
        if isinstance(layer, MoEFeedForward):
            watch(name, layer)
    return ties


def check_router_counts_near(summed: dict, ref_counts: dict, ties: dict, k: int) -> None:
    """Routed slots per expert summed over ranks (by layer) against the reference's where roundings may move
    a top-k choice: every routed slot counted once (the totals exact), and the counts moved by at most 2k per
    near tie of the reference's run (a token that takes another expert moves at most k slots out and k in)."""
    assert summed.keys() == ref_counts.keys(), (sorted(summed), sorted(ref_counts))
    for layer, ref in ref_counts.items():
        assert sum(summed[layer]) == sum(ref), layer
        moved = sum(abs(a - b) for a, b in zip(summed[layer], ref, strict=True))
        assert moved <= 2 * k * ties[layer], (layer, moved, ties[layer])


def train_with_router(ctx, runs: list[dict], steps: int, tripwire: bool = False) -> list[dict]:
    """On every rank (harness.testing.spawn), each run's engine in turn: its losses, gradient norms, final
    weights, describe, memory census, every rank's router statistics and its counted communication of the
    last step; with `tripwire`
    (engine megatron) the torch.cuda functions reached that the shim does not cover, as "uncovered"."""
    import torch.distributed as dist

    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.spec import parse_spec

    out = []
    for raw in runs:
        spec = parse_spec(raw)
        shape = spec.shape()
        if tripwire:
            from harness.frameworks.megatron import shim

            guard = shim.tripwire()
        else:
            guard = contextlib.nullcontext(set())
        with guard as reached:
            engine = build_engine(spec, shape, ctx)
            source = token_source(spec.workload, shape.vocab)
            losses, norms = [], []
            for step in range(steps):
                engine.router_stats()  # only the last step's
                losses.append(float(engine.train_step(source.global_batch_at(step))))
                norms.append(engine.grad_norm())
            stats = [None] * ctx.world_size
            dist.all_gather_object(stats, engine.router_stats())
            state = engine.full_state_dict()
        out.append(
            {
                "losses": losses,
                "grad_norms": norms,
                "census": engine.memory_census(),
                "state": state,
                "describe": engine.describe(),
                "router_stats": stats,
                "comm": engine.last_step_details().get("comm"),  # the last step's counted collectives, where counted
                "process_groups": {  # the groups the engine names for the profiler, by their ranks
                    axis: [dist.get_process_group_ranks(g) for g in groups if g is not None]
                    for axis, groups in engine.process_groups().items()
                },
                "uncovered": sorted(reached),
            }
        )
        del engine
    return out


def reference_with_router(run: dict, steps: int, grad_norms: list | None = None, ties: dict | None = None):
    """The reference's losses, final weights and last step's router statistics for run's workload (and its
    micro_batch_size); each step's gradient norm appended to `grad_norms` where given; with `ties`, its near
    ties by layer over the run added to it (counting_near_ties at the workload's rounding_step, tail over every
    routed token of the run)."""
    import torch

    from harness.data.source import token_source
    from harness.frameworks.single.engine import SingleDeviceEngine
    from harness.spec import parse_spec

    mb = run["layout"].get("micro_batch_size", 1)
    spec = parse_spec({"workload": run["workload"], "layout": {"engine": "single", "micro_batch_size": mb}})
    shape = spec.shape()
    engine = SingleDeviceEngine(spec, shape, torch.device("cpu"))
    source = token_source(spec.workload, shape.vocab)
    if ties is not None:
        w = spec.workload
        routed = shape.layers * steps * w.global_batch_size * w.seq_len
        counting_near_ties(engine.model, rounding_step(w.precision, w.fp8_recipe), tail(routed), ties)
    losses = []
    for step in range(steps):
        engine.router_stats()  # only the last step's
        losses.append(float(engine.train_step(source.global_batch_at(step))))
        if grad_norms is not None:
            grad_norms.append(engine.grad_norm())
    return losses, engine.full_state_dict(), engine.router_stats()


def check_router_stats(by_rank: list, ref_stats: dict, rtol: float = 1e-5) -> None:
    """Routed slots and forwards summed over the ranks are the reference's; each rank's losses are its
    forwards' mean, so their forward-weighted mean is the reference's to rtol."""
    by_rank = [s for s in by_rank if s]
    assert set(ref_stats) == {layer for s in by_rank for layer in s}, (sorted(ref_stats), by_rank)
    for layer, ref in ref_stats.items():
        held = [s[layer] for s in by_rank if layer in s]
        counts = [sum(s["counts"][e] for s in held) for e in range(len(ref["counts"]))]
        assert counts == ref["counts"], (layer, counts, ref["counts"])
        assert sum(s["forwards"] for s in held) == ref["forwards"]
        for loss in ("aux", "z"):
            mean = sum(s[loss] * s["forwards"] for s in held) / ref["forwards"]
            assert math.isclose(mean, ref[loss], rel_tol=rtol), (layer, loss, mean, ref[loss])
