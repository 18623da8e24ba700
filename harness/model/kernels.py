"""Attention and RMSNorm kernels as measured options, and the check that one can run here.

A kernel the machine cannot run is a SpecError before the run starts, never a silent
fallback: `check_kernels` executes each chosen kernel once on a tiny input of the run's
device and dtype (forward and backward), so the verdict is the machine's, not a guess.

Attention kernels take q, k, v as [batch, heads, seq, head_dim] (k, v already expanded to
all heads) and apply the causal mask.

`fused` RMSNorm is flash-attn's Triton RMSNorm (`flash_attn.ops.triton.layer_norm.rms_norm_fn`)
when flash-attn is installed and the tensor is on CUDA; otherwise the RMSNorm function
compiled by torch.compile (Inductor emits one fused Triton kernel on GPU, one C++ loop on CPU).
`rmsnorm_backend_name` says which was used, and the run record keeps it.

`probe` tries what one run needs (need_of); `probe_in_child` does it in a child process, so that a
launching process (harness.launch.machine.check_machine, before compare and sweep launch) holds no CUDA context.

A model takes its kernels when it is built (`Kernels`): the layout's choice by default, or a
stand-in given by whoever builds it (harness memory's fused RMSNorm with the kernel's memory on
fake tensors), never swapped inside the modules afterwards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.errors import SpecError

# ---------------------------------------------------------------- attention


def attention_naive(q, k, v):
    """Materialised softmax(QKᵀ/√d)V in fp32 with an explicit causal mask."""
    s = q.shape[-2]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


def _sdpa(backend):
    def run(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def attention_flash2(q, k, v):
    """The flash-attn package (FlashAttention-2); it wants [batch, seq, heads, head_dim]."""
    from flash_attn import flash_attn_func

    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
    return out.transpose(1, 2)


@functools.cache
def attention_fn(name: str):
    from torch.nn.attention import SDPBackend

    table = {
        "naive": attention_naive,
        "sdpa": _sdpa(None),
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "flash2": attention_flash2,
    }
    return table[name]


_SDPA_CHOICE = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # torch.nn.attention.SDPBackend's values


def attention_backend_name(name: str, device: torch.device, shape, seq: int, dtype) -> str:
    """The attention kernel a run's layout.attention ran: for `sdpa`, the backend torch chooses for one
    micro-batch's full-size query on this device and dtype (the report names it; a shard's shape is
    smaller, and torch's choice on a CPU depends on the dtype, not the shape)."""
    if name != "sdpa":
        return name
    heads, head_dim = shape.heads, shape.head_dim
    try:  # a private torch function: where it is missing or refuses, the report says so rather than the run failing
        q = torch.zeros(1, heads, seq, head_dim, device=device, dtype=dtype)
        choice = int(torch._fused_sdp_choice(q, q, q, is_causal=True))
    except (AttributeError, RuntimeError, TypeError, ValueError) as e:
        return f"sdpa (torch's backend choice not determined: {type(e).__name__})"
    return f"sdpa: {_SDPA_CHOICE.get(choice, choice)} (torch's choice at [1, {heads}, {seq}, {head_dim}] {dtype})"


# ---------------------------------------------------------------- RMSNorm


