"""Peaks and MFU: the datasheet's dense bf16 peak, the best matmul rate measured now, and the MFU table."""

from __future__ import annotations

import time

import torch

from harness.measure.timers import StepTimer

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, no sparsity).
DATASHEET_BF16_TFLOPS = (
    ("A100", 312.0),  # NVIDIA A100 datasheet
    ("H100", 989.0),  # NVIDIA H100 SXM5 datasheet (PCIe: 756)
    ("H200", 989.0),  # NVIDIA H200 SXM datasheet
)


def datasheet_peak_tflops(device_name: str) -> float | None:
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if key in device_name.upper():
            if key == "H100" and "PCIE" in device_name.upper():
                return 756.0
            return tflops
    return None


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.5) -> float:
    """The best matmul rate this device reaches now: a short square-GEMM microbenchmark."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        with StepTimer(device) as t:
            for _ in range(5):
                a @ b
        best = max(best, 5 * 2 * n**3 / t.seconds / 1e12)
    return best


def mfu_table(flops_per_token: dict, tokens_per_s: float, devices: int, peak_tflops: float | None) -> dict | None:
    if not peak_tflops:
        return None
    return {k: v * tokens_per_s / (devices * peak_tflops * 1e12) for k, v in flops_per_token.items()}
