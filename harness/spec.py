"""What to run: a Workload (the same for every engine) and a Layout (how it is parallelised).

Every check of user input lives here and raises SpecError naming the field, so that a user
mistake is one line and exit code 2 before anything launches.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
import types
import typing
from dataclasses import dataclass, field

from harness import registry
from harness.errors import CapabilityError, SpecError, shown
from harness.files.yaml_reader import load_yaml, read_yaml, yaml_problem  # noqa: F401 (the one YAML reader, re-exported)
from harness.model.presets import Shape, param_count, resolve_shape
from harness.parallel_dims import LABEL_ORDER, ParallelDims

ATTENTION_KERNELS = ("naive", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash2")
RMSNORM_KERNELS = ("torch", "fused")
CHECKPOINTING = ("none", "full", "selective")
CP_IMPLS = ("ring", "allgather", "ulysses")  # K/V blocks passed round a ring, K/V all-gathered, heads all-to-all
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _choices(*values, **kw):
    return field(metadata={"choices": values}, **kw)


def spec_field(default=dataclasses.MISSING, *, factory=dataclasses.MISSING, check=None, required=None, choices=None,
               applies=None):
    """A field of a spec the builder reads (build_spec): `check(value, name)` reads the given value in place
    of its type (refusing in its own words), `required` is why a missing one is refused, `choices` are
    the values it takes, `applies` = (other field, its value) where the field means something (a token
    file's path with kind: file), refused when given otherwise. A spec class with `NULL_IS_DEFAULT = True`
    reads `key:` (no value) as not given."""
    metadata = {k: v for k, v in (("check", check), ("required", required), ("choices", choices),
                                  ("applies", applies)) if v is not None}
    return field(default=default, default_factory=factory, metadata=metadata)


# Bounds beyond which a number is a typo (`steps: 1e30`), not a run.
MAX_STEPS = 100_000  # a record keeps every step's loss, time and breakdown
MAX_DEVICES = 2 ** 20  # more devices than any cluster has
MAX_SEED = 2 ** 32 - 1  # what every generator takes (numpy's limit; torch's is larger)


def in_range(tp, low=None, high=None, *, above=False, says=None, why=""):
    """A spec_field check: a number of type `tp` read as users write it (_number: finite, an int whole),
    `low` or more (more than `low` with above=True) and `high` or less. `says` replaces the words for
    the range; `why` follows them."""
    def check(value, name):
        number = _coerce(value, tp, name)
        if low is not None and (number <= low if above else number < low):
            words = "be positive" if (low == 0 and above) or (low == 1 and tp is int) else \
                "not be negative" if low == 0 else f"be at least {low}"
        elif high is not None and number > high:
            words = f"be at most {high:,}"
        else:
            return number
        raise SpecError(name, f"must {'be ' + says if says else words}{why}, got {shown(value)}")
    return check


def _betas(value, name: str) -> tuple[float, float]:
    betas = _coerce(value, tuple[float, float], name)
    for i, b in enumerate(betas):
        if not 0 <= b < 1:
            raise SpecError(f"{name}[{i}]", f"must be in [0, 1), got {shown(value[i])}")
    return betas


@dataclass
class Optimizer:
    """AdamW hyperparameters; every engine gets exactly these."""

    lr: float = spec_field(3e-4, check=in_range(float, 0, above=True))
    betas: tuple[float, float] = spec_field((0.9, 0.95), check=_betas)
    eps: float = spec_field(1e-8, check=in_range(float, 0, above=True))
    weight_decay: float = spec_field(0.1, check=in_range(float, 0))


@dataclass
class Data:
    """`synthetic`: seeded uniform tokens; `file`: a memory-mapped token file (.bin)."""

    kind: str = _choices("synthetic", "file", default="synthetic")
    path: str = spec_field("", applies=("kind", "file"))
    dtype: str = spec_field("uint16", choices=("uint16", "uint32"), applies=("kind", "file"))


@dataclass
class Workload:
    model: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    seq_len: int = spec_field(128, check=in_range(int, 1))  # at most the model's max_positions (check_tokens)
    global_batch_size: int = spec_field(8, check=in_range(int, 1))  # sequences per step
    steps: int = spec_field(10, check=in_range(int, 1, MAX_STEPS))
    warmup_steps: int = spec_field(2, check=in_range(int, 0, MAX_STEPS))
    precision: str = _choices("fp32", "bf16", default="fp32")
    # bf16: gradients are summed over micro-batches in grad_accum_dtype and reduced across
    # data-parallel ranks in grad_reduce_dtype (harness/model/training.py, PrecisionPolicy)
    grad_accum_dtype: str = _choices("fp32", "bf16", default="fp32")
    grad_reduce_dtype: str = _choices("fp32", "bf16", default="fp32")
    optimizer: Optimizer = field(default_factory=Optimizer)
    grad_clip: float = spec_field(1.0, check=in_range(float, 0, why=" (0 disables clipping)"))
    seed: int = spec_field(1234, check=in_range(int, 0, MAX_SEED))
    data: Data = field(default_factory=Data)
    device: str = _choices("auto", "cpu", "cuda", default="auto")


@dataclass
class Layout:
    engine: str = field(default="single", metadata={"choices": registry.ENGINES})  # the registry's, as it is now
    tp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    pp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    dp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    # context parallelism: each sequence split over cp ranks (load-balanced chunks i and 2cp-1-i), and
    # how their attention meets the other ranks' keys and values
    cp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    cp_impl: str = _choices(*CP_IMPLS, default="ring")
    micro_batch_size: int = spec_field(1, check=in_range(int, 1))
    activation_checkpointing: str = _choices(*CHECKPOINTING, default="none")
    sequence_parallel: bool = False
    attention: str = _choices(*ATTENTION_KERNELS, default="sdpa")
    rmsnorm: str = _choices(*RMSNORM_KERNELS, default="torch")
    # own engine
    pipeline_schedule: str = _choices(*SCHEDULES, default="1f1b")
    virtual_stages: int = spec_field(1, check=in_range(int, 1))
    # how pipeline stages exchange activations: grouped (batch_isend_irecv, what NCCL needs) or
    # async (isend/irecv); auto picks grouped on NCCL and async on gloo
    pipeline_p2p: str = _choices("auto", "async", "grouped", default="auto")
    zero_stage: int = spec_field(0, check=in_range(int, 0, 3, says="0, 1, 2 or 3 (ZeRO's stages)"))
    dp_bucket_mb: float = spec_field(25.0, check=in_range(float, 0, above=True))
    # deepspeed
    ds_config: str = ""
    model_impl: str = _choices("own", "hf", default="own")
    # fsdp
    reshard_after_forward: bool = True


@dataclass
class RunSpec:
    workload: Workload = field(default_factory=Workload)
    layout: Layout = field(default_factory=Layout)
    name: str = ""
    store: str = "results.sqlite"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def shape(self) -> Shape:
        """The model's shape (parse_spec has checked the layout against it)."""
        return resolve_shape(self.workload.model, self.workload.model_overrides)


# ---------------------------------------------------------------- parsing

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping"}
_PLURALS = {int: "integers", float: "numbers", str: "strings", dict: "mappings"}


def _coerce(value, tp, name: str):
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # `X | None`
        return None if value is None else _coerce(value, next(a for a in typing.get_args(tp) if a is not type(None)),
                                                   name)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise SpecError(name, "must be a mapping")
        return build_spec(tp, value, name)
    if tp is list or origin is list:  # elements checked by type, not converted
        item = (typing.get_args(tp) or (object,))[0]
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise SpecError(name, "must be a list" + (f" of {_PLURALS[item]}" if item in _PLURALS else ""))
        return value
    if origin is dict:
        tp = dict
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise SpecError(name, f"must be a list of {len(args)} numbers")
        return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if tp in (int, float) and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return _number(value, tp, name)
    if tp in (int, float) and isinstance(value, bool):
        raise SpecError(name, f"must be {_TYPE_NAMES[tp]}, got {value!r}")
    if not isinstance(value, tp):
        raise SpecError(name, f"must be {_TYPE_NAMES.get(tp, tp.__name__)}, got {shown(value)}")
    return value


def _number(value, tp, name: str):
    """An int or float field's value: a number, or a numeric string, as YAML 1.1 reads what users
    write (`lr: 1e-4` and `seq_len: 1e12` are strings to it); an int must be whole, every number finite."""
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text) if text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            raise SpecError(name, f"must be {_TYPE_NAMES[tp]}, got {shown(value)}") from None
    if isinstance(number, float) and not math.isfinite(number):
        raise SpecError(name, f"must be a finite number, got {shown(value)}")
    if tp is int and not float(number).is_integer():
        raise SpecError(name, f"must be {_TYPE_NAMES[tp]}, got {shown(value)}")
    return int(number) if tp is int else float(number)