def rmsnorm_torch(x, weight, eps: float):
    """LLaMA's RMSNorm as transformers writes it: statistics in fp32, scale in the input dtype."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


@functools.cache
def _compiled_rmsnorm():
    return torch.compile(rmsnorm_torch, dynamic=False, fullgraph=True)


def _flash_attn_rmsnorm():
    try:
        from flash_attn.ops.triton.layer_norm import rms_norm_fn
    except Exception:  # absent, or built without its Triton ops
        return None
    return rms_norm_fn


def rmsnorm_backend_name(name: str, device_type: str) -> str:
    if name == "torch":
        return "torch (eager)"
    if device_type == "cuda" and _flash_attn_rmsnorm() is not None:
        return "flash-attn Triton rms_norm_fn"
    return "torch.compile (Inductor)"


def rmsnorm_fused(x, weight, eps: float):
    if x.is_cuda:
        fn = _flash_attn_rmsnorm()
        if fn is not None:
            return fn(x, weight, None, eps=eps)
    return _compiled_rmsnorm()(x, weight, eps)


def rmsnorm_fn(name: str):
    """The RMSNorm function (x, weight, eps) -> normalised x that layout.rmsnorm names."""
    return {"torch": rmsnorm_torch, "fused": rmsnorm_fused}[name]


# ---------------------------------------------------------------- the seam


@dataclass(frozen=True)
class Kernels:
    """The functions a model computes attention and RMSNorm with, fixed at build time.

    attention(q, k, v) on [batch, heads, seq, head_dim], k and v expanded, causal;
    rmsnorm(x, weight, eps). `Kernels.of` gives the layout's; a builder may pass others
    (dataclasses.replace) to substitute one without touching the model's code.
    """

    attention: Callable
    rmsnorm: Callable

    @classmethod
    def of(cls, attention: str, rmsnorm: str) -> Kernels:
        return cls(attention_fn(attention), rmsnorm_fn(rmsnorm))


# ---------------------------------------------------------------- availability


def check_kernels(attention: str, rmsnorm_kind: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Run each chosen kernel once, forward and backward; raise SpecError if it cannot run."""
    if attention == "flash2":
        try:
            import flash_attn  # noqa: F401
        except Exception as e:
            raise SpecError(
                "layout.attention", f"flash2 needs the flash-attn package (pip install '.[flash]', CUDA only): {e}"
            ) from None
    try:
        q = torch.randn(1, 2, 16, head_dim, device=device, dtype=dtype, requires_grad=True)
        attention_fn(attention)(q, q, q).sum().backward()
    except Exception as e:
        raise SpecError(
            "layout.attention", f"{attention} cannot run on {device.type} with {dtype}: {str(e).splitlines()[0][:160]}"
        ) from None
    try:
        x = torch.randn(4, 32, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(32, device=device, dtype=dtype, requires_grad=True)
        rmsnorm_fn(rmsnorm_kind)(x, w, 1e-5).sum().backward()
    except Exception as e:
        raise SpecError(
            "layout.rmsnorm", f"{rmsnorm_kind} cannot run on {device.type}: {str(e).splitlines()[0][:160]}"
        ) from None


# ---------------------------------------------------------------- this machine, before any launch


def need_of(spec, device_type: str) -> tuple:
    """What a run (a RunSpec) asks of a device: (attention, rmsnorm, device type, precision, head size)."""
    shape = spec.shape()
    return (
        spec.layout.attention,
        spec.layout.rmsnorm,
        device_type,
        "bf16" if spec.workload.precision == "fp8" else spec.workload.precision,  # fp8: attention and norms bf16
        shape.head_dim,
    )


def run_kernels(spec, device: torch.device) -> None:
    """The kernels a run computes with, checked on `device`: what a rank's preflight calls, and
    harness.launch.machine.check_machine for every run before anything launches."""
    _, _, _, precision, head_dim = need_of(spec, device.type)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    check_kernels(spec.layout.attention, spec.layout.rmsnorm, device, dtype, head_dim)


def probe(need: tuple) -> None:
    """check_kernels for one need: (attention, rmsnorm, device type, precision, head size)."""
    attention, rmsnorm, device, precision, head_dim = need
    check_kernels(
        attention, rmsnorm, torch.device(device), torch.bfloat16 if precision == "bf16" else torch.float32, head_dim
    )


def probe_in_child(needs: list[tuple]) -> dict[tuple, tuple[str, str]]:
    """{need: (field, reason)} for the needs that cannot run, tried by `python -m harness.model.kernels`,
    so that the process asking holds no CUDA context (harness.launch.machine.check_machine)."""
    import json
    import subprocess
    import sys

    try:
        out = subprocess.run(
            [sys.executable, "-m", __name__], input=json.dumps(needs), capture_output=True, text=True, timeout=600
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SpecError("workload.device", f"the kernel check on this machine's GPU did not finish: {e}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        raise SpecError("workload.device", f"the kernel check on this machine's GPU failed: {last[:200]}")
    last = (out.stdout.strip().splitlines() or ["[]"])[-1]  # its answer is the last line it prints
    return {tuple(need): (field, reason) for need, field, reason in json.loads(last)}


if __name__ == "__main__":  # the child of probe_in_child: needs as JSON on stdin, failures as JSON on stdout
    import json
    import sys

    failures = []
    for need in json.load(sys.stdin):
        try:
            probe(tuple(need))
        except SpecError as e:
            failures.append([need, e.field, e.reason])
    print(json.dumps(failures))
