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

import functools

from harness.model.presets import Shape
from harness.planner.hardware import Profile
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PlannerLayout, Workload, stage_items

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
    head_dim = shape.hidden // shape.heads
    attn = shape.hidden * shape.heads * head_dim * 2 + 2 * shape.hidden * shape.kv_heads * head_dim
    per_layer = (attn + 3 * shape.hidden * shape.ffn) / tp + 2 * shape.hidden
    if shape.attention_bias:
        per_layer += (shape.heads + 2 * shape.kv_heads) * head_dim / tp + shape.hidden
    vocab = shape.vocab * shape.hidden / tp
    head = 0 if shape.tie_embeddings and has_emb else vocab
    return layers * per_layer + (vocab if has_emb else 0) + ((head + shape.hidden) if has_head else 0)


def layer_activation_bytes(shape: Shape, lay: PlannerLayout, wl: Workload, micro_batch: int | None = None) -> dict:
    """Bytes one layer keeps for one micro-batch: 'layer' (kept), 'scores' (kept s x s) and
    'full_layer' (everything that exists while the layer runs backward, recomputed or not)."""
    b = lay.micro_batch_size if micro_batch is None else micro_batch
    s, h, f, t, B = wl.seq_len, shape.hidden, shape.ffn, lay.tp, wl.dtype_bytes
    n = b * s
    head_dim = h // shape.heads
    kv = shape.kv_heads * head_dim
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


def in_flight(lay: PlannerLayout, stage: int, m: int) -> float:
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


def stage_memory(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int) -> dict:
    """Breakdown in bytes for one stage; 'total' is the sum of the parts. The study's engine
    (PlannerLayout.engine paper) here; the harness's engines in engine_stage_memory."""
    if lay.engine != "paper":
        return engine_stage_memory(shape, lay, wl, stage)
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
    step_extra = paper_step_extra(shape, (has_emb, layers, has_head), lay.tp, dp, phi, B, zero)
    if step_extra > dynamic:
        dynamic = step_extra
        held, peak_extra = 0.0, step_extra
    frag = FRAGMENTATION_PIPELINED if lay.pp > 1 and m > 1 else FRAGMENTATION
    overhead = CONTEXT_GIB * GIB + frag * dynamic
    if lay.pp > 1 and m > 1 and peak_extra != step_extra:  # interleaved lifetimes, as FRAGMENTATION_PIPELINED
        overhead += paper_stranded_block(shape, lay, wl, has_head and logits >= working)
    loss_part = logits if has_head and logits >= working and peak_extra == logits else 0.0
    parts = {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": held,
             "backward_working_set": peak_extra - loss_part, "logits_and_loss": loss_part,
             "overhead": overhead}
    parts["total"] = sum(parts.values())
    parts["params"] = phi
    return parts


