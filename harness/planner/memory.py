"""Bytes per GPU for the worst pipeline stage: model states, activations, logits, overheads.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Sec. 4), redone for LLaMA: RMSNorm instead of LayerNorm, SwiGLU (three
feed-forward matrices), rotary q/k, optional grouped-query attention, no dropout. Flash-style
kernels keep no s x s matrix; materialised ones do. Every count below is what autograd holds
between a layer's forward and its backward, in the training dtype unless stated.
"""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner.hardware import Profile
from harness.planner.layout import ATTENTION_CLASS, Layout, Workload, stage_items

GIB = 1024 ** 3

# Bytes per score element (b x heads x s x s) kept by materialised attention. Korthikanti's
# 5 a s^2 b: softmax output (2), attention-dropout mask (1), dropout output kept for AV (2);
# Megatron-style code runs dropout even at p=0, so the mask exists. Naive attention keeps
# the softmax output in fp32 (4) plus the mask (1) and the bf16 dropout output (2).
SCORE_BYTES = {"naive": 7, "fused_softmax": 5}
# While a materialised attention runs backward, the gradient of the score matrix exists next to
# what was kept: fp32 for naive (softmax in fp32), bf16 in place for the fused kernel.
SCORE_GRAD_BYTES = {"naive": 4, "fused_softmax": 2}
# Replicated tensors per layer in units of tokens x hidden x dtype bytes: both RMSNorms' inputs
# and outputs (the outputs are the column-parallel GEMMs' inputs), and the two residual-dropout
# masks (1 byte each = one unit at bf16; Korthikanti Eq. 1 counts them, p=0 or not).
REPLICATED_NH = 5
# Eager RMSNorm as transformers writes it keeps, besides input and output, the fp32 copy of the
# input (4, saved by pow and mul) and the bf16 normalised tensor (2, saved by the weight mul).
TORCH_RMSNORM_EXTRA = 6
# Cross-entropy over a large (vocab-parallel) vocabulary: bf16 logits (2) kept; the loss keeps an
# fp32 copy (4) and the fp32 softmax (4); during its backward the fp32 gradient (4) and its bf16
# cast (2) exist at once: 2 + 14 bytes per logit at the peak.
LOGIT_BYTES_FP32_EXTRA = 14
# Mixed precision keeps fp32 master weights + Adam m and v (4 + 4 + 4 bytes per parameter);
# fp32 training keeps only m and v (Rajbhandari et al. 2020, ZeRO, Sec. 3.1).
# Framework overhead: CUDA context, cuBLAS workspaces and NCCL buffers (~2 GiB on A100 with
# NCCL 2.1x and several communicators), and the caching allocator's fragmentation on dynamic memory (PyTorch
# memory-snapshot studies put reserved/allocated at ~1.1 for training loops).
CONTEXT_GIB = 2.0
FRAGMENTATION = 0.10


def stage_params(shape: Shape, has_emb: bool, layers: int, has_head: bool, tp: int) -> float:
    """Parameters held per GPU of a stage: matrices split over tp (vocab-parallel embedding/head)."""
    d = shape.hidden // shape.heads
    attn = shape.hidden * shape.heads * d * 2 + 2 * shape.hidden * shape.kv_heads * d
    per_layer = (attn + 3 * shape.hidden * shape.ffn) / tp + 2 * shape.hidden
    vocab = shape.vocab * shape.hidden / tp
    return layers * per_layer + (vocab if has_emb else 0) + ((vocab + shape.hidden) if has_head else 0)


