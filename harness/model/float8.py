"""FP8 GEMMs in the linear layers, through torchao.float8 (precision fp8; the policy itself is
harness/model/training.py's PrecisionPolicy): which linears are converted, the torchao config
of a recipe, the backend this machine runs the FP8 matmul with, and the conversion. The recipe
mxfp8 (block-scaled, torchao's MXFP8 linear) is harness/model/mxfp8.py's, dispatched from here.

torchao is imported here and in mxfp8.py only, lazily (a run that asks for no FP8 never imports it), with its
import-time noise silenced: on a CPU-only or older-torch machine it logs failed loads of its CUDA
extensions, which the FP8 training path does not use (float8 is pure PyTorch over torch._scaled_mm).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn

from harness.measure.ranges import FP8_CAST, ranged
from harness.model.torchao_quiet import quiet as _quiet

ALIGN = 16  # torch._scaled_mm: both dims of each FP8 operand a multiple of 16
MXFP8 = "mxfp8"  # the block-scaled recipe (harness/model/mxfp8.py); the others are Float8LinearConfig's
# torchao's Float8LinearRecipeName.ROWWISE_WITH_GW_HP (torchtitan's recipe_name "rowwise_with_gw_hp"): rowwise
# scales forward and for the input gradient, the weight gradient in high precision (_FusedWeightGradient)
GW_HP = "rowwise_with_gw_hp"
HEAD_NAME = "output"  # the LM head (harness.model.llama.Llama.output)
# a MoE's router: harness.model.moe.MoEFeedForward.router, DeepSpeed's TopKGate.wg (deepspeed/experts.py)
ROUTER_NAMES = ("router", "wg")


@functools.cache
def torchao_float8():
    """torchao.float8, imported once, quietly."""
    with _quiet():
        import torchao.float8 as f8
        import torchao.float8.float8_linear  # noqa: F401  (matmul_with_hp_or_float8_args)
        import torchao.float8.fsdp_utils  # noqa: F401
    linear = f8.float8_linear
    linear.hp_tensor_to_float8_dynamic = _ranged(linear.hp_tensor_to_float8_dynamic)
    linear.matmul_with_hp_or_float8_args = _EmptySafe(linear.matmul_with_hp_or_float8_args)
    return f8


class _EmptySafe:
    """torchao's FP8 matmul (the autograd Function every Float8Linear and `matmul` below calls, by this
    name in float8_linear), made to take an empty input: a mixture of experts runs each held expert on
    exactly its tokens, none in some micro-batches (harness.model.moe.run_experts), and a dynamic scale is
    the amax of the tensor, which an empty one has not (torch.max refuses it). No token, no cast: the
    product of an empty batch is computed in the input's precision, empty, and the weight's gradient
    from it zeros, exactly what the FP8 path would give; any other input takes torchao's path unchanged.
    A weight FSDP2 all-gathered in FP8 (fp8_all_gather: a Float8TrainingTensor, which multiplies only with
    another) is dequantised first, its gradient passed through (torchao's to_original_precision)."""

    def __init__(self, function):
        self.function = function

    def apply(self, x: torch.Tensor, weight_t: torch.Tensor, *configs):
        if x.numel() == 0:
            to_hp = getattr(weight_t, "to_original_precision", None)
            return x @ (to_hp() if to_hp is not None else weight_t).to(x.dtype)
        weight = weight_t._base if weight_t._base is not None else weight_t
        if getattr(weight, "main_grad", None) is not None and _high_precision_weight_gradient(configs[-1]):
            return _FusedWeightGradient.apply((self.function, weight), x, weight_t, *configs)
        return self.function.apply(x, weight_t, *configs)


def _high_precision_weight_gradient(cfg) -> bool:
    """Whether a Float8LinearConfig leaves both operands of the weight gradient's GEMM uncast (GW_HP's)."""
    disabled = torchao_float8().float8_linear.ScalingType.DISABLED
    return (
        cfg.cast_config_input_for_grad_weight.scaling_type is disabled
        and cfg.cast_config_grad_output_for_grad_weight.scaling_type is disabled
    )


class _FusedWeightGradient(torch.autograd.Function):
    """A high-precision weight gradient accumulated in fp32 into the weight's fp32 main gradient, Megatron's
    gradient_accumulation_fusion (its wgrad GEMM adds into weight.main_grad with fp32 accumulation and flags
    grad_added_to_main_grad, so that the gradient hook adds nothing more). Engines that keep a main gradient
    per parameter (the reference's MasterWeights, the own engine's buckets) set `main_grad` on the parameters
    under a policy that fuses (PrecisionPolicy.fuses_weight_gradient). Why: torchao computes GW_HP's weight
    gradient as one bf16 product over the GEMM's tokens, so the same tokens split over two GEMMs (an expert's
    batch under ep holds two micro-batches) round differently; summed in fp32 they differ only in the order
    of fp32 additions. Forward and the input gradient are torchao's own (its backward also forms the bf16
    weight gradient, which is dropped: torchao offers no backward without it). `given`: torchao's autograd Function
    (matmul_with_hp_or_float8_args), whose forward and backward run on this Function's ctx, and the Parameter
    (held here: a saved view unpacked in backward, under saved-tensor hooks, has another base)."""

    @staticmethod
    def forward(ctx, given, x, weight_t, *configs):
        ctx.torchao, ctx.weight = given
        return ctx.torchao.forward(ctx, x, weight_t, *configs)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, _, *rest = ctx.torchao.backward(ctx, grad_output)
        x, weight_t = ctx.saved_tensors
        weight = ctx.weight
        g2 = grad_output.reshape(-1, grad_output.shape[-1]).float()
        weight.main_grad.addmm_(g2.t(), x.reshape(-1, x.shape[-1]).float())  # [out, in], fp32 accumulation
        weight.grad_added_to_main_grad = True
        # a gradient must still arrive for the engines' hooks (they skip the add on the flag): a zero, not stored
        zero = torch.zeros((), dtype=weight_t.dtype, device=weight_t.device).expand_as(weight_t)
        return (None, grad_input, zero, *rest)


def _ranged(cast):
    """torchao's dynamic cast (every cast its float8 matmul makes, forward and backward, goes through
    this name in float8_linear) inside an FP8_CAST profiler range, so that a profiled step says how much
    of its compute the casts took (harness.profiling.analysis); a record_function costs microseconds."""
    return ranged(cast, FP8_CAST)


@functools.cache
def backend(device_type: str) -> str:
    """How FP8 matmuls run on `device_type`: "scaled_mm" (torch._scaled_mm, the real FP8 GEMM) where
    torch offers it for e4m3 x e4m3 on that device (probed once), else "emulated" (torchao's emulate:
    the FP8 values upcast and multiplied in high precision). On CUDA torch._scaled_mm is the path
    (a GPU without FP8 tensor cores fails in it, loudly, not silently emulated)."""
    if device_type == "cuda":
        return "scaled_mm"
    try:
        a = torch.ones(ALIGN, ALIGN, device=device_type).to(torch.float8_e4m3fn)
        b = torch.ones(ALIGN, ALIGN, device=device_type).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device_type)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, AttributeError):
        return "emulated"
    return "scaled_mm"


