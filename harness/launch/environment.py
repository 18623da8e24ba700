"""The environment a launched run's processes start with: the run's token (what fences its processes),
this environment's torch extension folder, and a CPU run's threads per process."""

from __future__ import annotations

import os

from harness.launch.build_lock import use_environment_dir
from harness.launch.processes import TOKEN_ENV

_CUDA_CACHE: list[bool] = []


def _has_cuda() -> bool:
    if not _CUDA_CACHE:
        try:
            import torch

            _CUDA_CACHE.append(bool(torch.cuda.is_available()))
        except Exception:  # noqa: BLE001 - no torch means no CUDA here
            _CUDA_CACHE.append(False)
    return _CUDA_CACHE[0]


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, e.g. a Slurm allocation), else all."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_process(nproc: int) -> int:
    """OMP_NUM_THREADS for each of `nproc` ranks sharing this machine's cores."""
    return max(1, cpu_cores() // max(1, nproc))


def run_env(nproc: int, spec_dict: dict, token: str, extra_env: dict | None) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in (extra_env or {}).items()})
    env[TOKEN_ENV] = token
    env.setdefault("PYTHONUNBUFFERED", "1")
    use_environment_dir(env)  # this environment's torch extensions: another's would be rebuilt at every run
    device = (spec_dict.get("workload") or {}).get("device", "auto")
    on_cpu = device == "cpu" or (device == "auto" and not _has_cuda())
    if on_cpu and "OMP_NUM_THREADS" not in env:
        # the deepspeed launcher leaves it unset and torchrun sets 1: both are wrong on CPU
        env["OMP_NUM_THREADS"] = str(threads_per_process(nproc))
    return env
