"""The memory settings published recipes name beyond the harness's engines' own (PlannerLayout's
selective_policy, recompute_layers, offload_layers, fp8_params, main_grads, fused_swiglu, fp8_transpose,
loss_fusion, te_attention, pp_outputs_kept), each a term read from the framework's source, none fitted;
memory_engines adds them to a stage's memory (te_attention in its attention terms), features.py the recomputation's
time.

- selective_policy "per_op": torchtitan's op-level selective checkpointing (parallelize_llama.py,
  _apply_ac_to_transformer_block with selective_ac_option "op"; ba24697 of 2024-12): inside a
  checkpointed block it saves the outputs of aten.mm, of the SDPA flash/efficient kernels and of the
  reduce-scatter, but every second mm, and recomputes the rest from the block's input. In a block's
  forward order (wq, wk, wv, attention, wo, w1, w3, w2) it keeps wq's, wv's, w1's and w2's outputs,
  the attention's output and log-sum-exp (a flash-style kernel's; naive attention's bmm are no aten.mm), and
  the block's input. The spec's activation_checkpointing selective_op is this policy, run by engines single,
  own and fsdp (harness/model/op_checkpoint.py; PlannerLayout maps it to selective with per_op). torchao's
  Float8Linear calls mm on its fp8 tensor subclass, which the policy sees as aten.mm: the same outputs are
  kept, in bf16.
- recompute_layers: Megatron's recompute_method "block" recomputes the first recompute_num_layers
  layers of each pipeline chunk (transformer_block.py, _checkpointed_forward); the others keep all.
- offload_layers: Megatron's cpu_offloading_num_layers moves the saved activations of that many
  layers to host memory as their forward ends and brings each back before its backward; one
  layer's are on the device in transit.
- fp8_params: under fp8_param_gather Transformer Engine's linear weights are fp8 tensors (their
  data and cached transpose, the fp8 copies fp8.weight_copy_bytes counts); the bf16 copy is gone.
- main_grads "bf16" (grad_reduce_in_fp32 False): Megatron's gradient buffer holds bf16; the
  distributed optimizer casts its shard to fp32 at the step (_copy_model_grads_to_main_grads),
  when the activations have been freed.
- fp8_transpose: Transformer Engine's fp8 weight keeps its transpose for the backward GEMMs where the
  GPU's FP8 GEMMs take the TN layout only (Hopper); on Blackwell, whose FP8 GEMMs take any layout, it
  keeps none (fp8.weight_copy_bytes' 2 bytes a parameter become 1).
- loss_fusion: Megatron's cross_entropy_loss_fusion (fused_vocab_parallel_cross_entropy, or Transformer
  Engine's parallel_cross_entropy under cross_entropy_fusion_impl "te") takes the logits as they are,
  without the fp32 copy the unfused loss makes (logits.float()), and saves its softmax in their dtype.
- pp_outputs_kept: torch.distributed.pipelining's last stage appends each micro-batch's output to
  stage.output_chunks in its forward (stage.py, forward_one_chunk) and keeps them for step()'s merged
  return until the next step clears them, unless step(return_outputs=False) (torch PR 165822); torchtitan
  passed it from 2025-10 (e5ef99a, "Update PP to release memory earlier"), so its 2024-12 runs kept the
  logits of every micro-batch of the step on the last stage: m x n x V / t (loss_parallel's shard) bytes.
- fused_swiglu: Megatron's bias_activation_fusion (bias_swiglu_impl) saves the fused op's input
  (fc1's 2 x ffn output) only, where the eager SwiGLU also keeps silu's output and the product.
"""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner import fp8
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PlannerLayout, Workload


def per_op_kept(shape: Shape, lay: PlannerLayout, wl: Workload) -> float:
    """Bytes one layer keeps per micro-batch under torchtitan's per-op policy (module docstring); `wl`
    the rank's workload (seq / cp tokens). Under tp the linears' outputs are their tp shards, but w2's,
    whose output before its reduction is the whole n x h (under SP also the reduce-scatter's n x h / t)."""
    b, s, t, B = lay.micro_batch_size, wl.seq_len, lay.tp, wl.dtype_bytes
    n, h = b * s, shape.hidden
    sp = t if lay.sequence_parallel and t > 1 else 1
    hq, kv = shape.heads * shape.head_dim / t, shape.kv_heads * shape.head_dim / t
    f = shape.ffn / t if not shape.moe else 0.0  # a MoE layer's experts: their grouped GEMMs are not aten.mm
    saved = n * (hq + kv + f + h + (h / sp if sp > 1 else 0.0)) * B
    if ATTENTION_CLASS[lay.attention] in MATERIALISED:  # naive: its bmm are no aten.mm, nothing of it kept
        return n * h * B / sp + saved
    lse = 4 * b * shape.heads / t * s
    return n * h * B / sp + saved + n * hq * B + lse  # a flash-style kernel's output and log-sum-exp


