"""The machine a record was measured on: hosts, device, CPU, driver, library versions, the environment
variables that change what is measured."""

from __future__ import annotations

import os
import platform
import subprocess

import torch

FINGERPRINT_ENV = (
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_IB_DISABLE",
    "NCCL_SOCKET_IFNAME",
    "NCCL_P2P_DISABLE",
    "MASTER_ADDR",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "PYTORCH_CUDA_ALLOC_CONF",
)


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def fingerprint(device: torch.device, world_size: int = 1, hosts: list[str] | None = None) -> dict:
    import socket

    cuda = device.type == "cuda"
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = None
    return {
        "hosts": sorted(set(hosts or [socket.gethostname()])),
        "device_type": device.type,
        "device_name": torch.cuda.get_device_name(device) if cuda else _cpu_model(),
        "device_count": torch.cuda.device_count() if cuda else 1,
        "cpu_model": _cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "world_size": world_size,
        "driver": _nvidia_driver() if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "deepspeed": _version("deepspeed"),
        "megatron_core": _version("megatron-core"),
        "transformers": _version("transformers"),
        "flash_attn": _version("flash-attn"),
        "python": platform.python_version(),
        "env": {k: os.environ[k] for k in FINGERPRINT_ENV if k in os.environ},
    }
