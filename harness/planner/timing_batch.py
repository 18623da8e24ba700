"""The step time of many layouts at once (predict_many): timing.step_time's arithmetic over numpy arrays,
one row per layout, so that a plan of 100,000 layouts does not run it once per layout in Python.

step_time's terms are taken as it takes them, from its caches (a layer's features and time, each stage
kind's extras, the data-parallel reduction and optimizer step: timing._per_layer, _extras, _dp_terms,
_bubble_factor); what combines them per layout (the stage times, the slowest stage, the schedule's share
of the fill and drain, the exposed reduction, the allocator pressure, the breakdown) is written here
again over arrays, operation for operation, so that every float is the one step_time gives
(tests/test_timing_batch.py compares every candidate of plans of each engine with step_time). A change
to that part of step_time goes here too.
"""

from __future__ import annotations

import numpy as np

from harness.model.presets import Shape
from harness.planner import feedforward, timing
from harness.planner.features import ALLOC_PRESSURE_FROM, ALLOC_PRESSURE_S, dot
from harness.planner.hardware import Profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.memory_terms import GIB


def step_times(
    shape: Shape,
    lays: list[PlannerLayout],
    wl: Workload,
    prof: Profile,
    theta: dict,
    layer_cache: dict,
    memory_bytes: list[float],
) -> tuple[list[float], list[dict]]:
    """timing.step_time of each layout (with `layer_cache` and its `memory_bytes`): seconds and breakdown."""
    n = len(lays)
    if not n:
        return [], []
    t_layer, bubble, split_of, firsts = [], [], [], []
    moe = shape.moe
    more = []  # the key of a layout's cp and expert all-to-all terms
    splits: dict = {}  # each split (a layout but its layer_own fields, timing._DATA_PARALLEL_FIELDS): its code
    reps: list[PlannerLayout] = []
    keys: list[tuple] = []  # each split's timing.layer_key
    bubbles: dict = {}
    for lay in lays:
        key = timing._DATA_PARALLEL_FIELDS(lay)
        code = splits.get(key)
        if code is None:
            code = splits[key] = len(reps)
            reps.append(lay)
            keys.append(timing.layer_key(lay, wl, prof))
            firsts.append(len(split_of))
        own = timing.layer_own(lay)
        tl, f = layer_terms(shape, lay, wl, prof, theta, layer_cache, keys[code] + own, bubbles)
        split_of.append(code)
        t_layer.append(tl)
        bubble.append(f)
        more.append((code, own) if lay.cp > 1 or moe else None)
    c = columns(shape, wl, prof, theta, layer_cache, reps, np.asarray(split_of), np.asarray(t_layer), bubble)
    c = finish(c, prof, theta, np.asarray(memory_bytes))
    columns_ = zip(*(c[k].tolist() for k in BREAKDOWN), strict=True)
    ffn = feedforward.of(shape)
    passes = c["passes"].tolist()
    out = []
    added: dict = {}  # step_time's cp and all-to-all terms, by the fields they read and the layer passes
    for lay, col, p, key in zip(lays, columns_, passes, more, strict=True):
        b = dict(zip(BREAKDOWN, col, strict=True))
        if key is not None:
            split, (ckpt, sp, cls) = key[0], key[1][:3]
            if lay.cp > 1:  # it reads the split, the checkpointing and the kernel's class
                cp = added.get(("cp", split, ckpt, cls, p))
                if cp is None:
                    cp = added[("cp", split, ckpt, cls, p)] = timing.cp_breakdown(
                        shape, lay, wl, prof, theta, p, layer_cache
                    )
                b.update(cp)
            if moe:  # the split, the checkpointing and sequence parallelism
                a2a = added.get(("ep", split, ckpt, sp, p))
                if a2a is None:
                    a2a = added[("ep", split, ckpt, sp, p)] = ffn.all_to_all_breakdown(lay, wl, prof, theta, p)
                b.update(a2a)
        out.append(b)
    seconds = c["total"].tolist()
    _check(shape, lays, wl, prof, theta, memory_bytes, seconds, out, firsts)
    return seconds, out


def layer_terms(shape, lay, wl, prof, theta, layer_cache: dict, key: tuple, bubbles: dict) -> tuple[float, float]:
    """A layout's layer time under theta (timing._per_layer, `key` its cache key) and its bubble factor."""
    hit = layer_cache.get(key)
    if hit is None:
        hit = timing._per_layer(shape, lay, wl, prof, theta, layer_cache)
    per_layer, tl = hit
    bkey = (lay.pipeline_schedule, lay.virtual_stages, lay.pp, timing.bubble_reads_layer(lay) and id(per_layer))
    f = bubbles.get(bkey)
    if f is None:  # the cache keeps each per_layer alive: an id is never another's here
        f = bubbles[bkey] = timing._bubble_factor(lay, theta, per_layer)
    return tl, f


