"""The workload the distributed tests share: the tiny model on this CPU in fp32 (exact equivalence),
32 tokens, 8 sequences. Each test file states only what it changes."""

from __future__ import annotations

TINY = dict(model="tiny", seq_len=32, global_batch_size=8, steps=2, warmup_steps=1, device="cpu", precision="fp32")


def tiny_workload(**fields) -> dict:
    """TINY with `fields` changed or added (a fresh dict each call)."""
    return {**TINY, **fields}
