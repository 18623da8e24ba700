"""One prediction: memory of the worst stage, whether it fits, step time, MFU, and why.

MFU uses the PaLM convention (6P + 12Lhs FLOPs per token, harness.model.flops), the one the
reference study's MFU column uses (for a mixture of experts P is the active parameters: 6 x active
parameters per token plus attention, as Megatron and DeepSeek report MoE MFU), against the profile's
dense peak (BF16's under fp8 too, as torchtitan reports it: MFU then ranks layouts of both precisions
as tokens/s does).
"""

from __future__ import annotations

import dataclasses
import gc
import operator
from dataclasses import dataclass, field

from harness.errors import SpecError
from harness.model.flops import flops_per_token
from harness.model.presets import Shape
from harness.planner import feedforward, schedules
from harness.planner.hardware import Profile
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PRECISIONS, PlannerLayout, Workload
from harness.planner.memory import FRAGMENTATION, GIB, fits, worst_stage_memory
from harness.planner.timing import step_time, theta_from_profile
from harness.spec import CP_IMPLS, RMSNORM_KERNELS

# Megatron's fused scale-mask-softmax runs only when (batch x heads per rank) divides into its
# 4-row blocks and the key length is at most 16384 (FusedScaleMaskSoftmax.is_kernel_available).
FUSED_SOFTMAX_MAX_SEQ = 16384
FLASH_MAX_HEAD_DIM = {"flash1": 128, "flash2": 256, "flash3": 256}


@dataclass
class Prediction:
    layout: PlannerLayout
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
    # fits, but within the allocator's margin of the device (tight_fit): may not fit
    tight: bool = False

    def row(self) -> dict:
        """The JSON object `harness plan --format json` prints per layout."""
        lay = self.layout
        return {
            "tp": lay.tp,
            "cp": lay.cp,
            "cp_impl": lay.cp_impl if lay.cp > 1 else None,
            "pp": lay.pp,
            "pipeline_schedule": lay.pipeline_schedule if lay.pp > 1 else None,
            "virtual_stages": schedules.chunks(lay.pipeline_schedule, lay.virtual_stages) if lay.pp > 1 else 1,
            "dp": lay.dp,
            "ep": lay.ep,
            "micro_batch_size": lay.micro_batch_size,
            "activation_checkpointing": lay.activation_checkpointing,
            "sequence_parallel": bool(lay.sequence_parallel),
            "attention": lay.attention,
            "rmsnorm": lay.rmsnorm,
            "zero": lay.sharding_stage,
            "precision": lay.precision,
            "compile": lay.compile,
            "dp_shard": lay.shard_group if lay.fsdp else None,  # ranks per sharding group (fsdp)
            "fits": bool(self.fits and self.available),
            "within_allocator_margin": bool(self.tight),
            "memory_gib": round(self.memory_gib, 2),
            "step_time_s": round(self.step_time_s, 4),
            "mfu": round(self.mfu, 4),
        }


