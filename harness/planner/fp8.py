"""FP8 training as the engines run it (PlannerLayout.precision "fp8"): which GEMMs run in FP8, the HBM
bytes of the casts to FP8, and the FP8 copies of weights a rank holds. One place for features.py (time),
timing.py (FSDP's all-gather) and memory_engines.py (memory).

What runs in FP8. torchao's convert_to_float8_training (engines own, deepspeed, fsdp, single; torchtitan's
Float8 converter) swaps each block's nn.Linear for Float8Linear: wq, wk, wv, wo, w1, w3, w2 of
harness/model/llama.py, each casting its own input. The LM head stays bf16: torchtitan's float8 config
filters the `output` module (filter_fqns), and Megatron-core's output layer is its own
ColumnParallelLinear, outside Transformer Engine's modules. Attention (flash, bf16), norms, SwiGLU,
embedding, loss and optimizer are unchanged. Megatron (Transformer Engine, "current scaling") fuses
q/k/v and w1/w3 into one GEMM each (LayerNormLinear), so it casts those inputs once.

Cast bytes, per element of a GEMM operand, forward + backward, B the bf16 bytes: torchao's roofline of
its own recipes (torchao/testing/training/roofline_utils.py, get_tensor_memory_traffic_ovhd_s, a cast
not fused with the op before it):
  tensorwise  activation (a linear's input, its output gradient): amax read (B), one read writing fp8
              row- and column-major (B + 2): 2B + 2.  weight: amax (B), forward cast (B + 1),
              backward cast (B + 1): 3B + 2.
  rowwise     activation: a read writing fp8 dim0 and a bf16 transpose (2B + 1), the transpose's cast
              (B + 1): 3B + 2.  weight: forward cast (B + 1), transpose (2B), its cast (B + 1): 4B + 2.
  rowwise_with_gw_hp  activation: one read writing fp8 dim0 (B + 1), no transpose (the weight gradient's GEMM
              takes the bf16 operands).  weight: forward cast (B + 1), backward tensorwise cast (B + 1): 2B + 2.
              Its weight-gradient GEMM is bf16 (torchao's roofline: gemm_dtype_grad_weight), which features.py
              does not model: it times every GEMM of an fp8 layout at gemm_fp8 (RECIPE is tensorwise).
  mxfp8       every operand cast along dim0 and along dim1 (torchao's mxfp8_cublas: two kernels, each a
              bf16 read and an fp8 write, the e8m0 scales, 1 byte per 32, left out as torchao does): 2B + 2.
FP8 all-gather under FSDP2 (torchao fsdp_utils.WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather):
the local shard is cast before each all-gather (B + 1 per shard element, the scales precomputed once a
step by precompute_float8_dynamic_scale_for_fsdp: an amax read, B), and the gathered fp8 weight serves
forward and backward. Transformer Engine casts a weight once per step into fp8 and its transpose
(Megatron passes is_first_microbatch; amax B, read B, two fp8 writes: 2B + 2) and keeps both.

What is saved for backward. torchao's matmul_with_hp_or_float8_args saves the bf16 input and weight
(ctx.save_for_backward(input_hp, weight_hp_t)) and casts them again in backward: the activations a
layer keeps are bf16's; only the fp8 operands of the linear running backward exist above them
(backward_operand_bytes). Transformer Engine keeps fp8 weight copies (2 bytes per linear parameter,
weight_copy_bytes) and saves its linears' inputs as the fp8 casts it computed (te.Linear and
LayerNormLinear save inputmat / ln_out in fp8 under fp8 autocast), not in bf16: saved_input_saving.
Scales: one fp32 per cast tensor (tensorwise), counted.
"""

from __future__ import annotations

import functools

from harness.model.presets import Shape
from harness.planner.layout import PlannerLayout

# The recipe the planner's "fp8" stands for: torchao's and torchtitan's default (Float8LinearConfig),
# and per-tensor like Transformer Engine's current scaling (FP8-CS). benchmarks/plan_fp8_pairs.py sets it
# to rowwise for torchao's rowwise row (its casts; the GEMMs keep gemm_fp8, there is no rowwise efficiency).
RECIPE = "tensorwise"
# bytes per element, forward + backward, as functions of the bf16 bytes B (module docstring)
CAST_BYTES = {
    "tensorwise": {"activation": lambda B: 2 * B + 2, "weight": lambda B: 3 * B + 2},
    "rowwise": {"activation": lambda B: 3 * B + 2, "weight": lambda B: 4 * B + 2},
    "rowwise_with_gw_hp": {"activation": lambda B: B + 1, "weight": lambda B: 2 * B + 2},
    "mxfp8": {"activation": lambda B: 2 * B + 2, "weight": lambda B: 2 * B + 2},
}
SCALE_BYTES = 4  # one fp32 scale per cast tensor (tensorwise)
CASTS_PER_LINEAR = 6  # input, weight, grad output: forward and backward copies


