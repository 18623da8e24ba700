"""Bytes per GPU of a stage of the harness's engines (own, megatron, deepspeed, fsdp): what each
engine's code holds, term by term, so that `harness plan` predicts the runs the harness launches.

What the own engine (harness/engine) holds, term by term from its code, checked against
`harness memory` traces of its real step on fake tensors (harness/memtrace; the agreement test is
tests/test_memory_trace.py). Everything in bytes; n = micro-batch tokens, B = the parameters'
dtype bytes, t = tp, "/t SP" = divided by t under sequence parallelism. Unlike the study's
engine (memory_paper), the own engine
  - partitions layers by cost (harness.engine.partition.balanced_partition), not uniformly;
  - keeps fp32 main gradients in flat buckets and fp32 masters (harness/engine/data_parallel.py),
    the model states of `model_states` below (tested against its census);
  - computes the loss vocabulary-parallel (tensor_parallel._VocabParallelCE): no full-vocab logits;
  - under SP keeps the all-gathered input of the column-parallel GEMMs (n x h, not /t: autograd
    saves what F.linear got), where Megatron re-gathers it in backward;
  - holds, per micro-batch in flight on a pipeline stage, the received input and the sent output
    (PipelineExecutor.live) besides what autograd saved.
Under context parallelism (harness/planner/context.py) a rank holds seq / cp tokens of each
sequence (Workload.local): every term on them, the attention's from context.cp_attention_bytes (the
own engine's fp32 blocks for ring and allgather, checked against traces of llama3-8b at 65,536 and
131,072 tokens), the model states sharded over dp x cp (under engine fsdp over its sharding group,
PlannerLayout.shard_group: dp x cp, or dp_shard ranks under hybrid sharding).
Megatron-core: its model states from `model_states` (tested against its census,
tests/test_megatron_views.py), its uniform layer split, and activations as the own engine's (its
local spec's layers keep what the own engine's Megatron-layout blocks keep) but for its SP GEMMs,
which keep their local input and re-gather it in backward.
DeepSpeed and FSDP: their model states from `model_states` (each tested against its census),
activations as the own engine's (they run the same plain model, harness/model/llama.py); FSDP2's
gathered parameters, reduce-scatter buffers and pipelined accumulation from fsdp_step_bytes
(checked against `harness memory` traces of engine fsdp, tests/test_memory_trace.py).
The terms shared with the study's engine: memory_terms; the feed-forward (dense or MoE): feedforward.py;
what published recipes set beyond the engines' defaults (per-op checkpointing, partial recomputation,
activation offload, fp8 primary weights, bf16 main gradients, fused SwiGLU and loss): memory_recipes;
FSDP2's step terms: memory_fsdp; the model states' closed forms and the experts' sharding group: memory_states.
Megatron-FSDP (engine megatron with fsdp) holds the FSDP states.
"""

from __future__ import annotations

import dataclasses
import functools

from harness.model.presets import Shape
from harness.planner import feedforward, fp8, schedules
from harness.planner import memory_recipes as recipes
from harness.planner import memory_reserve as reserve
from harness.planner import memory_terms as terms
from harness.planner.context import cp_attention_bytes
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PlannerLayout, Workload
from harness.planner.memory_fsdp import fsdp_step_bytes, one_round_chunks
from harness.planner.memory_states import expert_shard_group, memory_model, model_states, states_bytes
from harness.planner.memory_states import states_by_category as _states_by_category

__all__ = [
    "engine_layer_bytes",
    "engine_stage_items",
    "engine_stage_memory",
    "memory_model",
    "model_states",
    "states_bytes",
]


def engine_stage_items(shape: Shape, lay: PlannerLayout, seq_len: int) -> tuple[tuple[bool, int, bool], ...]:
    """(has_embedding, layers, has_lm_head) per pipeline rank, as the engine partitions: the own
    engine (and DeepSpeed, FSDP2) balanced by cost over pp x virtual_stages chunks, chunk c of rank r
    is stage c * pp + r; Megatron-core uniformly, layers / (pp x virtual_stages) per chunk."""
    split = (lay.split_counts_embedding, lay.split_counts_loss)
    return _stage_items_of(shape, lay.engine, lay.pp, lay.pipeline_schedule, lay.virtual_stages, seq_len, split)


