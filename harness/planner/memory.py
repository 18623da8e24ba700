"""Bytes per GPU for the worst pipeline stage: model states, activations, logits, overheads.

The structure follows what a Megatron-style engine of the reference study's kind holds (Hagemann
et al. 2023 used Aleph Alpha's framework; its open-sourced successor, github.com/Aleph-Alpha/scaling,
shows the same choices): bf16 weights and bf16 gradients on every data-parallel rank, fp32
master weights and Adam moments sharded over data parallelism (ZeRO-1); a language-model head
whose column-parallel output is all-gathered over the tensor-parallel group, so every tensor-
parallel rank computes the cross-entropy over the full vocabulary (``parallel_output=False``
and a plain ``torch.nn.functional.cross_entropy`` on ``logits.float()``).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", Sec. 4), redone for LLaMA: RMSNorm instead of LayerNorm, SwiGLU (three
feed-forward matrices), rotary q/k, optional grouped-query attention, and no dropout (LLaMA has
none, so none of Korthikanti's dropout masks exist). Flash-style kernels keep no s x s matrix;
materialised ones keep the softmax output. Every count below is what autograd holds between a
layer's forward and its backward, in units of (tokens x width x training-dtype bytes) unless
stated. Two constants are calibrated (CONTEXT_GIB, FRAGMENTATION; see their comments).
"""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner.hardware import Profile
from harness.planner.layout import ATTENTION_CLASS, Layout, Workload, stage_items

GIB = 1024 ** 3

# Bytes per score element (b x heads x s x s) kept by materialised attention until its backward:
# the fused scale-mask-softmax keeps its bf16 output (Megatron's kernel saves only that); the
# plain-torch path upcasts to fp32 for the softmax, keeps the fp32 output for the softmax
# backward (4) and the bf16 cast that feeds the AV product (2).
SCORE_BYTES = {"naive": 6, "fused_softmax": 2}
# While a materialised attention runs backward, the gradient of the score matrix exists next to
# what was kept: fp32 for naive (softmax in fp32), bf16 for the fused kernel.
SCORE_GRAD_BYTES = {"naive": 4, "fused_softmax": 2}
# Per RMSNorm, units of tokens x hidden x dtype kept: the fused kernel keeps its input (1) and the
# next GEMM keeps its output (1). Eager RMSNorm (x.float(), pow, mean, rsqrt, mul, cast, weight
# mul) keeps the fp32 copy of the input (2 units at bf16) saved by pow and mul, the bf16
# normalised tensor saved by the weight mul (1) and the output kept by the next GEMM (1).
RMSNORM_UNITS = {"fused": 2, "torch": 4}
# Cross-entropy over the all-gathered full vocabulary, bytes per logit (tokens x vocab) at the
# peak of the loss backward: the gathered bf16 logits the stage output still references (2), the
# fp32 log-softmax output saved for backward (4), the incoming fp32 gradient (4) and the fp32
# input gradient being produced (4). (The fp32 upcast is not saved by log_softmax, whose
# backward needs only its output.)
LOGIT_BYTES = 14
# ZeRO-1 gradient reduction (at the optimizer step, after the activations are freed): gradients
# are flattened into buckets of 500M elements, upcast to fp32 and all-reduced (Aleph Alpha
# scaling, optimizer/allreduce.py: `allreduce_bucket`, default bucket 5e8 elements).
REDUCE_BUCKET_ELEMENTS = 5e8
# Mixed precision keeps fp32 master weights + Adam m and v (4 + 4 + 4 bytes per parameter);
# fp32 training keeps only m and v (Rajbhandari et al. 2020, ZeRO, Sec. 3.1).
#
# Calibrated (grid search over the two, globally, on the OOM outcomes of the four published
# sweeps in baselines/paper_sweeps; leave-one-sweep-out figures in tests/test_planner_paper.py):
# memory outside PyTorch's tensors: CUDA context with cuBLAS/cuDNN workspaces and NCCL's buffers
# for the tensor-, pipeline- and data-parallel communicators. The CUDA context of an A100 is
# ~0.5-0.8 GiB and NCCL's ring/tree buffers with several communicators ~0.5-1 GiB.
CONTEXT_GIB = 1.0
# The caching allocator's fragmentation, as a fraction of the dynamic (activation, logit)
# memory. Without a pipeline, a micro-batch's activations are freed in the reverse order of
# their allocation (LIFO) and the allocator reuses its blocks cleanly; under 1F1B the stage
# frees micro-batch i's tensors while micro-batch i+p's are being allocated, interleaving
# lifetimes, and cached blocks split (reserved/allocated of 1.05-1.3 in PyTorch memory-snapshot
# studies of pipelined training).
FRAGMENTATION = 0.05
FRAGMENTATION_PIPELINED = 0.20


