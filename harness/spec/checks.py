"""Everything about a run spec that can be decided without launching (check_sizes, which parse_spec
runs last): the model against the layout, the batch, the sizes a machine holds, a token file
against its spec, then what the chosen engine runs (capabilities.py). Each check raises a
SpecError naming the field, so that a user mistake is one line and exit code 2.
"""

from __future__ import annotations

import json
import os

from harness import registry
from harness.errors import CapabilityError, SpecError
from harness.model.presets import Shape, param_count, resolve_shape
from harness.parallel_dims import ParallelDims
from harness.spec.capabilities import check_honoured, check_model_limits, check_precision_policy, check_rules
from harness.spec.schema import INTERLEAVED_SCHEDULES, V_SCHEDULES, RunSpec, Workload, micro_batch_count, model_chunks


def check_sizes(spec: RunSpec) -> Shape:
    """Everything that can be decided without launching; returns the model shape."""
    w, lay = spec.workload, spec.layout  # each number is in its field's range (spec_field checks)
    if w.data.kind == "file":
        if not w.data.path:
            raise SpecError("workload.data.path", "required when data.kind is file")
        if not os.path.isfile(w.data.path):
            raise SpecError("workload.data.path", f"file {w.data.path!r} does not exist")
    shape = resolve_shape(w.model, w.model_overrides)
    check_head_dim(
        shape, "workload.model_overrides" if {"hidden", "heads"} & set(w.model_overrides) else "workload.model"
    )
    check_sliding_window(shape, w.seq_len)
    if w.global_batch_size % (lay.dp * lay.micro_batch_size):
        raise SpecError(
            "workload.global_batch_size",
            f"{w.global_batch_size} is not divisible by dp x micro_batch_size = {lay.dp} x {lay.micro_batch_size}",
        )
    if shape.heads % lay.tp:
        raise SpecError("layout.tp", f"{shape.heads} attention heads are not divisible by tp={lay.tp}")
    if shape.kv_heads % lay.tp:
        raise SpecError("layout.tp", f"{shape.kv_heads} KV heads are not divisible by tp={lay.tp}")
    if shape.vocab % lay.tp:
        raise SpecError("layout.tp", f"vocabulary {shape.vocab} is not divisible by tp={lay.tp}")
    if shape.ffn % lay.tp:
        raise SpecError("layout.tp", f"feed-forward width {shape.ffn} is not divisible by tp={lay.tp}")
    if shape.moe and shape.moe_ffn % lay.tp:  # each expert's SwiGLU is split over tp as the dense one is
        raise SpecError("layout.tp", f"expert width moe_ffn {shape.moe_ffn} is not divisible by tp={lay.tp}")
    check_experts(shape, lay)
    stages = lay.pp * model_chunks(lay.pipeline_schedule, lay.virtual_stages)
    if shape.layers < stages:
        raise SpecError("layout.pp", f"{shape.layers} layers cannot fill {stages} pipeline stages")
    if lay.sequence_parallel and lay.tp == 1:
        raise SpecError("layout.sequence_parallel", "needs tp > 1")
    if lay.cp > 1 and w.seq_len % (2 * lay.cp):
        raise SpecError(
            "layout.cp",
            f"seq_len {w.seq_len} is not divisible by 2 x cp = {2 * lay.cp} (each rank holds two load-balanced chunks)",
        )
    if lay.cp > 1 and lay.cp_impl == "ulysses":
        for count, what in ((shape.heads, "attention heads"), (shape.kv_heads, "KV heads")):
            if count % ParallelDims.of(lay).product("cp", "tp"):
                raise SpecError(
                    "layout.cp_impl", f"ulysses needs {what} ({count}) divisible by cp x tp = {lay.cp} x {lay.tp}"
                )
    if lay.sequence_parallel and (w.seq_len // lay.cp) % lay.tp:
        raise SpecError(
            "layout.sequence_parallel",
            f"seq_len {w.seq_len} / cp={lay.cp} is not divisible by tp={lay.tp}"
            if lay.cp > 1
            else f"seq_len {w.seq_len} is not divisible by tp={lay.tp}",
        )
    if lay.virtual_stages > 1 and lay.pipeline_schedule not in INTERLEAVED_SCHEDULES:
        raise SpecError("layout.virtual_stages", "needs pipeline_schedule: interleaved or zero_bubble")
    if lay.pipeline_schedule in (*V_SCHEDULES, "zero_bubble") and lay.pp == 1:
        raise SpecError("layout.pipeline_schedule", f"{lay.pipeline_schedule} schedules pipeline stages: needs pp > 1")
    if lay.pipeline_schedule == "zero_bubble" and lay.virtual_stages < 2:
        raise SpecError(
            "layout.virtual_stages", "zero_bubble (interleaved zero bubble) needs virtual_stages >= 2 chunks per rank"
        )
    if lay.pipeline_schedule == "interleaved" and lay.pp > 1:
        micro = micro_batch_count(w.global_batch_size, lay.dp, lay.micro_batch_size)
        if micro % lay.pp:
            raise SpecError(
                "layout.pipeline_schedule", f"interleaved needs micro-batches ({micro}) divisible by pp={lay.pp}"
            )
    if lay.pipeline_schedule == "zero_bubble" and lay.pp > 1:
        micro = micro_batch_count(w.global_batch_size, lay.dp, lay.micro_batch_size)
        rounds = max(1, micro // lay.pp)  # torch's ScheduleInterleavedZeroBubble's order, which every engine runs
        if micro % rounds:
            raise SpecError(
                "layout.pipeline_schedule",
                f"zero_bubble runs micro-batches in rounds of max(1, m // pp) = {rounds}: m={micro} does not divide",
            )
    if lay.pipeline_schedule == "dualpipev" and lay.pp > 1:
        micro = micro_batch_count(w.global_batch_size, lay.dp, lay.micro_batch_size)
        if micro < 2 * lay.pp:  # torch's ScheduleDualPipeV's order, which every engine runs
            raise SpecError(
                "layout.pipeline_schedule", f"dualpipev needs at least 2 x pp = {2 * lay.pp} micro-batches, got {micro}"
            )
    if lay.compile != "none" and w.warmup_steps < 1:
        raise SpecError("layout.compile", f"{lay.compile} compiles in the first step: needs workload.warmup_steps >= 1")
    for name, takes, why in registry.facts(lay.engine).batch_limits:
        if not takes(w, lay):
            raise CapabilityError(f"layout.{name}", why(w, lay))
    check_fits_a_machine(spec, shape)
    check_tokens(shape, w.seq_len, w.global_batch_size, w.model)
    if w.data.kind == "file":
        check_token_file(w, shape)
    for name in ("grad_accum_dtype", "grad_reduce_dtype"):
        if w.precision == "fp32" and getattr(w, name) != "fp32":
            raise SpecError(f"workload.{name}", "bf16 gradients need precision: bf16 (or fp8)")
    check_fp8(w, lay)
    check_honoured(w, lay)
    check_rules(lay)
    check_precision_policy(w, lay)
    check_model_limits(shape, lay)
    return shape


def check_fp8(w: Workload, lay) -> None:
    """FSDP2's FP8 all-gather casts each weight with one dynamic scale (torchao's
    WeightWithDynamicFloat8CastTensor): it needs precision fp8 with the tensorwise recipe."""
    if not lay.fp8_all_gather:
        return
    if w.precision != "fp8":
        raise SpecError("layout.fp8_all_gather", f"needs precision: fp8, and precision is {w.precision}")
    if w.fp8_recipe != "tensorwise":
        raise SpecError(
            "layout.fp8_all_gather",
            f"needs fp8_recipe: tensorwise (torchao all-gathers FP8 weights with one scale per tensor; "
            f"{w.fp8_recipe} scales per {'block of 32' if w.fp8_recipe == 'mxfp8' else 'row'})",
        )


# More than any one process of any machine holds: a spec beyond it is a typo (seq_len: 1e12), not a run.
MAX_BYTES_PER_DEVICE = 64 * 2**40


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return ""


def _count(n: int) -> str:
    return str(n) if n < 10**9 else f"{n:.3g}"  # 1e30 as it was written, not 31 digits


def check_experts(shape: Shape, lay) -> None:
    """ep shares out a MoE's experts over ranks carved from dp x cp: it needs experts, whole ones per rank."""
    if lay.ep == 1:
        return
    if not shape.moe:
        raise SpecError("layout.ep", f"ep={lay.ep} shares out experts, and this model has none")
    if shape.experts % lay.ep:
        raise SpecError("layout.ep", f"{shape.experts} experts are not divisible by ep={lay.ep}")
    ParallelDims.of(lay).check_ep()


def check_sliding_window(shape: Shape, seq_len: int) -> None:
    """A sliding window of at least seq_len positions is causal attention (every engine runs it); a
    shorter one would mask keys no engine masks: refused, never ignored."""
    if 0 < shape.sliding_window < seq_len:
        raise SpecError(
            "workload.seq_len",
            f"{seq_len} is longer than the model's sliding_window {shape.sliding_window}: no engine here runs "
            f"sliding-window attention; set seq_len <= {shape.sliding_window}",
        )


def check_head_dim(shape: Shape, field: str) -> None:
    """Rotary embeddings turn pairs of a head's channels: its width (head_dim) must be even."""
    head_dim = shape.head_dim
    if head_dim % 2:
        raise SpecError(
            field,
            f"hidden {shape.hidden} / heads {shape.heads} = {head_dim} channels a head, an odd "
            "number: rotary embeddings need an even head width",
        )


SEQUENCE_FIELDS = {"seq_len": "workload.seq_len", "global_batch_size": "workload.global_batch_size"}


def check_tokens(
    shape: Shape,
    seq_len: int,
    global_batch_size: int,
    model: str,
    fields=None,
    positions: str = "workload.model_overrides.max_positions",
) -> None:
    """What the model and the batch allow whatever the layout (the spec's, and `harness plan`'s flags
    named by `fields`): a sequence within the model's positions (`positions` names what raises them),
    and a global batch of int64 tokens (every rank builds it) that a machine holds."""
    fields = fields or SEQUENCE_FIELDS
    given = {"seq_len": seq_len, "global_batch_size": global_batch_size}
    for name, field_name in fields.items():  # their fields' ranges (a spec's builder has read them already)
        Workload.__dataclass_fields__[name].metadata["check"](given[name], field_name)
    if seq_len > shape.max_positions:
        raise SpecError(
            fields["seq_len"],
            f"{_count(seq_len)} is beyond the {shape.max_positions} positions of "
            f"{model} (its max_position_embeddings); {positions} raises it",
        )
    need = global_batch_size * (seq_len + 1) * 8
    if need > MAX_BYTES_PER_DEVICE:
        raise SpecError(
            fields["global_batch_size"],
            f"{_count(global_batch_size)} sequences of {seq_len} tokens need "
            f"{_size(need)} on every rank, more than any machine holds "
            f"({_size(MAX_BYTES_PER_DEVICE)})",
        )


def check_fits_a_machine(spec: RunSpec, shape: Shape) -> None:
    """Refuse sizes no machine can hold, with the estimate: the training state (fp32 weights,
    gradients and Adam's two moments: 16 B a parameter) sharded over every device, plus one
    micro-batch's activations (34 B per token, hidden unit and layer: Korthikanti et al. 2022),
    its logits and the global batch of int64 tokens each rank builds. A generous lower bound;
    the error names the field of the largest part."""
    w, lay = spec.workload, spec.layout
    dims, tokens = ParallelDims.of(lay), lay.micro_batch_size * w.seq_len
    world = dims.world
    params = param_count(shape)
    parts = {
        "workload.model_overrides" if w.model_overrides else "workload.model": (
            params * 16 // world,
            f"{params:.3g} parameters x 16 B over {world} devices",
        ),
        "workload.seq_len": (
            tokens * shape.hidden * shape.layers * 34 // dims.excluding("dp") + tokens * shape.vocab * 4 // lay.tp,
            f"activations and logits of {lay.micro_batch_size} x {_count(w.seq_len)} tokens",
        ),
        "workload.global_batch_size": (
            w.global_batch_size * (w.seq_len + 1) * 8,
            f"the global batch of {_count(w.global_batch_size)} x {_count(w.seq_len + 1)} tokens",
        ),
    }
    total = sum(b for b, _ in parts.values())
    if total > MAX_BYTES_PER_DEVICE:
        field = max(parts, key=lambda k: parts[k][0])
        raise SpecError(
            field,
            f"needs about {_size(total)} per device ("
            + "; ".join(f"{why}: {_size(b)}" for b, why in parts.values())
            + f"), more than any machine holds ({_size(MAX_BYTES_PER_DEVICE)})",
        )


def check_token_file(w: Workload, shape: Shape) -> None:
    """A token file that matches its spec: the dtype `harness data prepare` wrote in <file>.json,
    a whole number of tokens, a vocabulary within the model's, and at least one global batch."""
    path, dtype = w.data.path, w.data.dtype
    meta_path = path + ".json"
    if os.path.isfile(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise SpecError("workload.data.path", f"cannot read {meta_path}: {e}") from None
        meta = meta if isinstance(meta, dict) else {}
        if meta.get("dtype") not in (None, dtype):
            raise SpecError(
                "workload.data.dtype",
                f"{dtype}, but {meta_path} (written by harness data prepare) "
                f"says the file holds {meta['dtype']} tokens",
            )
        vocab = meta.get("vocab_size")
        if isinstance(vocab, int) and vocab > shape.vocab:
            raise SpecError(
                "workload.data.path",
                f"its tokens come from a vocabulary of {vocab} ({meta_path}), larger than the model's {shape.vocab}",
            )
    size, item = os.path.getsize(path), 2 if dtype == "uint16" else 4
    if size % item:
        raise SpecError(
            "workload.data.path",
            f"{path} has {size} bytes, not a whole number of {dtype} tokens "
            f"({item} bytes each): a wrong dtype or a cut-off file",
        )
    need = w.global_batch_size * (w.seq_len + 1)
    if size // item < need:
        raise SpecError(
            "workload.data.path",
            f"{path} holds {size // item} tokens, fewer than one global batch "
            f"of {w.global_batch_size} x (seq_len {w.seq_len} + 1) = {need}",
        )


def check_world_size(spec: RunSpec, world_size: int) -> None:
    ParallelDims.of(spec.layout).check_world(world_size, "layout")