def build_spec(cls, raw: dict, prefix: str):
    """A spec dataclass from its mapping: every key known, every value of its field's type (or
    through its spec_field check), every required field given; a SpecError names the field."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in raw:
        if key not in known:
            raise SpecError(f"{prefix}.{key}" if prefix else str(key),
                            f"unknown key; allowed: {', '.join(known)}")
    given = {k: v for k, v in raw.items() if not (v is None and getattr(cls, "NULL_IS_DEFAULT", False))}
    for key, f in known.items():
        if key not in given and "required" in f.metadata:
            raise SpecError(f"{prefix}.{key}" if prefix else key, f.metadata["required"])
    values = {}
    for key, value in given.items():
        name = f"{prefix}.{key}" if prefix else key
        check = known[key].metadata.get("check")
        value = check(value, name) if check else _coerce(value, hints[key], name)
        choices = known[key].metadata.get("choices")
        if choices and value not in choices:
            raise SpecError(name, f"{shown(value)} is not one of {', '.join(map(str, choices))}")
        values[key] = value
    for key in values:  # a field that means something only beside another's value is not ignored
        other, wanted = known[key].metadata.get("applies", (None, None))
        have = values.get(other, known[other].default) if other else wanted
        if have != wanted and values[key] != known[key].default:  # (to_dict() writes the defaults back)
            raise SpecError(f"{prefix}.{key}" if prefix else key,
                            f"applies only with {other}: {wanted}, and {other} is {have}"
                            + ("" if other in values else " (the default)") + f": set {other}: {wanted}")
    return cls(**values)


def with_engine_defaults(raw: dict) -> dict:
    """`raw` with the layout fields it does not give at its engine's defaults where they differ from the
    field's (EngineFacts.defaults: megatron's attention); an unknown engine is left to the builder."""
    layout = raw.get("layout")
    engine = layout.get("engine", Layout.engine) if isinstance(layout, dict) else Layout.engine
    if not registry.available(engine):
        return raw
    own = {path.split(".", 1)[1]: value for path, value in registry.facts(engine).defaults.items()
           if path.startswith("layout.")}
    if not own:
        return raw
    given = layout if isinstance(layout, dict) else {}
    return {**raw, "layout": {**{k: v for k, v in own.items() if k not in given}, **given}}


def parse_spec(raw: dict | None) -> RunSpec:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError("spec", "top level must be a mapping")
    spec = build_spec(RunSpec, with_engine_defaults(raw), "")
    shape_types = typing.get_type_hints(Shape)
    spec.workload.model_overrides = {  # numbers as in the other fields (`layers: 1e9` is a string to YAML 1.1)
        k: _coerce(v, shape_types[k], f"workload.model_overrides.{k}") if k in shape_types else v
        for k, v in spec.workload.model_overrides.items()}
    check_sizes(spec)
    return spec


# ---------------------------------------------------------------- other inputs

NAME_MAX = 255  # bytes in one file name (Linux, macOS)


def check_positive(value, field: str):
    """A positive, finite number (a timeout, a peak), or a SpecError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(field, f"must be a positive number, got {shown(value)}")
    return value