def swiglu_saving(shape: Shape, lay: PlannerLayout, n: float, B: int) -> float:
    """What a fused SwiGLU (fused_swiglu) keeps less than the eager one per layer and micro-batch: one of
    the eager op's four ffn-wide tensors (silu's output and the product against fc2's input, which both
    keep)."""
    if not lay.fused_swiglu:
        return 0.0
    if shape.moe:
        return n * shape.experts_per_token * shape.moe_ffn / lay.tp * B
    return n * shape.ffn / lay.tp * B


def recomputed_layers(lay: PlannerLayout, layers: int) -> int:
    """How many of a stage's `layers` keep only their input (activation_checkpointing full): all, or
    recompute_layers of each of its chunks (virtual stages under an interleaved schedule)."""
    if lay.activation_checkpointing != "full":
        return 0
    if not lay.recompute_layers:
        return layers
    chunks = lay.virtual_stages if lay.pp > 1 else 1
    return min(layers, lay.recompute_layers * chunks)


def offloaded_layers(lay: PlannerLayout, layers: int) -> int:
    """Layers of a stage whose saved activations are in host memory (offload_layers, one in transit)."""
    return max(0, min(lay.offload_layers, layers) - 1)


def fp8_param_saving(shape: Shape, lay: PlannerLayout, layers: int, B: int) -> float:
    """The bf16 copy of a stage's fp8 linear weights that fp8_params removes (engine megatron under fp8;
    Megatron-FSDP gathers its blocks in fp8 instead: fp8.gathered_block_saving)."""
    if not (lay.fp8_params and lay.precision == "fp8" and lay.engine == "megatron") or lay.fsdp:
        return 0.0
    return B * layers * fp8.weight_elements(shape, lay.tp)


def bf16_main_grads(lay: PlannerLayout) -> bool:
    """Whether Megatron's gradient buffer is bf16 (main_grads), the fp32 shard made at the step only."""
    return lay.main_grads == "bf16" and lay.engine == "megatron"


def recompute_fraction(shape: Shape, lay: PlannerLayout) -> float:
    """The share of a layer's forward run again in backward under activation_checkpointing full: 1, or
    under recompute_layers the recomputed layers' share of a rank's (the time model's, features.py)."""
    if lay.activation_checkpointing != "full":
        return 0.0
    per_rank = max(1, round(shape.layers / lay.pp))
    return recomputed_layers(lay, per_rank) / per_rank


def per_op_gemm_passes(shape: Shape, lay: PlannerLayout) -> tuple[float, float, float, float] | None:
    """Under torchtitan's per-op policy, the share of each of features.py's GEMMs (fused qkv, wo, fused
    w1/w3, w2) run again in backward: wk of the qkv's, wo, w3 of w1/w3's, not w2 (module docstring);
    None for any other checkpointing."""
    if not (lay.activation_checkpointing == "selective" and lay.selective_policy == "per_op"):
        return None
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return kv / (q + 2 * kv), 1.0, 0.5, 0.0


def fused_loss_bytes(n: float, V: int, B: int, shards: int) -> tuple[float, float]:
    """(kept, extra) of a fused cross-entropy per micro-batch of n tokens (loss_fusion): its softmax kept
    in the logits' dtype, and at its forward the logits beside it, over `shards` vocabulary shards."""
    return B * n * V / shards + 9 * n, B * n * V / shards


def kept_outputs_bytes(lay: PlannerLayout, n: float, V: int, B: int, m: int, shards: int) -> float:
    """The logits of all `m` micro-batches of n tokens that the last pipeline stage keeps to the step's end
    under pp_outputs_kept (module docstring), `shards` vocabulary shards; 0 without a pipeline."""
    return (lay.pp_outputs_kept and lay.pp > 1) * m * n * V / shards * B
