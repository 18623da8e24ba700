"""A comparison against an earlier one's JSON report (`harness compare SPEC --baseline OLD.json`): what
a user's CI checks after each change: what drifted. Not harness/report/published_figures.py (figures
quoted from publications).

Runs are matched by their label (the name a compare spec gives each run); a run in one report and not
the other, or whose engine and layout changed under the same label, is a drift of its own. For each
matched run three things are compared:

- its losses over the parity window (the first parity_steps steps, the window the parity tolerance is
  set for) within that tolerance, relative to the baseline's loss;
- its memory census (bytes per category and dtype: exact, a count does not vary between runs);
- its step time as a ratio to the reference run's in the same comparison, so that a machine uniformly
  faster or slower than the baseline's moves both and not the verdict: the ratio interval of every
  measured step (measure.stats.ratio_interval, its coverage stated; a record without step times: the
  interval the two medians' CIs allow). The change between the two comparisons is the new ratio over
  the old, its interval the far ends of both (holding both intervals' coverage together); "DRIFT"
  where it lies beyond the time tolerance, "same" where it lies within it, else "undecided", with
  the smallest slowdown these steps could detect: noise cannot make a drift nor pass for "same".

A baseline from another comparison (another name or workload, or no label in common) is refused
before anything launches (check_matches).
"""

from __future__ import annotations

import dataclasses
import json
import math

from harness.errors import SpecError
from harness.measure.stats import coverage_text
from harness.measure.stats import ratio_interval as step_ratio
from harness.report.compare_machine import oversubscribed
from harness.report.sections import Items, Section, Table
from harness.spec import layout_label

DEFAULT_TIME_TOLERANCE = 0.10  # relative change of a step-time ratio; Megatron's golden values use 0.05-0.10
FIELD = "--baseline"


def load_baseline(path: str) -> dict:
    """An earlier `harness compare` JSON report, checked for what the comparison reads (a SpecError
    naming --baseline otherwise: exit 2, before anything launches)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise SpecError(FIELD, f"{path}: cannot be read ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecError(FIELD, f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise SpecError(FIELD, f"{path}: not a `harness compare` JSON report (no list of runs)")
    for i, r in enumerate(data["runs"]):
        if not isinstance(r, dict) or not isinstance(r.get("label"), str) or not isinstance(r.get("status"), str):
            raise SpecError(FIELD, f"{path}: runs[{i}] has no label or status")
        if not isinstance(r.get("metrics") or {}, dict) or not isinstance(r.get("layout") or {}, dict):
            raise SpecError(FIELD, f"{path}: runs[{i}] ({r['label']}): metrics and layout must be mappings")
        try:
            _layout(r)
        except Exception as e:  # a layout this harness cannot name: the comparison could not match it
            raise SpecError(FIELD, f"{path}: runs[{i}] ({r['label']}): layout: {e}") from None
    for key in ("loss_curves", "loss_table"):
        curves = data.get(key) or {}
        if not isinstance(curves, dict) or not all(
            isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) for v in curves.values()
        ):
            raise SpecError(FIELD, f"{path}: {key} must map run labels to lists of losses")
    return data


def _workload(raw) -> dict | None:
    """A workload as every field resolved (defaults filled in), but `steps`: more measured steps compare
    the same training; None where this harness cannot read it."""
    from harness.spec import parse_spec

    try:
        w = dataclasses.asdict(parse_spec({"workload": raw}).workload)
    except Exception:
        return None
    w.pop("steps", None)
    return w


def check_matches(baseline: dict, name: str, workload: dict, labels: list[str], path: str) -> None:
    """The baseline is an earlier run of this comparison: the same name, the same workload (every field but
    `steps`) and at least one run label in common; else a SpecError naming what differs (exit 2, before
    anything launches): a baseline from another comparison would launch every run to print drifts."""
    if baseline.get("name") != name:
        raise SpecError(FIELD, f"{path}: its comparison is {baseline.get('name')!r}, this one is {name!r}")
    old, new = _workload(baseline.get("workload")), _workload(workload)
    if old != new:
        differ = sorted(k for k in (new or {}) if (old or {}).get(k) != (new or {}).get(k)) if old else ["unreadable"]
        shown = ", ".join(f"{k} {(old or {}).get(k)!r} -> {(new or {}).get(k)!r}" for k in differ[:3]) if old else ""
        raise SpecError(FIELD, f"{path}: its workload differs from this comparison's ({shown or 'unreadable'})")
    before = [r["label"] for r in baseline["runs"]]
    if not set(before) & set(labels):
        raise SpecError(FIELD, f"{path}: no run label in common (baseline: {', '.join(before) or 'none'})")


def check_time_tolerance(value: float) -> float | None:
    """A relative tolerance: non-negative; inf: step times not compared (None)."""
    if value != value or value < 0:
        raise SpecError("--time-tolerance", f"must be a non-negative fraction (0.1 = 10%), got {value}")
    return None if value == math.inf else float(value)


def _losses(summary: dict, label: str) -> list:
    return (summary.get("loss_curves") or summary.get("loss_table") or {}).get(label) or []


def _mapping(value) -> dict:
    return value if isinstance(value, dict) else {}


def _median(run: dict) -> float | None:
    m = _mapping(_mapping(run.get("metrics")).get("step_time_s")).get("median")
    return m if isinstance(m, (int, float)) and m > 0 else None


def _census(run: dict) -> dict:
    """{(category, dtype): bytes} of a run's memory census (the summary's, as the report shows it)."""
    census = _mapping(_mapping(run.get("metrics")).get("memory_census"))
    return {(c, d): n for c, by in census.items() if isinstance(by, dict) for d, n in by.items()}


def _layout(run: dict) -> str:
    """What names a run's layout (its engine variant and every field that changes what is measured)."""
    return layout_label({"engine": run.get("engine"), **(run.get("layout") or {})})


