"""matplotlib (Agg) figures as SVG: sharp at any zoom on a laptop screen, text kept as text, and
small and quick, since a report may hold many.

Conventions every figure here follows: where a ratio or a throughput is drawn (MFU, tokens/s,
ms per step stacked) its value axis starts at zero, so a 0.2% difference is drawn as one; a
bar or point that stands for a median carries the whisker of its interval (harness.measure.stats.
median_interval, the one definition, carried into the record as ci95_low/high with ci_coverage), and the
figure names it with its real coverage (`whisker`, the caller's: 'interval of the median (99.2%)').
"""

from __future__ import annotations

import io
import random
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FORMAT = "svg"  # file extension of every figure
MIME = "image/svg+xml"
matplotlib.rcParams.update(
    {
        "svg.fonttype": "none",  # text stays text: small files, selectable labels
        "svg.hashsalt": "harness",
    }
)  # stable element ids: the same data, the same file
COLORS = {
    "compute": "#4c72b0",
    "tp_comm": "#dd8452",
    "cp_comm": "#da8bc3",
    "pp_comm": "#937860",
    "dp_comm": "#55a868",
    "bubble": "#c44e52",
    "optimizer": "#8172b3",
    "other": "#b0b0b0",
    "forward_backward": "#64b5cd",
}
CI_STYLE = {"fmt": "none", "ecolor": "#222222", "elinewidth": 1.2, "capsize": 4, "zorder": 3}
WHISKER = "interval of the median"  # what a whisker is where the caller names no coverage


def _encode(fig) -> bytes:
    """The figure as SVG bytes (tests replace this to inspect the matplotlib Figure)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format=FORMAT, bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def _whiskers(values: list[float], intervals: list) -> tuple[list[int], list[float], list[list[float]]]:
    """The positions, values and asymmetric errors of the entries that have a (low, high) interval."""
    idx = [i for i, ci in enumerate(intervals) if ci and None not in ci and values[i] is not None]
    errs = [
        [max(0.0, values[i] - min(intervals[i])) for i in idx],
        [max(0.0, max(intervals[i]) - values[i]) for i in idx],
    ]
    return idx, [values[i] for i in idx], errs


def lines(
    series: dict[str, list[tuple]], xlabel: str, ylabel: str, title: str, percent: bool, whisker: str = WHISKER
) -> bytes:
    """series name -> [(x, y)] or [(x, y, low, high)] with the interval of the median (named `whisker`);
    x is categorical-ish (micro-batch sizes) on a log2 axis. y is a ratio or a throughput: its axis starts
    at zero."""
    scale = 100 if percent else 1
    fig, ax = plt.subplots(figsize=(7, 4))
    whiskers = False
    for name, pts in series.items():
        pts = sorted(pts, key=lambda p: p[0])
        xs, ys = [p[0] for p in pts], [p[1] * scale for p in pts]
        (line,) = ax.plot(xs, ys, marker="o", label=name)
        cis = [(p[2] * scale, p[3] * scale) if len(p) > 3 and None not in p[2:4] else None for p in pts]
        idx, vals, errs = _whiskers(ys, cis)
        if idx:
            ax.errorbar([xs[i] for i in idx], vals, yerr=errs, **{**CI_STYLE, "ecolor": line.get_color()})
            whiskers = True
    xs = sorted({p[0] for pts in series.values() for p in pts})
    if xs and min(xs) > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    ax.set_title(title + (f" (whiskers: {whisker})" if whiskers else ""), fontsize=10)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    return _encode(fig)


def heatmap(cells: dict[tuple, float | str], title: str, percent: bool) -> bytes:
    """cells (tp, pp) -> value, or a status string for cells where nothing ran ok; colours from zero."""
    tps = sorted({k[0] for k in cells})
    pps = sorted({k[1] for k in cells})
    import numpy as np

    grid = np.full((len(pps), len(tps)), np.nan)
    for (tp, pp), v in cells.items():
        if isinstance(v, (int, float)):
            grid[pps.index(pp), tps.index(tp)] = v * (100 if percent else 1)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(tps), 1.0 + 0.6 * len(pps)))
    finite = grid[~np.isnan(grid)]
    top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    # the colour scale starts at zero, as every ratio or throughput axis here: a 1% difference is a shade
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower", vmin=0, vmax=top)
    mid = top / 2
    for (tp, pp), v in cells.items():
        num = isinstance(v, (int, float))
        text = (f"{v * 100:.1f}" if percent else f"{v:,.0f}") if num else v
        dark = num and v * (100 if percent else 1) < mid  # viridis: dark at the low end
        ax.text(
            tps.index(tp), pps.index(pp), text, ha="center", va="center", fontsize=8, color="white" if dark else "black"
        )
    ax.set_xticks(range(len(tps)), [str(t) for t in tps])
    ax.set_yticks(range(len(pps)), [str(p) for p in pps])
    ax.set_xlabel("tensor parallel (tp)")
    ax.set_ylabel("pipeline parallel (pp)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    return _encode(fig)


def bars(
    labels: list[str],
    values: list[float],
    title: str,
    ylabel: str,
    percent: bool,
    intervals: list | None = None,
    whisker: str = WHISKER,
) -> bytes:
    """One horizontal bar per label from zero, with the whisker of its interval (named `whisker`) where
    `intervals` gives one ((low, high) in the values' unit, or None)."""
    scale = 100 if percent else 1
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.36 * max(3, len(labels))))
    vals = [v * scale for v in values]
    ax.barh(range(len(labels)), vals, color="#4c72b0")
    if intervals:
        cis = [(ci[0] * scale, ci[1] * scale) if ci and None not in ci else None for ci in intervals]
        idx, ci_vals, errs = _whiskers(vals, cis)
        if idx:
            ax.errorbar(ci_vals, idx, xerr=errs, **CI_STYLE)
    whiskers = bool(intervals) and bool(idx)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel(ylabel + (" (%)" if percent else "") + (f" - whiskers: {whisker}" if whiskers else ""))
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _encode(fig)


