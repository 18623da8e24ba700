"""Context parallelism's own terms in the planner: which implementations a layout may use, the K/V
bytes in flight beside a layer's attention, and the exchange (its bytes, and how much of it the
attention compute hides).

Every other term of a cp layout is the plain one on the rank's seq / cp tokens (Workload.local):
the GEMMs, norms, SwiGLU, the kept activations, the logits and the loss. What cp adds is here.
Notation per rank and micro-batch: b sequences, s_l = s / cp local tokens, kv = the rank's KV width
(KV heads x head dim / tp), B the activations' bytes.

  ring       K/V blocks hop round the ring, each hop posted before the block in hand is computed
             (exposed: max(0, transfer - block compute) per block); backward the K/V hop again and
             the fp32 dK/dV accumulators come home. In flight: the block computed on and the one
             arriving, in backward the two dK/dV accumulators.
  allgather  K/V all-gathered before the attention (again in backward), the fp32 dK/dV
             reduce-scattered after it, not overlapped; only the local K/V are kept.
  ulysses    all-to-all of q, k, v from sequence shards to head shards before the attention and of
             the output back (backward: their gradients), not overlapped; the kernel runs on 1/cp of
             the heads over the whole sequence.
The exchange's bytes are the own engine's counted communication (comm_model.cp_attention_calls);
the kept and transient bytes of its attention (cp_attention_bytes) its code's
(harness/engine/context_parallel.py), checked against `harness memory` traces.
"""

from __future__ import annotations

from harness import registry
from harness.model.presets import Shape
from harness.parallel_dims import ParallelDims
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PAPER
from harness.spec import CP_IMPLS


def engine_impls(engine: str) -> tuple[str, ...]:
    """The cp implementations the planner offers under `engine`: those its facts declare it runs
    (layout.cp_impl's values where it runs a cp above 1); none under the study's engine."""
    if engine == PAPER:
        return ()
    facts = registry.facts(engine)
    return tuple(facts.runs("layout.cp_impl", CP_IMPLS)) if facts.runs("layout.cp", (2,)) else ()


def no_cp(engine: str) -> str:
    """Why `engine` has no context parallelism ("" where it has some), in its facts' words."""
    if engine == PAPER:
        return "the study's engine had no context parallelism"
    return registry.facts(engine).refuses("layout.cp", 2, 1) or ""


# The fewest tokens a rank keeps of each sequence for the planner to offer a cp degree unasked
# (`harness plan --cp` names any): below it the GEMMs' rows and the ring's blocks shrink while the
# exchange stays, and the candidates would multiply where cp is not what a layout lacks (a plan of
# a 2k-token workload answers in a second, not five).
MIN_LOCAL_TOKENS = 4096


def degrees(seq_len: int, gpus: int, tp: int, wanted=None) -> list[int]:
    """The cp degrees of `gpus` GPUs at tensor-parallel degree tp: powers of two that the sequence
    splits into 2 cp equal chunks (cp_token_index) and tp x cp divides the GPUs; 1 first. `wanted`:
    the degrees asked for (`harness plan --cp`), else those leaving a rank MIN_LOCAL_TOKENS."""
    out, cp = [1], 2
    while ParallelDims(cp=cp, tp=tp).divides(gpus) and seq_len % (2 * cp) == 0:
        if wanted is None and seq_len < cp * MIN_LOCAL_TOKENS:
            break
        out.append(cp)
        cp *= 2
    return [c for c in out if c in wanted] if wanted is not None else out


def impls(shape: Shape, engine: str, tp: int, cp: int) -> tuple[str, ...]:
    """The cp implementations the planner offers a layout (the spec's default for cp 1): ulysses
    only where the heads and the KV heads divide by cp x tp (harness.spec's check)."""
    if cp == 1:
        return ("ring",)
    both = ParallelDims(cp=cp, tp=tp).product("cp", "tp")
    return tuple(
        i for i in engine_impls(engine) if i != "ulysses" or (shape.heads % both == 0 and shape.kv_heads % both == 0)
    )


def _widths(shape: Shape, lay) -> tuple[float, float]:
    """(query width, KV width) per tensor-parallel rank."""
    d = shape.head_dim
    return shape.heads * d / lay.tp, shape.kv_heads * d / lay.tp


