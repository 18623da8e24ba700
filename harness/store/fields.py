"""A record's fields: the one definition from a stored record to a flat row.

Each field names a column (the CSV export's column and the row's key), gives its header in a
report's table, how it is read from a record (None where the record lacks it: optional metrics,
old or foreign records) and how a report writes its value. The export (harness.store.export),
the comparison's run entries (harness.compare.orchestrate) and the reports (harness.report) all
flatten records with row(); a report's rows (harness.report.data.Row) hold every field as an
attribute of its name, and the reports' tables of runs show every field marked `report`. So a
metric added here once reaches the export and every report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MISSING = "-"


def at(*path: str) -> Callable[[dict], Any]:
    """A reader of record[path[0]][path[1]]...; None where any level is missing or not a dict."""

    def read(record: dict):
        value: Any = record
        for key in path:
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return value

    return read


def fmt_s(v) -> str:
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def fmt_bytes(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def fmt_pct(v) -> str:
    return f"{100 * v:.1f}%"


def fmt_count(v) -> str:
    return f"{v:,.0f}"


def fmt_interval(pair) -> str:
    return f"[{fmt_s(pair[0])}, {fmt_s(pair[1])}]"


@dataclass(frozen=True)
class Field:
    name: str  # the export's column and the row's key
    header: str  # the column's header in a report's table
    read: Callable[[dict], Any]  # record -> value (None where absent)
    fmt: Callable[[Any], str] = str  # value (not None) -> a report's cell
    export: bool = True  # a CSV column: other tools read the export, so its columns change only by addition
    report: bool = True  # a column of the reports' tables of runs (the measurements; each report lays out
    # what names the run, its layout, itself)

    def cell(self, value) -> str:
        """The value as a report writes it; '-' where it is missing or not what the field expects."""
        if value is None:
            return MISSING
        try:
            return self.fmt(value)
        except (TypeError, ValueError, IndexError):
            return str(value)


def _final_loss(record: dict):
    return (at("metrics", "losses")(record) or [None])[-1]


def _error(record: dict):
    return (record.get("error") or "")[:200] or None


def _step_ci(record: dict):
    st = at("metrics", "step_time_s")(record) or {}
    return (st.get("ci95_low"), st.get("ci95_high")) if st.get("ci95_low") is not None else None


MEASURED = "measured steps"  # harness.profiling.MEASURED_SOURCE (a layer above this one)


def _breakdown(record: dict) -> dict:
    """The breakdown every report shows and the compare JSON keeps as a run's `breakdown_ms`: the measured
    steps' (breakdown_measured_ms) where the run clocked them, else the profiled steps' (breakdown_ms).
    One source, so a row's breakdown_* columns and its run's breakdown cannot disagree."""
    m = _metrics(record)
    shown = m.get("breakdown_measured_ms") or m.get("breakdown_ms")
    return shown if isinstance(shown, dict) else {}


def _breakdown_at(*path: str):
    def get(record: dict):
        v = _breakdown(record)
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    return get


def _metrics(record: dict) -> dict:
    m = at("metrics")(record)
    return m if isinstance(m, dict) else {}


def _breakdown_source(record: dict):
    m = _metrics(record)
    return MEASURED if m.get("breakdown_measured_ms") else m.get("breakdown_source")


def _exposed_comm(record: dict):
    """Exposed communication summed over the axes (ms per step of the shown breakdown, _breakdown)."""
    by_axis = _breakdown_at("exposed_comm")(record)
    return sum(by_axis.values()) if isinstance(by_axis, dict) else None


def _cp(record: dict):
    """The context-parallel degree: 1 for a record written before it existed (None without a layout)."""
    layout = at("spec", "layout")(record)
    return (layout.get("cp") or 1) if isinstance(layout, dict) else None


def _ep(record: dict):
    """The expert-parallel degree: 1 for a record written before it existed (None without a layout)."""
    layout = at("spec", "layout")(record)
    return (layout.get("ep") or 1) if isinstance(layout, dict) else None


def _router_median(key: str):
    """The median over the measured steps of a MoE run's router statistic (harness.model.moe.router_record)."""

    def read(record: dict):
        values = at("metrics", "router", key)(record)
        warmup = at("spec", "workload", "warmup_steps")(record) or 0
        kept = sorted(v for v in (values or [])[warmup:] if isinstance(v, (int, float)))
        return (kept[(len(kept) - 1) // 2] + kept[len(kept) // 2]) / 2 if kept else None

    return read


def _cp_impl(record: dict):
    """The context-parallel implementation where there is context parallelism, else None."""
    cp = _cp(record)
    return at("spec", "layout", "cp_impl")(record) if isinstance(cp, int) and cp > 1 else None


def _fp8_recipe(record: dict):
    """The FP8 recipe of an fp8 run, else None."""
    if at("spec", "workload", "precision")(record) != "fp8":
        return None
    return at("spec", "workload", "fp8_recipe")(record)


def _compile(record: dict):
    """layout.compile; none for a record written before the field (None without a layout)."""
    layout = at("spec", "layout")(record)
    return (layout.get("compile") or "none") if isinstance(layout, dict) else None


def _ms(name: str, *path: str) -> Field:
    """A component of the shown breakdown (_breakdown, ms): exported; the reports lay out their own."""
    return Field(name, name, _breakdown_at(*path), lambda v: f"{v:.1f} ms", report=False)


def _run(name: str, *path: str) -> Field:
    """A field that says what the run was (identity, workload, layout): exported, not a measurement."""
    return Field(name, name, at(*path), report=False)


FIELDS: tuple[Field, ...] = (
    _run("run_id", "run_id"),
    _run("sweep", "sweep"),
    _run("status", "status"),
    _run("engine", "spec", "layout", "engine"),
    _run("model", "spec", "workload", "model"),
    _run("seq_len", "spec", "workload", "seq_len"),
    _run("global_batch_size", "spec", "workload", "global_batch_size"),
    _run("precision", "spec", "workload", "precision"),
    _run("tp", "spec", "layout", "tp"),
    _run("pp", "spec", "layout", "pp"),
    _run("dp", "spec", "layout", "dp"),
    _run("micro_batch_size", "spec", "layout", "micro_batch_size"),
    _run("activation_checkpointing", "spec", "layout", "activation_checkpointing"),
    _run("sequence_parallel", "spec", "layout", "sequence_parallel"),
    _run("attention", "spec", "layout", "attention"),
    _run("rmsnorm", "spec", "layout", "rmsnorm"),
    _run("zero_stage", "spec", "layout", "zero_stage"),
    Field("step_time_median_s", "step (median)", at("metrics", "step_time_s", "median"), fmt_s),
    # the median's distribution-free interval (measure.stats.median_interval: its keys keep the name ci95, its
    # coverage is what it covers, 99.2% at 8 steps); the reports write its cell with that coverage (report.data)
    Field("step_time_ci95_s", "median interval (coverage)", _step_ci, fmt_interval, export=False),
    Field("step_time_ci95_low_s", "interval low", at("metrics", "step_time_s", "ci95_low"), fmt_s, report=False),
    Field("step_time_ci95_high_s", "interval high", at("metrics", "step_time_s", "ci95_high"), fmt_s, report=False),
    Field("steps_measured", "steps", at("metrics", "step_time_s", "n"), report=False),
    # not exported; None in records written before it (report.data.coverage_of: from the step count)
    Field(
        "step_time_ci_coverage",
        "interval coverage",
        at("metrics", "step_time_s", "ci_coverage"),
        fmt_pct,
        export=False,
        report=False,
    ),
    Field("tokens_per_s", "tokens/s", at("metrics", "tokens_per_s"), fmt_count),
    Field("tokens_per_s_per_device", "tok/s/device", at("metrics", "tokens_per_s_per_device"), fmt_count, export=False),
    Field("mfu_palm", "MFU", at("metrics", "mfu", "palm"), fmt_pct),
    Field("mfu_megatron", "MFU megatron", at("metrics", "mfu", "megatron"), fmt_pct),
    Field("hfu", "HFU", at("metrics", "mfu", "hardware"), fmt_pct),
    Field(
        "mfu_vs_measured_matmul",
        "MFU vs measured matmul",
        at("metrics", "mfu_vs_measured_matmul", "palm"),
        fmt_pct,
        export=False,
    ),
    Field("peak_memory_bytes", "peak mem", at("metrics", "peak_memory_bytes"), fmt_bytes),
    Field("memory_kind", "memory kind", at("metrics", "memory_kind"), export=False, report=False),
    Field("final_loss", "final loss", _final_loss, report=False),
    Field("error", "error", _error, report=False),
    Field("started_at", "started", at("started_at"), report=False),
    Field("ended_at", "ended", at("ended_at"), report=False),
    Field("breakdown_source", "breakdown from", _breakdown_source, report=False),
    _ms("breakdown_step_ms", "step"),
    _ms("breakdown_compute_ms", "compute"),
    _ms("breakdown_optimizer_ms", "optimizer"),
    Field(
        "breakdown_exposed_comm_ms", "breakdown_exposed_comm_ms", _exposed_comm, lambda v: f"{v:.1f} ms", report=False
    ),
    _ms("breakdown_exposed_tp_ms", "exposed_comm", "tp"),
    _ms("breakdown_exposed_dp_ms", "exposed_comm", "dp"),
    _ms("breakdown_exposed_pp_ms", "exposed_comm", "pp"),
    _ms("breakdown_bubble_ms", "bubble"),
    _ms("breakdown_other_ms", "other"),
    # a run whose loss became non-finite is failed, and stopped at this step (1-based, warm-up included)
    Field("diverged_at_step", "diverged at step", at("diverged_at_step"), report=False),
    # context parallelism (added after the columns above, which other tools may read by position);
    # records written before it read cp 1, and no cp_impl or exposed cp communication
    Field("cp", "cp", _cp, report=False),
    Field("cp_impl", "cp_impl", _cp_impl, report=False),
    _ms("breakdown_exposed_cp_ms", "exposed_comm", "cp"),
    # precision fp8 (added after cp): torchao's recipe, and how the FP8 GEMMs ran (torch._scaled_mm or emulated)
    Field("fp8_recipe", "fp8 recipe", _fp8_recipe, report=False),
    Field("fp8_backend", "fp8 GEMMs", at("metrics", "engine", "fp8_backend"), report=False),
    # the profiled step's time inside torchao's FP8 casts (a part of compute; CPU traces)
    Field(
        "breakdown_fp8_cast_ms",
        "fp8 casts",
        at("metrics", "compute_fp8_cast_ms"),
        lambda v: f"{v:.1f} ms",
        report=False,
    ),
    # torch.compile (layout.compile, added after cp); records written before it read none and no compile fields
    Field("compile", "compile", _compile, report=False),
    Field("compile_s", "compile s", at("metrics", "compile", "compile_s"), fmt_s, report=False),
    Field("graph_breaks", "graph breaks", at("metrics", "compile", "graph_breaks"), report=False),
    # mixture of experts (added after compile): the expert-parallel degree, its exposed all-to-all, and the
    # router's statistics over the measured steps (medians); dense runs read ep 1 and nothing else
    Field("ep", "ep", _ep, report=False),
    _ms("breakdown_exposed_ep_ms", "exposed_comm", "ep"),
    Field("router_imbalance", "expert imbalance", _router_median("imbalance_max"), lambda v: f"{v:.2f}", report=False),
    Field("router_aux_loss", "aux loss", _router_median("aux_loss"), lambda v: f"{v:.4f}", report=False),
    Field("active_parameter_count", "active parameters", at("metrics", "active_parameter_count"), report=False),
)


def exported() -> list[Field]:
    """The CSV export's columns, in order."""
    return [f for f in FIELDS if f.export]


def reported() -> list[Field]:
    """The measurements every report's table of runs shows, in order."""
    return [f for f in FIELDS if f.report]


def row(record: dict) -> dict:
    """Every field's value for one record, in FIELDS order."""
    return {f.name: f.read(record) for f in FIELDS}
