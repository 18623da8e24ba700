"""The compare spec: one workload under a list of engines and layouts.

```yaml
name: my-compare            # report file names and the store's sweep tag
nproc: 2                    # processes per run (dp = nproc / (tp x cp x pp), which must divide, unless a run sets it)
parity_steps: null          # the first N steps' losses and gradient norms must agree; null: every trained step
tolerance: null             # max relative loss difference; null: by precision (fp32 1e-5, bf16 1e-3, fp8 5.7e-3)
timeout_s: 600              # per run
reference: true             # also run the single-device reference (1 process)
workload: {model: tiny, seq_len: 64, ...}   # harness.spec Workload fields
runs:                       # harness.spec Layout fields, plus:
  - {engine: own, dp: 2}                      #   label:    name in the report
  - {engine: deepspeed, zero_stage: 3}        #   launcher: torchrun | deepspeed (default by engine)
  - {engine: fsdp, reshard_after_forward: false}
  - {engine: fsdp, label: planted, workload: {seed: 7}}  # per-run workload override (shown in the report)
  - {engine: own, workload: {precision: fp8, fp8_recipe: rowwise}}  # another precision group (below)
matrix:                     # and/or: every layout under every engine (the report's matrix)
  engines: [{engine: own, zero_stage: 1}, {engine: deepspeed, zero_stage: 1}, {engine: fsdp}]
  layouts: [{dp: 8}, {tp: 2, dp: 4}, {tp: 2, pp: 2, dp: 2}]
```

Precision groups (harness.compare.groups): a run whose `workload` override changes the precision policy
(precision, fp8_recipe, grad_accum_dtype, grad_reduce_dtype) belongs to that policy's group, which gets a
single-device reference of its own ("reference fp8 rowwise (single device)": the workload with the override's
policy fields) and its precision's default tolerance; its runs are checked against that reference only, and
compared with no run of another group. A `tolerance` set here serves one policy: with several groups it is
an error (one line, exit 2), not silently applied to some. An fp8 workload's bf16 baseline (fp8_vs_bf16) is
planned as before; an fp8 group of a workload in another precision gets none (its cost against bf16 is
measured where the workload itself is fp8); where a bf16 group's reference would be that baseline, the one run
serves both.

Everything is checked before the first launch: each run's spec (harness.spec), world size,
and its DeepSpeed config (auto fields, contradictions: harness.frameworks.deepspeed.config). A matrix
cell whose engine cannot run its layout (its engine's facts) is not an error: it is
listed as not runnable, with the reason, and the report shows it as a dash.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass, field

from harness import registry
from harness.compare.groups import (  # DEFAULT_TOLERANCE: where the tests and benchmarks import it
    DEFAULT_TOLERANCE,  # noqa: F401
    REFERENCE,
    PrecisionGroup,
    new_group,
    policy_key,
    policy_override,
)
from harness.errors import CapabilityError, SpecError, shown
from harness.launch import LOCAL_LAUNCHERS
from harness.parallel_dims import ParallelDims
from harness.spec import (
    build_spec,
    check_device_count,
    check_name,
    check_path,
    check_positive,
    check_positive_int,
    engine_variant,
    layout_label,
    parallel_label,
    read_yaml,
    spec_field,
)

RUN_EXTRA = ("label", "launcher", "workload")
BF16_BASELINE = "reference bf16 (single device)"

# The built-in default: a tiny LLaMA on this CPU machine, 2 processes, a few minutes.
DEFAULT = {
    "name": "cpu-default",
    "nproc": 2,
    "tolerance": None,
    "timeout_s": 240,
    "reference": True,
    "workload": {
        "model": "tiny",
        "seq_len": 64,
        "global_batch_size": 8,
        "steps": 8,
        "warmup_steps": 2,
        "precision": "fp32",
        "device": "cpu",
        "seed": 1234,
        # a loss that falls (about 40% in the 10 steps, the reference's): parity then compares training;
        # uniform tokens would hold it at ln 256 whatever the runs' updates were
        "data": {"kind": "markov"},
        "optimizer": {"lr": 3e-3},
    },
    "runs": [
        {"label": "own dp2", "engine": "own", "dp": 2, "micro_batch_size": 2},
        {"label": "own tp2", "engine": "own", "tp": 2, "micro_batch_size": 2},
        {"label": "own pp2", "engine": "own", "pp": 2, "micro_batch_size": 2},
        {"label": "deepspeed ZeRO-1", "engine": "deepspeed", "zero_stage": 1, "micro_batch_size": 2},
        {"label": "deepspeed ZeRO-2", "engine": "deepspeed", "zero_stage": 2, "micro_batch_size": 2},
        {"label": "deepspeed ZeRO-3", "engine": "deepspeed", "zero_stage": 3, "micro_batch_size": 2},
        {"label": "FSDP2 reshard", "engine": "fsdp", "reshard_after_forward": True, "micro_batch_size": 2},
        {"label": "FSDP2 no reshard", "engine": "fsdp", "reshard_after_forward": False, "micro_batch_size": 2},
        # the same tp2 and pp2 layouts under DeepSpeed (AutoTP; its pipeline engine) and native PyTorch
        {"label": "deepspeed tp2", "engine": "deepspeed", "tp": 2, "zero_stage": 1, "micro_batch_size": 2},
        {"label": "deepspeed pp2", "engine": "deepspeed", "pp": 2, "zero_stage": 1, "micro_batch_size": 2},
        {"label": "FSDP2 tp2", "engine": "fsdp", "tp": 2, "micro_batch_size": 2},
        {"label": "FSDP2 pp2", "engine": "fsdp", "pp": 2, "micro_batch_size": 2},
        # Megatron-core itself at the own engine's three layouts (its local layer spec has one core
        # attention, softmax(QK^T)V materialised: naive)
        {"label": "megatron dp2", "engine": "megatron", "dp": 2, "micro_batch_size": 2, "attention": "naive"},
        {"label": "megatron tp2", "engine": "megatron", "tp": 2, "micro_batch_size": 2, "attention": "naive"},
        {"label": "megatron pp2", "engine": "megatron", "pp": 2, "micro_batch_size": 2, "attention": "naive"},
        # the own engine at Megatron's kernel and layout: one like-for-like pair of the two Megatron-style engines
        {"label": "own tp2 naive", "engine": "own", "tp": 2, "micro_batch_size": 2, "attention": "naive"},
    ],
}


def _name(value, field: str) -> str:
    return check_name(
        str(value or "compare"), field, "the report files", reserved=len("harness-compare--") + 12
    )  # its log folder: name + an id


def _tolerance(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise SpecError(field, "must be a non-negative number (max relative loss difference)")
    if not math.isfinite(value):  # .nan compares false with every difference: parity would fail "x vs x"
        raise SpecError(field, f"must be a finite number, got {value!r}")
    return float(value)


def _runs(value, field: str) -> list:
    if not isinstance(value, list):
        raise SpecError(field, "must be a list of layouts")
    return value


_LAYOUTS = "must be a non-empty list of mappings of layout fields"


def _layouts(value, field: str) -> list:
    if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
        raise SpecError(field, _LAYOUTS)
    return value


@dataclass
class Matrix:
    """Every layout under every engine: the report's layout-by-engine matrix."""

    engines: list[dict] = spec_field(check=_layouts, required=_LAYOUTS)  # Layout fields naming an engine
    layouts: list[dict] = spec_field(check=_layouts, required=_LAYOUTS)  # Layout fields but the engine