def align(recipe: str) -> int:
    """What a converted linear's in and out features must be multiples of under `recipe`: torch._scaled_mm's
    16, or MXFP8's scale block (32) along each GEMM's reduction dim."""
    if recipe == MXFP8:
        from harness.model import mxfp8

        return mxfp8.BLOCK
    return ALIGN


def recipe_backend(recipe: str, device_type: str) -> str:
    """How this machine runs `recipe`'s GEMMs: backend() for torchao.float8's, mxfp8.backend() for MXFP8's."""
    if recipe == MXFP8:
        from harness.model import mxfp8

        return mxfp8.backend(device_type)
    return backend(device_type)


def config(recipe: str, device_type: str, fsdp_all_gather: bool = False):
    """torchao's Float8LinearConfig for `recipe` (Float8LinearConfig.from_recipe_name), emulated where
    backend() says so, with FSDP2's FP8 all-gather when asked (tensorwise only: torchao's weight
    wrapper casts with one dynamic scale per tensor)."""
    f8 = torchao_float8()
    cfg = f8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(
        cfg, emulate=backend(device_type) == "emulated", enable_fsdp_float8_all_gather=fsdp_all_gather
    )


def converts(module: nn.Module, fqn: str, multiple: int = ALIGN) -> bool:
    """Which linears run their GEMMs in FP8 (torchtitan's float8 converter's filter):

    - not the LM head: its output is the logits, whose softmax cross-entropy over the whole vocabulary
      needs more than e4m3's 3 mantissa bits (torchtitan's Float8 converter leaves `output` out too);
    - not a MoE's router (torchtitan's filter leaves `router.gate` out): routing is in fp32 in every
      engine (its logits through F.linear on the fp32 weight, harness.model.moe.route), so a converted
      router would be a Float8Linear whose FP8 forward never runs; an e4m3 logit would move top-k choices;
    - only linears whose in and out features are multiples of 16 (`multiple`: align(recipe)): torch._scaled_mm
      (cuBLASLt's FP8 GEMM) needs both dims of each FP8 operand divisible by 16 (MXFP8: by its block, 32),
      and padding them would change the GEMM's shape from the one the reference and the planner count.
    Attention's core and the norms are no linears: they stay in bf16.
    """
    return (
        isinstance(module, nn.Linear)
        and fqn.split(".")[-1] not in (HEAD_NAME, *ROUTER_NAMES)
        and module.in_features % multiple == 0
        and module.out_features % multiple == 0
    )


