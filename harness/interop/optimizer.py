"""The optimizer every export writes: the workload's AdamW and gradient clipping, harness.spec's
defaults where not given (a constant learning rate, as the harness trains)."""

from __future__ import annotations

from harness.spec import Optimizer
from harness.spec import Workload as SpecWorkload


def optimizer_and_clip(optimizer: Optimizer | None, grad_clip: float | None) -> tuple[Optimizer, float]:
    """The workload's optimizer and clipping, harness.spec's defaults where not given."""
    return optimizer or Optimizer(), SpecWorkload().grad_clip if grad_clip is None else grad_clip