def stacked(
    labels: list[str],
    parts: list[dict],
    title: str,
    scale: float = 1000.0,
    names: dict[str, str] | None = None,
    xlabel: str = "ms per step",
) -> bytes:
    """Per-layout time breakdown in milliseconds (parts times `scale`: s -> ms), one stacked
    horizontal bar each, drawn from zero; `names` gives each component's legend entry, `xlabel`
    which steps the milliseconds are of (the caller knows)."""
    keys = [k for k in COLORS if any(k in p for p in parts)]
    keys += sorted({k for p in parts for k in p} - set(keys))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.35 * max(3, len(labels))))
    left = [0.0] * len(labels)
    for k in keys:
        vals = [scale * float(p.get(k) or 0.0) for p in parts]
        ax.barh(range(len(labels)), vals, left=left, label=(names or {}).get(k, k), color=COLORS.get(k))
        left = [a + b for a, b in zip(left, vals, strict=True)]
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=min(len(keys), 4), loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    return _encode(fig)


def timeline(events: list[dict], title: str) -> bytes:
    """Pipeline schedule of one step: a row per stage, F, B (and W) boxes labelled by micro-batch."""
    stages = sorted({int(e.get("stage", 0)) for e in events})
    t0 = min(float(e["start_s"]) for e in events)
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.5 * len(stages)))
    for e in events:
        s, a, b = int(e.get("stage", 0)), float(e["start_s"]) - t0, float(e["end_s"]) - t0
        color = {"F": "#4c72b0", "W": "#dd8452"}.get(e.get("kind"), "#55a868")
        ax.barh(stages.index(s), (b - a) * 1000, left=a * 1000, color=color, edgecolor="white")
        if len(events) <= 96:
            ax.text(
                (a + b) / 2 * 1000,
                stages.index(s),
                f"{e.get('kind')}{e.get('micro')}",
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    split = any(e.get("kind") == "W" for e in events)
    ax.set_xlabel(
        "ms since the step began (blue: forward, green: backward"
        + (" (input gradient), orange: weight gradients" if split else "")
        + ", gaps: bubble)"
    )
    ax.set_title(title, fontsize=10)
    return _encode(fig)


LINESTYLES = ("-", "--", "-.", ":")


def loss_curves(series: dict[str, list[float]], warmup_steps: int, title: str, ylabel: str = "training loss") -> bytes:
    """The loss of every step (warm-up included, shaded), one line per run: runs that agree lie on
    top of each other, so each gets its own dash pattern and marker."""
    fig, ax = plt.subplots(figsize=(8, 4.2))
    markers = "os^vD<>ph*"
    longest = max((len(v) for v in series.values()), default=0)
    for i, (name, losses) in enumerate(series.items()):
        ax.plot(
            range(len(losses)),
            losses,
            label=name,
            linestyle=LINESTYLES[i % len(LINESTYLES)],
            marker=markers[i % len(markers)] if longest <= 60 else None,
            markersize=4,
            linewidth=1.3,
            alpha=0.85,
        )
    if warmup_steps:
        ax.axvspan(-0.5, warmup_steps - 0.5, color="#999999", alpha=0.15, lw=0, label="warm-up")
    ax.set_xlabel("step (0 = first step, warm-up included)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _encode(fig)


def distribution(
    series: dict[str, list[float]],
    title: str,
    xlabel: str,
    intervals: dict[str, tuple] | None = None,
    scale: float = 1000.0,
    whisker: str = WHISKER,
) -> bytes:
    """One box per run over its measured steps (box: quartiles, line: median, whiskers: 1.5 IQR,
    dots: every step), and in black the interval of the median, named `whisker` in the legend (values
    times `scale`: s -> ms)."""
    names = list(series)
    data = [[x * scale for x in series[n]] for n in names]
    fig, ax = plt.subplots(figsize=(8, 1.0 + 0.42 * max(3, len(names))))
    style = dict(
        positions=range(len(names)),
        widths=0.55,
        showfliers=False,
        patch_artist=True,
        boxprops={"facecolor": "#c6d4ea", "edgecolor": "#4c72b0"},
        medianprops={"color": "#c44e52", "linewidth": 1.5},
    )
    try:
        ax.boxplot(data, orientation="horizontal", **style)
    except TypeError:  # matplotlib < 3.10
        ax.boxplot(data, vert=False, **style)
    jitter = random.Random(0)
    for i, xs in enumerate(data):
        ax.scatter(xs, [i + jitter.uniform(-0.18, 0.18) for _ in xs], s=7, color="#4c72b0", alpha=0.45, zorder=2)
    if intervals:
        cis = [
            tuple(v * scale for v in intervals[n]) if intervals.get(n) and None not in intervals[n] else None
            for n in names
        ]
        meds = [statistics.median(xs) if xs else None for xs in data]
        idx, vals, errs = _whiskers(meds, cis)
        if idx:
            ax.errorbar(vals, [i + 0.36 for i in idx], xerr=errs, **CI_STYLE, label=whisker)
    flat = [x for xs in data for x in xs if x > 0]
    log = bool(flat) and max(flat) / min(flat) > 8  # runs an order of magnitude apart: each box stays visible
    if log:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor="#c6d4ea", edgecolor="#4c72b0", label="quartiles"),
        Line2D([], [], color="#c44e52", lw=1.5, label="median"),
        Line2D([], [], ls="", marker="o", ms=3, color="#4c72b0", alpha=0.6, label="one step"),
    ]
    ax.legend(
        handles=handles + ax.get_legend_handles_labels()[0],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
    )
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel + (" (log scale)" if log else ""))
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _encode(fig)
