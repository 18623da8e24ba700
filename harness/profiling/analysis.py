"""Where a profiled step went, from its Kineto (Chrome JSON) events alone.

Two backends over the same step windows (the `harness.step#N` ranges trace.py puts around each
profiled step):

- cpu (gloo): the main thread's blocked intervals. Every annotated collective and wait
  (annotate.py) and every functional wait_tensor is time the thread was blocked on its axis.
  Blocked on pp (a transfer waiting for its peer) or on the world group (the step's loss and
  norm reduction, which waits for the slowest rank) is bubble where the layout has a pipeline
  (pp > 1), as the own engine's counters charge it; without one there is no bubble and that time
  is WAIT, waiting for other ranks (a faster rank at the world-wide reduction). The harness's own
  loss reduction (inside measure.ranges.HARNESS_SYNC) counts as the world's. On tp or dp it is exposed
  communication (a sync call, a wait; posting an async
  tp/dp collective is host work where it runs, as the own engine counts it). Optimizer is the
  update phase: from the end of the step's last autograd function (its last backward) to its
  last op (gradient norm and clipping, the optimizer, parameter refresh, zeroing), and whatever
  runs inside the profiler's own Optimizer.step# / Optimizer.zero_grad# ranges. Compute is the
  operators' time (the union of the main thread's cpu_op events, less what else claimed it): measured,
  not the rest of the step; the host time between the step's ops (the Python of a forward, a
  framework's bookkeeping) is `unattributed`, its own component (and `host_gaps`, the same figure,
  as records before it named it); under FP8 `fp8_cast` the time inside torchao's casts,
  measure.ranges.FP8_CAST, a part of compute outside the sum; other is the time before the step's
  first op and after its last. Each is measured as its own intervals, none as the step's rest, so
  compute + optimizer + exposed + bubble (or wait) + unattributed + other = step holds where the
  intervals partition the step and fails where they overlap (the report's check). pp has no column
  here: one rank's trace cannot tell a transfer's wait from its peer's lateness (the measured steps'
  clocks can: record.split_transfers).
- cuda: the kernel timeline. NCCL kernels not overlapped by any compute kernel are exposed
  communication (on the axis of the annotated call that launched them; pp and the world's
  reduction: bubble, or wait without a pipeline), kernels launched in the update phase or the
  optimizer's ranges (as above, on the CPU side) are optimizer, other kernels compute, the device idle
  (the step less the union of its kernels, measured) other. Written for NCCL traces and checked on
  hand-made ones only: not yet run on a GPU.

Collectives per step come from the annotations: the outermost annotated issue of each call
(waits are not calls), grouped by axis and kind; the harness's own loss reduction under HARNESS
(it is not the engine's).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

from harness.measure.ranges import FP8_CAST, HARNESS_SYNC
from harness.profiling.annotate import CALL, PREFIX, WORLD, parse_range
from harness.profiling.intervals import clip, contains, length, subtract, union

STEP_PREFIX = "harness.step#"
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
FUNCTIONAL_WAIT = "_c10d_functional::wait_tensor"
AXES = ("tp", "cp", "ep", "dp", "pp")
# reported only where the step had such calls (no cp column for runs without CP, no ep one without experts)
OPTIONAL = ("cp", "ep", "other")
HARNESS = "harness"  # the axis of the harness's own loss reduction (every engine's step returns the global loss)
BUBBLE_AXES = ("pp", WORLD, HARNESS)  # blocked here: waiting for another stage or rank (bubble, or WAIT)
WAIT = "wait"  # without a pipeline: the time blocked at the world-wide reductions, waiting for other ranks


ONE_RANK = "one-rank"  # calls on groups of one rank (an axis of degree 1): no communication, their host time


def one_rank(axis: str, degrees: dict) -> bool:
    """Whether `axis` (tp, or a compound as Megatron's tp+pp) names a group of one rank at these degrees;
    dp is the replica group (dp x cp: parallel_dims.REPLICA_AXES), as its gradient reduction runs on it."""
    parts = str(axis).split("+")
    size = {**degrees, "dp": degrees.get("dp", 1) * degrees.get("cp", 1)}
    return all(p in size for p in parts) and all(size[p] == 1 for p in parts)


def relabel(exposed: dict, degrees: dict | None) -> dict:
    """Exposed communication with an axis of degree 1 left out ('-' in a report) and what its one-rank
    groups' calls took under ONE_RANK (where they took anything); as it is without `degrees`."""
    if degrees is None:
        return exposed
    out: dict = {}
    for axis, ms in exposed.items():
        if one_rank(axis, degrees):
            if ms:
                out[ONE_RANK] = out.get(ONE_RANK, 0.0) + ms
        else:
            out[axis] = ms
    return out


def waiting_key(pp: int) -> str:
    """What time blocked on BUBBLE_AXES is: pipeline bubble only where there is a pipeline."""
    return "bubble" if pp > 1 else WAIT


def _span(e) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))