@functools.lru_cache(maxsize=4096)
def _stage_items_of(
    shape: Shape, engine: str, pp: int, schedule: str, virtual_stages: int, seq_len: int, split=(False, False)
) -> tuple:
    if memory_model(engine).layer_split == "even":
        emb, loss = split  # a slot each of the even split (PlannerLayout.split_counts_*): one layer fewer there
        items = _uniform_stage_items(shape.layers + emb + loss, pp)
        return tuple((e, n - emb * e - loss * h, h) for e, n, h in items)
    chunks = schedules.chunks(schedule, virtual_stages)
    return _engine_stage_items(shape, pp, chunks, seq_len, schedule in schedules.V_SCHEDULES)


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
def _engine_stage_items(
    shape: Shape, pp: int, chunks: int, seq_len: int, v_shape: bool = False
) -> tuple[tuple[bool, int, bool], ...]:
    """Chunk c of rank r is stage c * pp + r (interleaved), or in a V (v_shape: two chunks, rank r
    holding stages r and 2 pp - 1 - r, so the first rank holds the embedding and the LM head)."""
    from harness.engine.partition import balanced_partition

    parts = balanced_partition(shape, pp * chunks, seq_len)
    last = pp * chunks - 1
    if v_shape:
        return tuple((r == 0, len(parts[r]) + len(parts[last - r]), r == 0) for r in range(pp))
    return tuple(
        (r == 0, sum(len(parts[c * pp + r]) for c in range(chunks)), (chunks - 1) * pp + r == last) for r in range(pp)
    )


def _norm_bytes(lay: PlannerLayout, n: float, h: int, B: int, sp: bool) -> float:
    """One RMSNorm and the GEMMs after it, kept for backward. Eager (kernels.rmsnorm_torch): under
    bf16 the fp32 copy of the input (saved by pow and mul, 4h), the bf16 normalised tensor (saved
    by the weight mul, 2h) and fp32 1/rms (4); under fp32 the input itself and the normalised
    tensor (8h + 4). Fused: its input and fp32 1/rms. Then the GEMMs keep the norm's output, or
    under SP the all-gathered one: n x h, not divided."""
    if lay.norm_kernel == "fused":
        local = B * h + 4
    else:
        local = (6 * h + 4) if B == 2 else (8 * h + 4)
    # Megatron's ColumnParallelLinear under SP saves its local input and all-gathers it again in backward
    gathered = n * h * B / (lay.tp if sp and memory_model(lay.engine).sp_regathers else 1)
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
    if lay.cp > 1 and not lay.te_attention:  # the own engine's ring (context.py)
        return cp_attention_bytes(shape, lay, wl.seq_len, b, wl.dtype_bytes)["kept"]
    s, t, B = wl.seq_len, lay.tp, wl.dtype_bytes
    n = b * s
    head_dim = shape.head_dim
    hq, kv = shape.heads * head_dim / t, shape.kv_heads * head_dim / t  # query width: heads x head_dim
    heads = shape.heads / t
    rot = 4 * s * head_dim * B if B == 2 else 0.0
    naive = ATTENTION_CLASS[lay.attention] in MATERIALISED
    if lay.activation_checkpointing == "selective":
        return n * (hq + 2 * kv) * B + n * hq * B + rot
    if naive:
        return 3 * n * hq * 4 + s * s + 4 * b * heads * s * s + n * hq * B + rot
    # the harness's model repeats k and v to every head before SDPA; Transformer Engine's attention
    # (te_attention) takes grouped-query k and v as they are
    kv_kept = 2 * n * (kv if lay.te_attention else hq) * B
    return n * hq * B + kv_kept + n * hq * B + 4 * b * heads * s + rot


def _attention_backward_bytes(shape: Shape, lay: PlannerLayout, wl: Workload, b: int) -> float:
    """Above what is kept, while the attention core runs backward: under selective checkpointing
    the recomputed core's own saved tensors; for materialised attention the fp32 gradients of
    the softmax output and of the scores (2 x 4 bytes per score); the gradient of the attention
    output (under context parallelism: context.cp_attention_bytes). The layer's SwiGLU and its
    norm have run backward before and freed what they kept."""
    s, t, B, h = wl.seq_len, lay.tp, wl.dtype_bytes, shape.hidden
    n, heads, hq = b * s, shape.heads / t, shape.heads * shape.head_dim / t
    naive = ATTENTION_CLASS[lay.attention] in MATERIALISED
    extra = n * h * B
    if lay.cp > 1 and not lay.te_attention:
        extra += cp_attention_bytes(shape, lay, s, b, B)["backward"]
    else:
        if naive:
            extra += 2 * 4 * b * heads * s * s
        if lay.activation_checkpointing == "selective":
            extra += (3 * n * hq * 4 + s * s + 4 * b * heads * s * s) if naive else (n * hq * B + 4 * b * heads * s)
    freed = _norm_bytes(lay, n, h, B, lay.sequence_parallel and t > 1) + feedforward.of(shape).kept_bytes(lay, n, B)
    return extra - freed