def check_positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(field, f"must be a positive integer, got {shown(value)}")
    return value


def check_device_count(value, field: str) -> int:
    """A number of processes or devices (a comparison's nproc, a sweep's gpus and nodes)."""
    check_positive_int(value, field)
    if value > MAX_DEVICES:
        raise SpecError(field, f"must be at most {MAX_DEVICES:,} (more devices than any cluster has), "
                               f"got {shown(value)}")
    return value


def check_path(value, field: str) -> str:
    """A file path the harness will write (a results store)."""
    if not isinstance(value, str) or not value.strip():
        raise SpecError(field, f"must be a file path, got {shown(value)}")
    return value


NAME_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")


def check_name(name, field: str, names: str, reserved: int = 0, hint: str = "") -> str:
    """A spec's name (a sweep's, a comparison's): a file name (check_file_name) of letters, digits,
    '-', '_' and '.' only, since it also names jobs, records and headings (`names` says which)."""
    text = check_file_name(name, field, reserved)
    bad = "".join(sorted({c for c in text if c not in NAME_CHARS}))
    if bad:
        raise SpecError(field, f"{shown(text)}: letters, digits, '-', '_' and '.' only (it names {names}), "
                               f"not {bad!r}{hint}")
    return text


def check_file_name(name, field: str, reserved: int = 0) -> str:
    """A name that becomes a file or folder name (logs, reports): no path separator, not '.' or
    '..', and within the file-name limit less `reserved` bytes the harness adds around it."""
    if not isinstance(name, str) or not name.strip():
        raise SpecError(field, f"must be a non-empty string, got {shown(name)}")
    if any(c in name for c in "/\\\0") or name in (".", ".."):
        raise SpecError(field, f"{shown(name)} names files and folders: no '/', '\\' or NUL, not '.' or '..'")
    if len(name.encode()) > NAME_MAX - reserved:
        raise SpecError(field, f"is {len(name.encode())} bytes long; it names files, so at most "
                               f"{NAME_MAX - reserved} bytes")
    return name