def complete_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]


def step_windows(events: list[dict]) -> tuple[object, list[tuple[float, float]]]:
    """The main thread (the one holding the step ranges) and each profiled step's window."""
    steps = sorted((e for e in events if str(e.get("name", "")).startswith(STEP_PREFIX)), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(f"no {STEP_PREFIX} ranges in the trace")
    return (steps[0].get("pid"), steps[0].get("tid")), [_span(e) for e in steps]


def _calls(thread_events: list[dict]) -> list[tuple[dict, tuple]]:
    """Each annotated call's span (its CALL range) with the fields of the marker inside it."""
    calls = sorted((_span(e) for e in thread_events if e.get("name") == CALL), key=lambda s: (s[0], -s[1]))
    markers = sorted(
        (
            (_span(e)[0], parse_range(str(e["name"])))
            for e in thread_events
            if str(e.get("name", "")).startswith(PREFIX) and parse_range(str(e["name"]))
        ),
        key=lambda m: m[0],
    )
    harness = [_span(e) for e in thread_events if e.get("name") == HARNESS_SYNC]
    out = []
    starts = [m[0] for m in markers]
    for span in calls:
        i = bisect.bisect_left(starts, span[0])
        if i < len(markers) and markers[i][0] < span[1]:
            fields = markers[i][1]
            if any(contains(h, span) for h in harness):
                fields = dict(fields, axis=HARNESS)
            out.append((fields, span))
    return out


def _blocked(thread_events: list[dict]) -> tuple[dict[str, list], list[tuple[dict, tuple]]]:
    """Blocked intervals per axis, and the calls to count: the outermost annotated ones, a batch of
    transfers (batch_isend_irecv) standing for the sends and receives nested in it."""
    comm = _calls(thread_events)
    by_axis: dict[str, list] = defaultdict(list)
    last_functional = "other"
    waits = sorted(_span(e) for e in thread_events if e.get("name") == FUNCTIONAL_WAIT)
    issued = [(span[0], f["axis"]) for f, span in comm if f["mode"] == "async"]
    # a coalescing manager (Megatron's gradient buckets) runs its calls with async_op False and returns
    # one work for them all: a wait no call returned is on the latest call's axis, whatever its mode
    called = [(span[0], f["axis"]) for f, span in comm if f["mode"] != "wait"]
    outermost: list[tuple[dict, tuple]] = []
    counted: list[tuple[dict, tuple]] = []
    for fields, span in comm:
        if outermost and contains(outermost[-1][1], span):
            if outermost[-1][0]["kind"] == "batch_p2p" and fields["mode"] != "wait":
                counted.append((fields, span))  # a batch's transfers: what it moved
            continue  # nested: a sync call's own wait, a batch's transfers
        outermost.append((fields, span))
        counted.append((fields, span))
    for fields, span in outermost:
        if fields["mode"] == "async" and fields["axis"] not in BUBBLE_AXES:
            continue  # posting an overlappable tp/dp collective is host work where it runs, not a wait
        axis = fields["axis"]
        if axis == "?":  # a wait on a work no annotated call returned (a coalescing manager's): the axis of
            axis = next((a for ts, a in reversed(called) if ts <= span[0]), "other")  # the latest call
        by_axis[axis].append(span)
    for span in waits:  # a functional wait: the axis of the latest functional issue before it
        for ts, axis in issued:
            if ts <= span[0]:
                last_functional = axis
        by_axis[last_functional].append(span)
        last_functional = "other"
    return by_axis, counted


def _thread(events: list[dict], thread) -> list[dict]:
    return [e for e in events if (e.get("pid"), e.get("tid")) == thread]


def cpu_breakdown(trace: dict, pp: int = 1, degrees: dict | None = None) -> dict:
    """{"steps": [per-step breakdown in ms], "collectives": [per-step counts]} for a CPU trace of a
    layout with `pp` pipeline stages (and these `degrees`: relabel)."""
    events = complete_events(trace)
    thread, windows = step_windows(events)
    mine = _thread(events, thread)
    by_axis, calls = _blocked(mine)
    optimizer_spans = [_span(e) for e in mine if str(e.get("name", "")).startswith(OPTIMIZER_PREFIXES)]
    ops = [_span(e) for e in mine if e.get("cat") == "cpu_op"]
    backward = [_span(e) for e in mine if str(e.get("name", "")).startswith(BACKWARD_PREFIX)]
    casts = [_span(e) for e in mine if e.get("name") == FP8_CAST]
    extra = sorted(set(by_axis) - set(AXES) - set(BUBBLE_AXES))  # Megatron's tp+pp, embedding; other [..]
    steps = []
    for lo, hi in windows:
        bubble = union(clip([s for a in BUBBLE_AXES for s in by_axis.get(a, [])], lo, hi))
        taken = list(bubble)
        exposed = {}
        for axis in (*AXES, *extra):
            if axis == "pp":
                continue  # one trace cannot tell a transfer's wait from its peer's lateness: in the bubble, no column
            spans = subtract(clip(by_axis.get(axis, []), lo, hi), taken)
            taken += spans
            if axis in AXES and axis not in OPTIONAL or spans:
                exposed[axis] = length(spans) / 1e3
        inside = clip(ops, lo, hi)
        busy = [(min(a for a, _ in inside), max(b for _, b in inside))] if inside else []
        update = (
            [(max(backward_ends), busy[0][1])]
            if busy and (backward_ends := [b for a, b in clip(backward, lo, hi)])
            else []
        )
        optimizer = subtract(clip(optimizer_spans, lo, hi) + update, taken)
        taken += optimizer
        compute = subtract(inside, taken)  # the operators' time: measured, not the rest of the step
        gaps = length(subtract(busy, taken)) - length(compute)  # host time between them: no op covers it
        exposed = relabel(exposed, degrees)
        outside = hi - lo - length(busy)  # before the step's first op and after its last: measured, not a rest
        step = _assemble(
            hi - lo, length(compute), length(optimizer), exposed, length(bubble), waiting_key(pp), outside, gaps
        )
        step["host_gaps"] = gaps / 1e3
        if casts:  # FP8: its casts' share of compute (outside the sum)
            step["fp8_cast"] = length(subtract(union(clip(casts, lo, hi)), taken)) / 1e3
        steps.append(step)
    return {"steps": steps, "collectives": count_calls(calls, windows)}


def _assemble(
    step_us: float,
    compute_us: float,
    optimizer_us: float,
    exposed_ms: dict,
    waiting_us: float,
    waiting: str,
    other_us: float,
    unattributed_us: float | None = None,
) -> dict:
    """One step's components in ms; `waiting` names the time blocked on BUBBLE_AXES (waiting_key);
    `other_us` what lies outside the step's ops (CPU) or kernels (CUDA: the device idle), measured as those
    intervals, not as the step's rest (so the components' sum can miss the step: the report's check);
    `unattributed_us` the host time between the step's ops (CPU traces)."""
    out = {
        "compute": compute_us / 1e3,
        "optimizer": optimizer_us / 1e3,
        "exposed_comm": exposed_ms,
        waiting: waiting_us / 1e3,
        "step": step_us / 1e3,
    }
    if unattributed_us is not None:
        out["unattributed"] = unattributed_us / 1e3
    out["other"] = other_us / 1e3
    return out


def count_calls(calls: list[tuple[dict, tuple]], windows) -> list[dict]:
    """Per-step count and bytes of each (axis, kind): the mean over the profiled steps."""
    agg: dict[tuple, list] = defaultdict(lambda: [0, 0])
    for fields, span in calls:
        if fields["mode"] == "wait" or fields["kind"] == "batch_p2p":
            continue
        if any(lo <= span[0] < hi for lo, hi in windows):
            entry = agg[(fields["axis"], fields["kind"])]
            entry[0] += 1
            entry[1] += fields["bytes"]
    n = max(1, len(windows))
    return [
        {"axis": axis, "kind": kind, "count": c / n, "bytes": b / n} for (axis, kind), (c, b) in sorted(agg.items())
    ]


def cuda_breakdown(trace: dict, pp: int = 1, degrees: dict | None = None) -> dict:
    """The kernel-timeline breakdown (see the module docstring); untested on a GPU so far."""
    events = complete_events(trace)
    thread, windows = step_windows(events)
    mine = _thread(events, thread)
    comm = _calls(mine)
    optimizer_spans = [_span(e) for e in mine if str(e.get("name", "")).startswith(OPTIMIZER_PREFIXES)]
    launches = {
        e.get("args", {}).get("correlation"): _span(e)[0]
        for e in events
        if e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") is not None
    }
    kernels = [e for e in events if e.get("cat") == "kernel"]

    def launched_in(e, spans) -> bool:
        ts = launches.get(e.get("args", {}).get("correlation"))
        return ts is not None and any(a <= ts < b for a, b in spans)

    ops = [_span(e) for e in mine if e.get("cat") == "cpu_op"]
    backward = [_span(e) for e in mine if str(e.get("name", "")).startswith(BACKWARD_PREFIX)]
    for lo, hi in windows:  # the update phase launches its kernels after the step's last backward
        ends = [b for _, b in clip(backward, lo, hi)]
        inside = clip(ops, lo, hi)
        if ends and inside:
            optimizer_spans.append((max(ends), max(b for _, b in inside)))
    nccl = defaultdict(list)
    compute, optimizer = [], []
    for k in kernels:
        if "nccl" in str(k.get("name", "")).lower():
            ts = launches.get(k.get("args", {}).get("correlation"))
            axis = next((f["axis"] for f, (a, b) in comm if ts is not None and a <= ts < b), "other")
            nccl["pp" if axis in BUBBLE_AXES else axis].append(_span(k))
        elif launched_in(k, optimizer_spans):
            optimizer.append(_span(k))
        else:
            compute.append(_span(k))
    steps = []
    for lo, hi in windows:
        busy = union(clip(compute + optimizer, lo, hi))
        named = (*AXES, *sorted(set(nccl) - set(AXES)))
        exposed = {a: length(subtract(clip(nccl.get(a, []), lo, hi), busy)) / 1e3 for a in named}
        bubble = exposed.pop("pp")  # a p2p kernel's time holds its wait for the peer: bubble, no pp column
        for axis in named:
            if axis == "pp":
                continue
            if (axis in OPTIONAL or axis not in AXES) and not exposed[axis] and not nccl.get(axis):
                del exposed[axis]
        exposed = relabel(exposed, degrees)
        kernels_here = union(clip(compute + optimizer + [s for spans in nccl.values() for s in spans], lo, hi))
        steps.append(
            _assemble(
                hi - lo,
                length(subtract(clip(compute, lo, hi), clip(optimizer, lo, hi))),
                length(clip(optimizer, lo, hi)),
                exposed,
                bubble * 1e3,
                waiting_key(pp),
                hi - lo - length(kernels_here),  # the device idle, measured
            )
        )
    _, calls = _blocked(mine)
    return {"steps": steps, "collectives": count_calls(calls, windows)}


def breakdown(trace: dict, device_type: str = "cpu", pp: int = 1, degrees=None) -> dict:
    """The breakdown of a profiled trace; `degrees` ({axis: degree}, ep included, or the run's ParallelDims)
    drops axes of degree 1."""
    if degrees is not None and not isinstance(degrees, dict):
        degrees = dict(degrees.sizes(), ep=degrees.ep)
    if device_type == "cuda":
        return cuda_breakdown(trace, pp, degrees)
    return cpu_breakdown(trace, pp, degrees)


def mean_step(steps: list[dict]) -> dict:
    """The mean over profiled steps, component by component."""
    n = len(steps)
    axes = sorted(
        {a for s in steps for a in s["exposed_comm"]},
        key=lambda a: (a not in AXES, AXES.index(a) if a in AXES else 0, a),
    )
    waiting = [k for k in ("bubble", WAIT) if any(k in s for s in steps)]
    out = {"compute": sum(s["compute"] for s in steps) / n, "optimizer": sum(s["optimizer"] for s in steps) / n}
    out["exposed_comm"] = {a: sum(s["exposed_comm"].get(a, 0.0) for s in steps) / n for a in axes}
    kept = [k for k in ("unattributed",) if any(k in s for s in steps)]
    out.update({k: sum(s.get(k, 0.0) for s in steps) / n for k in (*waiting, *kept, "other", "step")})
    return out
