"""matplotlib (Agg) figures as PNG bytes; small and quick, since a report may hold many."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 80
COLORS = {"compute": "#4c72b0", "tp_comm": "#dd8452", "bubble": "#c44e52", "dp_comm": "#55a868",
          "optimizer": "#8172b3", "other": "#b0b0b0"}


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def lines(series: dict[str, list[tuple]], xlabel: str, ylabel: str, title: str, percent: bool) -> bytes:
    """series name -> [(x, y)]; x is categorical-ish (micro-batch sizes) on a log2 axis."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for name, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] * (100 if percent else 1) for p in pts], marker="o", label=name)
    xs = sorted({p[0] for pts in series.values() for p in pts})
    if xs and min(xs) > 0:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel + (" (%)" if percent else ""))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    return _png(fig)


def heatmap(cells: dict[tuple, float | str], title: str, percent: bool) -> bytes:
    """cells (tp, pp) -> value, or a status string for cells where nothing ran ok."""
    tps = sorted({k[0] for k in cells})
    pps = sorted({k[1] for k in cells})
    import numpy as np

    grid = np.full((len(pps), len(tps)), np.nan)
    for (tp, pp), v in cells.items():
        if isinstance(v, (int, float)):
            grid[pps.index(pp), tps.index(tp)] = v * (100 if percent else 1)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(tps), 1.0 + 0.6 * len(pps)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    finite = grid[~np.isnan(grid)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    for (tp, pp), v in cells.items():
        num = isinstance(v, (int, float))
        text = (f"{v * 100:.1f}" if percent else f"{v:,.0f}") if num else v
        dark = num and v * (100 if percent else 1) < mid  # viridis: dark at the low end
        ax.text(tps.index(tp), pps.index(pp), text, ha="center", va="center", fontsize=8,
                color="white" if dark else "black")
    ax.set_xticks(range(len(tps)), [str(t) for t in tps])
    ax.set_yticks(range(len(pps)), [str(p) for p in pps])
    ax.set_xlabel("tensor parallel (tp)")
    ax.set_ylabel("pipeline parallel (pp)")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    return _png(fig)


def bars(labels: list[str], values: list[float], title: str, ylabel: str, percent: bool) -> bytes:
    fig, ax = plt.subplots(figsize=(6, 0.6 + 0.32 * max(3, len(labels))))
    vals = [v * (100 if percent else 1) for v in values]
    ax.barh(range(len(labels)), vals, color="#4c72b0")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(ylabel + (" (%)" if percent else ""))
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def stacked(labels: list[str], parts: list[dict], title: str) -> bytes:
    """Per-layout time breakdown in milliseconds, one stacked horizontal bar each."""
    keys = [k for k in COLORS if any(k in p for p in parts)]
    keys += sorted({k for p in parts for k in p} - set(keys))
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.35 * max(3, len(labels))))
    left = [0.0] * len(labels)
    for k in keys:
        vals = [1000 * float(p.get(k) or 0.0) for p in parts]
        ax.barh(range(len(labels)), vals, left=left, label=k, color=COLORS.get(k))
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=len(keys), loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    return _png(fig)


def timeline(events: list[dict], title: str) -> bytes:
    """Pipeline schedule of one step: a row per stage, F and B boxes labelled by micro-batch."""
    stages = sorted({int(e.get("stage", 0)) for e in events})
    t0 = min(float(e["start_s"]) for e in events)
    fig, ax = plt.subplots(figsize=(8, 0.8 + 0.5 * len(stages)))
    for e in events:
        s, a, b = int(e.get("stage", 0)), float(e["start_s"]) - t0, float(e["end_s"]) - t0
        color = "#4c72b0" if e.get("kind") == "F" else "#55a868"
        ax.barh(stages.index(s), (b - a) * 1000, left=a * 1000, color=color, edgecolor="white")
        if len(events) <= 96:
            ax.text((a + b) / 2 * 1000, stages.index(s), f"{e.get('kind')}{e.get('micro')}", ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (blue: forward, green: backward, gaps: bubble)")
    ax.set_title(title, fontsize=10)
    return _png(fig)
