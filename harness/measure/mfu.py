"""Peaks and MFU: the datasheet's dense bf16 peak, the best matmul rate measured now, and the MFU table."""

from __future__ import annotations

import os
import time

import torch

from harness.measure.timers import StepTimer

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, no sparsity), by a fragment of the
# CUDA device name; the first fragment the name holds wins (H100 PCIe and NVL before H100 SXM).
DATASHEET_BF16_TFLOPS = (
    ("H200", 989.0),  # H200 SXM datasheet (GH200 too)
    ("H100 PCIE", 756.0),  # H100 PCIe datasheet: 1,513 with sparsity
    ("H100 NVL", 835.0),  # H100 NVL datasheet: 1,671 with sparsity
    ("H100", 989.0),  # H100 SXM datasheet
    ("H800", 989.0),  # same silicon as H100 SXM
    ("A100", 312.0),  # A100 datasheet (40 and 80 GB, SXM and PCIe)
    ("A800", 312.0),
    ("A30", 165.0),  # A30 datasheet
    ("L40S", 362.0),  # L40S datasheet: 733 with sparsity
    ("L4", 121.0),  # L4 datasheet: 242 with sparsity
    ("GB200", 2500.0),  # GB200 NVL72 datasheet: 360 PFLOP/s with sparsity for 72 GPUs
    ("B200", 2250.0),  # B200 datasheet: 4.5 PFLOP/s with sparsity
)


def datasheet_peak_tflops(device_name: str) -> float | None:
    """The datasheet's dense bf16 peak of a CUDA device name ('NVIDIA H100 80GB HBM3'), else None."""
    upper = (device_name or "").upper()
    return next((tflops for fragment, tflops in DATASHEET_BF16_TFLOPS if fragment in upper), None)


MATMUL_SECONDS = 0.5  # how long the microbenchmark samples by default
MATMUL_SECONDS_ENV = "HARNESS_MATMUL_SECONDS"  # another duration (tests/conftest.py: the suite reads no peak's value)


def matmul_seconds() -> float:
    """MATMUL_SECONDS, or the positive number of seconds MATMUL_SECONDS_ENV gives."""
    try:
        given = float(os.environ.get(MATMUL_SECONDS_ENV, ""))
    except ValueError:
        return MATMUL_SECONDS
    return given if 0 < given < float("inf") else MATMUL_SECONDS


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, seconds: float | None = None) -> float:
    """The best matmul rate this device reaches now: a short square-GEMM microbenchmark, sampled for
    `seconds` (matmul_seconds() by default) and at least once."""
    seconds = matmul_seconds() if seconds is None else seconds
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while best == 0.0 or time.perf_counter() < deadline:
        with StepTimer(device) as t:
            for _ in range(5):
                a @ b
        best = max(best, 5 * 2 * n**3 / t.seconds / 1e12)
    return best


def mfu_table(flops_per_token: dict, tokens_per_s: float, devices: int, peak_tflops: float | None) -> dict | None:
    if not peak_tflops:
        return None
    return {k: v * tokens_per_s / (devices * peak_tflops * 1e12) for k, v in flops_per_token.items()}
