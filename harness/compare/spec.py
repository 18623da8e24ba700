"""The compare spec: one workload under a list of engines and layouts.

```yaml
name: my-compare            # report file names and the store's sweep tag
nproc: 2                    # processes per run (dp = nproc / (tp x pp) unless a run sets it)
parity_steps: 5             # the first N steps' losses must agree
tolerance: null             # max relative loss difference; null: 1e-5 for fp32, 1e-3 for bf16
timeout_s: 600              # per run
reference: true             # also run the single-device reference (1 process)
workload: {model: tiny, seq_len: 64, ...}   # harness.spec Workload fields
runs:                       # harness.spec Layout fields, plus:
  - {engine: own, dp: 2}                      #   label:    name in the report
  - {engine: deepspeed, zero_stage: 3}        #   launcher: torchrun | deepspeed (default by engine)
  - {engine: fsdp, reshard_after_forward: false}
  - {engine: fsdp, label: planted, workload: {seed: 7}}  # per-run workload override (shown in the report)
matrix:                     # and/or: every layout under every engine (the report's matrix)
  engines: [{engine: own, zero_stage: 1}, {engine: deepspeed, zero_stage: 1}, {engine: fsdp}]
  layouts: [{dp: 8}, {tp: 2, dp: 4}, {tp: 2, pp: 2, dp: 2}]
```

Everything is checked before the first launch: each run's spec (harness.spec), world size,
and its DeepSpeed config (auto fields, contradictions: harness.frameworks.ds_config). A matrix
cell whose engine cannot run its layout (its adapter's ENGINE.capabilities) is not an error: it is
listed as not runnable, with the reason, and the report shows it as a dash.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from harness import registry
from harness.errors import CapabilityError, SpecError
from harness.launch import LOCAL_LAUNCHERS
from harness.spec import engine_variant, layout_label, parallel_label, read_yaml

TOP_KEYS = ("name", "nproc", "parity_steps", "tolerance", "timeout_s", "reference", "workload", "runs", "matrix",
            "store")
RUN_EXTRA = ("label", "launcher", "workload")
DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}

# The built-in default: a tiny LLaMA on this CPU machine, 2 processes, a few minutes.
DEFAULT = {
    "name": "cpu-default",
    "nproc": 2,
    "parity_steps": 5,
    "tolerance": None,
    "timeout_s": 240,
    "reference": True,
    "workload": {"model": "tiny", "seq_len": 64, "global_batch_size": 8, "steps": 8, "warmup_steps": 2,
                 "precision": "fp32", "device": "cpu", "seed": 1234},
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
    ],
}


@dataclass
class PlannedRun:
    label: str
    spec: object  # harness.spec.RunSpec
    nproc: int
    launcher: str
    workload_override: dict = field(default_factory=dict)
    is_reference: bool = False


@dataclass
class CompareSpec:
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


def engine_available(engine: str) -> bool:
    return registry.available(engine)


def load_compare_spec(path: str | None) -> CompareSpec:
    if path is None:
        return parse_compare_spec(copy.deepcopy(DEFAULT))
    return parse_compare_spec(read_yaml(path))


def _int(raw: dict, key: str, default):
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise SpecError(key, f"must be a positive integer, got {v!r}")
    return v


def parse_compare_spec(raw) -> CompareSpec:
    from harness.frameworks.ds_config import validate
    from harness.spec import check_file_name, check_positive, check_world_size, parse_spec

    if not isinstance(raw, dict):
        raise SpecError("spec", "top level must be a mapping")
    for key in raw:
        if key not in TOP_KEYS:
            raise SpecError(str(key), f"unknown key; allowed: {', '.join(TOP_KEYS)}")
    name = str(raw.get("name") or "compare")
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise SpecError("name", "letters, digits, '-', '_' and '.' only (it names the report files)")
    check_file_name(name, "name", reserved=len("harness-compare--") + 12)  # its log folder: name + an id
    nproc = _int(raw, "nproc", 2)
    parity_steps = _int(raw, "parity_steps", 5)
    timeout_s = check_positive(raw.get("timeout_s", 600), "timeout_s")
    if not isinstance(raw.get("reference", True), bool):
        raise SpecError("reference", f"must be true or false, got {raw['reference']!r}")
    if raw.get("store") is not None and (not isinstance(raw["store"], str) or not raw["store"].strip()):
        raise SpecError("store", f"must be a file path, got {raw['store']!r}")
    workload = raw.get("workload") or {}
    if not isinstance(workload, dict):
        raise SpecError("workload", "must be a mapping")
    runs_raw = raw.get("runs", [])
    if not isinstance(runs_raw, list):
        raise SpecError("runs", "must be a list of layouts")
    matrix_runs = _matrix_runs(raw.get("matrix"))
    if not runs_raw and not matrix_runs:
        raise SpecError("runs", "must be a non-empty list of layouts (or give a matrix)")

    base = parse_spec({"workload": workload})  # checks the workload once, with its own field names
    precision = base.workload.precision
    tol = raw.get("tolerance")
    if tol is None:
        tolerance, source = DEFAULT_TOLERANCE[precision], f"default for {precision}"
    elif isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol < 0:
        raise SpecError("tolerance", "must be a non-negative number (max relative loss difference)")
    else:
        tolerance, source = float(tol), "set in the compare spec"
    total_steps = base.workload.warmup_steps + base.workload.steps
    if parity_steps > total_steps:
        raise SpecError("parity_steps", f"{parity_steps} > the {total_steps} steps each run trains "
                                        "(warm-up steps included)")

    planned, skipped, labels, not_runnable = [], [], set(), []
    if raw.get("reference", True):
        ref = parse_spec({"workload": workload, "layout": {"engine": "single", "micro_batch_size":
                                                           _ref_micro(runs_raw, base.workload.global_batch_size)}})
        planned.append(PlannedRun("reference (single device)", ref, 1, "direct", is_reference=True))
    entries = [(f"runs[{i}]", e) for i, e in enumerate(runs_raw)] + matrix_runs
    for where, entry in entries:
        if not isinstance(entry, dict):
            raise SpecError(where, "must be a mapping of layout fields")
        layout = {k: v for k, v in entry.items() if k not in RUN_EXTRA}
        override = entry.get("workload") or {}
        if not isinstance(override, dict):
            raise SpecError(f"{where}.workload", "must be a mapping of workload fields to override")
        engine = layout.get("engine", "single")
        label = str(entry.get("label") or layout_label(layout, short=True))
        if label in labels:
            raise SpecError(f"{where}.label", f"{label!r} is used twice")
        labels.add(label)
        if registry.known(engine) and not engine_available(engine):
            skipped.append((label, f"engine {engine!r} is not available in this checkout "
                                   f"({engine} adapter module missing)"))
            continue
        one_process = registry.known(engine) and registry.facts(engine).one_process
        tp, pp = layout.get("tp", 1), layout.get("pp", 1)
        if not one_process and "dp" not in layout and isinstance(tp, int) and isinstance(pp, int) \
                and tp > 0 and pp > 0:
            layout["dp"] = max(1, nproc // (tp * pp))
        try:
            spec = parse_spec({"workload": {**workload, **override}, "layout": layout,
                               "name": f"{name}/{label}"})
        except CapabilityError as e:
            if not where.startswith("matrix"):
                raise SpecError(f"{where}.{e.field.split('.', 1)[1]}", e.reason) from None
            not_runnable.append({"label": label, "layout": layout, "why": f"{e.field}: {e.reason}"})
            continue
        except SpecError as e:
            raise SpecError(f"{where}.{e.field.split('.', 1)[1] if e.field.startswith('layout.') else e.field}",
                            e.reason) from None
        lay = spec.layout
        world = 1 if one_process else lay.tp * lay.pp * lay.dp
        if not one_process:
            try:
                check_world_size(spec, nproc)
            except SpecError as e:
                raise SpecError(f"{where}", f"{e.reason} (nproc {nproc})") from None
        validate(spec)  # ds_config: "error: <file>: <key>: <reason>"
        launcher = entry.get("launcher", registry.facts(engine).launcher)
        if launcher not in LOCAL_LAUNCHERS:
            raise SpecError(f"{where}.launcher", " or ".join(LOCAL_LAUNCHERS))
        planned.append(PlannedRun(label, spec, world, launcher, workload_override=override))
    store = raw.get("store")
    return CompareSpec(name, nproc, parity_steps, tolerance, source, float(timeout_s), workload, planned,
                       skipped, store, not_runnable)


def _matrix_runs(matrix) -> list[tuple[str, dict]]:
    """Every layout under every engine, as (where, run entry); labelled '<engine> <layout>'."""
    if matrix is None:
        return []
    if not isinstance(matrix, dict) or set(matrix) - {"engines", "layouts"}:
        raise SpecError("matrix", "must be a mapping with `engines` and `layouts` (lists of layout fields)")
    engines, layouts = matrix.get("engines"), matrix.get("layouts")
    for key, value in (("engines", engines), ("layouts", layouts)):
        if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
            raise SpecError(f"matrix.{key}", "must be a non-empty list of mappings of layout fields")
    out = []
    for j, layout in enumerate(layouts):
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
