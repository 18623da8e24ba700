"""The comparison report's tables of where each engine's step goes: the profiled steps' breakdown,
the collectives per step, the kept traces, the memory census and the why section (each layout's
fastest engine against the others, from the breakdowns). They lay out what the records say."""

from __future__ import annotations

from harness.parallel_dims import ParallelDims
from harness.report.breakdown import HARNESS_AXIS
from harness.report.compare_census import NOT_MEASURED, census_rows, census_text, flop_text  # noqa: F401
from harness.report.compare_machine import oversubscribed, skipped_sentence, timed_runs
from harness.report.data import COMPONENTS, Breakdown, breakdown_of, collectives_of, component_title, layout_key
from harness.report.drift import load_drift_factor, load_drift_text
from harness.report.precision_groups import partitions, several
from harness.report.sections import Items, Section
from harness.report.why import Case, against_median, comparisons, explain, factors
from harness.spec import engine_variant

BREAKDOWN_TEXT = (
    "In ms and % of the step, the mean over ranks (a group that not every rank belongs to: the mean over its "
    "members). Source 'measured steps': clocked during the measured steps themselves, the same way for every "
    "engine, over the median measured step (the middle one or two by time). Compute is clocked: the time "
    "inside forward (the outermost module call) and backward (the autograd engine), less the collectives and "
    "waits inside them. Exposed communication is the time a rank was blocked on that axis's collectives (what"
    " overlapped compute is not counted; '-' where the axis has degree 1); calls on one-rank groups "
    "(Megatron's tensor-parallel group at tp 1) move nothing and are their own component. Pipeline transfers:"
    " the part of a pp send's or receive's blocked time after its peer had posted the other side (both ranks'"
    " clocks are the host's monotonic clock; ranks on several hosts: not split, no column); pipeline bubble "
    "(pp > 1) or waiting for other ranks (without a pipeline): blocked before the peer was ready, or at the "
    "world-wide reductions. Optimizer: the time inside the optimizer's step. Not clocked: what no clock "
    "covers (the loss outside a module, clipping outside the optimizer, a framework's host bookkeeping), "
    "negative where clocks overlap: the step less its clocked parts, so it is no component, shown apart and "
    "never a component of an explanation in Why (it says its share of a difference apart); host overhead "
    "and other: what of the measured step (the "
    "slowest rank's) a rank spent outside its own. Source 'profiler': from the torch.profiler trace of extra "
    "steps after the measured ones, whose own cost lengthens them (runs on a GPU, where a collective's wait "
    "happens on the device, out of the clocks' sight, and older runs): compute is the operators' time, not "
    "clocked the host time between them; 'instrumented': the engine's own counters. The check: the clocked "
    "parts' sum (not clocked left out, so nothing closes it) as a share of its run's measured median; Why "
    "does not use a breakdown whose step (clocked and not) is more than 10% off the median (other steps "
    "than the measured ones) or whose clocked parts sum to more than 110% of it (clocks that overlap); "
    "below 100% the rest is not clocked, and Why says its share. 'not measured' where a run has none."
)
COLLECTIVES_TEXT = (
    "Collectives issued per step by rank 0 (counted in the profiled steps), per axis and kind: the "
    "axis whose process group the call ran on (a send or receive without a group: the axis to its "
    "peer; all: every rank, a call that names no group, as the own engine's loss and gradient-norm "
    "reduction; tp+pp, tp+dp: Megatron's model-parallel and tensor-and-data groups; embedding: its "
    "embedding group; a group that is none of these named by the axes its ranks span ('pp+dp', or 'part "
    "of dp (2 of 4 ranks)'); '(one "
    "rank)': a group of this run's degrees that holds one rank, a call that moves nothing between ranks); "
    "'instrumented': the own engine's counted communication. The harness's own loss reduction (one "
    "all_reduce of the step's loss over every rank, for the parity check) is not the engine's and is "
    "left out."
)


BREAKDOWN_AXIS = "ms per step, mean over ranks (measured steps: the median step; profiler: the profiled steps)"


def run_metrics(run: dict) -> dict:
    """A run's metrics with the summary's own breakdown fields (orchestrate._run_entry) on top."""
    m = dict(run.get("metrics") or {})
    m.update({k: run[k] for k in ("breakdown_ms", "breakdown_source", "collectives") if run.get(k) is not None})
    return m