def fused(engine: str) -> bool:
    """Whether the engine fuses q/k/v and w1/w3 into one linear (Transformer Engine under Megatron)."""
    return engine == "megatron"


@functools.lru_cache(maxsize=256)
def linears(shape: Shape, tp: int, is_fused: bool = False) -> tuple[tuple[float, float], ...]:
    """(N, K) of each FP8 linear of one layer on one tensor-parallel rank (M = the tokens): output and
    input width. Unfused, as harness/model/llama.py (and torchtitan) build them; fused, as Megatron with
    Transformer Engine does. The GEMM FLOPs are the same either way."""
    h, f, t = shape.hidden, shape.ffn, tp
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim  # query width: heads x head_dim
    if is_fused:
        return ((q + 2 * kv) / t, h), (h, q / t), (2 * f / t, h), (h, f / t)
    return (q / t, h), (kv / t, h), (kv / t, h), (h, q / t), (f / t, h), (f / t, h), (h, f / t)


def weight_elements(shape: Shape, tp: int) -> float:
    """Elements of one layer's FP8 linear weights on a tensor-parallel rank."""
    return sum(N * K for N, K in linears(shape, tp))


def activation_cast_bytes(shape: Shape, lay: PlannerLayout, n: float, B: int, recipe: str | None = None) -> float:
    """HBM bytes of one layer's activation casts for one micro-batch of n tokens (forward + backward):
    each linear's input (n x K) and output gradient (n x N); `recipe` RECIPE unless given."""
    per = CAST_BYTES[recipe or RECIPE]["activation"](B)
    return per * n * sum(N + K for N, K in linears(shape, lay.tp, fused(lay.engine)))


def weight_cast_bytes(shape: Shape, lay: PlannerLayout, micro_batches: int, B: int, recipe: str | None = None) -> float:
    """HBM bytes of one layer's weight casts, per micro-batch: every forward and backward (torchao), once
    per all-gather of the shard (FSDP2's fp8 all-gather: forward, and backward when resharded after
    forward, plus the step's amax; tensorwise only), or once per step (Transformer Engine)."""
    recipe = recipe or RECIPE
    w = weight_elements(shape, lay.tp)
    if lay.engine == "megatron":
        return (2 * B + 2) * w / micro_batches
    if lay.fsdp and recipe == "tensorwise":
        gathers = 2 if lay.reshard_after_forward else 1
        return (gathers * (B + 1) + B / micro_batches) * w / lay.replicas
    return CAST_BYTES[recipe]["weight"](B) * w


def backward_operand_bytes(shape: Shape, lay: PlannerLayout, n: float) -> float:
    """The largest set of fp8 operands of one linear's backward (torchao): its output gradient row- and
    column-major (2 n N), the weight (N K) and the input (n K), one byte each, and their scales."""
    return max(2 * n * N + N * K + n * K for N, K in linears(shape, lay.tp, fused(lay.engine))) + 4 * SCALE_BYTES


def scale_bytes(shape: Shape, lay: PlannerLayout, layers: int) -> float:
    """The fp32 scales a stage's FP8 linears hold (negligible: counted so the census can say so)."""
    return layers * len(linears(shape, lay.tp, fused(lay.engine))) * CASTS_PER_LINEAR * SCALE_BYTES


def weight_copy_bytes(shape: Shape, lay: PlannerLayout, layers: int) -> float:
    """FP8 weight copies held through the step: Transformer Engine's fp8 weight and its transpose (2 bytes
    per linear parameter); torchao keeps none (it casts per use, or gathers fp8 under FSDP2)."""
    return 2.0 * layers * weight_elements(shape, lay.tp) if lay.engine == "megatron" else 0.0


def gathered_block_saving(shape: Shape, lay: PlannerLayout, B: int) -> float:
    """Bytes per gathered block that FSDP2's fp8 all-gather saves against the compute dtype: its linear
    weights arrive in fp8 (1 byte), the norms in B. torchao gathers fp8 under tensorwise scaling only."""
    return (B - 1) * weight_elements(shape, lay.tp) if lay.fsdp and RECIPE == "tensorwise" else 0.0


def saved_input_saving(shape: Shape, lay: PlannerLayout, n: float, B: int) -> float:
    """Bytes of one layer's saved activations that Transformer Engine keeps in fp8 rather than B (engine
    megatron under fp8): the inputs of QKV, FC1 and FC2, QKV's and FC1's the normalised hidden state
    (sharded over tp under sequence parallelism), FC2's SwiGLU's output; torchao saves them in bf16
    (nothing saved). The projection's input is the attention output, which the attention kernel
    keeps in B for its own backward: its fp8 copy is saved beside it (a negative saving)."""
    if lay.engine != "megatron" or lay.precision != "fp8":
        return 0.0
    t = lay.tp
    sp = t if lay.sequence_parallel and t > 1 else 1
    return (B - 1) * n * (2 * shape.hidden / sp + shape.ffn / t) - n * shape.heads * shape.head_dim / t
