"""The comparison report's tables of where each engine's step goes: the profiled steps' breakdown,
the collectives per step, the kept traces, the memory census and the why section (each layout's
fastest engine against the others, from the breakdowns). They lay out what the records say."""

from __future__ import annotations

import os
from urllib.parse import quote

from harness.report.data import COMPONENTS, Breakdown, breakdown_of, collectives_of, component_title, layout_key
from harness.report.sections import Items, Section
from harness.report.why import Case, comparisons
from harness.spec import engine_variant

NOT_MEASURED = "not measured"


def run_metrics(run: dict) -> dict:
    """A run's metrics with the summary's own breakdown fields (orchestrate._run_entry) on top."""
    m = dict(run.get("metrics") or {})
    m.update({k: run[k] for k in ("breakdown_ms", "breakdown_source", "collectives") if run.get(k) is not None})
    return m


def _share(b: Breakdown, key: str) -> str:
    if key not in b.parts:
        return "-"
    share = b.share(key)
    return f"{b.parts[key]:.1f} ms" + (f" ({100 * share:.0f}%)" if share is not None else "")


def breakdown_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Where each run's profiled step goes, per component, in ms and % of the step; 'not measured'
    only for a run that has no breakdown at all, never an estimate."""
    runs = [(r, breakdown_of(run_metrics(r))) for r in summary["runs"]]
    keys = sorted_components([b for _, b in runs if b])
    header = ["run", "source"] + [component_title(k) for k in keys] + ["step"]
    out = []
    for r, b in runs:
        if b is None:
            out.append([r["label"], NOT_MEASURED] + [NOT_MEASURED] * len(keys) + [NOT_MEASURED])
        else:
            out.append([r["label"], b.source] + [_share(b, k) for k in keys] + [f"{b.step_ms:.1f} ms"])
    return header, out


def sorted_components(breakdowns: list[Breakdown]) -> list[str]:
    """Every component any of the breakdowns has, in the order they are stacked (data.COMPONENTS)."""
    keys = {k for b in breakdowns for k in b.parts}
    return sorted(keys, key=lambda k: (COMPONENTS.index(k) if k in COMPONENTS else len(COMPONENTS), k))


def _bytes(n) -> str:
    return f"{n / 2**20:,.2f} MiB" if isinstance(n, (int, float)) else "-"


def collective_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Each run's collectives per step: axis, kind, count, bytes (one row each)."""
    header = ["run", "source", "axis", "kind", "count per step", "bytes per step"]
    out = []
    for r in summary["runs"]:
        found = collectives_of(run_metrics(r))
        if found is None:
            out.append([r["label"], NOT_MEASURED, "-", "-", "-", "-"])
            continue
        coll, source = found
        out += [
            [
                r["label"],
                source,
                str(c.get("axis")),
                str(c.get("kind")),
                str(c.get("count", "-")),
                _bytes(c.get("bytes")),
            ]
            for c in coll
        ] or [[r["label"], source, "-", "none", "0", "-"]]
    return header, out


TRACES_TEXT = (
    "Each trace is gzipped Chrome/Perfetto JSON of the profiled steps: open it at "
    "https://ui.perfetto.dev (Open trace file) or in Chrome at chrome://tracing (Load); both read "
    "the .json.gz as it is."
)


def _trace_name(trace: dict) -> str:
    rank = f"rank {trace.get('rank')}"
    role = trace.get("role") or rank
    return role if role == rank else f"{role} ({rank})"


def _trace_link(path: str, base: str | None) -> str:
    """A trace path relative to the report's folder (`base`), so the two can move together. A relative path
    in a record is relative to the folder the comparison ran in, as `base` is (one process writes both)."""
    if base:
        path = os.path.relpath(os.path.abspath(path), os.path.abspath(base))
    return quote(path, safe="/:._-~")


def trace_items(summary: dict, base: str | None = None) -> list[str]:
    """Per run, a link to each kept trace (rank 0, the slowest rank)."""
    out = []
    for r in summary["runs"]:
        traces = r.get("traces") or []
        links = ", ".join(f"[{_trace_name(t)}]({_trace_link(str(t['path']), base)})" for t in traces if t.get("path"))
        out.append(f"**{r['label']}**: {links or 'no trace kept'}")
    return out


