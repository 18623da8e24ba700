"""Honest measurement: synchronised step timers, distributions, FLOPs/MFU, memory, fingerprint.

A measurement is a distribution: warm-up excluded, every measured step kept, summarised by
median and spread with a distribution-free 95% confidence interval of the median.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import resource
import subprocess
import time
import weakref

import torch

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, no sparsity).
DATASHEET_BF16_TFLOPS = (
    ("A100", 312.0),  # NVIDIA A100 datasheet
    ("H100", 989.0),  # NVIDIA H100 SXM5 datasheet (PCIe: 756)
    ("H200", 989.0),  # NVIDIA H200 SXM datasheet
)
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


# The range around the harness's own loss reduction inside an engine's step (the global mean loss
# every engine returns for the parity check): a report keeps its collective apart from the engine's.
HARNESS_SYNC = "harness.loss_reduction"


# The range around each FP8 cast of torchao's float8 matmul (an input, a weight or an output gradient
# to e4m3/e5m2 with its amax and scale: harness.model.float8): the profiled step's FP8 cast time, a
# part of its compute.
FP8_CAST = "harness.fp8_cast"

_in_harness_sync = [0]  # how deep the main thread is in harness_sync() (the step counters read it)


@contextlib.contextmanager
def harness_sync():
    """Around the harness's own collectives inside a step: a HARNESS_SYNC range for the profiler's
    trace and a flag for the measured steps' counters (harness.profiling), a few microseconds."""
    _in_harness_sync[0] += 1
    try:
        with torch.profiler.record_function(HARNESS_SYNC):
            yield
    finally:
        _in_harness_sync[0] -= 1


def in_harness_sync() -> bool:
    return _in_harness_sync[0] > 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Wall time of one step, with the device synchronised on both ends."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self.start


def _quantile(sorted_xs: list[float], q: float) -> float:
    pos = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def median_ci95(sorted_xs: list[float]) -> tuple[float, float]:
    """Distribution-free 95% CI of the median from order statistics (binomial, p = 1/2)."""
    n = len(sorted_xs)
    if n < 6:  # no pair of order statistics reaches 95%: report the whole range
        return sorted_xs[0], sorted_xs[-1]
    cdf, k = 0.0, 0
    # largest k with P(Bin(n, 1/2) <= k - 1) <= 0.025
    for j in range(n + 1):
        cdf += math.comb(n, j) / 2**n
        if cdf > 0.025:
            k = j
            break
    lo, hi = max(k - 1, 0), min(n - k, n - 1)
    return sorted_xs[lo], sorted_xs[hi]


def summarize(times: list[float]) -> dict:
    xs = sorted(times)
    n = len(xs)
    mean = sum(xs) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    lo, hi = median_ci95(xs)
    return {
        "median": _quantile(xs, 0.5),
        "mean": mean,
        "p10": _quantile(xs, 0.1),
        "p90": _quantile(xs, 0.9),
        "std": std,
        "ci95_low": lo,
        "ci95_high": hi,
        "n": n,
        "min": xs[0],
        "max": xs[-1],
    }


# ---------------------------------------------------------------- peaks and MFU


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


