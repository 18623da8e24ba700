"""Stored records as rows the report can sort, group and plot (flattened by harness.store.fields).

Optional metrics (breakdown, timeline, MFU on a machine without a known peak) may be
missing; every accessor here returns None rather than failing, so one odd record cannot
break a report of two thousand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.measure.stats import coverage_text, median_coverage
from harness.parallel_dims import ParallelDims
from harness.profiling import MEASURED_SOURCE
from harness.report.compare_machine import run_threads
from harness.report.sections import Column
from harness.spec import engine_variant, layout_label
from harness.store import fields
from harness.store.fields import MISSING, row

# ---------------------------------------------------------------- where the step goes

# The components of a step in the order reports stack them; exposed communication is one per axis
# (`<axis>_comm`), what an old record names otherwise (FSDP2's forward_backward) comes after them.
COMPONENTS = (
    "compute",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "pp_comm",
    "dp_comm",
    "one-rank_comm",
    "bubble",
    "wait",
    "optimizer",
    "unattributed",
    "other",
)
TITLES = {
    "compute": "compute",
    "bubble": "pipeline bubble",
    "wait": "waiting for other ranks",  # blocked at the world-wide reductions, without a pipeline
    "optimizer": "optimizer",
    "other": "host overhead and other",
    "forward_backward": "forward+backward (compute and comm not split)",
    "pp_comm": "pipeline transfers",  # a pp send's or receive's blocked time once its peer was ready
    "one-rank_comm": "calls on one-rank groups (no communication)",  # an axis of degree 1: nothing moves
    "unattributed": "not clocked (the step less its clocked parts)",  # shown apart: no component explains by it
}


def component_title(key: str) -> str:
    """The words a report uses for a component: `tp_comm` is 'exposed tp communication'."""
    if key in TITLES:
        return TITLES[key]
    if key.startswith("part of ") and key.endswith("_comm"):  # a group named by the axes it spans part of
        return f"exposed communication in {key[:-5]}"
    return f"exposed {key[:-5]} communication" if key.endswith("_comm") else key.replace("_", " ")


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Breakdown:
    """One run's profiled step in ms per component (mean over ranks), the step they sum to, and
    whether a profiler trace or the engine's own counters measured it."""

    parts: dict[str, float]
    step_ms: float
    source: str

    def share(self, key: str) -> float | None:
        return self.parts[key] / self.step_ms if key in self.parts and self.step_ms > 0 else None


def _ordered(parts: dict[str, float]) -> dict[str, float]:
    return {
        k: parts[k]
        for k in sorted(parts, key=lambda k: (COMPONENTS.index(k) if k in COMPONENTS else len(COMPONENTS), k))
    }


def breakdown_of(metrics: dict | None, pp: int | None = None) -> Breakdown | None:
    """The step breakdown of a record's metrics: breakdown_ms where the run has it, else the older
    breakdown_s (the engine's own counters, in seconds; what its total leaves uncovered is `unattributed`),
    else None (not measured). With `pp` 1 a 'bubble' (what records before the fix called the wait
    at the world-wide reductions) is 'wait': there is no pipeline to have a bubble."""
    found = _breakdown_of(metrics or {})
    if found is not None and pp == 1 and "bubble" in found.parts:
        parts = {("wait" if k == "bubble" else k): v for k, v in found.parts.items()}
        found = Breakdown(_ordered(parts), found.step_ms, found.source)
    return found


MEASURED = MEASURED_SOURCE  # the source of a breakdown clocked during the measured steps themselves


def _from_ms(new: dict, source: str) -> Breakdown:
    comm = new.get("exposed_comm") if isinstance(new.get("exposed_comm"), dict) else {}
    parts = {f"{axis}_comm": float(ms) for axis, ms in comm.items() if _num(ms)}
    parts.update({k: float(v) for k, v in new.items() if k not in ("step", "exposed_comm") and _num(v)})
    step = float(new["step"]) if _num(new.get("step")) else sum(parts.values())
    return Breakdown(_ordered(parts), step, source)


