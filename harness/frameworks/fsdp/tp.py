"""Tensor and sequence parallelism for engine fsdp: DTensor `parallelize_module` on the tp mesh.

The plan is torchtitan's for LLaMA, applied to the plain model's modules (harness/model/llama.py)
from outside, so the model itself stays free of parallel code:

  attention wq, wk, wv        ColwiseParallel     (heads split; the model's .view(b, s, -1, head_dim)
                                                   then sees the local head count)
  attention wo                RowwiseParallel     (all-reduce, or reduce-scatter over the sequence with SP)
  feed_forward w1, w3 / w2    ColwiseParallel / RowwiseParallel
  attention_norm, ffn_norm,   SequenceParallel with SP (activations split over the sequence,
  final norm                  all-gathered before attention and the MLP by PrepareModuleInput);
                              without SP replicated DTensor parameters (ReplicatedParameters)
  attention q_norm, k_norm    SequenceParallel over the head dim (sequence_dim=2 of [b, s, heads, head_dim]:
  (Qwen3's, per head)                              each rank normalises its own heads; the replicated weights'
                                                   gradients are partial over tp, reduced as the SP norms' are)
  tok_embeddings              RowwiseParallel     (vocabulary rows split, the partial lookups reduced)
  output (LM head)            ColwiseParallel     (vocabulary split, logits all-gathered: the loss is
                                                   the reference's lm_loss on whole logits, no loss_parallel)

Every parameter becomes a DTensor on the tp mesh (replicated ones included), so that FSDP2 then
shards all of them on one 2-D (dp, tp) mesh and one global gradient norm covers them all.

Precision: the collectives run in the dtype of what they carry. Under bf16 FSDP2 gathers the
parameters in bf16 (MixedPrecisionPolicy.param_dtype, harness/frameworks/fsdp/engine.py), so the
activations and their gradients are bf16 and so is every TP/SP collective on them (all-reduce,
reduce-scatter, all-gather), as in Megatron. The sequence-parallel norms' weight gradients
(partial sums over tp) are all-reduced over tp when FSDP2 takes them for its own reduction
(_fsdp_param.py, _get_grad_inner_tensor), in the dtype FSDP2 holds them in then.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class ReplicatedParameters(ParallelStyle):
    """The module runs whole on every tp rank: its parameters become Replicate DTensors (no
    communication), its tensor inputs enter as replicated DTensors and its output leaves as a
    plain tensor. What torchtitan calls NoParallel; used for the norms without sequence parallelism."""

    def _apply(self, module, device_mesh):
        def wrap_inputs(_module, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def unwrap_output(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        # no partition_fn: distribute_module replicates every parameter of the module
        return distribute_module(module, device_mesh, input_fn=wrap_inputs, output_fn=unwrap_output)


def _sequence_layout(sequence_parallel: bool):
    """How the residual stream between blocks is laid out on the tp ranks."""
    return Shard(1) if sequence_parallel else Replicate()


def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    return SequenceParallel() if sequence_parallel else ReplicatedParameters()


def block_plan(sequence_parallel: bool, qk_norm: bool = False) -> dict[str, ParallelStyle]:
    """The plan of one transformer block (harness.model.llama.Block); qk_norm: it has per-head q/k norms."""
    seq = _sequence_layout(sequence_parallel)
    plan = {
        "attention_norm": _norm_style(sequence_parallel),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "ffn_norm": _norm_style(sequence_parallel),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if qk_norm:  # torchtitan's Qwen3 plan: the local heads enter as Shard(2), leave as plain tensors
        for norm in ("attention.q_norm", "attention.k_norm"):
            plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:  # all-gather the sequence before attention and the MLP (x, cos, sin / x)
        plan["attention"] = PrepareModuleInput(
            input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
    return plan


def outer_plan(module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of the pieces around the blocks that `module` holds (a pipeline stage may hold
    the embedding, the final norm and LM head, or neither)."""
    seq = _sequence_layout(sequence_parallel)
    plan: dict[str, ParallelStyle] = {}
    if getattr(module, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(module, "norm", None) is not None:
        plan["norm"] = _norm_style(sequence_parallel)
    if getattr(module, "output", None) is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    return plan


def apply_tensor_parallel(module, tp_mesh, sequence_parallel: bool) -> None:
    """Shard `module` (the plain Llama or a pipeline stage of it: .layers, optional
    .tok_embeddings/.norm/.output) over `tp_mesh` in place; must run before activation
    checkpointing wraps the blocks and before fully_shard."""
    plan = outer_plan(module, sequence_parallel)
    if plan:
        parallelize_module(module, tp_mesh, plan)
    for block in module.layers.children():
        qk_norm = getattr(block.attention, "q_norm", None) is not None
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel, qk_norm))


def describe_plan(sequence_parallel: bool) -> dict:
    """The plan in words, for the run record."""
    norms = "SequenceParallel (sequence-sharded)" if sequence_parallel else "replicated DTensor parameters"
    return {
        "attention": "wq/wk/wv ColwiseParallel (local heads), wo RowwiseParallel",
        "feed_forward": "w1/w3 ColwiseParallel, w2 RowwiseParallel",
        "norms": norms,
        "qk_norms": "SequenceParallel over the heads (Shard(2)), when the model has them",
        "tok_embeddings": "RowwiseParallel (vocabulary-sharded)",
        "output": "ColwiseParallel (vocabulary-sharded), logits all-gathered (no loss_parallel)",
        "residual_stream": "sharded over the sequence (Shard(1))" if sequence_parallel else "replicated",
    }