def time_reference(old: dict, new: dict) -> str | None:
    """The run every step time is divided by: the single-device reference where it finished in both
    comparisons, else the first run (in the new order) with a step time in both."""
    before = {r["label"]: r for r in old["runs"]}
    both = [r for r in new["runs"] if _median(r) and r["label"] in before and _median(before[r["label"]])]
    ref = next((r for r in both if r.get("is_reference")), both[0] if both else None)
    return ref["label"] if ref else None


def busy(summary: dict) -> str | None:
    """'load 4.8 on 2 cores' where a comparison's 1-minute load average (before or after its runs)
    exceeded the machine's cores: other work shared it, which a ratio to the reference does not cancel
    when it changes between runs."""
    load = _mapping(summary.get("load_average"))
    cores = _mapping(_mapping(summary.get("fingerprints")).get("common")).get("cpu_cores")
    peak = max((x[0] for x in (load.get("before"), load.get("after")) if isinstance(x, list) and x), default=None)
    if isinstance(cores, int) and isinstance(peak, (int, float)) and peak > cores:
        return f"load {peak:g} on {cores} cores"
    return None


def _row(run: str, what: str, before: str, after: str, drift: str | None) -> dict:
    return {"run": run, "what": what, "before": before, "after": after, "drift": drift}


def _loss_rows(label: str, old: dict, new: dict, n: int, tol: float) -> list[dict]:
    a, b = _losses(new, label)[:n], _losses(old, label)[:n]
    if not a and not b:
        return []
    if len(a) != len(b):
        drift = f"{label}: losses: {len(b)} of the first {n} steps in the baseline, {len(a)} now"
        return [_row(label, "losses", f"{len(b)} steps", f"{len(a)} steps", drift)]
    worst, at = 0.0, 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        d = abs(x - y) / max(abs(y), 1e-12)
        if not d <= worst:  # NaN included: it is the worst
            worst, at = d, i
            if d != d:
                break
    what = f"loss, first {n} steps (tolerance {tol:g})"
    before, after = f"{b[at]:.7g} at step {at}", f"{a[at]:.7g} (rel. diff {worst:.1e})"
    drift = None
    if not worst <= tol:
        drift = f"{label}: loss at step {at}: {b[at]:.7g} -> {a[at]:.7g} (rel. diff {worst:.1e} > tolerance {tol:g})"
    return [_row(label, what, before, after, drift)]