@dataclass
class CompareInput:
    """A compare spec as written (the format above), every field checked by harness.spec's builder;
    parse_compare_spec plans it into a CompareSpec."""

    NULL_IS_DEFAULT: typing.ClassVar[bool] = True
    name: str = spec_field("compare", check=_name)  # report file names and the store's sweep tag
    nproc: int = spec_field(2, check=check_device_count)  # processes per run; dp = nproc / (tp x cp x pp) unless set
    # the first N steps' losses and gradient norms must agree; None: every step a run trains (warm-up included)
    parity_steps: int | None = spec_field(None, check=check_positive_int)
    tolerance: float | None = spec_field(None, check=_tolerance)  # max relative loss difference; None: by precision
    timeout_s: float = spec_field(600.0, check=check_positive)  # per run
    reference: bool = True  # also run the single-device reference (1 process)
    workload: dict = spec_field(factory=dict)  # harness.spec Workload fields, checked once
    runs: list = spec_field(factory=list, check=_runs)  # Layout fields, plus RUN_EXTRA
    matrix: Matrix | None = None  # and/or every layout under every engine
    store: str | None = spec_field(None, check=check_path)  # the results store (default: the CLI's)


TOP_KEYS = tuple(f.name for f in dataclasses.fields(CompareInput))


@dataclass
class PlannedRun:
    label: str
    spec: object  # harness.spec.RunSpec
    nproc: int
    launcher: str
    workload_override: dict = field(default_factory=dict)
    is_reference: bool = False
    # beside the comparison, in no parity or policy check: the bf16 reference of an fp8 workload, whose
    # losses against the fp8 reference's are the measured cost of FP8 (summary["fp8_vs_bf16"])
    baseline: bool = False
    group: str = ""  # its precision group's name (harness.compare.groups)


