"""The peak memory a run held: the CUDA allocator's peak, or the process's peak RSS on CPU."""

from __future__ import annotations

import resource

import torch


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """CUDA allocator peak, or the process's peak RSS on CPU (cuda stats read 0 on a CPU build)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak_rss"