@functools.lru_cache(maxsize=1024)  # the same for every stage of a layout (worst_stage_memory asks per stage)
def engine_layer_bytes(shape: Shape, lay: PlannerLayout, wl: Workload) -> dict:
    """Per layer and micro-batch: 'layer' (kept between forward and backward, the layer input
    only under full checkpointing), 'full_layer' (what its forward saves, recomputed or not),
    'working' (what exists above that while its backward runs); `wl` the whole workload (a rank
    holds seq / cp of its tokens)."""
    wl = wl.local(lay)
    b, s, t, B = lay.micro_batch_size, wl.seq_len, lay.tp, wl.dtype_bytes
    n, h = b * s, shape.hidden
    sp = lay.sequence_parallel and t > 1
    full = 2 * _norm_bytes(lay, n, h, B, sp) + _attention_bytes(shape, lay, wl, b)
    ffn = feedforward.of(shape)
    full += ffn.kept_bytes(lay, n, B)  # SwiGLU's, or a MoE layer's (feedforward.py)
    tokens = ffn.token_shape(lay)  # a MoE layer's linears as a token sees them
    full -= fp8.saved_input_saving(tokens, lay, n, B)  # Transformer Engine saves its linears' inputs in fp8
    full -= recipes.swiglu_saving(shape, lay, n, B)  # a fused SwiGLU keeps its input only (memory_recipes)
    # A layer's backward, beyond what it saved: its feed-forward's gradients and its largest weight gradient
    # before the hook adds it into the fp32 bucket (FeedForward.working_bytes), or the attention core's backward.
    working = max(ffn.working_bytes(lay, n, B), _attention_backward_bytes(shape, lay, wl, b))
    if lay.precision == "fp8":  # the fp8 operands of the linear running backward (fp8.py: torchao saves bf16)
        working += fp8.backward_operand_bytes(tokens, lay, n)
    kept = n * h * B / (t if sp else 1) if lay.activation_checkpointing == "full" else full
    if _per_op(lay):  # torchtitan's per-op policy: what a layer without checkpointing saves, recomputed in part
        return {
            **engine_layer_bytes(shape, _without_checkpointing(lay), wl),
            "layer": recipes.per_op_kept(shape, lay, wl),
        }
    return {"layer": kept, "full_layer": full, "working": working}


def _per_op(lay: PlannerLayout) -> bool:
    return lay.activation_checkpointing == "selective" and lay.selective_policy == "per_op"


@functools.lru_cache(maxsize=256)
def _without_checkpointing(lay: PlannerLayout) -> PlannerLayout:
    return dataclasses.replace(lay, activation_checkpointing="none")


def _loss_parallel(lay: PlannerLayout) -> bool:
    """Whether the LM head's loss runs vocabulary-parallel (the layout's vocab_parallel_loss, else the engine's)."""
    parallel = lay.vocab_parallel_loss
    if parallel is None:
        parallel = memory_model(lay.engine).vocab_parallel_loss
    return lay.tp > 1 and parallel