def layer_activation_bytes(shape: Shape, lay: Layout, wl: Workload, micro_batch: int | None = None) -> dict:
    """Bytes one layer keeps for one micro-batch, split into 'layer' and the attention 'scores'."""
    b = lay.micro_batch_size if micro_batch is None else micro_batch
    s, h, f, t, B = wl.seq_len, shape.hidden, shape.ffn, lay.tp, wl.dtype_bytes
    n = b * s
    d = h // shape.heads
    kv = shape.kv_heads * d
    # Replicated across tensor-parallel ranks unless sequence parallel splits them: both
    # RMSNorms' inputs and outputs (the outputs are the column-parallel GEMMs' inputs).
    replicated = REPLICATED_NH * n * h * B
    if lay.rmsnorm == "torch" and B < 4:
        replicated += 2 * TORCH_RMSNORM_EXTRA * n * h
    if lay.sequence_parallel:
        replicated /= t
    # Split over tensor-parallel ranks: q, k, v (one buffer that v's view keeps alive), rotated
    # q and k, the attention output; SwiGLU's gate, up, silu(gate) and their product.
    sharded = n * (h + 2 * kv) * B + n * (h + kv) * B + n * h * B + 4 * n * f * B
    sharded /= t
    cls = ATTENTION_CLASS[lay.attention]
    scores = SCORE_BYTES.get(cls, 0) * b * (shape.heads / t) * s * s
    ckpt = lay.activation_checkpointing
    if ckpt == "selective":  # Korthikanti Sec. 4.2: recompute the attention core, keep the rest
        scores = 0.0
        sharded -= n * h * B / t  # the attention output is recomputed too
    score_grad = SCORE_GRAD_BYTES.get(cls, 0) * b * (shape.heads / t) * s * s
    if ckpt == "full":
        kept = n * h * B / (t if lay.sequence_parallel else 1)  # the layer input only
        return {"layer": kept, "scores": 0.0, "full_layer": replicated + sharded + scores + score_grad}
    return {"layer": replicated + sharded, "scores": scores, "full_layer": replicated + sharded + scores + score_grad}


def in_flight(lay: Layout, stage: int, m: int) -> float:
    """Micro-batches (in units of the stage's layers) whose activations a stage holds at peak."""
    p = lay.pp
    if p == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return float(m)
    if lay.schedule == "interleaved" and lay.virtual_stages > 1:
        v = lay.virtual_stages  # Megatron's warm-up count, in chunks of 1/v of the stage's layers
        chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
        return chunks / v
    return float(min(p - stage, m))  # 1F1B (Narayanan et al. 2021, Sec. 2.2)


def stage_memory(shape: Shape, lay: Layout, wl: Workload, stage: int) -> dict:
    """Breakdown in bytes for one stage; 'total' is the sum of the parts."""
    has_emb, layers, has_head = stage_items(shape, lay.pp)[stage]
    phi = stage_params(shape, has_emb, layers, has_head, lay.tp)
    B, dp = wl.dtype_bytes, lay.dp
    zero = 3 if lay.fsdp else lay.zero
    opt_bytes = 12 if B == 2 else 8
    weights = phi * B / (dp if zero >= 3 else 1)
    grads = phi * B / (dp if zero >= 2 else 1)
    optimizer = phi * opt_bytes / (dp if zero >= 1 else 1)
    if zero >= 3:  # gathered full layers in flight (current + prefetched), FSDP/ZeRO-3
        weights += 2 * phi / max(layers, 1) * B * 2
    m = wl.micro_batches(lay)
    act = layer_activation_bytes(shape, lay, wl)
    n = lay.micro_batch_size * wl.seq_len
    held = in_flight(lay, stage, m) * layers * (act["layer"] + act["scores"])
    # While one layer runs backward its full activations (recomputed under checkpointing) and
    # their gradients coexist with everything held: one layer's worth on top.
    working = act["full_layer"] if layers else 0.0
    if has_emb:
        held += in_flight(lay, stage, m) * n * shape.hidden * B / (lay.tp if lay.sequence_parallel else 1)
    logits = 0.0
    if has_head:
        logits = n * shape.vocab / lay.tp * (B + LOGIT_BYTES_FP32_EXTRA) + 2 * n * shape.hidden * B
    dynamic = held + working + logits
    overhead = CONTEXT_GIB * GIB + FRAGMENTATION * dynamic
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": held,
             "backward_working_set": working, "logits_and_loss": logits, "overhead": overhead}
    parts["total"] = sum(parts.values())
    parts["params"] = phi
    return parts


def worst_stage_memory(shape: Shape, lay: Layout, wl: Workload) -> tuple[int, dict]:
    """The stage with the largest total, and its breakdown."""
    best, seen = None, set()
    items = stage_items(shape, lay.pp)
    for i in range(lay.pp):  # the first stage of each kind holds the most micro-batches
        if (items[i], i == lay.pp - 1) in seen:
            continue
        seen.add((items[i], i == lay.pp - 1))
        parts = stage_memory(shape, lay, wl, i)
        if best is None or parts["total"] > best[1]["total"]:
            best = (i, parts)
    return best


def fits(total_bytes: float, profile: Profile) -> bool:
    return total_bytes <= profile.memory_gib * GIB
