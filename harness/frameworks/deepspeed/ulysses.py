"""DeepSpeed Ulysses (cp > 1, cp_impl ulysses) on the plain model: DeepSpeed's own sequence groups
and its DistributedAttention around the layout's causal attention kernel.

Groups: DeepSpeed's parallel_state_sp (what its Ulysses for Hugging Face models passes to
deepspeed.initialize as `mpu`): sequence groups of cp consecutive ranks, and one sequence-data-
parallel group of every rank, over which ZeRO 1/2/3 partitions and reduces (runtime/engine.py:
seq_data_parallel_group; stage_1_and_2.py and stage3.py sum the gradients over it and divide by
its size / sequence_parallel_size, that is by dp). That is the harness's mesh with tp = pp = 1
(cp innermost: harness.parallel_dims), checked rank by rank.

Tokens: each rank holds its cp_token_index chunks (i and 2cp-1-i) of every sequence, as every
engine does. DistributedAttention's all-to-all (scatter_idx 2: heads, gather_idx 1: sequence,
batch_dim_idx 0, so [b, s, h, d]) concatenates the ranks' tokens in rank order; the local kernel
puts them in sequence order before the causal kernel and back after. The rank's loss is its share
of the sequence mean (its tokens' summed losses / (micro-batch x seq_len)) where DeepSpeed divides
the gradients summed over dp x cp by dp only, and its own tokens' mean where it divides by dp x cp:
DeepSpeed 0.19.8 does both (loss_divisor).
"""

from __future__ import annotations

import dataclasses

import torch

from harness.model.kernels import Kernels
from harness.model.llama import attention_core, cp_token_index


def sequence_groups(dims, rank: int):
    """DeepSpeed's parallel_state_sp with sequence groups of dims.cp ranks (made once per process, as
    DeepSpeed's module allows; a later run with another cp in the same process is refused)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=dims.cp)
    made = mpu.get_sequence_parallel_world_size()
    if made != dims.cp:
        raise RuntimeError(f"DeepSpeed's sequence-parallel groups of this process have size {made}, not cp={dims.cp}")
    if (
        mpu.get_sequence_parallel_rank() != dims.coord(rank).cp
        or mpu.get_sequence_data_parallel_world_size() != dims.replicas()
    ):
        raise RuntimeError("DeepSpeed's sequence groups do not match the harness's mesh (cp innermost)")
    return mpu


def loss_divisor(zero_stage: int, cp: int) -> int:
    """What a rank's mean token loss is divided by so that DeepSpeed's gradient averaging gives the
    whole sequence's mean. ZeRO-1/2 divide the gradients summed over the sequence-data-parallel
    group by its size / sequence_parallel_size (stage_1_and_2.py: average_tensor, allreduce_bucket),
    the sum over dp of the cp ranks' shares: divide by cp. ZeRO-3's reduce-scatter
    (stage3.py: __avg_scatter_grads, the path of reduce_scatter true) divides by the whole group
    (dp x cp), the mean of the cp ranks' means: divide by 1 (deepspeed/config.py refuses reduce_scatter
    false with cp: ZeRO-3's contiguous path would divide by dp).
    Measured (tests/test_deepspeed_cp.py): with cp for every stage, ZeRO-3 reports half ZeRO-2's
    gradient norm and misses the reference's weights."""
    return 1 if zero_stage == 3 else cp


def forget_sequence_groups() -> None:
    """deepspeed.initialize leaves its mpu in deepspeed.utils.groups for the process: a later engine
    without cp in the same process must not inherit the sequence groups."""
    from deepspeed.utils import groups

    if getattr(groups.mpu, "__name__", "").endswith("parallel_state_sp"):
        groups.mpu = None


class _RankOrder(torch.nn.Module):
    """The local attention inside DistributedAttention: [b, seq, h/cp, d] in rank order (every
    rank's chunks as it holds them) -> the layout's causal kernel in sequence order -> rank order."""

    def __init__(self, kernel, seq: int, cp: int):
        super().__init__()
        self.kernel = kernel
        order = torch.cat([cp_token_index(seq, cp, r) for r in range(cp)])  # gathered row j holds position order[j]
        self.register_buffer("order", order, persistent=False)
        self.register_buffer("to_sequence", torch.argsort(order), persistent=False)

    def forward(self, q, k, v):
        q, k, v = (t[:, self.to_sequence.to(t.device)].transpose(1, 2) for t in (q, k, v))
        out = attention_core(q, k, v, self.kernel)  # repeats the KV heads for grouped-query attention
        return out.transpose(1, 2)[:, self.order.to(out.device)]


class UlyssesAttention:
    """The model's attention kernel under Ulysses: q, k, v [b, heads, s_local, d] (k, v repeated to
    every head by the model's attention_core) -> the rank's output rows [b, heads, s_local, d].
    The all-to-alls carry the KV heads once (taking every groups-th of the repeated heads is the
    identity on the KV heads, so their gradients are exact)."""

    def __init__(self, kernel, shape, seq: int, cp: int, group):
        from deepspeed.sequence.layer import DistributedAttention

        self.groups = shape.heads // shape.kv_heads
        self.attention = DistributedAttention(_RankOrder(kernel, seq, cp), group, scatter_idx=2, gather_idx=1)

    def __call__(self, q, k, v):
        if self.groups > 1 and k.shape[1] == q.shape[1]:
            k, v = k[:, :: self.groups], v[:, :: self.groups]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return self.attention(q, k, v, 0).transpose(1, 2)


def ulysses_kernels(layout, shape, seq: int, cp: int, group) -> Kernels:
    """The layout's kernels with the attention under DistributedAttention."""
    base = Kernels.of(layout.attention, layout.rmsnorm)
    return dataclasses.replace(base, attention=UlyssesAttention(base.attention, shape, seq, cp, group))


def describe_ulysses(layout, divisor: int) -> str:
    share = "its tokens' mean / cp" if divisor > 1 else "its tokens' mean"
    return (
        f"DeepSpeed Ulysses over cp={layout.cp}: deepspeed.sequence.layer.DistributedAttention (all-to-all of "
        f"q, k, v and the output; KV heads moved once) around {layout.attention} on the head shard's whole "
        f"sequence; parallel_state_sp as mpu, ZeRO over its sequence-data-parallel group; tokens: "
        f"cp_token_index chunks; the rank's loss: {share} (how ZeRO-{layout.zero_stage} averages)"
    )


def rank_tokens(inputs: torch.Tensor, targets: torch.Tensor, cp: int, index: int):
    """This cp rank's tokens and targets of a micro-batch [b, seq] (cp_token_index's chunks)."""
    pick = cp_token_index(inputs.shape[1], cp, index, inputs.device)
    return inputs[:, pick], targets[:, pick]