# ---------------------------------------------------------------- memory


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """CUDA allocator peak, or the process's peak RSS on CPU (cuda stats read 0 on a CPU build)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak_rss"


# ---------------------------------------------------------------- live metrics stream (TensorBoard)

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


# ---------------------------------------------------------------- fingerprint


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


# ---------------------------------------------------------------- memory census

# buffers: communication scratch a framework keeps (DeepSpeed's reduce buckets), sized by its
# config, not by the model: not gradients, though gradients pass through them
# fp8: what persists of FP8 training between steps (FP8 weight copies, their scales: harness/model/float8.py)
CENSUS_CATEGORIES = ("parameters", "buffers", "gradients", "master_parameters", "optimizer_states", "fp8")


# torchao.float8's tensor subclasses (no storage of their own) -> the attribute holding their data: the
# weight FSDP2 all-gathers in FP8 (its bf16/fp32 shard), and an FP8 tensor (its float8 bytes; the scale apart)
TORCHAO_INNER = {"WeightWithDynamicFloat8CastTensor": "_tensor", "Float8TrainingTensor": "_data"}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank really holds: a DTensor's local shard, the result inside a pending
    functional collective (AsyncCollectiveTensor.elem), torchao's FP8 wrappers' data (TORCHAO_INNER)."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None)
        if inner is None and type(t).__name__ in TORCHAO_INNER:
            inner = getattr(t, TORCHAO_INNER[type(t).__name__], None)
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def storage_address(storage) -> int:
    """What tells two storages apart on a real device: their address. (Fake tensors, which
    `harness memory` traces, all have address 0: it passes storage_identity instead.)"""
    return storage.data_ptr()


def storage_identity(storage) -> int:
    """The storage's StorageImpl: unique while it lives, on fake tensors too."""
    return storage._cdata


def tensor_census(categories: dict[str, list], key=storage_address) -> dict[str, dict[str, int]]:
    """Bytes per category and dtype of the tensors an engine holds, each storage counted once
    (the first category that names it wins: a parameter that is its own master is a parameter;
    views into one flat buffer count the buffer once, padding included, as allocated)."""
    seen: set[int] = set()
    out: dict[str, dict[str, int]] = {}
    for category, tensors in categories.items():
        counts = out.setdefault(category, {})
        for t in tensors:
            if t is None:
                continue
            t = local_tensor(t)
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            k = key(storage)
            if k in seen or storage.nbytes() == 0:
                continue
            seen.add(k)
            counts[_dtype_key(t.dtype)] = counts.get(_dtype_key(t.dtype), 0) + storage.nbytes()
    return out


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's state (Adam's moments; the step counter too)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class SavedActivations:
    """Bytes autograd saves for backward while this context is open (torch's saved-tensor hooks),
    each storage once, parameters excluded: what activation memory a step holds. A storage is
    forgotten when the last saved tensor on it is freed, so an address the allocator reuses later
    in the step (pipeline schedules interleave forwards and backwards) counts again."""

    def __init__(self, parameters, key=storage_address):
        self.key = key
        self.skip = {key(local_tensor(p).untyped_storage()) for p in parameters}
        self.live: dict[int, int] = {}  # storage key -> saved tensors alive on it
        self.bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, key: int) -> None:
        self.live[key] -= 1
        if not self.live[key]:
            del self.live[key]

    def _pack(self, t):
        t_local = local_tensor(t)
        # parameters by identity too: ZeRO-3 gathers full parameters into storages that did not
        # exist when this context opened (DeepSpeed marks them with ds_id)
        if t_local.device.type != "meta" and not isinstance(t, torch.nn.Parameter) and not hasattr(t, "ds_id"):
            storage = t_local.untyped_storage()
            key = self.key(storage)
            if key not in self.skip:
                if key not in self.live:
                    self.bytes += storage.nbytes()
                    self.live[key] = 0
                self.live[key] += 1
                weakref.finalize(t, self._release, key)
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class CensusAtStep:
    """tensor_census(tensors()) taken once, right after `optimizer` first steps: its states exist
    then and the gradients are not cleared yet, so all four categories are alive (the
    census 'held at the optimizer step'). `optimizer` is the torch optimizer that updates this
    rank's master (or only) parameters, also where a framework wraps it."""

    def __init__(self, optimizer, tensors):
        self.tensors, self.result = tensors, None
        # kept registered (a no-op after the first step): removing a hook while the optimizer
        # iterates its hooks would break any hook registered after this one
        optimizer.register_step_post_hook(self._take)

    def _take(self, optimizer, args, kwargs) -> None:
        if self.result is None:
            self.result = tensor_census(self.tensors())