def run_breakdown(run: dict) -> Breakdown | None:
    """The run's breakdown, its waiting named for its layout (no bubble without a pipeline), an axis of
    degree 1 left out ('-') and what calls on its one-rank groups took, if anything, under their own name
    (records written before the measured steps did so themselves)."""
    dims = ParallelDims.of(run.get("layout") or {})
    b = breakdown_of(run_metrics(run), dims.pp)
    if b is None:
        return None
    parts: dict[str, float] = {}
    for key, ms in b.parts.items():
        axis = key[: -len("_comm")] if key.endswith("_comm") else None
        if axis is not None and _one_rank(axis, dims):
            if ms:
                parts[ONE_RANK_KEY] = parts.get(ONE_RANK_KEY, 0.0) + ms
            continue
        parts[key] = ms
    return Breakdown(parts, b.step_ms, b.source) if parts != b.parts else b


ONE_RANK_KEY = "one-rank_comm"  # profiling.analysis.ONE_RANK's component


def _one_rank(axis: str, dims: ParallelDims) -> bool:
    """profiling.analysis.one_rank (dp: the replica group, dp x cp), without importing torch."""
    parts = axis.split("+")
    size = {**dims.sizes(), "dp": dims.replicas()}
    return all(p in size for p in parts) and all(size[p] == 1 for p in parts)


def _median_s(run: dict) -> float | None:
    return ((run.get("metrics") or {}).get("step_time_s") or {}).get("median")


def _share(b: Breakdown, key: str) -> str:
    if key not in b.parts:
        return "-"
    share = b.share(key)
    return f"{b.parts[key]:.1f} ms" + (f" ({100 * share:.0f}%)" if share is not None else "")


def breakdown_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Where each run's profiled step goes, per component, in ms and % of the step; 'not measured'
    only for a run that has no breakdown at all, never an estimate."""
    runs = [(r, run_breakdown(r)) for r in summary["runs"]]
    keys = sorted_components([b for _, b in runs if b])
    header = ["run", "source"] + [component_title(k) for k in keys]
    casts = any(run_metrics(r).get("compute_fp8_cast_ms") is not None for r, _ in runs)
    header += ["of compute: FP8 casts (profiled steps)"] if casts else []
    header += ["step", "measured median", "clocked share of the median"]
    out = []
    for r, b in runs:
        median = _median_s(r)
        shown = f"{1e3 * median:.1f} ms" if median else "-"
        if b is None:
            out.append([r["label"], NOT_MEASURED] + [NOT_MEASURED] * (len(keys) + casts) + [NOT_MEASURED, shown, "-"])
        else:
            row = [r["label"], b.source] + [_share(b, k) for k in keys]
            if casts:
                cast = run_metrics(r).get("compute_fp8_cast_ms")
                row.append("-" if cast is None else f"{cast:.1f} ms")
            out.append(row + [f"{b.step_ms:.1f} ms", shown, against_median(b, median)])
    return header, out


FLOP_FLAG = 1.5  # a run whose compute costs this much more than the reference's per FLOP is flagged


def _profiled_split(run: dict) -> tuple[float, float] | None:
    """(operator time, host time between operators) of a run's profiled steps' compute, ms per rank: the
    profiler's breakdown (its compute is operator time, its unattributed the gaps; older records: compute
    held both, compute_host_gaps_ms the gaps)."""
    m = run.get("metrics") or {}
    b, gaps = m.get("breakdown_ms"), m.get("compute_host_gaps_ms")
    if m.get("breakdown_source") != "profiler" or not isinstance(b, dict) or not isinstance(gaps, (int, float)):
        return None
    ops = b.get("compute", 0.0) - (0.0 if "unattributed" in b else gaps)
    return ops, gaps


def compute_flags(summary: dict) -> list[str]:
    """Runs whose measured compute, summed over their ranks, exceeds FLOP_FLAG x the reference's for the same
    workload (the same FLOPs, but for recomputation), with where the profiled steps say the time went; each
    run against its own precision group's reference (report.precision_groups)."""
    out = [line for _, part in partitions(summary) for line in _compute_flags(part)]
    if out:
        of = "its precision group's reference's" if several(summary) else "the reference's"
        out.insert(0, f"Compute costing more than {FLOP_FLAG}x {of} per FLOP:")
    return out