def loss_bytes(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple[float, float]:
    """(kept, extra) of the LM head's loss per micro-batch. The own engine's vocabulary-parallel
    cross-entropy keeps the fp32 softmax (4 n V/t) and the local target ids; at its forward peak
    the bf16 logits, their fp32 copy (bf16 only) and the fp32 shifted logits exist beside it.
    Without TP, torch's cross_entropy on logits.float() keeps the fp32 log-softmax; its backward
    peak holds that, the nll gradient and the log-softmax gradient (fp32 each)."""
    n, B, V = lay.micro_batch_size * wl.local(lay).seq_len, wl.dtype_bytes, shape.vocab
    upcast = 4 if B == 2 else 0
    if lay.loss_fusion:  # Megatron's fused cross-entropy in the logits' dtype (memory_recipes)
        return recipes.fused_loss_bytes(n, V, B, lay.tp if _loss_parallel(lay) or lay.engine == "megatron" else 1)
    if _loss_parallel(lay) and memory_model(lay.engine).states == "fsdp":
        # torch's loss_parallel (torchtitan's, on DTensor logits; tensor/parallel/loss.py): it keeps the fp32
        # log-softmax, and its backward holds zeros_like and the exp of it and their sum beside it
        return 4 * n * V / lay.tp + 9 * n, 12 * n * V / lay.tp
    if _loss_parallel(lay):  # Megatron's vocab_parallel_cross_entropy too
        return 4 * n * V / lay.tp + 9 * n, (B + upcast + 4) * n * V / lay.tp
    return 4 * n * V, max(B + upcast, 8) * n * V


def engine_stage_memory(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int) -> dict:
    """memory.stage_memory for the harness's engines (PlannerLayout.engine own, deepspeed or fsdp)."""
    has_emb, layers, has_head = engine_stage_items(shape, lay, wl.seq_len)[stage]
    phi = terms.stage_params(shape, has_emb, layers, has_head, lay.tp, lay.ep)
    ffn = feedforward.of(shape)
    phi_e = ffn.expert_params(layers, lay.tp, lay.ep)  # sharded over the expert-data-parallel group
    states = memory_model(lay.engine).states
    if lay.fsdp and states == "megatron":  # Megatron-FSDP (optim_grads_params): states sharded as FSDP2's
        states = "fsdp"
    # states sharded over dp x cp (REPLICA_AXES); FSDP's over its sharding group (HSDP: dp_shard ranks)
    B, dp, t = wl.dtype_bytes, lay.shard_group if states == "fsdp" else lay.replicas, lay.tp
    precision = "bf16" if B == 2 else "fp32"
    zero = 3 if states == "fsdp" else lay.sharding_stage
    # The planner's workload has the default policy (fp32 accumulation and reduction): then what
    # the census counts at the optimizer step (own engine: flat parameters, fp32 main gradients,
    # ZeRO-1's reduced shard being their view, masters, Adam states) is held the whole step; the
    # ZeRO-1 collectives add nothing (both in place, harness/engine/data_parallel.py).
    by_cat = dict(_states_by_category(phi - phi_e, states, zero, precision, dp))
    e_dp = expert_shard_group(lay, states)  # ep's ranks hold different experts (memory_states)
    for k, v in (_states_by_category(phi_e, states, zero, precision, e_dp) if phi_e else {}).items():
        by_cat[k] = by_cat.get(k, 0.0) + v
    step_grads = 0.0
    if recipes.bf16_main_grads(lay) and "fp32" not in precision:  # bf16 buffer; the fp32 shard at the step
        by_cat["gradients"] = by_cat.get("gradients", 0.0) / 2
        sharded = lay.sharding_stage >= 1
        step_grads = 4 * ((phi - phi_e) / (dp if sharded else 1) + phi_e / (e_dp if sharded else 1))
    sp = lay.sequence_parallel and t > 1
    n = lay.micro_batch_size * wl.local(lay).seq_len  # the rank's tokens
    h = shape.hidden
    act = engine_layer_bytes(shape, lay, wl)
    hidden = n * h * B / (t if sp else 1)  # one [s(/t), b, h] activation
    m = wl.micro_batches(lay)
    k = terms.in_flight(lay, stage, m)
    recomputed = recipes.recomputed_layers(lay, layers)
    micro = (
        recomputed * act["layer"] + (layers - recomputed) * act["full_layer"] if recomputed else layers * act["layer"]
    )
    micro -= recipes.offloaded_layers(lay, layers) * micro / max(layers, 1)  # in host memory (memory_recipes)
    if lay.pp > 1:  # PipelineExecutor.live: the received input (not on the first stage) and the sent output
        micro += hidden * ((0 if has_emb else 1) + (0 if has_head else 1))
    keeps_input = lay.activation_checkpointing == "full" or lay.norm_kernel == "fused" or B == 4
    if keeps_input and lay.pp > 1 and not has_emb and layers:
        micro -= hidden  # what the first layer keeps of its input (checkpoint, norm) is the received tensor
    if has_emb and t > 1:
        micro += 9 * n  # the vocabulary-parallel lookup's local ids (int64) and mask
    ce_kept, ce_extra = loss_bytes(shape, lay, wl) if has_head else (0.0, 0.0)
    head = _norm_bytes(lay, n, h, B, sp) + ce_kept if has_head else 0.0
    micro += head
    chunks = one_round_chunks(shape, lay, wl, stage)  # torch's one-round interleaved order (memory_fsdp)
    if chunks:  # the chunk whose first backward holds the most: its activations in flight and its gradients
        k, chunk_grads = max(chunks, key=lambda kg: kg[0] * micro + kg[1])
    held = k * micro
    if has_head:  # every micro-batch's logits, kept for the pipeline step's return (memory_recipes)
        held += recipes.kept_outputs_bytes(lay, n, shape.vocab, B, m, lay.tp if _loss_parallel(lay) else 1)
    if head and k > 1 and lay.pipeline_schedule != "gpipe":
        # the LM head's state lives for one micro-batch: the last chunk's forward is followed at once by
        # its backward (interleaved: after the warm-up of the other chunks; the V schedules' rank 0)
        held -= (k - 1) * head
    working = (act["full_layer"] - act["layer"] if recomputed or _per_op(lay) else 0.0) + act["working"]
    candidates = {"backward_working_set": working if layers else 0.0}
    if has_head:  # the loss's peak with this micro-batch's activations, the others' held
        candidates["logits_and_loss"] = ce_extra
    if has_emb:  # the embedding's weight gradient (vocab/t x h, the parameters' dtype) at the stage's last backward
        candidates["embedding_gradient"] = shape.vocab * h / t * B - micro
    shards = lay.tp if _loss_parallel(lay) else 1
    fsdp = fsdp_step_bytes(shape, lay, wl, has_emb, layers, has_head, shards) if states == "fsdp" else None
    if fsdp is not None:
        # a block's backward runs with its gathered parameters and the next block's (prefetched);
        # after the loss's backward, with the log-softmax freed, the step's logits still referenced
        # and the LM head's unsharded weight gradient waiting for the root's reduce-scatter
        if layers:
            candidates["backward_working_set"] += (
                fsdp["backward_blocks"] + fsdp["after_loss"] - (ce_kept if has_head else 0.0)
            )
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
    # the caching allocator's free blocks the peak cannot reuse (memory_reserve): the logits freed before the loss's
    # backward, the pipeline's merged outputs
    kept = recipes.kept_outputs_bytes(lay, n, shape.vocab, B, m, shards) if has_head else 0.0
    stranded = reserve.reserve(
        reserve.logits_block(shape, lay, wl, has_head, shards),
        candidates.get("logits_and_loss", 0.0),
        extra,
        reserve.merged_outputs_block(shape, lay, wl, has_emb, has_head, kept, shards),
    )
    dynamic = held + extra
    frag = terms.FRAGMENTATION_PIPELINED if lay.pp > 1 and m > 1 else terms.FRAGMENTATION
    parts = {
        "weights": by_cat.get("parameters", 0.0),
        "gradients": by_cat.get("gradients", 0.0),
        "optimizer": by_cat.get("master_parameters", 0.0) + by_cat.get("optimizer_states", 0.0),
        "activations": held,
        "backward_working_set": extra if extra_name != "logits_and_loss" else 0.0,
        "logits_and_loss": extra if extra_name == "logits_and_loss" else 0.0,
    }
    if fsdp is not None:
        parts["weights"] += fsdp["gathered"]
        if fsdp["accumulated"]:  # pipelined: the unsharded accumulation, not yet the sharded gradient
            parts["gradients"] = chunk_grads if chunks else fsdp["accumulated"]
        parts["gradients"] += fsdp["reduce_scatter"]
        # all of it comes and goes within a step: the gathered parameters at every all-gather, the
        # reduce-scatter buffers, and the gradients (the sharded ones freed by
        # zero_grad(set_to_none=True) after every step, allocated again by the first reduce-scatter)
        dynamic += fsdp["gathered"] + parts["gradients"]
    elif zero >= 3:  # gathered full layers in flight (current + prefetched), ZeRO-3
        parts["weights"] += 2 * phi / max(layers, 1) * B
    if lay.precision == "fp8":  # Transformer Engine's fp8 weight copies; the scales (fp8.py)
        w = ffn.weight_shape(lay.ep)  # a MoE layer's: its rank's experts
        copies = 0.0 if lay.fsdp else fp8.weight_copy_bytes(w, lay, layers)  # Megatron-FSDP: gathered per block
        copies *= 1.0 if lay.fp8_transpose else 0.5  # the fp8 weight without its transpose (memory_recipes)
        parts["fp8_weights_and_scales"] = copies + fp8.scale_bytes(w, lay, layers)
        parts["weights"] -= recipes.fp8_param_saving(w, lay, layers, B)  # fp8 primary weights: no bf16 copy
    if step_grads > dynamic:  # the step's fp32 gradient shard, once the activations are freed
        parts["optimizer_step"] = step_grads - dynamic
    parts["overhead"] = terms.CONTEXT_GIB * terms.GIB + frag * dynamic
    if stranded:
        parts["allocator_reserve"] = stranded
    parts["total"] = sum(parts.values())
    parts["params"] = phi
    return parts
