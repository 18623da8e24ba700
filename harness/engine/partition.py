"""Which layers each pipeline stage holds, and how each parameter is sharded.

The layers are a pure function of the shape and layout (the model builder and the closed-form comm
model read the same split). A parameter's sharding is carried by the parameter, set where the module
builds it (harness/engine/model.py, experts.py); the parameter list the gradient buckets, the norm
and the state gather read is derived from the built modules (module_params).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from harness.model.presets import Shape

if TYPE_CHECKING:  # an annotation only: the planner imports this module for balanced_partition
    from harness.engine.schedules import Placement


def layer_cost(shape: Shape, seq_len: int) -> float:
    """Forward FLOPs per token of one block: projections + attention scores and values."""
    hd = shape.head_dim
    proj = 2 * shape.hidden * hd * (2 * shape.heads + 2 * shape.kv_heads) + 6 * shape.hidden * shape.ffn
    return proj + 4 * seq_len * shape.hidden


def head_cost(shape: Shape) -> float:
    """The LM head's matmul plus the loss (about 5 FLOPs per logit for softmax and its grad)."""
    return 2 * shape.hidden * shape.vocab + 5 * shape.vocab


def embed_cost(shape: Shape) -> float:
    """A lookup: no matmul, but a pass over hidden-sized rows (and the vocab mask under TP)."""
    return 2 * shape.hidden


def balanced_partition(shape: Shape, stages: int, seq_len: int) -> list[range]:
    """Contiguous layer ranges per global stage minimising the most expensive stage.

    Stage 0 also carries the embedding and the last stage the final norm and LM head, so with
    a large vocabulary the last stage gets fewer layers. Ties go to the earlier boundary.
    """
    n = shape.layers
    if stages > n:
        raise ValueError(f"{n} layers cannot fill {stages} stages")
    lc, embed, head = layer_cost(shape, seq_len), embed_cost(shape), head_cost(shape)
    cut = _integer_cuts(n, stages, lc, embed, head) or _cuts(n, stages, lc, embed, head)
    bounds, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]


def _cuts(n: int, stages: int, lc: float, embed: float, head: float) -> list[list[int]]:
    """cut[s][i]: where stage s begins when the first i layers fill the first s stages, minimising the most
    expensive stage (the dynamic programme; ties to the earlier boundary)."""

    inf = float("inf")
    # best[s][i]: minimal max cost placing the first i layers in the first s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        prev, row, cuts = best[s - 1], best[s], cut[s]
        first, last = s - 1 == 0, s - 1 == stages - 1
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                c = (i - j) * lc  # cost(s - 1, j, i), inlined (the planner asks this of thousands of splits)
                if first:
                    c += embed
                if last:
                    c += head
                v = prev[j] if prev[j] > c else c
                if v < row[i] - 1e-9:
                    row[i], cuts[i] = v, j
    return cut


def _integer_cuts(n: int, stages: int, lc, embed, head) -> list[list[int]] | None:
    """_cuts over numpy arrays, every i of a stage at once, where the costs are integers (as a Shape's are)
    that int64 holds exactly: then _cuts' "lower by more than 1e-9" is "lower", and its cut the first j of
    the least max(best[s - 1][j], cost of layers j..i): argmin's. None otherwise (_cuts then)."""
    if not all(type(x) is int for x in (lc, embed, head)) or n * lc + embed + head >= 2**53:
        return None
    import numpy as np

    big = 2**62  # no j: above every cost
    i = np.arange(n + 1)[:, None]
    j = np.arange(n + 1)[None, :]
    layers = (i - j) * lc
    prev = np.full(n + 1, big, dtype=np.int64)
    prev[0] = 0
    cut = [[0] * (n + 1)]
    for s in range(1, stages + 1):
        c = layers + ((embed if s == 1 else 0) + (head if s == stages else 0))
        v = np.maximum(prev[None, :], c)
        v[(j < s - 1) | (j >= i)] = big
        rows = np.arange(s, n - (stages - s) + 1)
        best = np.full(n + 1, big, dtype=np.int64)
        at = np.zeros(n + 1, dtype=np.int64)
        at[rows] = np.argmin(v[rows], axis=1)
        best[rows] = v[rows, at[rows]]
        cut.append(at.tolist())
        prev = best
    return cut


@dataclass(frozen=True)
class Sharding:
    """How a parameter is held across ranks, carried by the parameter itself (`param.sharding`, set by the
    module that builds it: Megatron's tensor_model_parallel / partition_dim / allreduce attributes).
    A parameter without one is replicated across TP with a whole gradient (norms, a row-parallel bias)."""

    dim: int | None = None  # the dimension split over TP; None: replicated across TP
    expert: bool = False  # a routed expert's: replicated over the expert-data-parallel group only
    tp_partial: bool = False  # replicated across TP with a partial gradient on each rank (q/k norms, the router)


REPLICATED = Sharding()


def shard(param, dim: int | None = None, *, expert: bool = False, tp_partial: bool = False):
    """Mark `param` (returned) as held so."""
    param.sharding = Sharding(dim, expert, tp_partial)
    return param


def shard_swiglu(ffn, expert: bool = False) -> None:
    """A SwiGLU (harness.model.feed_forward.FeedForward) at width ffn/tp, Megatron's way: w1/w3
    column-parallel (rows split), w2 row-parallel (columns split)."""
    for linear, dim in ((ffn.w1, 0), (ffn.w3, 0), (ffn.w2, 1)):
        shard(linear.weight, dim, expert=expert)


@dataclass(frozen=True)
class ParamSpec:
    name: str  # as in the plain Llama's state dict
    full: tuple[int, ...]  # full shape
    local: tuple[int, ...]  # this rank's shard
    shard_dim: int | None  # None: replicated across TP
    chunk: int  # which of this rank's model chunks holds it
    expert: bool = False  # a routed expert's: replicated over the expert-data-parallel group only
    tp_partial: bool = False  # replicated across TP with a partial gradient on each rank (the router's)


def module_params(module, chunk: int, tp: int) -> list[ParamSpec]:
    """The parameter list of one built model chunk in registration order (the plain model's: a tied LM
    head is tok_embeddings.weight, listed once), from what each parameter carries (Sharding)."""
    out = []
    for name, p in module.named_parameters():
        s = getattr(p, "sharding", REPLICATED)
        local = tuple(p.shape)
        full = tuple(n * tp if d == s.dim else n for d, n in enumerate(local))
        out.append(ParamSpec(name, full, local, s.dim, chunk, s.expert, s.tp_partial))
    return out


@dataclass(frozen=True)
class ChunkPlan:
    chunk: int
    stage: int
    layers: range
    first: bool
    last: bool


def rank_chunks(shape: Shape, place: Placement, pp_rank: int, seq_len: int) -> list[ChunkPlan]:
    """The model chunks of one pipeline rank: chunk c holds global stage place.stage(pp_rank, c) of a
    balanced partition into every stage."""
    parts = balanced_partition(shape, place.last + 1, seq_len)
    out = []
    for c in range(place.chunks):
        s = place.stage(pp_rank, c)
        out.append(ChunkPlan(c, s, parts[s], s == 0, s == place.last))
    return out


def shard_of(full, spec: ParamSpec, tp_index: int, tp: int):
    """This TP rank's slice of a full tensor."""
    if spec.shard_dim is None:
        return full
    return full.chunk(tp, dim=spec.shard_dim)[tp_index]
