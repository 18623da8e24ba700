"""What rank 0 records of every rank: each rank's memory census, step breakdown and pipeline
timeline gathered (stages and ZeRO shards differ, so one rank's view alone would mislead), the
slowest rank's times and every rank's host. Every rank calls these together (collectives)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.frameworks import TrainingEngine
from harness.runtime import RunContext


def max_across_ranks(values: list[float], ctx: RunContext) -> list[float]:
    if ctx.backend is None:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def hosts(ctx: RunContext) -> list[str]:
    import socket

    if ctx.backend is None:
        return [socket.gethostname()]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, socket.gethostname())
    return out


def census_over_ranks(engine: TrainingEngine, activations: int | None, ctx: RunContext) -> dict:
    """Rank 0's memory census and saved activations per micro-batch, and every rank's (pipeline
    stages and ZeRO shards differ); None where the engine does not measure them."""
    mine = {"memory_census": engine.memory_census(), "activations_saved_bytes": activations}
    everyone = [mine]
    if ctx.backend is not None:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
    return {
        "memory_census": everyone[0]["memory_census"],
        "memory_census_by_rank": [r["memory_census"] for r in everyone],
        "activations_saved_bytes": everyone[0]["activations_saved_bytes"],
        "activations_saved_bytes_by_rank": [r["activations_saved_bytes"] for r in everyone],
    }


def breakdown_over_ranks(mine: dict, ctx: RunContext) -> dict:
    """Each rank's median breakdown, and their mean: where a GPU's step goes on average.
    Pipeline stages differ (the first waits in the bubble, the last holds the loss), so one
    rank's view alone would mislead."""
    if ctx.backend is None:
        return {"breakdown_s": mine, "breakdown_s_by_rank": [mine]}
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    mean = {k: sum(r[k] for r in everyone) / len(everyone) for k in mine}
    return {"breakdown_s": mean, "breakdown_s_by_rank": everyone}


def timeline_of_every_stage(mine: list[dict], ctx: RunContext) -> list[dict]:
    """The last step's forward/backward events of every pipeline stage, one rank per stage
    (each rank's times count from its own step start, which the step's collectives align)."""
    if ctx.backend is None:
        return mine
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    owner: dict = {}
    for events in everyone:
        for e in events or []:
            owner.setdefault(e["stage"], e.get("rank"))
    merged = [e for events in everyone for e in events or [] if owner.get(e["stage"]) == e.get("rank")]
    return sorted(merged, key=lambda e: (e["stage"], e["start_s"]))


def router_over_ranks(mine: list[dict], ctx: RunContext) -> list[dict]:
    """Every step's router statistics (a MoE's, harness.model.moe) summed over the ranks: each rank
    routed its own tokens of the layers it holds."""
    from harness.model.moe import combine_router_stats

    everyone = [mine]
    if ctx.backend is not None:
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
    return [combine_router_stats([rank[i] for rank in everyone]) for i in range(len(mine))]
