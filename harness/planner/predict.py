"""One prediction: memory of the worst stage, whether it fits, step time, MFU, and why.

MFU uses the PaLM convention (6P + 12Lhs FLOPs per token, harness.model.flops), the one the
reference study's MFU column uses, against the profile's dense peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.errors import SpecError
from harness.model.flops import flops_per_token
from harness.model.presets import Shape
from harness.planner.hardware import Profile
from harness.planner.layout import ATTENTION_CLASS, Layout, Workload
from harness.planner.memory import GIB, fits, worst_stage_memory
from harness.planner.timing import step_time, theta_from_profile
from harness.spec import RMSNORM_KERNELS

# Megatron's fused scale-mask-softmax runs only when (batch x heads per rank) divides into its
# 4-row blocks and the key length is at most 16384 (FusedScaleMaskSoftmax.is_kernel_available).
FUSED_SOFTMAX_MAX_SEQ = 16384
FLASH_MAX_HEAD_DIM = {"flash1": 128, "flash2": 256}


@dataclass
class Prediction:
    layout: Layout
    fits: bool
    available: bool
    memory_gib: float
    step_time_s: float
    mfu: float
    tokens_per_s: float
    worst_stage: int
    memory_breakdown_gib: dict = field(default_factory=dict)
    time_breakdown_s: dict = field(default_factory=dict)
    why_unavailable: str = ""

    def row(self) -> dict:
        """The JSON object `harness plan --format json` prints per layout."""
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batch_size": lay.micro_batch_size,
                "activation_checkpointing": lay.activation_checkpointing,
                "sequence_parallel": bool(lay.sequence_parallel), "attention": lay.attention,
                "rmsnorm": lay.rmsnorm, "zero": lay.sharding_stage, "fits": bool(self.fits and self.available),
                "memory_gib": round(self.memory_gib, 2), "step_time_s": round(self.step_time_s, 4),
                "mfu": round(self.mfu, 4)}


def kernel_available(shape: Shape, lay: Layout, wl: Workload, prof: Profile) -> str:
    """Empty when the attention kernel can run this layout on this hardware, else why not."""
    if lay.attention not in prof.attention_kernels:
        return f"{lay.attention} is not available on {prof.name}"
    cls = ATTENTION_CLASS[lay.attention]
    if cls == "fused_softmax":
        if (lay.micro_batch_size * shape.heads // lay.tp) % 4 or wl.seq_len > FUSED_SOFTMAX_MAX_SEQ or wl.seq_len % 4:
            return "fused softmax needs micro-batch x heads per rank divisible by 4 and seq <= 16384"
    if cls in FLASH_MAX_HEAD_DIM and shape.hidden // shape.heads > FLASH_MAX_HEAD_DIM[cls]:
        return f"{lay.attention} supports head dim up to {FLASH_MAX_HEAD_DIM[cls]}"
    return ""


def validate(shape: Shape, lay: Layout, wl: Workload) -> None:
    """SpecError for a layout that cannot exist (as opposed to one that does not fit)."""
    if min(lay.tp, lay.pp, lay.dp, lay.micro_batch_size) < 1:
        raise SpecError("layout", "tp, pp, dp and micro_batch_size must be at least 1")
    if lay.pp > shape.layers:
        raise SpecError("layout.pp", f"{lay.pp} pipeline stages for {shape.layers} layers")
    if shape.heads % lay.tp:
        raise SpecError("layout.tp", f"{shape.heads} attention heads are not divisible by tp={lay.tp}")
    if wl.global_batch_size % (lay.dp * lay.micro_batch_size):
        raise SpecError("workload.global_batch_size",
                        f"{wl.global_batch_size} is not divisible by dp x micro-batch = {lay.dp * lay.micro_batch_size}")
    if lay.attention not in ATTENTION_CLASS:
        raise SpecError("layout.attention", f"unknown kernel {lay.attention!r}; known: {', '.join(ATTENTION_CLASS)}")
    if lay.rmsnorm not in RMSNORM_KERNELS:
        raise SpecError("layout.rmsnorm", f"{lay.rmsnorm!r} is not one of {', '.join(RMSNORM_KERNELS)}")


def predict(shape: Shape, layout: Layout, workload: Workload, profile: Profile,
            theta: dict | None = None) -> Prediction:
    """Memory, fit and speed of one layout. `theta` overrides the profile's inverse efficiencies."""
    validate(shape, layout, workload)
    stage, parts = worst_stage_memory(shape, layout, workload)
    t, breakdown = step_time(shape, layout, workload, profile, theta or theta_from_profile(profile))
    tokens = workload.global_batch_size * workload.seq_len
    flops = tokens * flops_per_token(shape, workload.seq_len)["palm"]
    mfu = flops / (t * layout.gpus * profile.peak_flops(workload.dtype_bytes))
    why = kernel_available(shape, layout, workload, profile)
    return Prediction(layout=layout, fits=fits(parts["total"], profile), available=not why,
                      memory_gib=parts["total"] / GIB, step_time_s=t, mfu=mfu, tokens_per_s=tokens / t,
                      worst_stage=stage,
                      memory_breakdown_gib={k: v / GIB for k, v in parts.items() if k != "params"},
                      time_breakdown_s=breakdown, why_unavailable=why)