def _breakdown_of(m: dict) -> Breakdown | None:
    """The measured steps' breakdown (breakdown_measured_ms) where the run has it, else the profiled
    steps' (breakdown_ms), else the engine's counters of old records (breakdown_s)."""
    measured = m.get("breakdown_measured_ms")
    if isinstance(measured, dict) and measured:
        return _from_ms(measured, MEASURED)
    new = m.get("breakdown_ms")
    if isinstance(new, dict) and new:
        return _from_ms(new, m.get("breakdown_source") or "profiler")
    old = m.get("breakdown_s")
    if isinstance(old, dict) and old:
        parts = {k: 1e3 * float(v) for k, v in old.items() if k != "total" and _num(v)}
        step = 1e3 * float(old["total"]) if _num(old.get("total")) else sum(parts.values())
        rest = step - sum(parts.values())
        if abs(rest) > 1e-9 * max(step, 1.0):  # what the counters' clocks leave: shown apart, no component
            parts["unattributed"] = rest
        return Breakdown(_ordered(parts), step, "instrumented")
    return None


def collectives_of(metrics: dict | None) -> tuple[list[dict], str] | None:
    """Collectives per step as [{axis, kind, count, bytes}] and their source: the profiler's
    `collectives`, else the own engine's counted `comm` ({axis: {op: {count, bytes}}}), else None."""
    m = metrics or {}
    if isinstance(m.get("collectives"), list):
        return [dict(c) for c in m["collectives"]], "profiler"  # counted in the profiled steps' trace
    if isinstance(m.get("comm"), dict):
        return [
            {"axis": axis, "kind": op, "count": v.get("count"), "bytes": v.get("bytes")}
            for axis, ops in m["comm"].items()
            for op, v in (ops or {}).items()
        ], "instrumented"
    return None


def layout_key(layout) -> str:
    """Everything that names a layout but its engine (the label less the engine variant): runs
    with the same key are the same layout under different engines."""
    return layout_label(layout)[len(engine_variant(layout)) :].strip() or "one process"


# What a report row holds where a record lacks a field or holds it empty (the export keeps None:
# harness.store.fields.row).
STAND_INS = {
    "run_id": "?",
    "sweep": "(no sweep)",
    "status": "?",
    "engine": "?",
    "model": "None",
    "activation_checkpointing": "none",
    "sequence_parallel": False,
    "attention": "?",
    "rmsnorm": "?",
}


@dataclass
class RowOwn:
    """What a report row reads of a record itself (the degrees as ParallelDims gives them, the whole error,
    the metrics no table flattens) and derives from its layout; Row adds every other field of the record."""

    variant: str = ""  # engine and sharding mode (spec.engine_variant)
    label: str = ""  # spec.layout_label
    layout_key: str = ""  # layout_key: the label without the engine
    gpus: int | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism's degree (records written before it: 1)
    cp_impl: str = ""  # and its implementation, '' without it
    ep: int = 1  # the expert-parallel degree (records written before it, and dense models: 1)
    breakdown: dict | None = None  # the record's breakdown_s as it is (old records)
    step_breakdown: Breakdown | None = None  # breakdown_of(the record's metrics)
    collectives: tuple | None = None  # collectives_of(the record's metrics): (list, source)
    timeline: list | None = None
    error: str = ""
    error_line: str = ""  # the run's first `error:` line (launch.first_error_line), if it printed one
    oversubscribed: bool = False  # more busy threads than cores (compare_machine): not ranked nor explained
    device: str = ""
    hosts: tuple = ()
    versions: tuple = ()
    values: dict = field(default_factory=dict)  # every field's value (harness.store.fields.row)
    layout: dict = field(default_factory=dict)  # the record's layout as it is (an ablation matches the others)
    workload: dict = field(default_factory=dict)  # and its workload (a sweep may vary workload fields too)
    step_times: tuple = ()  # every measured step's time (s): two runs' ratio interval (measure.stats)

    @property
    def kernel(self) -> str:
        return f"{self.attention}+{self.rmsnorm}"

    @property
    def context(self) -> str:
        """Context parallelism as an ablation names it: 'cp1' (none), 'cp2 ring'."""
        return f"cp{self.cp} {self.cp_impl}" if self.cp > 1 else "cp1"

    @property
    def expert(self) -> str:
        """Expert parallelism as an ablation names it: 'ep1' (every rank holds every expert), 'ep4'."""
        return f"ep{self.ep}"

    @property
    def compiled(self) -> str:
        """torch.compile as an ablation names it: 'none' (eager; records written before it too), 'blocks'."""
        return str(self.layout.get("compile") or "none")

    @property
    def schedule(self) -> str:
        """The pipeline schedule as an ablation names it: '1f1b', 'interleaved v2', 'zbv'."""
        v = int(self.layout.get("virtual_stages") or 1)
        return str(self.layout.get("pipeline_schedule") or "1f1b") + (f" v{v}" if v > 1 else "")

    @property
    def reason(self) -> str:
        if self.error_line:
            return self.error_line[:160]
        lines = [ln.strip() for ln in (self.error or "").splitlines() if ln.strip()]
        return lines[0][:160] if lines else ""


