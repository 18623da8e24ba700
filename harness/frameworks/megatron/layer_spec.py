"""The workload's LLaMA as Megatron-core's GPTModel: its TransformerConfig and its layer spec.

The spec is Megatron's local one (get_gpt_layer_local_spec: ColumnParallelLinear / RowParallelLinear,
DotProductAttention, SwiGLU MLP; no Transformer Engine) with two pieces of ours:
  - the RMSNorm: the local spec's norm (transformer/torch_norm.py, torch.nn.RMSNorm) refuses sequence
    parallelism without TE or Apex. Ours is the plain model's math (harness.model.kernels.rmsnorm_torch,
    fp32 statistics, the workload's eps) and marks its weight `sequence_parallel` as Megatron's fused norms
    do, so finalize_model_grads all-reduces its gradient over tp when each rank saw only its part of the
    sequence;
  - with attention_bias, the output projection's bias (transformers' o_proj): Megatron's add_bias_linear
    would put biases on the MLP too, and add_qkv_bias covers q/k/v only, so linear_proj is Megatron's
    RowParallelLinear built with its bias (added after the reduction, by the layer's bias-dropout-add).
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
        add_qkv_bias=shape.attention_bias,
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
    )


def block_spec(config: TransformerConfig, attention_bias: bool, vp_stage: int | None) -> TransformerBlockSubmodules:
    """This model chunk's layers (as many as Megatron builds for it) and the final norm."""
    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    norm = ModuleSpec(module=RMSNorm)
    layer.submodules.input_layernorm = norm
    layer.submodules.pre_mlp_layernorm = norm
    if attention_bias:
        layer.submodules.self_attention.submodules.linear_proj = ProjectionWithBias
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=norm
    )