@dataclass
class CompareSpec:
    """The comparison planned from a CompareInput: every run's checked spec, process count and launcher."""

    name: str
    nproc: int
    parity_steps: int
    tolerance: float
    tolerance_source: str
    timeout_s: float
    workload: dict
    runs: list[PlannedRun]
    skipped: list[tuple[str, str]]  # (label, why)
    store: str | None = None
    not_runnable: list[dict] = field(default_factory=list)  # matrix cells: {label, layout, why}
    # Muon with a bf16 Newton-Schulz: {matrix: bound on two runs' final difference} (compare/muon_tolerance.py)
    muon_bounds: dict = field(default_factory=dict)
    # the runs by precision policy, the workload's first (harness.compare.groups); tolerance, its source and
    # muon_bounds above are that first group's
    groups: list[PrecisionGroup] = field(default_factory=list)


def engine_available(engine: str) -> bool:
    return registry.available(engine)


def load_compare_spec(path: str | None) -> CompareSpec:
    if path is None:
        return parse_compare_spec(copy.deepcopy(DEFAULT))
    return parse_compare_spec(read_yaml(path))


def parse_compare_spec(raw) -> CompareSpec:
    from harness.frameworks.deepspeed.config import validate
    from harness.spec import check_world_size, parse_spec

    if not isinstance(raw, dict):
        raise SpecError("spec", "top level must be a mapping")
    given = build_spec(CompareInput, raw, "")
    name, nproc, parity_steps, workload, runs_raw = (
        given.name,
        given.nproc,
        given.parity_steps,
        given.workload,
        given.runs,
    )
    matrix_runs = _matrix_runs(given.matrix)
    if not runs_raw and not matrix_runs:
        raise SpecError("runs", "must be a non-empty list of layouts (or give a matrix)")

    base = parse_spec({"workload": workload})  # checks the workload once, with its own field names
    precision = base.workload.precision
    own = new_group(base, True, given.tolerance, given.reference)  # the workload's precision group
    tolerance, source, muon_bounds = own.tolerance, own.tolerance_source, own.muon_bounds
    groups = {policy_key(base.workload): own}
    total_steps = base.workload.warmup_steps + base.workload.steps
    parity_steps = total_steps if parity_steps is None else parity_steps
    if parity_steps > total_steps:
        raise SpecError(
            "parity_steps", f"{parity_steps} > the {total_steps} steps each run trains (warm-up steps included)"
        )

    planned, skipped, labels, not_runnable, where_of = [], [], set(), [], {}
    ref_layout = {"engine": "single", "micro_batch_size": _ref_micro(runs_raw, base.workload.global_batch_size)}
    if given.reference:
        ref = parse_spec({"workload": workload, "layout": ref_layout})
        planned.append(PlannedRun(REFERENCE, ref, 1, "direct", is_reference=True, group=own.name))
        own.labels.append(REFERENCE)
        if precision == "fp8":
            bf16 = {**workload, "precision": "bf16"}
            bf16.pop("fp8_recipe", None)
            ref = parse_spec({"workload": bf16, "layout": ref_layout})
            planned.append(PlannedRun(BF16_BASELINE, ref, 1, "direct", {"precision": "bf16"}, baseline=True))
    head = len(planned)  # the references of the other precision groups go after these
    entries = [(f"runs[{i}]", e) for i, e in enumerate(runs_raw)] + matrix_runs
    for where, entry in entries:
        if not isinstance(entry, dict):
            raise SpecError(where, "must be a mapping of layout fields")
        layout = {k: v for k, v in entry.items() if k not in RUN_EXTRA}
        override = entry.get("workload") or {}
        if not isinstance(override, dict):
            raise SpecError(f"{where}.workload", "must be a mapping of workload fields to override")
        engine = layout.get("engine", "single")
        label = entry.get("label")
        if label is not None and (not isinstance(label, str) or not label.strip()):
            raise SpecError(f"{where}.label", f"must be a non-empty string, got {shown(label)}")
        label = label or layout_label(layout, short=True)
        if label in {p.label for p in planned if p.is_reference or p.baseline}:
            raise SpecError(f"{where}.label", f"{label!r} is the label of the run the harness adds; choose another")
        if label in labels:
            raise SpecError(f"{where}.label", f"{label!r} is used twice")
        labels.add(label)
        where_of[label] = where
        if registry.known(engine) and not engine_available(engine):
            skipped.append(
                (label, f"engine {engine!r} is not available in this checkout ({engine} adapter module missing)")
            )
            continue
        one_process = registry.known(engine) and registry.facts(engine).one_process
        try:
            layout = layout if one_process else _with_dp(layout, nproc)
            spec = parse_spec({"workload": {**workload, **override}, "layout": layout, "name": f"{name}/{label}"})
        except CapabilityError as e:
            if not where.startswith("matrix"):
                raise SpecError(f"{where}.{e.field.split('.', 1)[1]}", e.reason) from None
            not_runnable.append({"label": label, "layout": layout, "why": f"{e.field}: {e.reason}"})
            continue
        except SpecError as e:
            raise SpecError(
                f"{where}.{e.field.split('.', 1)[1] if e.field.startswith('layout.') else e.field}", e.reason
            ) from None
        lay = spec.layout
        world = 1 if one_process else ParallelDims.of(lay).world
        if not one_process:
            try:
                check_world_size(spec, nproc)
            except SpecError as e:
                raise SpecError(f"{where}", f"{e.reason} (nproc {nproc})") from None
        checks = registry.facts(engine).preflight  # a run's own files and this machine (compare runs here):
        if checks is not None:  # a ds_config that contradicts the workload, fsdp's cp on a CPU
            try:
                checks(spec)
            except SpecError as e:
                if checks is validate:
                    raise  # "error: <file>: <key>: <reason>"
                if not where.startswith("matrix"):
                    raise SpecError(
                        f"{where}.{e.field.split('.', 1)[1] if e.field.startswith('layout.') else e.field}", e.reason
                    ) from None
                not_runnable.append({"label": label, "layout": layout, "why": f"{e.field}: {e.reason}"})
                continue
        launcher = entry.get("launcher", registry.facts(engine).launcher)
        if launcher not in LOCAL_LAUNCHERS:
            raise SpecError(f"{where}.launcher", " or ".join(LOCAL_LAUNCHERS))
        group = groups.get(policy_key(spec.workload))
        if group is None:
            group = _other_group(where, override, workload, ref_layout, own, given, planned, head, len(groups))
            groups[policy_key(spec.workload)] = group
        group.labels.append(label)
        planned.append(PlannedRun(label, spec, world, launcher, workload_override=override, group=group.name))
    for group in list(groups.values())[1:]:  # a run may not take the label of a reference the harness adds
        if group.reference in labels:
            raise SpecError(
                f"{where_of[group.reference]}.label",
                f"{group.reference!r} is the label of the run the harness adds; choose another",
            )
    return CompareSpec(
        name,
        nproc,
        parity_steps,
        tolerance,
        source,
        float(given.timeout_s),
        workload,
        planned,
        skipped,
        given.store,
        not_runnable,
        muon_bounds,
        list(groups.values()),
    )