def _census_rows(label: str, old_run: dict, new_run: dict) -> list[dict]:
    before, after = _census(old_run), _census(new_run)
    rows = []
    for c, d in sorted(set(before) | set(after)):
        x, y = before.get((c, d)), after.get((c, d))
        shown = [f"{v:,} B" if isinstance(v, (int, float)) else "none" for v in (x, y)]
        drift = None if x == y else f"{label}: census {c} {d}: {shown[0]} -> {shown[1]}"
        rows.append(_row(label, f"census {c} {d}", *shown, drift))
    return rows


def _interval(run: dict) -> tuple[float, float] | None:
    """The CI of a run's median step time (the median alone where a record has no CI)."""
    st, m = _mapping(_mapping(run.get("metrics")).get("step_time_s")), _median(run)
    low, high = st.get("ci95_low"), st.get("ci95_high")
    if m is None:
        return None
    ok = isinstance(low, (int, float)) and isinstance(high, (int, float)) and 0 < low <= m <= high
    return (low, high) if ok else (m, m)


def _times(run: dict) -> list[float]:
    t = _mapping(run.get("metrics")).get("step_times_s")
    return [x for x in t if isinstance(x, (int, float)) and x > 0] if isinstance(t, list) else []


def ratio_interval(run: dict, ref: dict) -> tuple[float, float, float, float | None] | None:
    """(low, ratio, high, coverage) of a run's step time over the reference's: the ratio interval of
    their measured steps (measure.stats); without step times the median ratio and the widest ratio the
    two medians' CIs allow (run low / reference high, run high / reference low), coverage None."""
    a, b = _times(run), _times(ref)
    if a and b:
        r = step_ratio(a, b)
        return r["low"], r["ratio"], r["high"], r["coverage"]
    x, y = _interval(run), _interval(ref)
    if x is None or y is None:
        return None
    return x[0] / y[1], _median(run) / _median(ref), x[1] / y[0], None


def time_moved(before: tuple, now: tuple, tol: float) -> float:
    """How far the ratio moved beyond what the two comparisons' intervals allow: the smallest
    relative change between any ratio inside the baseline's interval and any inside this one's
    (0 where the intervals meet). A drift is this beyond the tolerance: noise that widened an
    interval (a busy machine) cannot make one, a change larger than the noise and the tolerance
    together does."""
    if now[0] > before[2]:
        return now[0] / before[2] - 1
    if now[2] < before[0]:
        return now[2] / before[0] - 1
    return 0.0


def time_verdict(before: tuple, now: tuple, tol: float) -> dict:
    """The change of the ratio (now over before) with its interval (the far ends of both: it holds
    where both intervals do), the verdict ("DRIFT" beyond the tolerance, "same" within it, else
    "undecided") and the smallest slowdown these intervals let a drift be found at: a true change f is
    a drift once f x (low / estimate) > 1 + tol."""
    change, low, high = now[1] / before[1], now[0] / before[2], now[2] / before[0]
    moved = time_moved(before, now, tol)
    if abs(moved) > tol:
        verdict = "DRIFT"
    elif low >= 1 - tol and high <= 1 + tol:
        verdict = "same"
    else:
        verdict = "undecided"
    covers = [c for c in (before[3], now[3]) if c is not None]
    coverage = covers[0] * covers[1] if len(covers) == 2 else None
    return {
        "change": change,
        "low": low,
        "high": high,
        "coverage": coverage,
        "moved": moved,
        "verdict": verdict,
        "detectable_slowdown": (1 + tol) * change / low - 1 if low > 0 else None,
    }


