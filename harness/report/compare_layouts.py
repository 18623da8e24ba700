"""What tells a comparison's runs apart: the layout-by-engine matrix (a row per layout, a column per
engine variant, a dash with the reason where an engine cannot run it) and the fields that differ
between runs, each run's value of them (an engine's own default included)."""

from __future__ import annotations

import dataclasses
import json
import os

from harness import registry
from harness.parallel_dims import LABEL_ORDER, ParallelDims
from harness.report.compare_machine import OVERSUBSCRIBED, oversubscribed
from harness.report.data import coverage_label, coverage_of
from harness.report.precision_groups import group_of
from harness.spec import Layout, capability_error, engine_variant, layout_label, parallel_label


def _ms(x) -> str:
    return f"{x * 1e3:.1f}" if isinstance(x, (int, float)) else "n/a"


# What tells a comparison's layouts apart (the matrix's rows); the engine variant is the column.
ROW_FIELDS = (*LABEL_ORDER, "cp_impl", "sequence_parallel", "micro_batch_size", "activation_checkpointing")


# What makes a matrix column (engine_variant); every other field that differs between runs is a row.
VARIANT_FIELDS = ("engine", "zero_stage", "reshard_after_forward", "model_impl", "ds_moe")


def _mark(run: dict, summary: dict) -> str:
    """' (oversubscribed)' after a cell whose run had more busy threads than cores (compare_machine); its
    precision group after one of another policy than the workload's, whose time the others' are not
    comparable with (report.precision_groups)."""
    own = {g["name"] for g in summary.get("precision_groups") or [] if g.get("workload_group")}
    group = group_of(run) if own and group_of(run) not in own else None
    return (f" ({OVERSUBSCRIBED})" if oversubscribed(run, summary) else "") + (
        f" (precision {group}: not comparable with the other precision's times)" if group else ""
    )


def _full_layout(layout: dict) -> dict:
    """Every field of a run's layout: an old record's missing ones at their defaults, the engine's own
    where it declares one."""
    layout = layout or {}
    return {**dataclasses.asdict(Layout()), **registry.layout_defaults(layout.get("engine", Layout.engine)), **layout}


def _matrix_layout(layout: dict) -> dict:
    """A run's layout as the matrix groups it: every field (an old record's missing ones at their
    defaults), cp_impl at its default without context parallelism, where it changes nothing."""
    lay = _full_layout(layout)
    return lay if ParallelDims.of(lay).cp > 1 else {**lay, "cp_impl": Layout.cp_impl}


def _at_defaults(key: str, layouts: list[dict]) -> bool:
    """Whether every layout has field `key` at its engine's default (its own, else the field's): then
    the values differ by engine, which the columns already show, not by layout."""
    general = dataclasses.asdict(Layout())
    return all(lay[key] == registry.layout_defaults(lay["engine"]).get(key, general[key]) for lay in layouts)


def _run_fields(run: dict, workload: dict) -> dict:
    """Every layout field of a run, and every workload field a run overrides (`workload.<key>`,
    with the compared workload's value for the runs that do not)."""
    return {
        **_full_layout(run.get("layout")),
        **{f"workload.{k}": v for k, v in (workload or {}).items()},
        **{f"workload.{k}": v for k, v in (run.get("workload_override") or {}).items()},
    }


def differing_fields(summary: dict) -> list[str]:
    """The fields whose value is not the same in every run (the engine has its own column),
    in the Layout's field order: computed from the layouts, not from a list of usual suspects."""
    fields = [_run_fields(r, summary.get("workload")) for r in summary["runs"]]
    keys = list(dict.fromkeys(k for f in fields for k in f))
    return [
        k
        for k in keys
        if k != "engine" and len({json.dumps(f.get(k), sort_keys=True, default=str) for f in fields}) > 1
    ]