def cp_attention_bytes(shape: Shape, lay, s: int, b: int, B: int) -> dict[str, float]:
    """Bytes of one layer's cp attention for one micro-batch per rank, `s` its local tokens: 'kept'
    for backward (from the rotated q/k/v to wo's input), and 'backward' (what exists above that
    while it runs backward), as the own engine's code holds them (harness/engine/context_parallel.py).

    Ring and allgather run one block per source rank, merged by online softmax in fp32: kept q, the
    local k and v, the fp32 output and log-sum-exp, and wo's input (a copy of the output in its
    dtype). Their backward holds dq's fp32 accumulator, the K/V it attends (ring: its packed block
    and the next arriving; allgather: the whole sequence's, re-gathered, and the fp32 dK/dV of all
    of it) and at the largest block (the rank's own, s x s): with a materialised kernel (naive's
    fp32 math) four fp32 score-sized tensors (P, dP, dP - delta or P (dP - delta), dS), the mask,
    the fp32 copies of q, of the output gradient and of the block's K/V, and dV; with a flash-style
    one (torch's flash kernel per block) the output in its dtype, the block's K/V repeated to every
    query head and the kernel's three gradients, no s x s tensor.
    Ulysses runs the layout's kernel on 1/cp of the heads over the whole sequence: the plain
    kernel's tensors with s x cp keys (the mask seq x seq), q/k/v as one all-to-all output
    (flash keeps all of it: q is a view of it), and wo's input beside the kernel's output."""
    hq, kv = _widths(shape, lay)
    heads = shape.heads / lay.tp
    d = shape.head_dim
    n, cp = b * s, lay.cp
    seq = s * cp
    rot = 4 * s * d * B if B == 2 else 0.0
    up = 4 if B == 2 else 0  # an fp32 copy of a tensor in the activations' dtype (none under fp32)
    lse = 4 * b * heads * s
    gqa = shape.heads != shape.kv_heads
    materialised = ATTENTION_CLASS[lay.attention] in MATERIALISED
    if lay.cp_impl in ("ring", "allgather"):
        kept = n * hq * B + 2 * n * kv * B + n * hq * 4 + lse + n * hq * B + rot
        if lay.cp_impl == "ring":  # its packed K/V block and the next one arriving
            held = 2 * 2 * n * kv * B
        else:  # the re-gathered K/V and the fp32 dK/dV of every source rank
            held = cp * 2 * n * kv * (B + 4)
        held += n * hq * 4  # dq
        if materialised:
            scores = 4 * b * heads * s * s
            block = 4 * scores + s * s + 2 * n * hq * up + lse + 2 * n * kv * up + n * kv * 4
        else:  # the output in its dtype; the block's K/V repeated; dq, dk, dv of the kernel
            repeated = 2 * n * hq * B if gqa else 0.0
            block = n * hq * (B if B == 2 else 0) + repeated + n * hq * B + 2 * n * (hq if gqa else kv) * B
        return {"kept": kept, "backward": held + block}
    qkv = n * (hq + 2 * kv) * B  # the all-to-all's output: the head shard's q, k, v of every token
    wo_in = n * hq * B
    if materialised:
        core = 3 * n * hq * 4 + seq * seq + 4 * b * heads * s * seq  # fp32 q, k, v; mask; softmax
        core_backward = 2 * 4 * b * heads * s * seq
    else:
        core = qkv + (2 * n * hq * B if gqa else 0.0) + n * hq * B + lse  # q a view of the all-to-all's output
        core_backward = n * hq * 4
    if lay.activation_checkpointing == "selective":  # the core's inputs kept, the core recomputed in backward
        return {"kept": qkv + wo_in + rot, "backward": core + core_backward + qkv}
    return {"kept": core + wo_in + rot, "backward": core_backward + qkv}


def exchange_bytes(shape: Shape, lay, seq_len: int, B: int) -> dict[str, float]:
    """What one rank's cp attention moves for one layer and micro-batch, forward and backward, as
        the own engine's counted communication has it (harness.engine.comm_model.cp_attention_calls,
        which imports torch: tests/test_cp_planner.py holds the two equal): 'calls' (the bytes of each
        of its calls' kinds), 'total' (the bytes a rank puts on its link: a ring's sends; (cp-1)/cp of
        a collective's buffer) and for the ring 'step' (one K/V hop) and 'steps' (the blocks it computes,
    forward and backward, each overlapping a hop). Full
        checkpointing runs the forward, its exchange included, twice; selective repeats none of it."""
    cp = lay.cp
    if cp == 1:
        return {"calls": {}, "total": 0.0, "step": 0.0, "steps": 0}
    hq, kv = _widths(shape, lay)
    n_l = lay.micro_batch_size * seq_len / cp
    runs = 2 if lay.activation_checkpointing == "full" else 1
    block = 2 * n_l * kv  # K and V packed, elements
    frac = (cp - 1) / cp
    if lay.cp_impl == "ring":
        hops = runs * (cp - 1) + (cp - 1)
        calls = {"send": hops * block * B + cp * block * 4}  # the K/V hops; the fp32 dK/dV accumulators
        return {"calls": calls, "total": calls["send"], "step": block * B, "steps": (runs + 1) * cp}
    if lay.cp_impl == "allgather":
        calls = {"all_gather": (runs + 1) * cp * block * B, "reduce_scatter": cp * block * 4}
    else:  # ulysses: q, k, v packed and the output, each way
        calls = {"all_to_all": (runs + 1) * n_l * ((hq + 2 * kv) + hq) * B}
    return {"calls": calls, "total": frac * sum(calls.values()), "step": 0.0, "steps": 0}