def convert(module: nn.Module, recipe: str, device_type: str, fsdp_all_gather: bool = False) -> nn.Module:
    """torchao's convert_to_float8_training over `module` (in place; returns it): every linear
    `converts` accepts becomes a Float8Linear sharing its weight Parameter (names and values kept); under
    mxfp8 an MXFP8 linear (harness.model.mxfp8.Linear), the same way (no FP8 all-gather: the spec refuses it)."""
    if recipe == MXFP8:
        from harness.model import mxfp8

        return mxfp8.convert(module, functools.partial(converts, multiple=mxfp8.BLOCK), device_type)
    f8 = torchao_float8()
    return f8.convert_to_float8_training(
        module, config=config(recipe, device_type, fsdp_all_gather), module_filter_fn=converts
    )


def float8_linears(module: nn.Module) -> list[nn.Module]:
    """The converted linears in `module`: torchao's Float8Linear and the MXFP8 linears."""
    from harness.model import mxfp8

    f8 = torchao_float8()
    return [m for m in module.modules() if isinstance(m, (f8.float8_linear.Float8Linear, mxfp8.Linear))]


def matmul(recipe: str, device_type: str):
    """x @ weight.t() with torchao's FP8 autograd function (matmul_with_hp_or_float8_args: dynamic
    casts of the input, the weight and, in backward, the output gradient), for linears that are not
    nn.Linear modules (the own engine's sharded Weight). Its configs are a Float8Linear's own, built by
    torchao from `recipe` on a meta Linear, so the matmul is exactly what a converted nn.Linear runs
    (mxfp8: harness.model.mxfp8.matmul, the one its Linear runs)."""
    if recipe == MXFP8:
        from harness.model import mxfp8

        return mxfp8.matmul(device_type)
    f8 = torchao_float8()
    with torch.device("meta"):
        linear = nn.Linear(ALIGN, ALIGN, bias=False)
        template = f8.float8_linear.Float8Linear.from_float(linear, config(recipe, device_type))
    mm, mm_config, cfg = f8.float8_linear.matmul_with_hp_or_float8_args, template.linear_mm_config, template.config

    def fp8_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return mm.apply(x, weight.t(), mm_config, cfg)

    return fp8_matmul


def precompute_fsdp_scales(module: nn.Module) -> None:
    """torchao's precompute_float8_dynamic_scale_for_fsdp: one all-reduce of every FP8-all-gathered
    weight's amax, the scales its next all-gather casts with (torchtitan calls it after each step); once per
    mesh the weights are sharded over (torchao stacks their amaxes into one DTensor, which takes one mesh: under
    expert parallelism the experts' is dp_mod_ep, the rest's dp, harness/frameworks/fsdp/experts.py)."""
    by_mesh: dict = {}
    for m in float8_linears(module):
        mesh = getattr(m.weight, "device_mesh", None)
        if mesh is not None:
            by_mesh.setdefault(mesh, []).append(m)
    for linears in by_mesh.values():
        torchao_float8().precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(linears))


def fsdp_scale_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The precomputed scales FSDP2's FP8 all-gather keeps on each weight between steps (one fp32 scalar
    per converted weight, on each rank): what persists of FP8 at the optimizer step under fp8_all_gather."""
    out = []
    for m in float8_linears(module):
        local = getattr(m.weight, "_local_tensor", m.weight)
        scale = getattr(local, "_precomputed_scale", None)
        if scale is not None:
            out.append(scale)
    return out
