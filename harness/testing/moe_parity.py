"""The engines' MoE parity tests' common parts: each rank's training with its router statistics, the
single-device reference's, and the check an engine's per-rank statistics sum to them (the runner's sum over
ranks: harness.model.moe.combine_router_stats)."""

from __future__ import annotations

import contextlib
import math


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


def reference_with_router(run: dict, steps: int, grad_norms: list | None = None):
    """The reference's losses, final weights and last step's router statistics for run's workload (and its
    micro_batch_size); each step's gradient norm appended to `grad_norms` where given."""
    import torch

    from harness.data.source import token_source
    from harness.frameworks.single.engine import SingleDeviceEngine
    from harness.spec import parse_spec

    mb = run["layout"].get("micro_batch_size", 1)
    spec = parse_spec({"workload": run["workload"], "layout": {"engine": "single", "micro_batch_size": mb}})
    shape = spec.shape()
    engine = SingleDeviceEngine(spec, shape, torch.device("cpu"))
    source = token_source(spec.workload, shape.vocab)
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