def _other_group(where, override, workload, ref_layout, own, given, planned, head, n) -> PrecisionGroup:
    """The precision group of a run whose override changes the workload's policy, with its single-device
    reference planned after the workload's (its workload: the compare's with the override's policy fields).
    One tolerance set in the compare spec cannot serve two precisions: an error. The fp8 workload's bf16
    baseline, where this group's reference is the same run, becomes that reference (still fp8_vs_bf16's)."""
    from harness.spec import parse_spec

    policy = policy_override(override)
    ref = parse_spec({"workload": {**workload, **policy}, "layout": ref_layout})
    group = new_group(ref, False, None, given.reference)
    if given.tolerance is not None:
        raise SpecError(
            "tolerance",
            f"one tolerance cannot serve two precision policies ({own.name}; {group.name}, {where}.workload): leave "
            "it null, each precision group is then checked at its precision's default",
        )
    if given.reference:
        twin = next((p for p in planned if p.baseline and p.label == group.reference), None)
        if twin is not None:
            twin.is_reference, twin.baseline, twin.group = True, False, group.name
        else:
            planned.insert(head + n - 1, PlannedRun(group.reference, ref, 1, "direct", policy, True, group=group.name))
        group.labels.append(group.reference)
    return group


def _with_dp(layout: dict, nproc: int) -> dict:
    """A run's layout with dp = nproc / (tp x cp x pp) unless it sets dp (ParallelDims' one rule: an nproc
    that tp x cp x pp does not divide is an error); a malformed degree is left to the spec's checks."""
    tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
    if "dp" in layout or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tp, pp, cp)):
        return layout
    try:
        dims = ParallelDims.derive(nproc, field="layout.dp", tp=tp, pp=pp, cp=cp)
    except SpecError as e:
        raise SpecError(
            e.field, f"{e.reason} (nproc {nproc}: a run that does not set dp takes nproc / (tp x cp x pp))"
        ) from None
    return {**layout, "dp": dims.dp}


def _matrix_runs(matrix: Matrix | None) -> list[tuple[str, dict]]:
    """Every layout under every engine, as (where, run entry); labelled '<engine> <layout>'."""
    if matrix is None:
        return []
    engines, out = matrix.engines, []
    for j, layout in enumerate(matrix.layouts):
        if "engine" in layout:
            raise SpecError(f"matrix.layouts[{j}].engine", "engines are the matrix's other axis")
        for i, engine in enumerate(engines):
            if "engine" not in engine:
                raise SpecError(f"matrix.engines[{i}].engine", "required")
            entry = {**layout, **engine}
            entry["label"] = f"{engine_variant(engine)} {parallel_label(layout) or 'one process'}"
            out.append((f"matrix.engines[{i}] x matrix.layouts[{j}]", entry))
    return out


def _ref_micro(runs_raw, global_batch: int) -> int:
    """The reference's micro-batch size: the runs' (when they agree and it divides the batch)."""
    sizes = {r.get("micro_batch_size", 1) for r in runs_raw if isinstance(r, dict)}
    size = sizes.pop() if len(sizes) == 1 else 1
    return size if isinstance(size, int) and size > 0 and global_batch % size == 0 else 1
