"""Interval algebra on [start, end) pairs in microseconds: the breakdown's only arithmetic."""

from __future__ import annotations


def union(spans) -> list[tuple[float, float]]:
    """Sorted, disjoint, merged intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in spans if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(spans, minus) -> list[tuple[float, float]]:
    """union(spans) with union(minus) cut out."""
    cut = union(minus)
    out = []
    for a, b in union(spans):
        for c, d in cut:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


def clip(spans, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def length(spans) -> float:
    return sum(b - a for a, b in union(spans))


def contains(outer: tuple[float, float], inner: tuple[float, float]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]
