"""MXFP8 GEMMs in the linear layers (fp8_recipe mxfp8), through torchao 0.18's MXFP8 linear
(torchao.prototype.moe_training.mxfp8_linear, the op MXFP8TrainingOpConfig dispatches an nn.Linear's matmul to):
every operand of the three GEMMs of a linear (forward, input gradient, weight gradient) cast to e4m3
elements with one e8m0 (power-of-two) scale per block of 32 consecutive elements along the GEMM's
reduction dim, RCEIL rounding of the scale (torchao's MXFP8_RCEIL recipe); harness.model.float8 owns
which linears are converted and dispatches here by recipe.

Blocks of 32 along each reduction dim: a linear's in and out features must be multiples of 32 (the forward
and input-gradient GEMMs reduce over them: float8.align), and the weight-gradient GEMM reduces over the
tokens, which no model width fixes (a micro-batch's, an expert's share of one, none at all). `matmul` pads
the tokens with zero rows to a multiple of 32, as torchao's grouped GEMM pads each expert's token group
(pad_token_groups_for_grouped_mm): a zero row adds nothing to a block's amax nor to the weight gradient,
and its output row is dropped, so the real tokens' blocks, scales and products are those of the unpadded
definition (the last block partial); an empty batch stays empty.

Backend: torchao's EMULATED kernels (the casts in PyTorch, the GEMM on the dequantised values) where no
MXFP8 tensor core is (this CPU; CUDA before compute capability 10.0), its AUTO kernels on Blackwell.
torchao is imported lazily, quietly (harness.model.torchao_quiet).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.measure.ranges import ranged
from harness.model.torchao_quiet import quiet

BLOCK = 32  # MXFP8's scale block (torchao: block_size 32, element e4m3fn, scale e8m0)


@functools.cache
def _torchao():
    """(torchao's MXFP8 matmul, KernelPreference, ScaleCalculationMode), imported once, quietly, with its
    casts ranged (_range_casts)."""
    with quiet():
        import torchao.prototype.moe_training.mxfp8_linear as mx
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference
    _range_casts(mx)
    return mx._to_mxfp8_then_scaled_mm, KernelPreference, ScaleCalculationMode


def _range_casts(mx) -> None:
    """Every cast torchao's MXFP8 matmul makes (its autograd Function mx_mm, forward and backward: an operand to
    e4m3 blocks along dim0 through MXTensor.to_mx, along dim1 through _to_mxfp8_dim1_kernel_wrapper, both looked
    up by these names in mxfp8_linear) inside an FP8_CAST profiler range, as harness.model.float8 ranges
    torchao.float8's, so that a profiled step's breakdown carries the cast time (harness.profiling.analysis).
    The GEMM on the cast operands stays outside the range."""
    tensor = mx.MXTensor

    class RangedMXTensor:
        """mxfp8_linear's MXTensor: mx_mm calls only its to_mx, here inside the range."""

        to_mx = staticmethod(ranged(tensor.to_mx))

    mx.MXTensor = RangedMXTensor
    mx._to_mxfp8_dim1_kernel_wrapper = ranged(mx._to_mxfp8_dim1_kernel_wrapper)


@functools.cache
def backend(device_type: str) -> str:
    """ "auto" (torchao's MXFP8 kernels) on a CUDA device of compute capability 10.0 or later (MXFP8 tensor
    cores), else "emulated" (torchao's EMULATED kernel preference: the same casts, the GEMM on their values)."""
    if device_type == "cuda" and torch.cuda.get_device_capability() >= (10, 0):
        return "auto"
    return "emulated"


def matmul(device_type: str):
    """x @ weight.t() with torchao's MXFP8 autograd function, the tokens padded to whole blocks (module
    docstring); for linears that are not nn.Linear modules (the own engine's sharded Weight) and Linear."""
    mm, kernel, scaling = _torchao()
    preference = kernel.AUTO if backend(device_type) == "auto" else kernel.EMULATED

    def mxfp8_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        pad = -n % BLOCK
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        out = mm(rows, weight, kernel_preference=preference, scale_calculation_mode=scaling.RCEIL)
        return out[:n].reshape(*x.shape[:-1], out.shape[-1])

    return mxfp8_matmul


class Linear(nn.Linear):
    """An nn.Linear whose GEMMs run in MXFP8 (matmul), sharing the converted linear's Parameters (names
    and values kept, as torchao's Float8Linear.from_float does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mm(x, self.weight)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @classmethod
    def from_float(cls, linear: nn.Linear, device_type: str) -> Linear:
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False)
        new.weight = linear.weight
        new.bias = linear.bias
        new.mm = matmul(device_type)
        return new


def convert(module: nn.Module, filter_fn, device_type: str) -> nn.Module:
    """Every linear `filter_fn(module, fqn)` accepts swapped for a Linear (in place; returns `module`),
    by torchao's own module walk (torchao.float8.float8_linear_utils.swap_linear_layers)."""
    with quiet():
        from torchao.float8.float8_linear_utils import swap_linear_layers
    return swap_linear_layers(module, lambda m: Linear.from_float(m, device_type), module_filter_fn=filter_fn)


def linears(module: nn.Module) -> list[nn.Module]:
    """The MXFP8 linears in `module`."""
    return [m for m in module.modules() if isinstance(m, Linear)]
