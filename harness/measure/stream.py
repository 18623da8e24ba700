"""Rank 0's live metrics of every step to TensorBoard (`--tensorboard DIR`)."""

from __future__ import annotations

import os

import torch

from harness.measure.memory import peak_memory

# `harness compare/sweep --tensorboard DIR` hand DIR to every run they launch through this variable
TENSORBOARD_ENV = "HARNESS_TENSORBOARD_DIR"
TENSORBOARD_MISSING = (
    "the tensorboard package is not installed; pip install 'tensorboard>=2.14' (the package's `tensorboard` extra)"
)


def check_tensorboard(log_dir: str, field: str = "--tensorboard") -> None:
    """Before anything launches: the package is there (torch.utils.tensorboard needs it) and
    log_dir can be written (a folder, or a new one in an existing folder); else SpecError."""
    import importlib.util

    from harness.errors import SpecError

    if importlib.util.find_spec("tensorboard") is None:
        raise SpecError(field, TENSORBOARD_MISSING)
    full = os.path.abspath(log_dir)
    if os.path.exists(full) and not os.path.isdir(full):
        raise SpecError(field, f"{log_dir} is a file; give a folder")
    parent = full if os.path.isdir(full) else os.path.dirname(full)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise SpecError(field, f"folder {parent} does not exist or cannot be written")


class MetricsStream:
    """Rank 0's metrics of every step (warm-up included: step 0 is the first step) as TensorBoard
    scalars: loss, step time, tokens/s, MFU where a peak is known, peak memory so far. The step
    time is rank 0's own, timed as the measurement times it (device synchronised); the record's
    statistics take each step's slowest rank instead, over the measured steps only."""

    def __init__(self, log_dir: str, description: str = ""):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir, flush_secs=30)  # a long run shows up within 30 s
        if description:
            self.writer.add_text("run", description, 0)

    def step(
        self, step: int, *, loss: float, seconds: float, tokens: int, mfu: float | None, device: torch.device
    ) -> None:
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("perf/step_time_ms", seconds * 1e3, step)
        w.add_scalar("perf/tokens_per_s", tokens / seconds, step)
        if mfu:
            w.add_scalar("perf/mfu_palm", mfu, step)
        w.add_scalar("memory/peak_gib", peak_memory(device)[0] / 2**30, step)
        if device.type == "cuda":
            w.add_scalar("memory/allocated_gib", torch.cuda.memory_allocated(device) / 2**30, step)

    def close(self) -> None:
        self.writer.close()