def worst_stage_memory(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple[int, dict]:
    """The stage with the largest total, and its breakdown."""
    best, seen = None, set()
    items = stage_items(shape, lay.pp) if lay.engine == "paper" else engine_stage_items(shape, lay, wl.seq_len)
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
    P, B = float(params), {"fp32": 4, "bf16": 2}
    mixed = precision == "bf16"
    acc, red = (grad_accum, grad_reduce) if mixed else ("fp32", "fp32")
    out: dict[str, dict[str, float]] = {"parameters": {}, "gradients": {}, "master_parameters": {},
                                        "optimizer_states": {}}

    def add(category: str, dtype: str, elements: float) -> None:
        if elements:
            out[category][dtype] = out[category].get(dtype, 0.0) + elements * B[dtype]

    if engine == "fsdp":  # the sharded fp32 parameters are the master; the gathered bf16 ones are gone
        add("parameters", "fp32", P / dp)
        add("gradients", "fp32", P / dp)
        add("optimizer_states", "fp32", 2 * P / dp)
        return out
    # harness/engine/data_parallel.py, Megatron's layout; Megatron-core's own (engine megatron) holds the same:
    # main_grad in its DDP's contiguous buffer (one dtype to accumulate and reduce), its DistributedOptimizer
    # reduce-scattering into this rank's view of it and sharding the fp32 masters and Adam's moments over dp
    if engine in ("own", "single", "megatron"):
        shard = P / dp if zero_stage >= 1 and dp > 1 else P
        add("parameters", "bf16" if mixed else "fp32", P)
        add("gradients", acc, P)  # the main gradients; ZeRO-1 reduce-scatters in place, into their shard
        if acc != "fp32":  # the fp32 reduced gradient the masters step with (ZeRO-1: this rank's shard)
            add("gradients", "fp32", shard)
        if mixed:
            add("master_parameters", "fp32", shard)
        add("optimizer_states", "fp32", 2 * shard)
        return out
    if engine == "deepspeed" and zero_stage >= 1:  # ds_configs/README.md, "Precision": what each stage holds
        add("master_parameters", "fp32", P / dp)  # a clone of the partition, fp32 workloads too
        add("optimizer_states", "fp32", 2 * P / dp)
        if zero_stage == 3:
            add("parameters", "bf16" if mixed else "fp32", P / dp)
            add("gradients", acc, P / dp)  # the partition's accumulation buffer
            add("gradients", "fp32", P / dp)  # the fp32 partition gradient the optimizer steps with
            add("gradients", red, reduce_bucket_elements)  # the reduce bucket, held for the run
            return out
        add("parameters", "bf16" if mixed else "fp32", P)
        if mixed and zero_stage == 1 and acc == "fp32":  # BF16_Optimizer
            add("gradients", "bf16", P)  # every .grad, zeroed but kept
            add("gradients", "fp32", P)  # its whole-model fp32 accumulation buffer
        else:
            add("gradients", "fp32", P / dp)
        return out
    raise ValueError(f"no model-state model for engine {engine!r} at ZeRO stage {zero_stage}")


# ---------------------------------------------------------------- the study's engine (paper)
#
# Terms of Aleph Alpha's scaling library (github.com/Aleph-Alpha/scaling, the open-sourced
# successor of the framework the study ran; src/scaling/core/optimizer/) that the generic model
# above does not spell out. They grow with model size and with tokens per micro-batch, which is
# where the study's held-aside 65B and sequence-8192 sweeps ran out of memory while predicted to
# fit.

def paper_allreduce_bucket_elements(shape: Shape, has_emb: bool, layers: int, has_head: bool, tp: int) -> float:
    """Elements of the largest gradient bucket the study's data-parallel all-reduce builds.

    scaling's `allreduce_no_retain` (optimizer/allreduce.py) appends the .grad tensors in parameter
    order and sends a bucket only once its element count *exceeds* `allreduce_bucket_size` (5e8):
    a bucket is 5e8 elements plus the tensor that crossed the line, so a vocabulary-parallel
    embedding or LM head (vocab x hidden / tp: 1.05e9 elements for 65B at tp=1) makes a bucket
    far larger than 5e8. The order is the module order (embedding; per layer q/k/v, o, SwiGLU's
    dense_in, siglu_weight, dense_out; the LM head); the norms' few elements are left out."""
    return _bucket(shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab, has_emb, layers, has_head, tp)


@functools.lru_cache(maxsize=4096)
def _bucket(h: int, heads: int, kv_heads: int, ffn: int, vocab: int, has_emb: bool, layers: int,
            has_head: bool, tp: int) -> float:
    head_dim = h // heads
    layer = [h * heads * head_dim / tp, 2 * h * kv_heads * head_dim / tp, h * h / tp,
             h * ffn / tp, h * ffn / tp, h * ffn / tp]
    tensors = ([vocab * h / tp] if has_emb else []) + layer * layers + ([vocab * h / tp] if has_head else [])
    largest, numel = 0.0, 0.0
    for n in tensors:
        numel += n
        if numel > REDUCE_BUCKET_ELEMENTS:
            largest, numel = max(largest, numel), 0.0
    return max(largest, numel)


def paper_step_extra(shape: Shape, items: tuple, tp: int, dp: int, phi: float, dtype_bytes: int, zero: int) -> float:
    """Bytes above the model states at the optimizer step, after the activations are freed.

    Two moments, never together (scaling's Optimizer.step): the all-reduce, where each bucket is
    flattened into one bf16 tensor and upcast to an fp32 copy for the fp32 reduction
    (`allreduce_tensor_in_float32`: bucket x (2 + 4) bytes, the .grad tensors still held); then
    `step_prequel`, which allocates the fp32 gradient of this rank's ZeRO-1 partition (4 P / dp)
    while copying the bf16 .grad into it and freeing them one by one. The bf16 parameter
    all-gather after the update writes into views of the flat parameter buffer."""
    bucket = paper_allreduce_bucket_elements(shape, *items, tp) if dp > 1 else 0.0
    return max(bucket * (dtype_bytes + 4), 4 * phi / dp if zero >= 1 else 0.0)


# The caching allocator cannot coalesce a block that live tensors split: a multi-GiB block freed
# by one micro-batch's peak (the fp32 logits, or the largest tensor of a layer's backward) is
# carved up by the next micro-batch's smaller tensors, and that micro-batch's peak then needs
# fresh segments for its own block of the same size (the effect `expandable_segments` was added
# to PyTorch for). Unlike a flat fraction this scales with the largest block: at sequence 8192 a
# micro-batch's fp32 logits (tokens x 128,000 x 4 bytes) are 4.2 GB per sequence. The constant is
# the share of one such block left stranded, calibrated with CONTEXT_GIB and the fragmentation
# fractions on the published OOM outcomes (prior 1: one block).
STRANDED_BLOCKS = 1.0


def paper_stranded_block(shape: Shape, lay: PlannerLayout, wl: Workload, loss_peak: bool) -> float:
    """Bytes of the largest single tensor at the stage's peak, times STRANDED_BLOCKS."""
    n = lay.micro_batch_size * wl.seq_len
    if loss_peak:  # one fp32 tensor of tokens x vocab (the log-softmax output or its gradient)
        block = n * shape.vocab * 4
    else:  # a layer's largest: SwiGLU's gate/up output, or materialised attention's fp32 scores
        block = n * shape.ffn * wl.dtype_bytes / lay.tp
        if ATTENTION_CLASS[lay.attention] == "naive":
            block = max(block, 4 * lay.micro_batch_size * shape.heads / lay.tp * wl.seq_len ** 2)
    return STRANDED_BLOCKS * block


# ---------------------------------------------------------------- the harness's engines (own, deepspeed, fsdp)
#
# What the own engine (harness/engine) holds, term by term from its code, checked against
# `harness memory` traces of its real step on fake tensors (harness/memtrace; the agreement test is
# tests/test_memory_trace.py). Everything in bytes; n = micro-batch tokens, B = the parameters'
# dtype bytes, t = tp, "/t SP" = divided by t under sequence parallelism. Unlike the study's
# engine above, the own engine
#   - partitions layers by cost (harness.engine.partition.balanced_partition), not uniformly;
#   - keeps fp32 main gradients in flat buckets and fp32 masters (harness/engine/data_parallel.py),
#     the model states of `model_states` below (tested against its census);
#   - computes the loss vocabulary-parallel (tensor_parallel._VocabParallelCE): no full-vocab logits;
#   - under SP keeps the all-gathered input of the column-parallel GEMMs (n x h, not /t: autograd
#     saves what F.linear got), where Megatron re-gathers it in backward;
#   - holds, per micro-batch in flight on a pipeline stage, the received input and the sent output
#     (PipelineExecutor.live) besides what autograd saved.
# Under context parallelism (harness/planner/context.py) a rank holds seq / cp tokens of each
# sequence (Workload.local): every term on them, the attention's from context.cp_attention_bytes (the
# own engine's fp32 blocks for ring and allgather, checked against traces of llama3-8b at 65,536 and
# 131,072 tokens), the model states sharded over dp x cp.
# Megatron-core: its model states from `model_states` (tested against its census,
# tests/test_megatron_views.py), its uniform layer split, and activations as the own engine's (its
# local spec's layers keep what the own engine's Megatron-layout blocks keep) but for its SP GEMMs,
# which keep their local input and re-gather it in backward.
# DeepSpeed and FSDP: their model states from `model_states` (each tested against its census),
# activations as the own engine's (they run the same plain model, harness/model/llama.py); FSDP2's
# gathered parameters, reduce-scatter buffers and pipelined accumulation from fsdp_step_bytes
# (checked against `harness memory` traces of engine fsdp, tests/test_memory_trace.py).


def engine_stage_items(shape: Shape, lay: PlannerLayout, seq_len: int) -> tuple[tuple[bool, int, bool], ...]:
    """(has_embedding, layers, has_lm_head) per pipeline rank, as the engine partitions: the own
    engine (and DeepSpeed, FSDP2) balanced by cost over pp x virtual_stages chunks, chunk c of rank r
    is stage c * pp + r; Megatron-core uniformly, layers / (pp x virtual_stages) per chunk."""
    chunks = lay.virtual_stages if lay.pipeline_schedule == "interleaved" else 1
    if lay.engine == "megatron":
        return _uniform_stage_items(shape.layers, lay.pp)
    return _engine_stage_items(shape, lay.pp, chunks, seq_len)


@functools.lru_cache(maxsize=4096)
def _uniform_stage_items(n_layers: int, pp: int) -> tuple[tuple[bool, int, bool], ...]:
    """Megatron-core's split (transformer_block.get_num_layers_to_build): every chunk the same number
    of layers, so every rank layers / pp, whatever the virtual stages; the embedding on the first
    rank, the LM head (and a tied embedding's copy) on the last. It refuses a split that is not even
    (harness plan --engine megatron offers only pp dividing the layers); here the first ranks would
    take one more."""
    base, extra = divmod(n_layers, pp)
    return tuple((r == 0, base + (1 if r < extra else 0), r == pp - 1) for r in range(pp))


@functools.lru_cache(maxsize=4096)
def _engine_stage_items(shape: Shape, pp: int, chunks: int, seq_len: int) -> tuple[tuple[bool, int, bool], ...]:
    from harness.engine.partition import balanced_partition

    parts = balanced_partition(shape, pp * chunks, seq_len)
    last = pp * chunks - 1
    return tuple((r == 0, sum(len(parts[c * pp + r]) for c in range(chunks)), (chunks - 1) * pp + r == last)
                 for r in range(pp))


def _norm_bytes(lay: PlannerLayout, n: float, h: int, B: int, sp: bool) -> float:
    """One RMSNorm and the GEMMs after it, kept for backward. Eager (kernels.rmsnorm_torch): under
    bf16 the fp32 copy of the input (saved by pow and mul, 4h), the bf16 normalised tensor (saved
    by the weight mul, 2h) and fp32 1/rms (4); under fp32 the input itself and the normalised
    tensor (8h + 4). Fused: its input and fp32 1/rms. Then the GEMMs keep the norm's output, or
    under SP the all-gathered one: n x h, not divided."""
    if lay.rmsnorm == "fused":
        local = B * h + 4
    else:
        local = (6 * h + 4) if B == 2 else (8 * h + 4)
    # Megatron's ColumnParallelLinear under SP saves its local input and all-gathers it again in backward
    gathered = n * h * B / (lay.tp if sp and lay.engine == "megatron" else 1)
    return n * local / (lay.tp if sp else 1) + gathered


def _attention_bytes(shape: Shape, lay: PlannerLayout, wl: Workload, b: int) -> float:
    """The attention between the q/k/v GEMMs and wo, kept for backward, per rank; `wl` is the rank's
    workload (Workload.local: seq / cp tokens under context parallelism: context.cp_attention_bytes).

    Flash-style (SDPA flash/efficient/cuDNN, flash-attn): rotated q, k and v as the kernel gets
    them (k and v repeated to every head under grouped-query attention), its output and fp32
    log-sum-exp; wo's input is a view of the output (the kernel allocates it in q's memory order,
    which is [s, b, heads, head_dim] here). Materialised (naive): fp32 copies of q, k, v, the causal
    mask (1 byte per score), the fp32 softmax, and wo's input, a copy of the [b, heads, s, head_dim]
    output.
    Selective checkpointing keeps only the recomputed core's inputs q, k, v and wo's input. The
    rotary tables cast to bf16 per call (q and k: cos and sin) are kept too."""
    if lay.cp > 1:
        from harness.planner.context import cp_attention_bytes

        return cp_attention_bytes(shape, lay, wl.seq_len, b, wl.dtype_bytes)["kept"]
    s, t, B, h = wl.seq_len, lay.tp, wl.dtype_bytes, shape.hidden
    n = b * s
    head_dim = h // shape.heads
    hq, kv = h / t, shape.kv_heads * head_dim / t
    heads = shape.heads / t
    rot = 4 * s * head_dim * B if B == 2 else 0.0
    naive = ATTENTION_CLASS[lay.attention] in MATERIALISED
    if lay.activation_checkpointing == "selective":
        return n * (hq + 2 * kv) * B + n * hq * B + rot
    if naive:
        return 3 * n * hq * 4 + s * s + 4 * b * heads * s * s + n * hq * B + rot
    kv_kept = 2 * n * (hq if shape.heads != shape.kv_heads else kv) * B
    return n * hq * B + kv_kept + n * hq * B + 4 * b * heads * s + rot


def _attention_backward_bytes(shape: Shape, lay: PlannerLayout, wl: Workload, b: int) -> float:
    """Above what is kept, while the attention core runs backward: under selective checkpointing
    the recomputed core's own saved tensors; for materialised attention the fp32 gradients of
    the softmax output and of the scores (2 x 4 bytes per score); the gradient of the attention
    output (under context parallelism: context.cp_attention_bytes). The layer's SwiGLU and its
    norm have run backward before and freed what they kept."""
    s, t, B, h = wl.seq_len, lay.tp, wl.dtype_bytes, shape.hidden
    n, heads, hq = b * s, shape.heads / t, h / t
    naive = ATTENTION_CLASS[lay.attention] in MATERIALISED
    extra = n * h * B
    if lay.cp > 1:
        from harness.planner.context import cp_attention_bytes

        extra += cp_attention_bytes(shape, lay, s, b, B)["backward"]
    else:
        if naive:
            extra += 2 * 4 * b * heads * s * s
        if lay.activation_checkpointing == "selective":
            extra += (3 * n * hq * 4 + s * s + 4 * b * heads * s * s) if naive else (n * hq * B + 4 * b * heads * s)
    freed = _norm_bytes(lay, n, h, B, lay.sequence_parallel and t > 1) + 4 * n * shape.ffn / t * B
    return extra - freed


@functools.lru_cache(maxsize=1024)  # the same for every stage of a layout (worst_stage_memory asks per stage)
def engine_layer_bytes(shape: Shape, lay: PlannerLayout, wl: Workload) -> dict:
    """Per layer and micro-batch: 'layer' (kept between forward and backward, the layer input
    only under full checkpointing), 'full_layer' (what its forward saves, recomputed or not),
    'working' (what exists above that while its backward runs); `wl` the whole workload (a rank
    holds seq / cp of its tokens)."""
    wl = wl.local(lay)
    b, s, t, B = lay.micro_batch_size, wl.seq_len, lay.tp, wl.dtype_bytes
    n, h, f = b * s, shape.hidden, shape.ffn
    sp = lay.sequence_parallel and t > 1
    full = 2 * _norm_bytes(lay, n, h, B, sp) + _attention_bytes(shape, lay, wl, b) + 4 * n * f / t * B
    # A layer's backward, beyond what it saved: the incoming gradient (n x h), SwiGLU's three
    # gradients of width ffn / t, and the largest weight gradient in the parameters' dtype before
    # the gradient hook adds it into the fp32 bucket and frees it (h x ffn / t); or the attention
    # core's backward, whichever is larger.
    working = max((n * h + 3 * n * f / t + h * f / t) * B, _attention_backward_bytes(shape, lay, wl, b))
    kept = n * h * B / (t if sp else 1) if lay.activation_checkpointing == "full" else full
    return {"layer": kept, "full_layer": full, "working": working}


def _loss_bytes(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple[float, float]:
    """(kept, extra) of the LM head's loss per micro-batch. The own engine's vocabulary-parallel
    cross-entropy keeps the fp32 softmax (4 n V/t) and the local target ids; at its forward peak
    the bf16 logits, their fp32 copy (bf16 only) and the fp32 shifted logits exist beside it.
    Without TP, torch's cross_entropy on logits.float() keeps the fp32 log-softmax; its backward
    peak holds that, the nll gradient and the log-softmax gradient (fp32 each)."""
    n, B, V = lay.micro_batch_size * wl.local(lay).seq_len, wl.dtype_bytes, shape.vocab
    upcast = 4 if B == 2 else 0
    if lay.tp > 1 and lay.engine in ("own", "megatron"):  # Megatron's vocab_parallel_cross_entropy likewise
        return 4 * n * V / lay.tp + 9 * n, (B + upcast + 4) * n * V / lay.tp
    return 4 * n * V, max(B + upcast, 8) * n * V


def engine_stage_memory(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int) -> dict:
    """stage_memory for the harness's engines (PlannerLayout.engine own, deepspeed or fsdp)."""
    has_emb, layers, has_head = engine_stage_items(shape, lay, wl.seq_len)[stage]
    phi = stage_params(shape, has_emb, layers, has_head, lay.tp)
    B, dp, t = wl.dtype_bytes, lay.replicas, lay.tp  # states sharded over dp x cp (REPLICA_AXES)
    precision = "bf16" if B == 2 else "fp32"
    zero = 3 if lay.engine == "fsdp" else lay.sharding_stage
    if lay.engine == "deepspeed" and zero == 0:  # its pipeline engine without ZeRO: bf16 .grad, an fp32 optimizer copy
        census = model_states(phi, "own", 0, precision, dp, grad_accum="bf16" if B == 2 else "fp32")
    else:
        census = model_states(phi, lay.engine, min(zero, 1) if lay.engine == "own" else zero, precision, dp)
    # The planner's workload has the default policy (fp32 accumulation and reduction): then what
    # the census counts at the optimizer step (own engine: flat parameters, fp32 main gradients,
    # ZeRO-1's reduced shard being their view, masters, Adam states) is held the whole step; the
    # ZeRO-1 collectives add nothing (both in place, harness/engine/data_parallel.py).
    by_cat = {k: sum(v.values()) for k, v in census.items()}
    sp = lay.sequence_parallel and t > 1
    n = lay.micro_batch_size * wl.local(lay).seq_len  # the rank's tokens
    h = shape.hidden
    act = engine_layer_bytes(shape, lay, wl)
    hidden = n * h * B / (t if sp else 1)  # one [s(/t), b, h] activation
    m = wl.micro_batches(lay)
    k = in_flight(lay, stage, m)
    micro = layers * act["layer"]
    if lay.pp > 1:  # PipelineExecutor.live: the received input (not on the first stage) and the sent output
        micro += hidden * ((0 if has_emb else 1) + (0 if has_head else 1))
    keeps_input = lay.activation_checkpointing == "full" or lay.rmsnorm == "fused" or B == 4
    if keeps_input and lay.pp > 1 and not has_emb and layers:
        micro -= hidden  # what the first layer keeps of its input (checkpoint, norm) is the received tensor
    if has_emb and t > 1:
        micro += 9 * n  # the vocabulary-parallel lookup's local ids (int64) and mask
    ce_kept, ce_extra = _loss_bytes(shape, lay, wl) if has_head else (0.0, 0.0)
    if has_head:
        micro += _norm_bytes(lay, n, h, B, sp) + ce_kept
    held = k * micro
    working = (act["full_layer"] - act["layer"] if lay.activation_checkpointing == "full" else 0.0) + act["working"]
    candidates = {"backward_working_set": working if layers else 0.0}
    if has_head:  # the loss's peak with this micro-batch's activations, the others' held
        candidates["logits_and_loss"] = ce_extra
    if has_emb:  # the embedding's weight gradient (vocab/t x h, the parameters' dtype) at the stage's last backward
        candidates["embedding_gradient"] = shape.vocab * h / t * B - micro
    fsdp = fsdp_step_bytes(shape, lay, wl, has_emb, layers, has_head) if lay.engine == "fsdp" else None
    if fsdp is not None:
        # a block's backward runs with its gathered parameters and the next block's (prefetched);
        # after the loss's backward, with the log-softmax freed, the step's logits still referenced
        # and the LM head's unsharded weight gradient waiting for the root's reduce-scatter
        if layers:
            candidates["backward_working_set"] += (fsdp["backward_blocks"] + fsdp["after_loss"]
                                                   - (ce_kept if has_head else 0.0))
        for name in candidates:
            if name != "backward_working_set":
                candidates[name] += fsdp["kept_blocks"]
        if has_emb and t > 1:
            # DTensor's backward of the RowwiseParallel (vocabulary-sharded) embedding yields the
            # gradient of the whole table on every tp rank, not its vocab/t rows
            candidates["embedding_gradient"] = shape.vocab * h * B - micro
        if lay.pp > 1 and layers:
            # between two backwards of a pipelined stage: every block gathered (kept since its first
            # backward), one micro-batch fewer in flight
            candidates["gathered_between_backwards"] = fsdp["all_blocks"] - micro
    extra_name = max(candidates, key=candidates.get)
    extra = max(0.0, candidates[extra_name])
    dynamic = held + extra
    frag = FRAGMENTATION_PIPELINED if lay.pp > 1 and m > 1 else FRAGMENTATION
    parts = {"weights": by_cat.get("parameters", 0.0), "gradients": by_cat.get("gradients", 0.0),
             "optimizer": by_cat.get("master_parameters", 0.0) + by_cat.get("optimizer_states", 0.0),
             "activations": held, "backward_working_set": extra if extra_name != "logits_and_loss" else 0.0,
             "logits_and_loss": extra if extra_name == "logits_and_loss" else 0.0}
    if fsdp is not None:
        parts["weights"] += fsdp["gathered"]
        if fsdp["accumulated"]:  # pipelined: the unsharded accumulation, not yet the sharded gradient
            parts["gradients"] = fsdp["accumulated"]
        parts["gradients"] += fsdp["reduce_scatter"]
        # all of it comes and goes within a step: the gathered parameters at every all-gather, the
        # reduce-scatter buffers, and the gradients (the sharded ones freed by
        # zero_grad(set_to_none=True) after every step, allocated again by the first reduce-scatter)
        dynamic += fsdp["gathered"] + parts["gradients"]
    elif zero >= 3:  # gathered full layers in flight (current + prefetched), ZeRO-3
        parts["weights"] += 2 * phi / max(layers, 1) * B
    parts["overhead"] = CONTEXT_GIB * GIB + frag * dynamic
    parts["total"] = sum(parts.values())
    parts["params"] = phi
    return parts


def fsdp_step_bytes(shape: Shape, lay: PlannerLayout, wl: Workload, has_emb: bool, layers: int, has_head: bool) -> dict:
    """What engine fsdp (FSDP2 fully_shard per block and on the root, harness/frameworks/fsdp/engine.py)
    holds during its step beyond the model states and the plain model's activations, per rank,
    as torch's FSDP2 code allocates it (torch/distributed/fsdp/_fully_shard/) and `harness memory`
    traces it:

      gathered        the root's unsharded parameters in the compute dtype (embedding, final
                      norm, LM head; fully_shard(root, reshard_after_forward=False): gathered from
                      the first forward to the end of the last backward)
      backward_blocks while a block runs backward, its gathered parameters and the next block's,
                      whose flat all-gather output exists from when the all-gather is issued ahead
                      (_fsdp_state backward prefetch; _fsdp_collectives.foreach_all_gather); with
                      reshard_after_forward true no block is gathered between its forward and
                      backward (the loss's peak has none)
      kept_blocks     with reshard_after_forward false every block stays gathered from its
                      forward to its backward: all of them at the loss's peak and the first
                      block's backward
      reduce_scatter  one block's reduce-scatter input in the reduce dtype (foreach_reduce), which
                      FSDP2 keeps (comm_ctx.reduce_scatter_state) until the next reduce-scatter
                      waits, so one is alive whenever a block's backward runs
      after_loss      while the blocks run backward: the step's logits in the compute dtype (the
                      train step's variable keeps them through loss.backward()) and the LM head's
                      unsharded weight gradient, reduced only with the root after the last block

    Under pipelining (pp > 1) torch.distributed.pipelining runs every backward but the reduction
    with set_reshard_after_backward(False) and set_requires_gradient_sync(False)
    (pipelining/stage.py, backward_maybe_with_nosync; perform_reduce_grad after the last):

      accumulated     the stage's unsharded gradients, accumulated in the reduce dtype from its
                      first backward to the reduce-scatter after its last (the sharded gradients
                      exist only after that, with the activations gone); the embedding's is the
                      whole table's under TP (DTensor's backward of the RowwiseParallel embedding)
      all_blocks      every block stays gathered from its backward until the next forward of it
                      reshards it (reshard_after_forward): between two backwards all are gathered
      reduce_scatter  none while micro-batches are in flight

    The planner's workload carries the default precision policy: compute dtype = the workload's,
    reduction in fp32."""
    B, t = wl.dtype_bytes, lay.tp
    h, V = shape.hidden, shape.vocab
    head_dim = h // shape.heads
    attn = h * shape.heads * head_dim * 2 + 2 * h * shape.kv_heads * head_dim
    block = (attn + 3 * h * shape.ffn) / t + 2 * h
    if shape.attention_bias:
        block += (shape.heads + 2 * shape.kv_heads) * head_dim / t + h
    vocab = V * h / t
    head = 0.0 if shape.tie_embeddings and has_emb else vocab
    root = (vocab if has_emb else 0.0) + ((head + h) if has_head else 0.0)
    reshard = lay.reshard_after_forward
    n = lay.micro_batch_size * wl.local(lay).seq_len
    kept = 0.0 if reshard else layers * block * B
    piped = lay.pp > 1
    # the embedding's gradient is the whole table's under TP (see engine_stage_memory)
    emb_grad = V * h if has_emb else 0.0
    accumulated = root - (vocab if has_emb else 0.0) + emb_grad + layers * block
    return {"gathered": root * B,
            "backward_blocks": min(2, layers) * block * B if reshard else kept,
            "kept_blocks": kept,
            "all_blocks": layers * block * B,
            "reduce_scatter": block * 4 if layers and not piped else 0.0,
            "accumulated": accumulated * 4 if piped else 0.0,
            "after_loss": (n * V * B + vocab * B) if has_head else 0.0}