_OWN = {f.name for f in dataclasses.fields(RowOwn)}
ROW_FIELDS = tuple(f.name for f in fields.FIELDS if f.name not in _OWN)  # Row's attributes from the record's fields
Row = dataclasses.make_dataclass(
    "Row",
    [(name, Any, field(default=None)) for name in ROW_FIELDS],
    bases=(RowOwn,),
    namespace={
        "__module__": __name__,
        "__doc__": """One run as the sweep report reads it: every field of harness.store.fields under its name
    (ROW_FIELDS, a STAND_INS value where the record has none) and RowOwn's.""",
    },
)


def to_row(rec: dict) -> Row:
    v, lay = row(rec), (rec.get("spec") or {}).get("layout") or {}
    m, fp = rec.get("metrics") or {}, rec.get("fingerprint") or {}
    dims = ParallelDims.of(lay)
    versions = tuple(f"{k} {fp.get(k)}" for k in ("torch", "cuda", "nccl", "deepspeed", "megatron_core") if fp.get(k))
    return Row(
        **{name: (v[name] or STAND_INS[name]) if name in STAND_INS else v[name] for name in ROW_FIELDS},
        variant=engine_variant(lay),
        label=layout_label(lay),
        layout_key=layout_key(lay),
        gpus=fp.get("world_size") or dims.world,
        tp=dims.tp,
        pp=dims.pp,
        dp=dims.dp,
        cp=dims.cp,
        cp_impl=(lay.get("cp_impl") or "ring") if dims.cp > 1 else "",
        ep=dims.ep,
        breakdown=m.get("breakdown_s") or None,
        step_breakdown=breakdown_of(m, dims.pp),
        collectives=collectives_of(m),
        timeline=m.get("pipeline_timeline") or None,
        error=rec.get("error") or "",
        error_line=rec.get("error_line") or "",
        oversubscribed=run_threads(
            {"nproc": (rec.get("launch") or {}).get("nproc"), "fingerprint": fp}, {}
        ).oversubscribed,
        device=str(fp.get("device_name") or ""),
        hosts=tuple(sorted(set(fp.get("hosts") or []))),
        versions=versions,
        values=v,
        layout=lay,
        workload=(rec.get("spec") or {}).get("workload") or {},
        step_times=tuple(m.get("step_times_s") or ()),
    )


def shared_matmul_peaks(records: list[dict]) -> dict[str, float]:
    """One matmul peak per device for a whole report: the highest rate any of its ok runs measured on that
    device (load only lowers a microbenchmark, so the highest is the nearest the device's own). Each run's
    own figure moved with the load of its moment (0.023-0.103 TFLOP/s in one CPU sweep): divided by it,
    runs 2x apart in tokens/s showed the same MFU."""
    out: dict[str, float] = {}
    for rec in records:
        peak = (rec.get("metrics") or {}).get("measured_matmul_tflops")
        device = str((rec.get("fingerprint") or {}).get("device_name") or "")
        if rec.get("status") == "ok" and _num(peak) and peak > 0:
            out[device] = max(out.get(device, 0.0), float(peak))
    return out


