"""The workload's LLaMA as Megatron-core's GPTModel: its TransformerConfig and its layer spec.

The spec is Megatron's local one (get_gpt_layer_local_spec: ColumnParallelLinear / RowParallelLinear,
DotProductAttention, SwiGLU MLP; no Transformer Engine) with two pieces of ours:
  - the RMSNorm: the local spec's norm (transformer/torch_norm.py, torch.nn.RMSNorm) refuses sequence
    parallelism without TE or Apex. Ours is the plain model's math (harness.model.kernels.rmsnorm_torch,
    fp32 statistics, the workload's eps) and marks its weight `sequence_parallel` as Megatron's fused norms
    do, so finalize_model_grads all-reduces its gradient over tp when each rank saw only its part of the
    sequence;
  - with qk_norm (Qwen3), the same RMSNorm as Megatron's q_layernorm / k_layernorm, at the head's width
    (finalize_model_grads sums their gradients over tp: each rank normalised its own heads);
  - with attention_bias, the output projection's bias (transformers' o_proj): Megatron's add_bias_linear
    would put biases on the MLP too, and add_qkv_bias covers q/k/v only, so linear_proj is Megatron's
    RowParallelLinear built with its bias (added after the reduction, by the layer's bias-dropout-add).

A mixture-of-experts shape (harness/model/moe.py) takes the local spec's MoELayer: TopKRouter, the alltoall
token dispatcher, SequentialMLP experts (a list of the same SwiGLU MLP; GroupedMLP needs the grouped_gemm
package and TEGroupedMLP Transformer Engine, neither here). moe_config() says how its routing and losses
equal the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from harness.model.kernels import rmsnorm_torch

RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}


class RMSNorm(torch.nn.Module):
    """LLaMA's RMSNorm for Megatron's spec (built as build_module(spec, config=, hidden_size=, eps=))."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return rmsnorm_torch(x, self.weight, self.eps)


class ProjectionWithBias(RowParallelLinear):
    """The attention's output projection with a bias whatever add_bias_linear says (attention_bias)."""

    def __init__(self, *args, bias: bool = False, **kwargs):
        super().__init__(*args, bias=True, **kwargs)


def transformer_config(
    shape, spec, tp: int, pp: int, vp: int, dtype: torch.dtype, deallocate: bool
) -> TransformerConfig:
    lay = spec.layout
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.has_qkv_bias,  # attention_bias (all four) or qkv_bias (Qwen2: q/k/v only)
        qk_layernorm=shape.qk_norm,  # Qwen3: per-head RMSNorm of q and k before rotary
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        # initialised by Megatron (on the CPU: no device RNG), then overwritten by the reference weights; its
        # initialisation also marks the tp-split parameters (tensor_model_parallel), which its gradient norm reads
        use_cpu_initialization=True,
        perform_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
        # Megatron-LM's defaults: the interleaved schedule overlaps unbatched transfers (_p2p_ops, which at
        # pp=2 sends one direction on another group; batched, pp=2's wrap-around pairs the same two ranks in
        # both directions and gloo matched the wrong transfers), 1F1B batches them
        overlap_p2p_comm=vp > 1,
        batch_p2p_comm=vp == 1,
        # Megatron-LM's: a stage's sent output keeps only its graph (its data freed once sent). Not on gloo: its
        # sends run on a background thread that still reads the tensor, and the interleaved schedule frees it
        # before waiting for the send (NaN losses here); NCCL has copied it by then
        deallocate_pipeline_outputs=deallocate,
        sequence_parallel=lay.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        **RECOMPUTE[lay.activation_checkpointing],
        **moe_config(shape, spec),
    )


def moe_config(shape, spec) -> dict:
    """The TransformerConfig fields of a MoE shape ({} for a dense one), so that Megatron's MoELayer is
    harness.model.moe's:

    - routing (moe_utils.topk_routing_with_score_function, score_function softmax, router_dtype fp32):
      moe_router_pre_softmax=True is softmax over every expert, then top-k, the weights NOT renormalised
      (Qwen3-MoE without norm_topk_prob); False is top-k of the logits, then a softmax over those k, which is
      p_i / sum of the chosen p (the same experts, softmax being monotone): the renormalised weights (Mixtral).
      So pre_softmax = not norm_topk (Megatron refuses k=1 without pre-softmax: facts.py refuses that shape);
    - dropless: no capacity factor, every expert runs on all its tokens;
    - the losses: load-balancing type aux_loss is switch_load_balancing_loss_func, E/(k T^2) * sum_e
      (tokens of e)(summed probabilities of e) over one micro-batch's T tokens (counts summed over the tp
      ranks that hold parts of it under sequence parallelism, each rank's probabilities its own part): the
      reference's E/k sum_e f_e P_e. z_loss_func is the mean of logsumexp(logits)^2, each of those tp ranks
      taking its share with the coefficient / tp. Both enter the backward through MoEAuxLossAutoScaler with
      the schedule's scale 1 / micro-batches, and DDP's mean over dp, as the reference's AuxLossScaler;
    - expert_tensor_parallel_size = tp (Megatron's default): each expert's MLP split over tp as the dense
      MLP is, and the expert-data-parallel groups are dp x cp / ep, as harness/parallel_dims.py carves ep.
    """
    if not shape.moe:
        return {}
    w = spec.workload
    return {
        "num_moe_experts": shape.experts,
        "moe_ffn_hidden_size": shape.moe_ffn,
        "moe_router_topk": shape.experts_per_token,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not shape.norm_topk,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": w.moe_aux_loss_coeff,
        # None skips the z-loss (0 would still compute it, and log it divided by 0)
        "moe_z_loss_coeff": w.moe_z_loss_coeff or None,
        "moe_expert_capacity_factor": None,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "expert_model_parallel_size": spec.layout.ep,
        "expert_tensor_parallel_size": spec.layout.tp,
    }


def block_spec(config: TransformerConfig, attention_bias: bool, vp_stage: int | None) -> TransformerBlockSubmodules:
    """This model chunk's layers (as many as Megatron builds for it) and the final norm."""
    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
    )  # a MoE: SequentialMLP experts (grouped GEMM needs the grouped_gemm package or Transformer Engine)
    norm = ModuleSpec(module=RMSNorm)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    if config.qk_layernorm:  # built at the head's width; finalize_model_grads sums their gradients over tp
        layer.submodules.self_attention.submodules.q_layernorm = norm
        layer.submodules.self_attention.submodules.k_layernorm = norm
    if attention_bias:
        layer.submodules.self_attention.submodules.linear_proj = ProjectionWithBias
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=norm
    )
