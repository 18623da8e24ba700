"""Which layers each pipeline stage holds, and which parameter shards each rank owns.

Both are pure functions of the shape and layout, so the model builder, the gradient
buckets and the closed-form comm model all read the same list.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.engine.schedules import Placement
from harness.model.presets import Shape


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
    bounds, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        bounds.append(range(j, i))
        i = j
    return bounds[::-1]


@dataclass(frozen=True)
class ParamSpec:
    name: str  # as in the plain Llama's state dict
    full: tuple[int, ...]  # full shape
    local: tuple[int, ...]  # this rank's shard
    shard_dim: int | None  # None: replicated across TP
    chunk: int  # which of this rank's model chunks holds it
    expert: bool = False  # a routed expert's: replicated over the expert-data-parallel group only
    tp_partial: bool = False  # replicated across TP with a partial gradient on each rank (the router's)


def _sharded(name, full, dim, tp, chunk, expert=False):
    local = list(full)
    local[dim] //= tp
    return ParamSpec(name, tuple(full), tuple(local), dim, chunk, expert)


def feed_forward_params(shape: Shape, tp: int, p: str, chunk: int, experts: range | None) -> list[ParamSpec]:
    """A block's feed-forward: the dense SwiGLU, or under a MoE the router (replicated across TP, its
    gradient a partial sum per TP rank: harness.engine.experts) and the held experts (`experts`, by
    global index; all by default), each a SwiGLU at width moe_ffn/tp."""
    h = shape.hidden
    if not shape.moe:
        return [
            _sharded(p + "feed_forward.w1.weight", (shape.ffn, h), 0, tp, chunk),
            _sharded(p + "feed_forward.w3.weight", (shape.ffn, h), 0, tp, chunk),
            _sharded(p + "feed_forward.w2.weight", (h, shape.ffn), 1, tp, chunk),
        ]
    e, f = shape.experts, shape.moe_ffn
    out = [ParamSpec(p + "feed_forward.router.weight", (e, h), (e, h), None, chunk, tp_partial=True)]
    for x in range(e) if experts is None else experts:
        q = f"{p}feed_forward.experts.{x}."
        out += [
            _sharded(q + "w1.weight", (f, h), 0, tp, chunk, True),
            _sharded(q + "w3.weight", (f, h), 0, tp, chunk, True),
            _sharded(q + "w2.weight", (h, f), 1, tp, chunk, True),
        ]
    return out


def stage_params(
    shape: Shape, tp: int, layers: range, first: bool, last: bool, chunk: int = 0, experts: range | None = None
) -> list[ParamSpec]:
    """Parameters of one model chunk in registration order (the plain model's order).

    Attention biases: q/k/v's sharded with their heads, wo's replicated across TP (added after
    the reduction; under SP its gradient is a partial sum over the sequence, like the norms').
    Per-head q/k norms (qk_norm): replicated, their gradients partial over TP (tp_partial).
    A tied LM head is tok_embeddings.weight: not listed again. `experts`: the routed experts this
    rank holds under expert parallelism (all by default)."""
    h, hd = shape.hidden, shape.head_dim
    out = []
    if first:
        out.append(_sharded("tok_embeddings.weight", (shape.vocab, h), 0, tp, chunk))
    for i in layers:
        p = f"layers.{i}."
        out.append(ParamSpec(p + "attention_norm.weight", (h,), (h,), None, chunk))
        for name, rows in (("wq", shape.heads * hd), ("wk", shape.kv_heads * hd), ("wv", shape.kv_heads * hd)):
            out.append(_sharded(p + f"attention.{name}.weight", (rows, h), 0, tp, chunk))
            if shape.has_qkv_bias:
                out.append(_sharded(p + f"attention.{name}.bias", (rows,), 0, tp, chunk))
        out.append(_sharded(p + "attention.wo.weight", (h, shape.heads * hd), 1, tp, chunk))
        if shape.attention_bias:
            out.append(ParamSpec(p + "attention.wo.bias", (h,), (h,), None, chunk))
        if shape.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out.append(ParamSpec(p + f"attention.{norm}.weight", (hd,), (hd,), None, chunk, tp_partial=tp > 1))
        out.append(ParamSpec(p + "ffn_norm.weight", (h,), (h,), None, chunk))
        out += feed_forward_params(shape, tp, p, chunk, experts)
    if last:
        out.append(ParamSpec("norm.weight", (h,), (h,), None, chunk))
        if not (shape.tie_embeddings and first):
            out.append(_sharded("output.weight", (shape.vocab, h), 0, tp, chunk))
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


def rank_params(shape: Shape, tp: int, place: Placement, pp_rank: int, seq_len: int) -> list[ParamSpec]:
    out = []
    for plan in rank_chunks(shape, place, pp_rank, seq_len):
        out += stage_params(shape, tp, plan.layers, plan.first, plan.last, plan.chunk)
    return out


def shard_of(full, spec: ParamSpec, tp_index: int, tp: int):
    """This TP rank's slice of a full tensor."""
    if spec.shard_dim is None:
        return full
    return full.chunk(tp, dim=spec.shard_dim)[tp_index]
