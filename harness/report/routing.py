"""The comparison report's routing section, for runs of a mixture-of-experts model: each run's router
statistics as its record holds them (harness.model.moe.router_record: tokens per expert, the
imbalance the slowest expert sets, the load-balancing and z losses), tabled and plotted per step.
Engines that route the same tokens with the same weights must show the same statistics; where they do
not, the table shows it."""

from __future__ import annotations

import statistics

from harness.report import plots
from harness.report.precision_groups import group_of
from harness.report.sections import Figure, Section, Table

ROUTING_TEXT = (
    "Per run, over the measured steps (warm-up excluded), the median of each step's statistic: imbalance is "
    "the routed tokens per expert, max over mean, of the worst layer and the layers' mean (1 = every expert "
    "got the same tokens; an expert-parallel step waits for the most loaded expert); aux is the "
    "load-balancing loss E/k·Σ f_e·P_e (1 = uniform routing) and z the router z-loss (mean squared "
    "logsumexp of the router logits), unweighted, the layers' mean; tokens per expert: the measured steps' "
    "routed slots of the layer with the largest imbalance, fewest to most. Counted by the harness's one "
    "definition (harness/model/moe.py) from each engine's own routing, every token once. Against the "
    "reference: every layer's routed slots per expert over the measured steps, compared count by count with the "
    "single-device reference's (of the run's own precision policy, where the runs hold several); 'equal' means "
    "every count of every layer is the same, else how many slots sit "
    "on another expert (half the sum of the absolute count differences) of how many were routed."
)


def _router(run: dict) -> dict:
    return (run.get("metrics") or {}).get("router") or {}


def _median(values: list, warmup: int) -> float | None:
    kept = [v for v in values[warmup:] if isinstance(v, (int, float))]
    return statistics.median(kept) if kept else None


def _cell(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _worst_layer(tokens: dict) -> tuple[str, list] | None:
    def ratio(c):
        mean = sum(c) / len(c) if c else 0
        return max(c) / mean if mean else 1.0

    return max(tokens.items(), key=lambda kv: ratio(kv[1]), default=None)


def against_reference(tokens: dict, reference: dict) -> str:
    """Whether a run routed the reference's tokens per expert in every layer, or how many slots moved."""
    if not reference or not tokens:
        return "-"
    if set(tokens) != set(reference) or any(len(tokens[n]) != len(reference[n]) for n in tokens):
        return "other layers or experts"
    moved = sum(abs(a - b) for n in tokens for a, b in zip(tokens[n], reference[n], strict=True)) / 2
    routed = sum(sum(reference[n]) for n in reference)
    if moved == 0:
        return f"equal ({len(tokens)} layers)"
    return f"{moved:.0f} of {routed:.0f} slots moved"


def routing_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    warmup = int((summary.get("workload") or {}).get("warmup_steps") or 0)
    header = [
        "run",
        "imbalance, worst layer",
        "imbalance, layers' mean",
        "aux",
        "z",
        "tokens per expert (worst layer)",
        "against the reference",
    ]
    refs = {group_of(r): r for r in reversed(summary["runs"]) if r.get("is_reference") and _router(r)}
    rows = []
    for r in summary["runs"]:
        router = _router(r)
        if not router:
            continue
        ref = refs.get(group_of(r))  # its precision group's reference (harness.compare.groups)
        ref_tokens = _router(ref).get("tokens_per_expert") or {} if ref else {}
        worst = _worst_layer(router.get("tokens_per_expert") or {})
        counts = "-" if worst is None else f"{worst[0]}: " + ", ".join(f"{c:.0f}" for c in sorted(worst[1]))
        rows.append(
            [
                r["label"],
                _cell(_median(router.get("imbalance_max") or [], warmup), 2),
                _cell(_median(router.get("imbalance_mean") or [], warmup), 2),
                _cell(_median(router.get("aux_loss") or [], warmup), 4),
                _cell(_median(router.get("z_loss") or [], warmup), 4),
                counts,
                "-" if r is ref else against_reference(router.get("tokens_per_expert") or {}, ref_tokens),
            ]
        )
    return header, rows


def routing_figures(summary: dict) -> list[tuple[str, bytes, str]]:
    """The worst layer's imbalance and the aux loss of every step, one line per run."""
    routed = [(r["label"], _router(r)) for r in summary["runs"] if _router(r)]
    if not routed:
        return []
    warmup = int((summary.get("workload") or {}).get("warmup_steps") or 0)
    out = []
    for key, name, ylabel, alt in (
        ("imbalance_max", "routing-imbalance", "tokens per expert, max over mean", "imbalance per step"),
        ("aux_loss", "routing-aux", "load-balancing loss (unweighted)", "aux loss per step"),
    ):
        series = {label: [v for v in router.get(key) or [] if v is not None] for label, router in routed}
        series = {k: v for k, v in series.items() if v}
        if series:
            title = f"Router: {ylabel} per step (worst layer)" if key == "imbalance_max" else f"Router: {ylabel}"
            out.append((name, plots.loss_curves(series, warmup, title, ylabel), f"{alt} of every run"))
    return out


def routing_sections(summary: dict, figs: list) -> list[Section]:
    """The routing section, or none when no run routed tokens."""
    header, rows = routing_rows(summary)
    if not rows:
        return []
    pictures = [Figure(n, img, alt) for n, img, alt in figs if n in ("routing-imbalance", "routing-aux")]
    return [Section("routing", "Routing (mixture of experts)", body=[ROUTING_TEXT, Table(header, rows), *pictures])]