def stage_params(shape: Shape, has_emb: bool, layers: int, has_head: bool, tp: int) -> float:
    """Parameters held per GPU of a stage: matrices split over tp (vocab-parallel embedding/head;
    a tied head on the embedding's stage is the same tensor, counted once; attention biases: q/k/v's
    split over tp, o's replicated)."""
    d = shape.hidden // shape.heads
    attn = shape.hidden * shape.heads * d * 2 + 2 * shape.hidden * shape.kv_heads * d
    per_layer = (attn + 3 * shape.hidden * shape.ffn) / tp + 2 * shape.hidden
    if shape.attention_bias:
        per_layer += (shape.heads + 2 * shape.kv_heads) * d / tp + shape.hidden
    vocab = shape.vocab * shape.hidden / tp
    head = 0 if shape.tie_embeddings and has_emb else vocab
    return layers * per_layer + (vocab if has_emb else 0) + ((head + shape.hidden) if has_head else 0)


def layer_activation_bytes(shape: Shape, lay: Layout, wl: Workload, micro_batch: int | None = None) -> dict:
    """Bytes one layer keeps for one micro-batch: 'layer' (kept), 'scores' (kept s x s) and
    'full_layer' (everything that exists while the layer runs backward, recomputed or not)."""
    b = lay.micro_batch_size if micro_batch is None else micro_batch
    s, h, f, t, B = wl.seq_len, shape.hidden, shape.ffn, lay.tp, wl.dtype_bytes
    n = b * s
    d = h // shape.heads
    kv = shape.kv_heads * d
    # Replicated across tensor-parallel ranks unless sequence parallel splits them: the two
    # RMSNorms' kept tensors (their outputs are the column-parallel GEMMs' inputs).
    norm_units = RMSNORM_UNITS[lay.rmsnorm] if B < 4 else 2
    replicated = 2 * norm_units * n * h * B
    if lay.sequence_parallel:
        replicated /= t
    # Split over tensor-parallel ranks: the fused q/k/v output (kept alive by v, a view of it),
    # rotated q and k, the attention output; SwiGLU's fused gate/up output, silu(gate), product.
    sharded = (n * (h + 2 * kv) + n * (h + kv) + n * h + 4 * n * f) * B / t
    cls = ATTENTION_CLASS[lay.attention]
    scores = SCORE_BYTES.get(cls, 0) * b * (shape.heads / t) * s * s
    score_grad = SCORE_GRAD_BYTES.get(cls, 0) * b * (shape.heads / t) * s * s
    ckpt = lay.activation_checkpointing
    if ckpt == "selective":  # Korthikanti Sec. 4.2: recompute the attention core, keep the rest
        scores = 0.0
        sharded -= n * h * B / t  # the attention output is recomputed too
    full_layer = replicated + sharded + scores + score_grad
    # The s x s tensors a layer's backward allocates and frees: the score gradient, and the
    # scores themselves when the attention core is recomputed (full or selective checkpointing).
    s2_transient = score_grad + (SCORE_BYTES.get(cls, 0) * b * (shape.heads / t) * s * s if ckpt != "none" else 0.0)
    if ckpt == "full":
        kept = n * h * B / (t if lay.sequence_parallel else 1)  # the layer input only
        return {"layer": kept, "scores": 0.0, "full_layer": full_layer, "s2_transient": s2_transient}
    return {"layer": replicated + sharded, "scores": scores, "full_layer": full_layer, "s2_transient": s2_transient}


def in_flight(lay: Layout, stage: int, m: int) -> float:
    """Micro-batches (in units of the stage's layers) whose activations a stage holds at peak."""
    p = lay.pp
    if p == 1:
        return 1.0
    if lay.pipeline_schedule == "gpipe":
        return float(m)
    if lay.pipeline_schedule == "interleaved" and lay.virtual_stages > 1:
        v = lay.virtual_stages  # Megatron's warm-up count, in chunks of 1/v of the stage's layers
        chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
        return chunks / v
    return float(min(p - stage, m))  # 1F1B (Narayanan et al. 2021, Sec. 2.2)