def with_shared_peak(r: Row, rec: dict, peaks: dict[str, float]) -> Row:
    """The row's "MFU vs measured matmul" against its device's shared peak (shared_matmul_peaks), PaLM FLOPs
    per token and tokens/s per device: one definition for every run of the report; None without a peak."""
    m = rec.get("metrics") or {}
    fpt, tps, peak = (m.get("flops_per_token") or {}).get("palm"), m.get("tokens_per_s_per_device"), peaks.get(r.device)
    value = fpt * tps / (peak * 1e12) if r.status == "ok" and _num(fpt) and _num(tps) and peak else None
    r.values["mfu_vs_measured_matmul"] = r.mfu_vs_measured_matmul = value
    return r


def coverage_of(coverage, n) -> float | None:
    """The coverage of a median's interval: as recorded (step_time_s.ci_coverage), else from its step count
    (measure.stats.median_coverage, a function of n alone: records written before coverage was kept);
    None where neither was recorded."""
    if isinstance(coverage, (int, float)) and not isinstance(coverage, bool):
        return float(coverage)
    return median_coverage(n) if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def coverage_label(coverages) -> str:
    """'99.2%' where every interval covers the same, '93.8% to 99.2%' where the runs' step counts differ,
    'coverage not recorded' where none is known (said so where only some are)."""
    known = sorted({round(c, 9) for c in coverages if c is not None})
    if not known:
        return "coverage not recorded"
    text = coverage_text(known[0]) if len(known) == 1 else f"{coverage_text(known[0])} to {coverage_text(known[-1])}"
    return text + (", some not recorded" if any(c is None for c in coverages) else "")


def values_coverage(values: dict) -> float | None:
    """A row's (harness.store.fields.row) step-time interval coverage (coverage_of)."""
    return coverage_of(values.get("step_time_ci_coverage"), values.get("steps_measured"))


def interval_name(coverages) -> str:
    """What a figure's whisker or a table's column is: 'interval of the median (99.2%)'."""
    return f"interval of the median ({coverage_label(list(coverages))})"


def interval_cell(values: dict) -> str:
    """A run's step-time interval with its coverage: '[17.8 ms, 19.0 ms] (99.2%)'; '-' without one."""
    pair = values.get("step_time_ci95_s")
    if not isinstance(pair, (list, tuple)) or len(pair) != 2 or None in pair:
        return MISSING
    return f"{fields.fmt_interval(pair)} ({coverage_label([values_coverage(values)])})"


def measured_columns(values: Callable[[Any], dict]) -> list[Column]:
    """A column per reported field (harness.store.fields.reported), reading an item's row with `values`; the
    median's interval with its coverage (interval_cell)."""
    return [
        Column(f.header, lambda item: interval_cell(values(item)))
        if f.name == "step_time_ci95_s"
        else Column(f.header, lambda item, f=f: f.cell(values(item).get(f.name)))
        for f in fields.reported()
    ]


@dataclass
class Metric:
    """The number layouts are ranked by: MFU where a peak is known, else the best substitute."""

    key: str
    title: str
    percent: bool
    short: str = "MFU"

    def of(self, r: Row) -> float | None:
        if self.key == "mfu":
            return r.values.get("mfu_palm")
        if self.key == "mfu_measured":
            return r.values.get("mfu_vs_measured_matmul")
        return r.tokens_per_s_per_device

    def fmt(self, v: float | None) -> str:
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if self.percent else f"{v:,.0f}"


def choose_metric(rows: list[Row]) -> Metric:
    """MFU against the datasheet peak where the runs know one; else tokens/s per device.

    Not MFU against the measured matmul peak: each run measures its own peak, and on a shared
    or throttled machine that figure moves from run to run, which would rank layouts by the
    noise of the microbenchmark. Within a sweep the workload is identical, so tokens/s per
    device ranks the same way MFU would.
    """
    ok = [r for r in rows if r.status == "ok"]
    if ok and any(r.values.get("mfu_palm") is not None for r in ok):
        return Metric("mfu", "MFU (PaLM FLOPs, vs the device's datasheet dense bf16 peak)", True, "MFU")
    return Metric(
        "tokens_per_s_dev",
        "tokens/s per device (no datasheet peak is known for this machine, so no MFU)",
        False,
        "tokens/s per device",
    )


def fmt_bytes(n) -> str:
    return MISSING if n is None else fields.fmt_bytes(n)


def fmt_s(v) -> str:
    return MISSING if v is None else fields.fmt_s(v)