def _compute_flags(summary: dict) -> list[str]:
    runs = summary.get("runs") or []
    ref = next((r for r in runs if r.get("is_reference") and r.get("status") == "ok"), None)
    rb = run_breakdown(ref) if ref else None
    if not rb or not rb.parts.get("compute"):
        return []
    ref_cost = rb.parts["compute"] * (ref.get("nproc") or 1)
    ref_split = _profiled_split(ref)
    out = []
    for r in runs:
        b = run_breakdown(r) if r is not ref and r.get("status") == "ok" else None
        if not b or "compute" not in b.parts:
            continue
        n = r.get("nproc") or 1
        ratio = b.parts["compute"] * n / ref_cost
        if ratio <= FLOP_FLAG:
            continue
        text = (
            f"**{r['label']}**: compute {b.parts['compute']:.1f} ms per rank on {n} rank{'s' * (n != 1)} costs "
            f"{ratio:.1f}x the reference's {rb.parts['compute']:.1f} ms for the same FLOPs"
        )
        if (r.get("layout") or {}).get("activation_checkpointing", "none") != "none":
            text += " (its recomputation adds FLOPs)"
        split = _profiled_split(r)
        if split and ref_split:
            text += (
                f"; in the profiled steps (slower than the measured ones) its compute was {split[0]:.1f} ms of "
                f"operators and {split[1]:.1f} ms of host time between them per rank, against the reference's "
                f"{ref_split[0]:.1f} and {ref_split[1]:.1f} ms"
            )
        out.append(text + ".")
    return out


def sorted_components(breakdowns: list[Breakdown]) -> list[str]:
    """Every component any of the breakdowns has, in the order they are stacked (data.COMPONENTS)."""
    keys = {k for b in breakdowns for k in b.parts}
    return sorted(keys, key=lambda k: (COMPONENTS.index(k) if k in COMPONENTS else len(COMPONENTS), k))


def _bytes(n) -> str:
    return f"{n / 2**20:,.2f} MiB" if isinstance(n, (int, float)) else "-"


def axis_text(axis, dims: ParallelDims) -> str:
    """An axis as the table names it: 'tp (one rank)' where the run's degrees make its group one
    rank (Megatron's tensor-parallel group at tp 1 still takes its cross-entropy reductions)."""
    parts = str(axis).split("+")
    if all(p in dims.sizes() for p in parts) and dims.product(*parts) == 1:
        return f"{axis} (one rank)"
    return str(axis)


