"""DeepSpeed AutoTP (tp > 1) on the harness's models: which linears it shards, and how the
shards are put back together for full_state_dict.

AutoTP replaces nn.Linear modules by its column-parallel LinearLayer (output features split;
the input's gradient all-reduced in the backward) or row-parallel LinearAllreduce (input
features split; the output all-reduced in the forward), as the config's layer specs say.
Our Llama's names are not the Hugging Face ones its presets know, so the plan is given
explicitly (`tensor_parallel.partition_config`, DeepSpeed's configurable AutoTP API):

  column: attention.wq, wk, wv (whole heads per rank), feed_forward.w1, w3 (SwiGLU gate and up)
  row:    attention.wo, feed_forward.w2
  replicated: tok_embeddings, the RMSNorm weights, output (the LM head: full logits on every rank)

That is Megatron's layout of a block; the own engine also shards the embedding and LM head by
vocabulary. transformers' LlamaForCausalLM (model_impl hf) gets DeepSpeed's "llama" preset, the
same plan under the Hugging Face names.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

OWN_LLAMA_PLAN = {
    "use_default_specs": False,
    "strict_mode": False,
    "layer_specs": [
        {
            "patterns": [r".*\.attention\.w[qkv]\.weight$", r".*\.feed_forward\.w[13]\.weight$"],
            "partition_type": "column",
        },
        {"patterns": [r".*\.attention\.wo\.weight$", r".*\.feed_forward\.w2\.weight$"], "partition_type": "row"},
    ],
}
SHARDED = (
    "column-parallel: attention wq/wk/wv, feed-forward w1/w3 (hf: q/k/v_proj, gate/up_proj); "
    "row-parallel: attention wo, feed-forward w2 (hf: o_proj, down_proj); "
    "replicated: embedding, RMSNorm weights, LM head"
)


def add_tp_plan(config: dict, model_impl: str) -> None:
    """Give AutoTP the plan for our model unless the ds_config file brings its own."""
    section = config["tensor_parallel"]
    if "partition_config" in section or "preset_model" in section:
        return
    if model_impl == "hf":
        section["preset_model"] = "llama"
    else:
        section["partition_config"] = copy.deepcopy(OWN_LLAMA_PLAN)


def sharded_names(named_parameters) -> list[str]:
    """The parameters AutoTP actually cut (it records each shard's layout on the parameter)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    out = []
    for name, param in named_parameters:
        meta = getattr(param, DS_AUTOTP_UC_META, None)
        if meta and not meta.get("replicated") and meta.get("partition_dim") is not None:
            out.append(name)
    return out


def tp_groups(tp: int):
    """DeepSpeed's tensor- and data-parallel groups (tp x dp mesh: tp ranks adjacent), created
    before deepspeed.initialize and passed to it as `mpu`. Without an mpu DeepSpeed checks
    train_batch_size against the whole world (as if every tp rank were data-parallel) while it
    averages gradients over world / tp: the batch arithmetic would contradict the workload's."""
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)  # what DeepSpeed itself calls for AutoTP
    made = groups.get_tensor_model_parallel_world_size()
    if made != tp:  # the groups are process-wide and made once: another tp in the same process
        raise RuntimeError(f"DeepSpeed's tensor-parallel groups of this process have size {made}, not tp={tp}")
    return groups


def tp_group():
    from deepspeed.utils import groups

    return groups.get_tensor_model_parallel_group()


def gather_tp_shards(param, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor from this rank's AutoTP shard `local` (a copy of `param`'s value), using
    the layout AutoTP records on the parameter; a replicated parameter comes back as it is.
    Collective over the tensor-parallel group for sharded parameters."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    meta = getattr(param, DS_AUTOTP_UC_META, None)
    if not meta or meta.get("replicated") or meta.get("partition_dim") is None:
        return local
    if meta.get("sub_param_shape") or meta.get("sub_param_sizes"):
        raise NotImplementedError("fused sub-parameter shards (packed QKV / gate-up) are not gathered here")
    dim, sizes = meta["partition_dim"], list(meta["partition_sizes"])
    group = tp_group()
    width = max(sizes)
    padded_shape = list(local.shape)
    padded_shape[dim] = width
    padded = local.new_zeros(padded_shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    padded = padded.to(_comm_device())
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.cpu().narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=dim)


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