def _shown(x: tuple) -> str:
    cov = f" ({coverage_text(x[3])})" if x[3] is not None else ""
    return f"{x[1]:.3f}x [{x[0]:.3f}, {x[2]:.3f}]{cov}"


def _time_row(label: str, old_run: dict, new_run: dict, ref: tuple, tol: float, loads: str) -> list[dict]:
    ratios = [ratio_interval(r, x) for r, x in zip((old_run, new_run), ref, strict=True)]
    if None in ratios:
        return []
    v, shown = time_verdict(ratios[0], ratios[1], tol), [_shown(x) for x in ratios]
    cov = "at least " + coverage_text(v["coverage"]) if v["coverage"] is not None else "from the medians' intervals"
    cov = f" ({cov})"
    change = f"change {v['change']:.3f}x [{v['low']:.3f}, {v['high']:.3f}]{cov}"
    detect = v["detectable_slowdown"]
    drift = None
    if v["verdict"] == "DRIFT":
        drift = (
            f"{label}: step time relative to {ref[1]['label']}'s: {shown[0]} -> {shown[1]} "
            f"(beyond both intervals by {100 * v['moved']:+.1f}%, tolerance {100 * tol:g}%)"
        )
        if loads:
            drift += f"; the machine was busy ({loads})"
    elif v["verdict"] == "undecided" and detect is not None:
        change += f"; these steps detect a slowdown of {100 * detect:+.0f}% or more"
    what = f"step time relative to {ref[1]['label']}'s [interval] (tolerance {100 * tol:g}% beyond the intervals)"
    row = _row(label, what, shown[0], f"{shown[1]}; {change}", drift)
    return [{**row, "verdict": v["verdict"], "detectable_slowdown": detect}]


def compare_with_baseline(
    old: dict, new: dict, time_tolerance: float | None = DEFAULT_TIME_TOLERANCE, path: str = ""
) -> dict:
    """{path, time_reference, time_tolerance, rows: [{run, what, before, after, drift}], drifts: [one
    line each]} for the new comparison's summary against the baseline's (both as `harness compare`
    writes them); time_tolerance None: step times not compared."""
    before, after = {r["label"]: r for r in old["runs"]}, {r["label"]: r for r in new["runs"]}
    par = new.get("parity") or {}
    n, tol = int(par.get("steps") or 0), float(par.get("tolerance") or 0.0)
    # several precision groups (harness.compare.groups): each run's loss at its own group's tolerance
    tols = {p["label"]: p["tolerance"] for p in par.get("runs") or [] if p.get("tolerance") is not None}
    ref_label = time_reference(old, new)
    ref = (before[ref_label], after[ref_label]) if ref_label else None
    loads = "; ".join(f"{when}: {b}" for when, b in (("baseline", busy(old)), ("now", busy(new))) if b)
    rows = []
    for label in list(after) + [lab for lab in before if lab not in after]:
        if label not in after:
            rows.append(_row(label, "run", before[label]["status"], "absent", f"{label}: in the baseline, not run now"))
            continue
        if label not in before:
            rows.append(_row(label, "run", "absent", after[label]["status"], f"{label}: not in the baseline"))
            continue
        o, r = before[label], after[label]
        layouts = [_layout(o), _layout(r)]
        if layouts[0] != layouts[1]:
            rows.append(_row(label, "layout", *layouts, f"{label}: layout {layouts[0]} -> {layouts[1]}"))
            continue
        if o["status"] != r["status"] or r["status"] != "ok":
            drift = None if o["status"] == r["status"] else f"{label}: status {o['status']} -> {r['status']}"
            rows.append(_row(label, "status", o["status"], r["status"], drift))
            continue
        rows += _loss_rows(label, old, new, n, tols.get(label, tol)) + _census_rows(label, o, r)
        # an oversubscribed run's step times measure CPU contention (compare_machine): not checked
        over = oversubscribed(o, old) or oversubscribed(r, new)
        if ref and label != ref_label and time_tolerance is not None and not over:
            rows += _time_row(label, o, r, ref, time_tolerance, loads)
    return {
        "path": path,
        "time_reference": ref_label,
        "time_tolerance": time_tolerance,
        "busy": loads,
        "rows": rows,
        "drifts": [x["drift"] for x in rows if x["drift"]],
    }