def check_output_path(path: str, field: str, directory: bool) -> None:
    """Where a command will write (a report folder, an export file): refused before any work if
    it cannot be written there (a missing folder, a file where a folder goes, or the reverse)."""
    full = os.path.abspath(path)
    if directory and os.path.exists(full) and not os.path.isdir(full):
        raise SpecError(field, f"{path} is a file; give a folder")
    if not directory and os.path.isdir(full):
        raise SpecError(field, f"{path} is a folder; give a file name")
    folder = full if directory and os.path.isdir(full) else os.path.dirname(full)
    if not os.path.isdir(folder):
        raise SpecError(field, f"folder {os.path.dirname(path) or folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecError(field, f"folder {folder} cannot be written")


def load_spec(path: str | None) -> RunSpec:
    """Load a YAML spec; None gives the embedded default (tiny model, this machine)."""
    return parse_spec({} if path is None else read_yaml(path))


def parse_with_overrides(raw, overrides: list[str] | None, parse, prefix: str = ""):
    """`parse(raw)` after the CLI's `--set key.path=value` overrides, applied in order to the raw
    mapping (before any validation). A value is YAML (`256`, `naive`, `true`, `[1, 2]`); a path
    walks mappings (a key that itself holds dots, like a sweep's `workload.seq_len` axis, is
    matched whole) and list indices (`runs.0.engine`), creating missing mappings. A malformed
    override, or a validation error at an overridden path (or above it) (`prefix` is how the parser
    names the spec's top level, e.g. `sweep.`), is `--set: ...`."""
    if not overrides:
        return parse(raw)
    if raw is None:
        raw = {}
    paths = {}
    for text in overrides:
        path, eq, value_text = text.partition("=")
        parts = path.strip().split(".")
        if not eq or not all(p.strip() for p in parts):
            raise SpecError("--set", f"{text!r}: give KEY.PATH=VALUE, e.g. workload.seq_len=256")
        try:
            value = load_yaml(value_text, path) if value_text.strip() else None
        except SpecError as e:
            raise SpecError("--set", f"{path}: {e.reason}") from None
        if not isinstance(raw, dict):
            raise SpecError("--set", f"{path}: the spec's top level is not a mapping")
        node, i, walked = raw, 0, []
        while True:
            if isinstance(node, dict):  # the longest dotted key already present, else one part
                j = next((j for j in range(len(parts), i + 1, -1) if ".".join(parts[i:j]) in node), i + 1)
                key = ".".join(parts[i:j])
            elif isinstance(node, list):
                j, key = i + 1, parts[i]
                if not key.isdigit() or int(key) >= len(node):
                    raise SpecError("--set", f"{path}: {'.'.join(walked)} is a list of {len(node)}; "
                                             f"{key!r} is not an index into it")
                key = int(key)
            else:
                raise SpecError("--set", f"{path}: {'.'.join(walked)} is {node!r}, not a mapping")
            walked.append(str(key))
            if j == len(parts):
                node[key] = value
                break
            if isinstance(node, dict) and node.get(key) is None:
                node[key] = {}
            node, i = node[key], j
        paths[prefix + ".".join(walked)] = f"{'.'.join(walked)}={value_text.strip()}"
    try:
        return parse(raw)
    except SpecError as e:
        hit = next((t for p, t in paths.items() if p == e.field or p.startswith(e.field + ".")), None)
        if hit is not None:  # at an overridden path, or at a mapping the override made
            raise SpecError("--set", f"{hit}: {e.reason}") from None
        raise


# ---------------------------------------------------------------- semantic checks


def check_sizes(spec: RunSpec) -> Shape:
    """Everything that can be decided without launching; returns the model shape."""
    w, lay = spec.workload, spec.layout  # each number is in its field's range (spec_field checks)
    if w.data.kind == "file":
        if not w.data.path:
            raise SpecError("workload.data.path", "required when data.kind is file")
        if not os.path.isfile(w.data.path):
            raise SpecError("workload.data.path", f"file {w.data.path!r} does not exist")
    shape = resolve_shape(w.model, w.model_overrides)
    check_head_dim(shape, "workload.model_overrides" if {"hidden", "heads"} & set(w.model_overrides)
                   else "workload.model")
    if w.global_batch_size % (lay.dp * lay.micro_batch_size):
        raise SpecError("workload.global_batch_size",
                        f"{w.global_batch_size} is not divisible by dp x micro_batch_size = "
                        f"{lay.dp} x {lay.micro_batch_size}")
    if shape.heads % lay.tp:
        raise SpecError("layout.tp", f"{shape.heads} attention heads are not divisible by tp={lay.tp}")
    if shape.kv_heads % lay.tp:
        raise SpecError("layout.tp", f"{shape.kv_heads} KV heads are not divisible by tp={lay.tp}")
    if shape.vocab % lay.tp:
        raise SpecError("layout.tp", f"vocabulary {shape.vocab} is not divisible by tp={lay.tp}")
    if shape.ffn % lay.tp:
        raise SpecError("layout.tp", f"feed-forward width {shape.ffn} is not divisible by tp={lay.tp}")
    stages = lay.pp * lay.virtual_stages
    if shape.layers < stages:
        raise SpecError("layout.pp", f"{shape.layers} layers cannot fill {stages} pipeline stages")
    if lay.sequence_parallel and lay.tp == 1:
        raise SpecError("layout.sequence_parallel", "needs tp > 1")
    if lay.cp > 1 and w.seq_len % (2 * lay.cp):
        raise SpecError("layout.cp", f"seq_len {w.seq_len} is not divisible by 2 x cp = {2 * lay.cp} "
                                     f"(each rank holds two load-balanced chunks)")
    if lay.cp > 1 and lay.cp_impl == "ulysses":
        for count, what in ((shape.heads, "attention heads"), (shape.kv_heads, "KV heads")):
            if count % ParallelDims.of(lay).product("cp", "tp"):
                raise SpecError("layout.cp_impl", f"ulysses needs {what} ({count}) divisible by cp x tp = "
                                                  f"{lay.cp} x {lay.tp}")
    if lay.sequence_parallel and (w.seq_len // lay.cp) % lay.tp:
        raise SpecError("layout.sequence_parallel", f"seq_len {w.seq_len} / cp={lay.cp} is not divisible by "
                                                    f"tp={lay.tp}" if lay.cp > 1 else
                        f"seq_len {w.seq_len} is not divisible by tp={lay.tp}")
    if lay.virtual_stages > 1 and lay.pipeline_schedule != "interleaved":
        raise SpecError("layout.virtual_stages", "needs pipeline_schedule: interleaved")
    if lay.pipeline_schedule == "interleaved" and lay.pp > 1:
        micro = micro_batch_count(w.global_batch_size, lay.dp, lay.micro_batch_size)
        if micro % lay.pp:
            raise SpecError("layout.pipeline_schedule",
                            f"interleaved needs micro-batches ({micro}) divisible by pp={lay.pp}")
    for name, takes, why in registry.facts(lay.engine).batch_limits:
        if not takes(w, lay):
            raise CapabilityError(f"layout.{name}", why(w, lay))
    check_fits_a_machine(spec, shape)
    check_tokens(shape, w.seq_len, w.global_batch_size, w.model)
    if w.data.kind == "file":
        check_token_file(w, shape)
    for name in ("grad_accum_dtype", "grad_reduce_dtype"):
        if w.precision == "fp32" and getattr(w, name) != "fp32":
            raise SpecError(f"workload.{name}", "bf16 gradients need precision: bf16")
    check_honoured(w, lay)
    check_capabilities(lay)
    check_precision_policy(w, lay)
    check_model_limits(shape, lay)
    return shape


# More than any one process of any machine holds: a spec beyond it is a typo (seq_len: 1e12), not a run.
MAX_BYTES_PER_DEVICE = 64 * 2**40


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    return ""


def _count(n: int) -> str:
    return str(n) if n < 10 ** 9 else f"{n:.3g}"  # 1e30 as it was written, not 31 digits


def check_head_dim(shape: Shape, field: str) -> None:
    """Rotary embeddings turn pairs of a head's channels: its width (hidden / heads) must be even."""
    head_dim = shape.hidden // shape.heads
    if head_dim % 2:
        raise SpecError(field, f"hidden {shape.hidden} / heads {shape.heads} = {head_dim} channels a head, an odd "
                               "number: rotary embeddings need an even head width")


SEQUENCE_FIELDS = {"seq_len": "workload.seq_len", "global_batch_size": "workload.global_batch_size"}


def check_tokens(shape: Shape, seq_len: int, global_batch_size: int, model: str, fields=None) -> None:
    """What the model and the batch allow whatever the layout (the spec's, and `harness plan`'s flags
    named by `fields`): a sequence within the model's positions, and a global batch of int64 tokens
    (every rank builds it) that a machine holds."""
    fields = fields or SEQUENCE_FIELDS
    given = {"seq_len": seq_len, "global_batch_size": global_batch_size}
    for name, field_name in fields.items():  # their fields' ranges (a spec's builder has read them already)
        Workload.__dataclass_fields__[name].metadata["check"](given[name], field_name)
    if seq_len > shape.max_positions:
        hint = "; workload.model_overrides.max_positions raises it" if fields is SEQUENCE_FIELDS else ""
        raise SpecError(fields["seq_len"], f"{_count(seq_len)} is beyond the {shape.max_positions} positions of "
                                           f"{model} (its max_position_embeddings){hint}")
    need = global_batch_size * (seq_len + 1) * 8
    if need > MAX_BYTES_PER_DEVICE:
        raise SpecError(fields["global_batch_size"], f"{_count(global_batch_size)} sequences of {seq_len} tokens need "
                                                     f"{_size(need)} on every rank, more than any machine holds "
                                                     f"({_size(MAX_BYTES_PER_DEVICE)})")


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
        "workload.model_overrides" if w.model_overrides else "workload.model":
            (params * 16 // world, f"{params:.3g} parameters x 16 B over {world} devices"),
        "workload.seq_len": (tokens * shape.hidden * shape.layers * 34 // dims.excluding("dp")
                             + tokens * shape.vocab * 4 // lay.tp,
                             f"activations and logits of {lay.micro_batch_size} x {_count(w.seq_len)} tokens"),
        "workload.global_batch_size": (w.global_batch_size * (w.seq_len + 1) * 8,
                                       f"the global batch of {_count(w.global_batch_size)} x "
                                       f"{_count(w.seq_len + 1)} tokens"),
    }
    total = sum(b for b, _ in parts.values())
    if total > MAX_BYTES_PER_DEVICE:
        field = max(parts, key=lambda k: parts[k][0])
        raise SpecError(field, f"needs about {_size(total)} per device ("
                               + "; ".join(f"{why}: {_size(b)}" for b, why in parts.values())
                               + f"), more than any machine holds ({_size(MAX_BYTES_PER_DEVICE)})")


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
            raise SpecError("workload.data.dtype", f"{dtype}, but {meta_path} (written by harness data prepare) "
                                                   f"says the file holds {meta['dtype']} tokens")
        vocab = meta.get("vocab_size")
        if isinstance(vocab, int) and vocab > shape.vocab:
            raise SpecError("workload.data.path", f"its tokens come from a vocabulary of {vocab} ({meta_path}), "
                                                  f"larger than the model's {shape.vocab}")
    size, item = os.path.getsize(path), 2 if dtype == "uint16" else 4
    if size % item:
        raise SpecError("workload.data.path", f"{path} has {size} bytes, not a whole number of {dtype} tokens "
                                              f"({item} bytes each): a wrong dtype or a cut-off file")
    need = w.global_batch_size * (w.seq_len + 1)
    if size // item < need:
        raise SpecError("workload.data.path", f"{path} holds {size // item} tokens, fewer than one global batch "
                                              f"of {w.global_batch_size} x (seq_len {w.seq_len} + 1) = {need}")


# What an engine runs, where it cannot follow the precision policy and where it cannot build the model: its
# adapter declares them (harness.registry.EngineFacts); check_sizes asks them last, in that order. Epsilon
# and Llama 3.1 rope scaling every engine applies (the plain model's RMSNorm and rotary tables); attention
# biases every engine adds (own engine: q/k/v's sharded, o's after the reduction).


def model_limit_error(shape: Shape, lay: Layout) -> CapabilityError | None:
    """Why the chosen engine cannot build this model under this layout (the first rule it breaks), or None."""
    for what, takes, why in registry.facts(lay.engine).model_limits:
        if not takes(shape, lay):
            return CapabilityError("workload.model", f"{what}: {why}")
    return None


def check_model_limits(shape: Shape, lay: Layout) -> None:
    error = model_limit_error(shape, lay)
    if error is not None:
        raise error


def check_precision_policy(w: Workload, lay: Layout) -> None:
    for name, follows, why in registry.facts(lay.engine).precision_limits:
        if not follows(w, lay):
            raise CapabilityError(f"workload.{name}", why.format(engine=lay.engine))


def honoured_error(w: Workload | None, lay: Layout) -> CapabilityError | None:
    """The first field the chosen engine does not honour at its value (EngineFacts.honours: opt-in, so a
    field no engine declares is refused unless at its default), or None; w None: the layout's only."""
    facts = registry.facts(lay.engine)
    for prefix, spec_part in (("layout", lay), ("workload", w)):
        if spec_part is None:
            continue
        for f in dataclasses.fields(spec_part):
            path = f"{prefix}.{f.name}"
            general = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            why = facts.refuses(path, getattr(spec_part, f.name), facts.default(path, general))
            if why is not None:
                return CapabilityError(path, why)
    return None


def check_honoured(w: Workload, lay: Layout) -> None:
    error = honoured_error(w, lay)
    if error is not None:
        raise error


def capability_error(lay: Layout) -> CapabilityError | None:
    """Why the chosen engine cannot run this layout (a field it does not honour, else the first rule it
    breaks), or None."""
    error = honoured_error(None, lay)
    if error is not None:
        return error
    for name, takes, why in registry.facts(lay.engine).capabilities:
        if not takes(lay):
            return CapabilityError(f"layout.{name}", why.format(engine=lay.engine))
    return None


def check_capabilities(lay: Layout) -> None:
    error = capability_error(lay)
    if error is not None:
        raise error


def check_world_size(spec: RunSpec, world_size: int) -> None:
    ParallelDims.of(spec.layout).check_world(world_size, "layout")


def micro_batches_per_step(spec: RunSpec) -> int:
    return micro_batch_count(spec.workload.global_batch_size, spec.layout.dp, spec.layout.micro_batch_size)


def micro_batch_count(global_batch_size: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return global_batch_size // (dp * micro_batch_size)


# ---------------------------------------------------------------- the layout's text label

_DEFAULT_LAYOUT = dataclasses.asdict(Layout())


def _layout_dict(layout) -> dict:
    """A layout as a dict with every field (a partial one, as a compare spec's run or an old
    record holds, takes the defaults)."""
    return dataclasses.asdict(layout) if dataclasses.is_dataclass(layout) else {**_DEFAULT_LAYOUT, **(layout or {})}


def engine_variant(layout) -> str:
    """The engine and its sharding mode: own, own ZeRO-1, deepspeed ZeRO-3, FSDP2 reshard, ...
    (tolerates the partial layouts of old or foreign records)."""
    lay = _layout_dict(layout)
    engine = lay["engine"]
    return registry.facts(engine).variant(lay) if registry.available(engine) else engine


def parallel_label(layout) -> str:
    """The parallel degrees other than 1, SP and the CP implementation: 'tp2 pp2', 'dp8', 'tp4 dp2 sp',
    'cp2 dp2 ring' ('' for none)."""
    lay = _layout_dict(layout)
    dims = ParallelDims.of(lay)
    impl = (lay.get("cp_impl") or "ring") if dims.cp > 1 else ""
    return " ".join(p for p in (dims.label(), "sp" if lay.get("sequence_parallel") else "", impl) if p)


def layout_label(layout, short: bool = False) -> str:
    """One line naming a layout, used by every view of a run (console, sweep, compare, report).

    short: the engine variant and parallel_label (what tells a comparison's runs apart);
    otherwise every field that changes what is measured."""
    lay = _layout_dict(layout)
    if short:
        return " ".join(p for p in (engine_variant(lay), parallel_label(lay)) if p)
    degrees = {k: ParallelDims.of(lay).degree(k) for k in LABEL_ORDER}
    parts = [engine_variant(lay)] + [f"{k}{v}" + (f" {lay.get('cp_impl') or 'ring'}" if k == "cp" else "")
                                     for k, v in degrees.items() if k != "cp" or v > 1]
    parts += [f"mb{lay.get('micro_batch_size', '?')}", f"ckpt={lay.get('activation_checkpointing') or 'none'}",
              f"{lay.get('attention') or '?'}/{lay.get('rmsnorm') or '?'}"]
    virtual = int(lay.get("virtual_stages") or 1)
    if (degrees["pp"] > 1 or virtual > 1) and lay.get("pipeline_schedule"):
        parts.append(lay["pipeline_schedule"] + (f" v{virtual}" if virtual > 1 else ""))
    if lay.get("sequence_parallel"):
        parts.append("sp")
    return " ".join(parts)


def spec_from_dict(d: dict) -> RunSpec:
    """Rebuild a spec stored in a record (trusted: it was validated when written)."""
    return parse_spec(d)
