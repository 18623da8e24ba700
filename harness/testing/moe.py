"""The single-device reference's router statistics and the check an engine's per-rank statistics sum to them
(the runner's sum over ranks: harness.model.moe.combine_router_stats), for the engines' MoE parity tests."""

from __future__ import annotations

import math


def reference_with_router(run: dict, steps: int):
    """The reference's losses, final weights and last step's router statistics for run's workload (and its
    micro_batch_size)."""
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
