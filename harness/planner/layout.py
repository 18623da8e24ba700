"""What the planner is asked about: one layout and one workload, as plain values.

The planner keeps its own small types (not harness.spec's) so it can describe layouts the
engines cannot run yet, such as the study's kernels (fused_softmax, flash1).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from harness.model.presets import Shape

# Attention kernels: the study's (naive = its "torch", fused_softmax = Megatron's fused
# scale-mask-softmax, flash1, flash2) and the harness's own names. Each maps to a cost class.
ATTENTION_CLASS = {
    "naive": "naive", "fused_softmax": "fused_softmax", "flash1": "flash1", "flash2": "flash2",
    "sdpa": "flash2", "sdpa_flash": "flash2", "sdpa_cudnn": "flash2", "sdpa_efficient": "mem_efficient",
}
MATERIALISED = ("naive", "fused_softmax")  # keep the s x s score matrix
RMSNORMS = ("torch", "fused")
CHECKPOINTING = ("none", "full", "selective")
SCHEDULES = ("1f1b", "interleaved", "gpipe")

# Names the study's CSVs use, and the checkpointing names.
PAPER_KERNELS = {
    "torch": ("naive", "torch"), "fused": ("fused_softmax", "torch"),
    "flash_attention": ("flash1", "torch"), "flash_attentionv1.0.8": ("flash1", "torch"),
    "flash_attention2": ("flash2", "torch"), "flash_attention2 + RMS kernel": ("flash2", "fused"),
}
PAPER_CHECKPOINTING = {"disabled": "none", "every_layer": "full", "selective": "selective"}


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    activation_checkpointing: str = "none"
    sequence_parallel: bool = False
    attention: str = "flash2"
    rmsnorm: str = "fused"
    zero: int = 1                    # 0-3; the study sharded optimizer states (ZeRO-1)
    schedule: str = "1f1b"
    virtual_stages: int = 1          # interleaved schedule: model chunks per stage
    fsdp: bool = False               # PyTorch FSDP full sharding: memory like ZeRO-3

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch_size: int           # sequences per optimizer step
    dtype_bytes: int = 2             # bf16 mixed precision (2) or fp32 (4)

    def micro_batches(self, lay: Layout) -> int:
        """Micro-batches per step per data-parallel replica (gradient accumulation x pipeline)."""
        return self.global_batch_size // (lay.dp * lay.micro_batch_size)


def stage_items(shape: Shape, pp: int) -> list[tuple[bool, int, bool]]:
    """(has_embedding, layers, has_lm_head) per stage.

    A uniform split of the items [embedding, layer_1..layer_L, final norm, LM head], the first
    stages taking one more when it does not divide (DeepSpeed's `partition_uniform`, which the
    study's ranks used; see ../shared/paper-sweeps/README.md).
    """
    return list(_stage_items(shape.layers, pp))


@functools.lru_cache(maxsize=4096)
def _stage_items(n_layers: int, pp: int) -> tuple[tuple[bool, int, bool], ...]:
    n_items = n_layers + 3
    base, extra = divmod(n_items, pp)
    out, start = [], 0
    for i in range(pp):
        size = base + (1 if i < extra else 0)
        end = start + size  # items [start, end); layers are items 1..n_layers
        layers = max(0, min(end, n_layers + 1) - max(start, 1))
        out.append((start == 0 and size > 0, layers, start <= n_items - 1 < end))
        start = end
    return tuple(out)