def kernel_available(shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile) -> str:
    """Empty when the attention kernel can run this layout on this hardware, else why not."""
    if lay.precision == "fp8" and not prof.fp8:
        return f"{prof.name} has no FP8 tensor cores (its profile says fp8: false)"
    if lay.attention not in prof.attention_kernels:
        return f"{lay.attention} is not available on {prof.name}"
    cls = ATTENTION_CLASS[lay.attention]
    if cls == "fused_softmax":
        if (lay.micro_batch_size * shape.heads // lay.tp) % 4 or wl.seq_len > FUSED_SOFTMAX_MAX_SEQ or wl.seq_len % 4:
            return "fused softmax needs micro-batch x heads per rank divisible by 4 and seq <= 16384"
    if cls in FLASH_MAX_HEAD_DIM and shape.head_dim > FLASH_MAX_HEAD_DIM[cls]:
        return f"{lay.attention} supports head dim up to {FLASH_MAX_HEAD_DIM[cls]}"
    return ""


# The margin of the device a prediction that fits must leave to be trusted to fit: the caching
# allocator's fragmentation as the memory model takes it without a pipeline (memory_terms.FRAGMENTATION,
# the low end of the reserved/allocated ratios of 1.05-1.3 it cites), here taken of the whole device.
# The prediction counts fragmentation on the dynamic memory only, and the stranded blocks it can name
# (memory_reserve.py: its total holds them); a layout within this margin of the device is one that a little more
# fragmentation (or a term the model does not hold) pushes out.
ALLOCATOR_MARGIN = FRAGMENTATION


def tight_fit(total_bytes: float, profile: Profile) -> bool:
    """Whether a total that fits lies within ALLOCATOR_MARGIN of the device's memory."""
    device = profile.memory_gib * GIB
    return (1 - ALLOCATOR_MARGIN) * device < total_bytes <= device


def validate(shape: Shape, lay: PlannerLayout, wl: Workload) -> None:
    """SpecError for a layout that cannot exist (as opposed to one that does not fit)."""
    if min(lay.tp, lay.cp, lay.pp, lay.dp, lay.micro_batch_size) < 1:
        raise SpecError("layout", "tp, cp, pp, dp and micro_batch_size must be at least 1")
    if lay.cp > 1 and wl.seq_len % (2 * lay.cp):
        raise SpecError("layout.cp", f"seq_len {wl.seq_len} is not divisible by 2 x cp = {2 * lay.cp}")
    if lay.cp > 1 and lay.cp_impl not in CP_IMPLS:
        raise SpecError("layout.cp_impl", f"{lay.cp_impl!r} is not one of {', '.join(CP_IMPLS)}")
    if lay.dp_shard and not lay.fsdp:
        raise SpecError("layout.dp_shard", "sharding groups (HSDP) are engine fsdp's: 0 under the others")
    if lay.dp_shard < 0 or lay.dp_shard and lay.replicas % lay.dp_shard:
        raise SpecError("layout.dp_shard", f"{lay.dp_shard} does not divide dp x cp = {lay.replicas}")
    if lay.dp_shard and lay.ep > 1 and lay.dp_shard % lay.ep:
        raise SpecError("layout.dp_shard", f"ep={lay.ep} does not divide the sharding group of {lay.dp_shard} ranks")
    if shape.moe and lay.engine == "paper":
        raise SpecError("--engine", "paper: the study's engine ran no mixture of experts; plan it under another engine")
    if lay.ep > 1 and not shape.moe:
        raise SpecError("layout.ep", f"ep={lay.ep} needs a mixture-of-experts model")
    if shape.experts % lay.ep:
        raise SpecError("layout.ep", f"{shape.experts} experts are not divisible by ep={lay.ep}")
    feedforward.expert_data_parallel(lay.dims)  # ep divides dp x cp
    if lay.pp > shape.layers:
        raise SpecError("layout.pp", f"{lay.pp} pipeline stages for {shape.layers} layers")
    if shape.heads % lay.tp:
        raise SpecError("layout.tp", f"{shape.heads} attention heads are not divisible by tp={lay.tp}")
    if wl.global_batch_size % (lay.dp * lay.micro_batch_size):
        raise SpecError(
            "workload.global_batch_size",
            f"{wl.global_batch_size} is not divisible by dp x micro-batch = {lay.dp * lay.micro_batch_size}",
        )
    if lay.attention not in ATTENTION_CLASS:
        raise SpecError("layout.attention", f"unknown kernel {lay.attention!r}; known: {', '.join(ATTENTION_CLASS)}")
    if lay.rmsnorm not in RMSNORM_KERNELS:
        raise SpecError("layout.rmsnorm", f"{lay.rmsnorm!r} is not one of {', '.join(RMSNORM_KERNELS)}")
    if lay.precision not in PRECISIONS:
        raise SpecError("precision", f"{lay.precision!r} is not one of {', '.join(PRECISIONS)}")


# By the shape's id, not its hash (hashing a Shape costs more than a prediction's arithmetic; a plan asks
# once per layout); each entry holds its shape, so an id in here is never another shape's.
_FLOPS: dict[tuple[int, int], tuple[Shape, float]] = {}


def _palm_flops_per_token(shape: Shape, seq_len: int) -> float:
    hit = _FLOPS.get((id(shape), seq_len))
    if hit is None:
        if len(_FLOPS) >= 256:
            _FLOPS.clear()
        hit = _FLOPS[(id(shape), seq_len)] = (shape, flops_per_token(shape, seq_len)["palm"])
    return hit[1]


def predict(
    shape: Shape,
    layout: PlannerLayout,
    workload: Workload,
    profile: Profile,
    theta: dict | None = None,
    layer_cache: dict | None = None,
    memory_cache: dict | None = None,
) -> Prediction:
    """Memory, fit and speed of one layout. `theta` overrides the profile's inverse efficiencies;
    `layer_cache` (timing.step_time) and `memory_cache` (memory_key) are for callers predicting
    many layouts of one shape, workload and profile."""
    validate(shape, layout, workload)
    if memory_cache is None:
        memory = _memory(shape, layout, workload, profile)
    else:
        mkey = memory_key(layout)
        memory = memory_cache.get(mkey)
        if memory is None:
            memory = memory_cache[mkey] = _memory(shape, layout, workload, profile)
    stage, total, breakdown_gib, fit, tight = memory
    t, breakdown = step_time(
        shape, layout, workload, profile, theta or theta_from_profile(profile), layer_cache, memory_bytes=total
    )
    tokens = workload.global_batch_size * workload.seq_len
    flops = tokens * _palm_flops_per_token(shape, workload.seq_len)
    mfu = flops / (t * layout.gpus * profile.peak_flops(workload.dtype_bytes))
    why = kernel_available(shape, layout, workload, profile)
    return Prediction(
        layout=layout,
        fits=fit,
        available=not why,
        memory_gib=total / GIB,
        step_time_s=t,
        mfu=mfu,
        tokens_per_s=tokens / t,
        worst_stage=stage,
        memory_breakdown_gib=breakdown_gib,
        time_breakdown_s=breakdown,
        why_unavailable=why,
        tight=tight,
    )


def _memory(shape: Shape, layout: PlannerLayout, workload: Workload, profile: Profile) -> tuple:
    """(worst stage, its total bytes, its breakdown in GiB, fits, tight_fit): what a prediction takes of
    memory.py, once per memory_key in predict_many (layouts sharing it share the breakdown's dict)."""
    stage, parts = worst_stage_memory(shape, layout, workload)
    total = parts["total"]
    gib = {k: v / GIB for k, v in parts.items() if k != "params"}
    return stage, total, gib, fits(total, profile), tight_fit(total, profile)


# One kernel per cost class stands for the others: memory.py and timing.py read the attention
# kernel only through ATTENTION_CLASS, so kernels of one class predict identically (only whether
# the kernel is available differs).
CLASS_REPRESENTATIVE = {
    cls: next(k for k in ATTENTION_CLASS if ATTENTION_CLASS[k] == cls)
    for cls in dict.fromkeys(ATTENTION_CLASS.values())
}


# A layout's field values but its attention kernel as a tuple, at C speed (attrgetter): the caches' keys
# below read the fields only (not whatever else an instance's __dict__ holds).
FIELDS = tuple(f.name for f in dataclasses.fields(PlannerLayout))
_BUT_ATTENTION = operator.attrgetter(*(f for f in FIELDS if f != "attention"))


def memory_key(layout: PlannerLayout, fields: tuple | None = None) -> tuple:
    """Layouts whose memory is the same: memory.py tells attention kernels apart only by whether
    they materialise the score matrix (naive, fused_softmax) or not (every flash-style kernel keeps
    no s x s tensor); tests/test_plan_output.py checks it on every engine."""
    att = layout.attention if ATTENTION_CLASS.get(layout.attention) in MATERIALISED else "flash"
    return (att, _BUT_ATTENTION(layout) if fields is None else fields)  # `fields`: _BUT_ATTENTION's, when read


def prediction_key(layout: PlannerLayout) -> PlannerLayout:
    """The layout whose prediction stands for `layout`: its attention kernel replaced by the first
    kernel of its cost class."""
    cls = ATTENTION_CLASS.get(layout.attention)  # an unknown kernel is left to predict()'s check
    rep = CLASS_REPRESENTATIVE[cls] if cls else layout.attention
    return layout if rep == layout.attention else dataclasses.replace(layout, attention=rep)


def _same_rate_classes(theta: dict) -> dict[str, str]:
    """Flash-style cost classes whose rate under theta is another's: the same formula at the same
    efficiency (features.attention_features), so the same prediction; each mapped to the first such
    class (on A100 the flash3 class, cuDNN's attention, runs at FlashAttention-2's assumed rate)."""
    out: dict[str, str] = {}
    first: dict[float, str] = {}
    for cls in CLASS_REPRESENTATIVE:
        if cls in MATERIALISED or cls not in theta:
            continue
        out[cls] = first.setdefault(theta[cls], cls)
    return out


def predict_many(
    shape: Shape, layouts, workload: Workload, profile: Profile, theta: dict | None = None
) -> list[Prediction]:
    """predict() for every layout, computing each cost class once (`harness plan` over thousands
    of layouts must answer in well under a second); the same Predictions as one call each: a layout
    whose key (its fields, the attention kernel as its rate class) was predicted is that prediction
    with its own layout and availability (kernel_available reads the kernel, micro-batch, tp and
    precision only: remembered by those). The distinct layouts' memory and step time are computed
    together, over numpy arrays (memory_batch.py, timing_batch.py: the scalar models' terms, combined
    per layout as they combine them; tests/test_memory_batch.py and test_timing_batch.py hold them equal)."""
    paused = gc.isenabled()
    if paused:  # the collector's passes over the growing list cost a tenth of a plan: nothing here is cyclic
        gc.disable()
    try:
        return _predict_many(shape, layouts, workload, profile, theta)
    finally:
        if paused:
            gc.enable()


def _predict_many(shape: Shape, layouts, workload: Workload, profile: Profile, theta: dict | None) -> list:
    theta = theta or theta_from_profile(profile)
    same = _same_rate_classes(theta)
    rate_class: dict[str, str] = {}  # attention kernel -> the class that stands for it in the key
    layouts = list(layouts)
    index, stand_ins = [], {}  # each layout's prediction (its index in stand_ins); the layout predicted per key
    for lay in layouts:
        att = lay.attention
        cls = rate_class.get(att)
        if cls is None:
            cls = ATTENTION_CLASS.get(att, att)
            cls = rate_class[att] = same.get(cls, cls)
        fields = _BUT_ATTENTION(lay)
        key = (cls, fields)
        entry = stand_ins.get(key)
        if entry is None:
            rep = CLASS_REPRESENTATIVE.get(cls, att)
            stand_in = lay if rep == att else dataclasses.replace(lay, attention=rep)
            entry = stand_ins[key] = (len(stand_ins), stand_in, fields)
        index.append(entry[0])
    why_cache: dict = {}
    predicted = _predict_all(shape, list(stand_ins.values()), workload, profile, theta, why_cache)
    out = []
    for lay, i in zip(layouts, index, strict=True):
        base = predicted[i]
        att = lay.attention
        if base.layout is lay or base.layout.attention == att:  # the key holds every other field: an equal layout
            out.append(base)
            continue
        wkey = (att, lay.micro_batch_size, lay.tp, lay.precision)
        why = why_cache.get(wkey)
        if why is None:
            why = why_cache[wkey] = kernel_available(shape, lay, workload, profile)
        alias = object.__new__(Prediction)  # a shallow copy (copy.copy's, at a third of its cost)
        alias.__dict__.update(base.__dict__)
        alias.layout, alias.available, alias.why_unavailable = lay, not why, why
        out.append(alias)
    return out


def _predict_all(shape: Shape, todo: list, workload: Workload, profile: Profile, theta: dict, why_cache: dict) -> list:
    """predict() of each layout of `todo` ((index, layout, its fields but the kernel), all distinct), with the
    memory (memory_batch) and step time (timing_batch) of all of them computed together; SpecError of the first
    invalid one, as predict() raises it."""
    from harness.planner import timing_batch

    lays = [lay for _, lay, _ in todo]
    for lay in lays:
        validate(shape, lay, workload)
    mkeys = [memory_key(lay, fields) for _, lay, fields in todo]
    memory_cache = _memories(shape, lays, mkeys, workload, profile)
    memories = []
    for lay, mkey in zip(lays, mkeys, strict=True):
        memory = memory_cache.get(mkey)
        if memory is None:  # a layout the arrays do not hold
            memory = memory_cache[mkey] = _memory(shape, lay, workload, profile)
        memories.append(memory)
    peaks = [m[1] for m in memories]
    try:
        seconds, breakdowns = timing_batch.step_times(shape, lays, workload, profile, theta, {}, peaks)
    except timing_batch.Diverged:  # step_time's arithmetic changed, not the arrays': tests/test_timing_batch.py fails
        cache: dict = {}
        timed = [
            step_time(shape, lay, workload, profile, theta, cache, peak) for lay, peak in zip(lays, peaks, strict=True)
        ]
        seconds, breakdowns = [t for t, _ in timed], [b for _, b in timed]
    tokens = workload.global_batch_size * workload.seq_len
    flops = tokens * _palm_flops_per_token(shape, workload.seq_len)
    peak = profile.peak_flops(workload.dtype_bytes)
    out = []
    for lay, (stage, total, breakdown_gib, fit, tight), t, breakdown in zip(
        lays, memories, seconds, breakdowns, strict=True
    ):
        wkey = (lay.attention, lay.micro_batch_size, lay.tp, lay.precision)
        why = why_cache.get(wkey)
        if why is None:
            why = why_cache[wkey] = kernel_available(shape, lay, workload, profile)
        p = object.__new__(Prediction)  # Prediction(...) field by field, at a third of its __init__'s cost
        p.__dict__.update(
            layout=lay,
            fits=fit,
            available=not why,
            memory_gib=total / GIB,
            step_time_s=t,
            mfu=flops / (t * lay.gpus * peak),
            tokens_per_s=tokens / t,
            worst_stage=stage,
            memory_breakdown_gib=breakdown_gib,
            time_breakdown_s=breakdown,
            why_unavailable=why,
            tight=tight,
        )
        out.append(p)
    return out


def _memories(shape: Shape, layouts: list, mkeys: list, workload: Workload, profile: Profile) -> dict:
    """memory_key -> _memory of every layout among `layouts` (valid ones; `mkeys` their memory_key) whose memory
    the arrays of memory_batch hold (the others are left to _memory)."""
    from harness.planner import memory_batch

    todo: dict = {}
    for lay, mkey in zip(layouts, mkeys, strict=True):
        if mkey not in todo and memory_batch.batched(shape, lay, workload):
            todo[mkey] = lay
    try:
        batch = memory_batch.memories(shape, list(todo.values()), workload, profile, ALLOCATOR_MARGIN)
    except memory_batch.Diverged:  # engine_stage_memory has a term the arrays lack: tests/test_memory_batch.py fails
        return {}
    return dict(zip(todo, batch, strict=True))