def collective_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Each run's collectives per step: axis, kind, count, bytes (one row each); the harness's own
    loss reduction left out (COLLECTIVES_TEXT says so)."""
    header = ["run", "source", "axis", "kind", "count per step", "bytes per step"]
    out = []
    for r in summary["runs"]:
        found = collectives_of(run_metrics(r))
        if found is None:
            out.append([r["label"], NOT_MEASURED, "-", "-", "-", "-"])
            continue
        coll, source = found
        dims = ParallelDims.of(r.get("layout") or {})
        out += [
            [
                r["label"],
                source,
                axis_text(c.get("axis"), dims),
                str(c.get("kind")),
                str(c.get("count", "-")),
                _bytes(c.get("bytes")),
            ]
            for c in coll
            if c.get("axis") != HARNESS_AXIS
        ] or [[r["label"], source, "-", "none", "0", "-"]]
    return header, out


TRACES_TEXT = (
    "Each trace is gzipped Chrome/Perfetto JSON of the profiled steps: open it at "
    "https://ui.perfetto.dev (Open trace file) or in Chrome at chrome://tracing (Load); both read "
    "the .json.gz as it is."
)


def why_cases(summary: dict) -> list[Case]:
    """The compared runs (not the reference) that finished, have a breakdown and were not oversubscribed."""
    out = []
    for r in summary["runs"]:
        b = run_breakdown(r)
        if r.get("is_reference") or r.get("status") != "ok" or b is None or oversubscribed(r, summary):
            continue
        stats = (r.get("metrics") or {}).get("step_time_s") or {}
        ci = (stats["ci95_low"], stats["ci95_high"]) if "ci95_low" in stats and "ci95_high" in stats else None
        imbalance = (r.get("row") or {}).get("router_imbalance")
        key = layout_key(r["layout"])
        rounds = r.get("step_time_rounds_s")  # runs measured in alternating rounds (compare --rounds)
        times = tuple(map(tuple, rounds)) if rounds else tuple((r.get("metrics") or {}).get("step_times_s") or ())
        drift = load_drift_factor(summary)
        out.append(
            Case(
                r["label"],
                engine_variant(r["layout"]),
                key,
                stats.get("median"),
                b,
                ci,
                imbalance,
                times,
                drift,
                fields=factors(r["layout"]),
                unit=r.get("step_time_unit") or "round",
            )
        )
    return out


WHY_TEXT = (
    "For each layout, its fastest engine against each other engine (and the own engine against the "
    "others); for each engine, two layouts only where they differ in one factor (the parallel split, or "
    "one other layout field: the attention and norm kernels, checkpointing, micro-batch, schedule, "
    "sequence parallelism), each run against the fastest such run; the fastest run's pairs first. "
    "Which run is slower is decided by the interval on the ratio of the two runs' step times "
    "(one launch per run: every measured step, the Hodges-Lehmann ratio with its distribution-free "
    "Mann-Whitney interval, its coverage stated, at least 95%, widened by the load drift the comparison "
    "measured where it found one; runs measured in rounds or interleaved turns: the round or turn is the "
    "unit, since the steps of one launch share its load: each block's own ratio, and across blocks the "
    "sign test's exact interval on their median from 6 blocks on, Student's t on their mean below, "
    "never narrower than a block's own spread): "
    "'slower' where it lies above 1; 'not distinguishable' where it lies within the equivalence margin of "
    "10% either way; 'undecided' otherwise, with the measured steps per run (or the rounds or turns) that "
    "the observed spread would need. "
    "Only a run decided slower is explained. A difference is explained "
    "only from breakdowns whose sum lies within 10% of their run's measured median, by every component "
    "that moved by 10% of the difference between the breakdowns or more, either way: those that moved "
    "with the step with their share of it, largest first, then those that partly offset it; where "
    "components moved both ways by more than that difference, no share is given."
)


def same_run_twice(cases: list[Case]) -> list[str]:
    """Runs of one engine and layout under different labels, each against the first of them: nothing but
    the moment they ran differs, so the statistics must not call one slower (the comparisons' pairs
    leave them out: they differ in neither the engine nor the layout)."""
    first: dict = {}
    out = []
    for c in cases:
        key = (c.engine, c.layout)
        if key in first:
            out.append(explain(first[key], c))
        else:
            first[key] = c
    return out


def fastest_run(summary: dict) -> dict | None:
    """The timed run (not oversubscribed) with the lowest measured median step, as the verdict ranks them."""
    timed = [r for r in timed_runs(summary) if _median_s(r)]
    return min(timed, key=_median_s) if timed else None


def console_lines(summary: dict) -> list[str]:
    """What `harness compare` prints after its verdict: the fastest run and Why's pairs, as the report says them
    (per precision group where the runs hold several: report.precision_groups)."""
    if not summary.get("runs"):
        return []
    out = []
    for name, part in partitions(summary):
        fastest, cases = fastest_run(part), why_cases(part)
        of = "" if name is None else f" of precision group {name}"
        out += [f"fastest run{of} (measured median): {fastest['label']}"] if fastest else []
        engines, layouts = comparisons(cases) if len(cases) >= 2 else ([], [])
        out += [f"why: {line.replace('**', '')}" for line in [*engines, *layouts, *same_run_twice(cases)]]
    return out


WHY_GROUPS_TEXT = (
    "The runs hold several precision policies: runs are ranked and explained within their precision group "
    "only (engines compare under one precision policy)."
)


def why_section(summary: dict) -> Section:
    cases, skipped = why_cases(summary), skipped_sentence(summary)
    if several(summary):
        drift = load_drift_text(summary)
        body = [WHY_TEXT, WHY_GROUPS_TEXT, *skipped, *([drift] if drift else [])]
        for name, part in partitions(summary):
            few = "Fewer than two of its finished runs that were not oversubscribed have a step breakdown."
            body += [f"**Precision group {name}**", *(_why_body(part) if len(why_cases(part)) > 1 else [few])]
        return Section("why", "Why", body=body)
    if len(cases) < 2:
        return Section(
            "why",
            "Why",
            body=[
                "Fewer than two finished runs that were not oversubscribed have a step breakdown: nothing to explain.",
                *skipped,
            ],
        )
    drift = load_drift_text(summary)
    return Section("why", "Why", body=[WHY_TEXT, *skipped, *([drift] if drift else []), *_why_body(summary)])


def _why_body(summary: dict) -> list:
    """The fastest run and the pairs of the summary's runs (of one precision group)."""
    cases = why_cases(summary)
    fastest = fastest_run(summary)
    engines, layouts = comparisons(cases)
    body = [f"Fastest run (measured median): **{fastest['label']}**."]
    body += [
        "**The same layout under other engines**",
        Items(engines or ["No layout ran under two engines."]),
        "**The same engine at other layouts**",
        Items(layouts or ["No engine ran two layouts."]),
    ]
    twins = same_run_twice(cases)
    if twins:  # one engine and layout under two labels: what the measurement alone tells apart
        body += ["**The same engine and layout under other labels**", Items(twins)]
    return body