def _field_value(key: str, value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if key == "ds_config":
        return os.path.basename(value) if value else "none"
    return json.dumps(value, default=str) if isinstance(value, (dict, list, tuple)) else str(value)


def differs_texts(summary: dict) -> list[str]:
    """Per run (in order), `field=value` for each field that differs between the compared runs
    ('-' for none), less the fields that do not apply to that run. Which apply, the layout's label
    says (spec.layout_label, the one place that knows it): a field the label shows for some run but
    whose other values would not change this run's label is not this run's (reshard_after_forward
    under the own engine, zero_stage under FSDP2, the schedule without pipeline stages); a field no
    label shows (ds_config, a workload override) always applies."""
    keys = differing_fields(summary)
    everyone = [_run_fields(r, summary.get("workload")) for r in summary["runs"]]
    values = {
        k: [v for v in {json.dumps(f.get(k), sort_keys=True, default=str): f.get(k) for f in everyone}.values()]
        for k in keys
    }

    def changes_label(fields: dict, key: str) -> bool:
        if key.startswith("workload."):
            return False
        lay = {k: v for k, v in fields.items() if not k.startswith("workload.")}
        return any(layout_label({**lay, key: v}) != layout_label(lay) for v in values[key] if v != lay[key])

    labelled = {k: [changes_label(f, k) for f in everyone] for k in keys}
    return [
        " ".join(
            f"{k}={_field_value(k, f.get(k))}"
            for k in keys
            if (labelled[k][i] or not any(labelled[k])) and _precision_applies(k, f.get("workload.precision"))
        )
        or "-"
        for i, f in enumerate(everyone)
    ]


# the workload's precision-policy fields and the precisions whose policy reads them (model.training's
# precision_policy): an fp32 run has no fp8 recipe and accumulates and reduces in fp32 whatever the fields say
_POLICY_FIELD_PRECISIONS = {
    "workload.fp8_recipe": ("fp8",),
    "workload.grad_accum_dtype": ("bf16", "fp8"),
    "workload.grad_reduce_dtype": ("bf16", "fp8"),
}


def _precision_applies(key: str, precision) -> bool:
    """Whether a run of this precision reads the field (a precision-policy field, else always)."""
    return key not in _POLICY_FIELD_PRECISIONS or precision in _POLICY_FIELD_PRECISIONS[key]


def _row_text(lay: dict, extra_fields: tuple = ()) -> str:
    extra = [f"mbs {lay['micro_batch_size']}"]
    if lay["activation_checkpointing"] != "none":
        extra.append(f"ckpt {lay['activation_checkpointing']}")
    extra += [f"{k}={_field_value(k, lay[k])}" for k in extra_fields]
    return " ".join([parallel_label(lay) or "one process"] + extra)


def layout_matrix(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Layouts by engine: per cell the run's median step time [its interval] (that interval's coverage,
    report.data.coverage_of) and parity verdict, or a
    dash with the reason the engine cannot run that layout (its facts, harness.registry)."""
    runs = [r for r in summary["runs"] if not r.get("is_reference")]
    parity = {p["label"]: p["verdict"] for p in summary["parity"]["runs"]}
    entries = [(_matrix_layout(r["layout"]), r) for r in runs] + [
        (_matrix_layout(n["layout"]), n) for n in summary.get("not_runnable") or []
    ]
    # a field outside ROW_FIELDS that differs (virtual stages, schedule, kernels...) makes rows too
    extra = tuple(
        k
        for k in _full_layout({})
        if k not in ROW_FIELDS + VARIANT_FIELDS
        and len({json.dumps(lay[k], default=str) for lay, _ in entries}) > 1
        and not _at_defaults(k, [lay for lay, _ in entries])
    )
    row_fields = ROW_FIELDS + extra
    rows, cols, cells = {}, {}, {}
    for lay, entry in entries:
        row, col = tuple(lay[k] for k in row_fields), engine_variant(lay)
        rows.setdefault(row, lay)
        cols.setdefault(col, lay)
        if "why" in entry:
            cells[row, col] = f"– {entry['why']}"
        else:
            st = (entry.get("metrics") or {}).get("step_time_s") or {}
            cells[row, col] = (
                f"{_ms(st.get('median'))} ms [{_ms(st.get('ci95_low'))}, {_ms(st.get('ci95_high'))}] "
                f"({coverage_label([coverage_of(st.get('ci_coverage'), st.get('n'))])}) "
                f"{parity.get(entry['label'], '-')}{_mark(entry, summary)}"
                if st
                else f"{entry['status']}"
            )
    table = []
    for row, row_lay in rows.items():
        line = [_row_text(row_lay, extra)]
        for col, col_lay in cols.items():
            if (row, col) not in cells:
                merged = {**col_lay, **{k: row_lay[k] for k in row_fields}}
                error = capability_error(Layout(**merged))
                cells[row, col] = f"– {error}" if error else "not run"
            line.append(cells[row, col])
        table.append(line)
    return ["layout"] + list(cols), table