BASELINE_TEXT = (
    "This comparison against the earlier report `{path}`, run by run (matched by label): the losses over "
    "the parity window within the parity tolerance (relative), the memory census byte for byte, and the "
    "step time as a ratio to {ref}'s in the same comparison, so that a machine uniformly faster or "
    "slower than the baseline's does not move the verdict, with the ratio's interval over every measured "
    "step (Hodges-Lehmann, Mann-Whitney, its coverage stated; from the medians' intervals where a report has no "
    "step times), so that noise widens the interval rather than flipping the verdict{time}. The change is "
    "'same' only where its interval lies within the tolerance; where it can tell neither way it is "
    "'undecided', with the smallest slowdown these steps can detect."
)


def baseline_sections(summary: dict) -> list[Section]:
    """The report's Baseline section where the comparison was given one (--baseline), else nothing."""
    b = summary.get("baseline")
    if not b:
        return []
    if b.get("time_tolerance") is None:
        time = " (step times not compared: --time-tolerance inf)"
    elif b.get("time_reference"):
        time = f" (drift: a ratio that moved by more than {100 * b['time_tolerance']:g}% beyond both intervals)"
    else:
        time = " (no run has a step time in both: step times not compared)"
    drifts = b["drifts"]
    body = [
        BASELINE_TEXT.format(
            path=b["path"], ref=f"`{b['time_reference']}`" if b.get("time_reference") else "a reference run", time=time
        ),
        *(
            [
                f"The machine was busy ({b['busy']}: a load average above the core count): a step-time "
                "drift may be other work, not the change."
            ]
            if b.get("busy") and b.get("time_tolerance") is not None
            else []
        ),
        f"**{len(drifts)} drift(s)**" + (":" if drifts else ": the runs match the baseline."),
    ]
    if drifts:
        body.append(Items(drifts))
    rows = [
        [x["run"], x["what"], x["before"], x["after"], x.get("verdict") or ("DRIFT" if x["drift"] else "same")]
        for x in b["rows"]
    ]
    body.append(Table(["Run", "Compared", "Baseline", "Now", "Verdict"], rows))
    return [Section("baseline", "Baseline", body=body)]


def load_drift_factor(summary: dict) -> float:
    """The factor (>= 1) by which a comparison's pair verdicts widen their ratio intervals: the far end of
    its load-drift check's interval (the first run measured again after the last: orchestrate) where that
    check found the machine's speed changed, else 1 (no drift found)."""
    d = _mapping(summary.get("load_drift"))
    low, high = d.get("low"), d.get("high")
    if not isinstance(low, (int, float)) or not isinstance(high, (int, float)) or low <= 0:
        return 1.0
    if d.get("verdict") == "slower":
        return float(high)
    if d.get("verdict") == "faster":
        return 1.0 / float(low)
    return 1.0


def load_drift_text(summary: dict) -> str | None:
    """The report's sentence on the load-drift check, None where the comparison made none."""
    from harness.measure.stats import verdict_text

    d = _mapping(summary.get("load_drift"))
    if not d.get("verdict"):
        return d.get("note") or None
    factor = load_drift_factor(summary)
    if factor > 1:
        after = f"every pair's ratio interval is widened by {factor:.2f}x either way before it decides"
    elif d.get("verdict") == "undecided":  # too few steps to decide: no drift was ruled out either
        after = (
            "the check could not decide, so no drift is ruled out and none is corrected for: the pairs' intervals "
            "are used as measured"
        )
    else:
        after = "no drift found, the pairs' intervals are used as measured (a drift inside this interval went unseen)"
    return (
        f"Load drift: {d['run']} was measured again after the last run; its step time then against its first "
        f"measurement: {verdict_text(d)}; {after}."
    )