def stage_memory(shape: Shape, lay: Layout, wl: Workload, stage: int) -> dict:
    """Breakdown in bytes for one stage; 'total' is the sum of the parts."""
    has_emb, layers, has_head = stage_items(shape, lay.pp)[stage]
    phi = stage_params(shape, has_emb, layers, has_head, lay.tp)
    B, dp = wl.dtype_bytes, lay.dp
    zero = lay.sharding_stage
    opt_bytes = 12 if B == 2 else 8
    weights = phi * B / (dp if zero >= 3 else 1)
    grads = phi * B / (dp if zero >= 2 else 1)
    optimizer = phi * opt_bytes / (dp if zero >= 1 else 1)
    if zero >= 3:  # gathered full layers in flight (current + prefetched), FSDP/ZeRO-3
        weights += 2 * phi / max(layers, 1) * B * 2
    m = wl.micro_batches(lay)
    act = layer_activation_bytes(shape, lay, wl)
    n = lay.micro_batch_size * wl.seq_len
    flight = in_flight(lay, stage, m)
    held = flight * layers * (act["layer"] + act["scores"])
    if has_emb:  # the embedding output (the first layer's input), per micro-batch in flight
        held += flight * n * shape.hidden * B / (lay.tp if lay.sequence_parallel else 1)
    # The peak is either the loss backward (last stage: full-vocab logits next to everything
    # held) or a layer's backward (its full activations, recomputed under checkpointing, and
    # their gradients next to everything held), whichever is larger.
    working = act["full_layer"] + 2 * n * shape.hidden * B if layers else 0.0
    logits = n * shape.vocab * LOGIT_BYTES + n * shape.vocab / lay.tp * B if has_head else 0.0
    # The s x s transients of materialised attention do not outlive a layer's backward, yet they
    # add to the loss peak, not just compete with it: the caching allocator carves them out of
    # the segments the logits and loss tensors were freed into, and live tensors allocated
    # between the layer backwards (gradient buckets, the next micro-batch's checkpoints) keep
    # those split blocks from coalescing, so the next micro-batch's logits need fresh segments.
    # (A known effect of PyTorch's non-coalescing segments, the reason for expandable_segments.)
    # No constant: the bytes are the ones counted above. It moves 2 of the 390 judged outcomes of
    # the published sweeps (13B naive attention with full checkpointing at 4-8 x 2048 tokens
    # per GPU) to the measured OOM and no other.
    if has_head:
        logits += act["s2_transient"]
    peak_extra = max(working, logits)
    dynamic = held + peak_extra
    # The optimizer step runs after the activations are freed: fp32 gradient buckets (bf16
    # flatten + fp32 copy) and the fp32 gradient of this rank's shard.
    step_extra = min(phi, REDUCE_BUCKET_ELEMENTS) * (B + 4) + (4 * phi / dp if zero >= 1 else 0.0)
    if step_extra > dynamic:
        dynamic = step_extra
        held, peak_extra = 0.0, step_extra
    frag = FRAGMENTATION_PIPELINED if lay.pp > 1 and m > 1 else FRAGMENTATION
    overhead = CONTEXT_GIB * GIB + frag * dynamic
    loss_part = logits if has_head and logits >= working and peak_extra == logits else 0.0
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": held,
             "backward_working_set": peak_extra - loss_part, "logits_and_loss": loss_part,
             "overhead": overhead}
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


def model_states(params: float, engine: str, zero_stage: int, precision: str, dp: int,
                 grad_accum: str = "fp32", grad_reduce: str = "fp32",
                 reduce_bucket_elements: float = 0.0) -> dict[str, dict[str, float]]:
    """Bytes per category and dtype of the model states one rank of `engine` holds at the optimizer
    step, for `params` parameters on the rank, under the workload's precision policy: the same
    categories as a run's measured memory census (harness.measure.tensor_census), so a prediction
    and a census compare term by term (tests/test_planner_census.py). Adam's step counters and
    alignment padding are left out (under 1%)."""
    P, d, B = float(params), dp, {"fp32": 4, "bf16": 2}
    mixed = precision == "bf16"
    acc, red = (grad_accum, grad_reduce) if mixed else ("fp32", "fp32")
    out: dict[str, dict[str, float]] = {"parameters": {}, "gradients": {}, "master_parameters": {},
                                        "optimizer_states": {}}

    def add(category: str, dtype: str, elements: float) -> None:
        if elements:
            out[category][dtype] = out[category].get(dtype, 0.0) + elements * B[dtype]

    if engine == "fsdp":  # the sharded fp32 parameters are the master; the gathered bf16 ones are gone
        add("parameters", "fp32", P / d)
        add("gradients", "fp32", P / d)
        add("optimizer_states", "fp32", 2 * P / d)
        return out
    if engine in ("own", "single"):  # harness/engine/data_parallel.py (Megatron's layout)
        shard = P / d if zero_stage >= 1 and d > 1 else P
        add("parameters", "bf16" if mixed else "fp32", P)
        add("gradients", acc, P)  # the main gradients
        if zero_stage >= 1 and d > 1:
            add("gradients", red, P / d)  # the reduce-scatter output
            if red != "fp32":
                add("gradients", "fp32", P / d)  # the optimizer's fp32 copy of it
        elif acc != "fp32":
            add("gradients", "fp32", P)  # the fp32 reduced gradient the masters step with
        if mixed:
            add("master_parameters", "fp32", shard)
        add("optimizer_states", "fp32", 2 * shard)
        return out
    if engine == "deepspeed" and zero_stage >= 1:  # ds_configs/README.md, "Precision": what each stage holds
        add("master_parameters", "fp32", P / d)  # a clone of the partition, fp32 workloads too
        add("optimizer_states", "fp32", 2 * P / d)
        if zero_stage == 3:
            add("parameters", "bf16" if mixed else "fp32", P / d)
            add("gradients", acc, P / d)  # the partition's accumulation buffer
            add("gradients", "fp32", P / d)  # the fp32 partition gradient the optimizer steps with
            add("gradients", red, reduce_bucket_elements)  # the reduce bucket, held for the run
            return out
        add("parameters", "bf16" if mixed else "fp32", P)
        if mixed and zero_stage == 1 and acc == "fp32":  # BF16_Optimizer
            add("gradients", "bf16", P)  # every .grad, zeroed but kept
            add("gradients", "fp32", P)  # its whole-model fp32 accumulation buffer
        else:
            add("gradients", "fp32", P / d)
        return out
    raise ValueError(f"no model-state model for engine {engine!r} at ZeRO stage {zero_stage}")