def columns(shape, wl, prof, theta, layer_cache: dict, reps: list, at: np.ndarray, tl: np.ndarray, bubble) -> dict:
    """step_time's terms of rows whose split (a layout but its layer_own fields) is reps[at[row]], whose layer
    takes tl[row] seconds and whose schedule's bubble factor is bubble[row]: the slowest stage's time and index,
    the fill and drain, the reduction and the optimizer step (before the allocator's pressure: finish)."""
    kind_of: dict[int, int] = {}  # pp -> index into kinds
    kinds: list[tuple] = []
    rows: list[tuple] = []  # each split's micro-batches, stage kinds, extras, reduction, optimizer step, overlap
    for lay in reps:
        code = kind_of.get(lay.pp)
        if code is None:
            code = kind_of[lay.pp] = len(kinds)
            kinds.append(timing._stage_kinds(shape.layers, lay.pp))
        dpx, ox = timing._dp_terms(shape, lay, wl, prof, kinds[code], layer_cache)
        window = 0 if not lay.overlaps_dp else (1 if lay.fsdp else 2)
        ex = timing._extras(shape, lay, wl, prof, theta, kinds[code], layer_cache)
        rows.append((wl.micro_batches(lay), code, ex, dot(theta, dpx), ox, window, lay.pp > 1))
    ms, kind_code, extras, dots, opt_x, window, piped = zip(*rows, strict=True)
    codes = np.asarray(kind_code)
    width = max(len(k) for k in kinds)
    n_splits = len(rows)
    layers = np.zeros((n_splits, width), dtype=np.int64)
    count = np.zeros((n_splits, width), dtype=np.int64)
    first = np.zeros((n_splits, width), dtype=np.int64)
    valid = np.zeros((n_splits, width), dtype=bool)
    extra = np.zeros((n_splits, width))
    for code, stage_kinds in enumerate(kinds):
        where = np.flatnonzero(codes == code)
        size = len(stage_kinds)
        layers[where, :size] = [key[0][1] for key, _, _ in stage_kinds]
        first[where, :size] = [f for _, f, _ in stage_kinds]
        count[where, :size] = [c for _, _, c in stage_kinds]
        valid[where, :size] = True
        extra[where, :size] = [extras[i] for i in where.tolist()]
    layers, count, first, valid, extra = layers[at], count[at], first[at], valid[at], extra[at]
    times = np.where(valid, layers * tl[:, None] + extra, -np.inf)
    i_slow = np.argmax(times, axis=1)  # the first of the slowest (kinds are in stage order)
    rows = np.arange(len(at))
    t_slow = times[rows, i_slow]
    finite = np.where(valid, times, 0.0)
    times_sum = count[:, 0] * finite[:, 0]  # sum(count x time), in kind order
    for k in range(1, width):
        times_sum = np.where(valid[:, k], times_sum + count[:, k] * finite[:, k], times_sum)
    m = np.asarray(ms, dtype=np.int64)[at]
    f = np.asarray(bubble)
    compute_s = m * t_slow + (times_sum - t_slow) * f
    win = np.asarray(window)[at]
    overlap = np.where(win == 0, 0.0, np.where(win == 1, compute_s, t_slow))
    exposed = np.asarray(dots)[at] - overlap
    return {
        "compute_and_tp_s": compute_s,
        "bubble_s": np.where(np.asarray(piped)[at], (times_sum - t_slow) * f, 0.0),
        "dp_reduction_exposed_s": np.where(exposed > 0.0, exposed, 0.0),
        "optimizer_s": theta["hbm"] * np.asarray(opt_x)[at],
        "per_microbatch_slowest_stage_s": t_slow,
        "micro_batches": m,
        "slowest_stage": first[rows, i_slow],
        "passes": m * layers[rows, i_slow],  # the slowest stage's layer passes (cp and all-to-all terms)
    }


def finish(c: dict, prof: Profile, theta: dict, memory_bytes: np.ndarray) -> dict:
    """`columns` with the allocator's pressure of each row's `memory_bytes` and the step's total."""
    x = memory_bytes / (prof.memory_gib * GIB)
    pressure = np.where(x < 1.0, x, 1.0) - ALLOC_PRESSURE_FROM
    pressure = np.where(pressure > 0.0, pressure, 0.0)
    c["allocator_pressure_s"] = alloc_s = theta.get("alloc_pressure_s", ALLOC_PRESSURE_S) * pressure
    c["total"] = c["compute_and_tp_s"] + c["dp_reduction_exposed_s"] + c["optimizer_s"] + alloc_s
    return c


class Diverged(AssertionError):
    """The arrays' step time of a layout is not timing.step_time's: its arithmetic changed there, not here."""


CHECKED = 8  # splits whose first layout is checked against step_time on every call


def _check(shape, lays, wl, prof, theta, memory_bytes, seconds, breakdowns, firsts) -> None:
    """The first layout of the first CHECKED splits against timing.step_time: a change to its arithmetic not made
    here raises Diverged (predict_many then takes the scalar path)."""
    for i in firsts[:CHECKED]:
        want = timing.step_time(shape, lays[i], wl, prof, theta, None, memory_bytes=memory_bytes[i])
        if (seconds[i], list(breakdowns[i].items())) != (want[0], list(want[1].items())):
            raise Diverged(f"{lays[i]}: {seconds[i]}, {breakdowns[i]} against step_time's {want}")


# timing._breakdown's keys, in its order
BREAKDOWN = (
    "compute_and_tp_s",
    "bubble_s",
    "dp_reduction_exposed_s",
    "optimizer_s",
    "allocator_pressure_s",
    "per_microbatch_slowest_stage_s",
    "micro_batches",
    "slowest_stage",
)