def why_cases(summary: dict) -> list[Case]:
    """The compared runs (not the reference) that finished and have a breakdown."""
    out = []
    for r in summary["runs"]:
        b = breakdown_of(run_metrics(r))
        if r.get("is_reference") or r.get("status") != "ok" or b is None:
            continue
        out.append(
            Case(
                r["label"],
                engine_variant(r["layout"]),
                layout_key(r["layout"]),
                ((r.get("metrics") or {}).get("step_time_s") or {}).get("median"),
                b,
            )
        )
    return out


WHY_TEXT = (
    "Computed from the breakdowns above. For each layout, its fastest engine against each other engine; "
    "for each engine, its fastest layout against each other layout (the fastest run's pairs first). "
    "Each sentence names the components whose difference covers at least 80% of the difference in "
    "profiled step time, largest first (at most three)."
)


def why_section(summary: dict) -> Section:
    cases = why_cases(summary)
    if len(cases) < 2:
        return Section("why", "Why", body=["Fewer than two finished runs have a step breakdown: nothing to explain."])
    fastest = min(cases, key=lambda c: c.step_s if c.step_s is not None else c.breakdown.step_ms / 1e3)
    engines, layouts = comparisons(cases)
    body = [WHY_TEXT, f"Fastest run: **{fastest.label}**."]
    body += [
        "**The same layout under other engines**",
        Items(engines or ["No layout ran under two engines."]),
        "**The same engine at other layouts**",
        Items(layouts or ["No engine ran two layouts."]),
    ]
    return Section("why", "Why", body=body)


CENSUS_TEXT = (
    "Bytes rank 0 held at its first optimizer step, by category and dtype, counted from the tensors "
    "the engine really holds (each storage once), and in bytes per parameter of the model (xP: fp32 "
    "parameters are 4.00P, a shard of them over 2 ranks 2.00P); activations: what autograd saved for "
    "backward, per micro-batch. What a framework holds beyond the policy is shown as it is."
)
BUFFERS_TEXT = (
    "Communication buffers: the buckets a framework keeps for its collectives (DeepSpeed ZeRO-3's reduce "
    "bucket of zero_optimization.reduce_bucket_size elements, held for the whole run), sized by its "
    "config, not by the model: given in elements, not per parameter; '-' where the engine keeps none "
    "at the step."
)


def census_text(summary: dict) -> list[str]:
    """What the census table shows: its buffers column explained only where it is shown."""
    shown = any(((r.get("metrics") or {}).get("memory_census") or {}).get("buffers") for r in summary["runs"])
    return [CENSUS_TEXT, BUFFERS_TEXT] if shown else [CENSUS_TEXT]


def _buffer_cell(by_dtype: dict | None) -> str:
    size = {"fp32": 4, "bf16": 2, "fp16": 2}
    if not by_dtype:
        return "-"
    return ", ".join(
        f"{dtype} {n / 2**20:,.2f} MiB" + (f" ({n // size[dtype]:,} elements)" if dtype in size else "")
        for dtype, n in sorted(by_dtype.items())
    )


def _census_cell(by_dtype: dict | None, params: int | None) -> str:
    if not by_dtype:
        return "none" if by_dtype is not None else NOT_MEASURED
    return ", ".join(
        f"{dtype} {n / 2**20:,.2f} MiB" + (f" ({n / params:.2f}P)" if params else "")
        for dtype, n in sorted(by_dtype.items())
    )


def census_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Each run's memory census (rank 0) and saved activations; 'not measured' where absent."""
    categories = ("parameters", "gradients", "master_parameters", "optimizer_states")
    censuses = [(r.get("metrics") or {}).get("memory_census") for r in summary["runs"]]
    buffers = any((c or {}).get("buffers") for c in censuses)  # the column only where some run keeps one
    header = ["run"] + [c.replace("_", " ") for c in categories]
    header += ["communication buffers"] * buffers + ["activations saved / micro-batch"]
    rows = []
    for r, census in zip(summary["runs"], censuses, strict=True):
        m = r.get("metrics") or {}
        params, act = m.get("parameter_count"), m.get("activations_saved_bytes")
        rows.append(
            [r["label"]]
            + [_census_cell(census.get(c, {}) if census is not None else None, params) for c in categories]
            + ([_buffer_cell(census.get("buffers")) if census is not None else NOT_MEASURED] if buffers else [])
            + [f"{act / 2**20:,.2f} MiB" if act is not None else NOT_MEASURED]
        )
    return header, rows
