"""A few extra steps under torch.profiler, after the measured ones, and the trace files kept.

The profiler costs a few microseconds per recorded op (own pp2 on 2 CPU cores: 18.8 ms a profiled
step against 10.7 ms measured), so the profiled steps are never measured ones: they run after the
last measured step and no step-time statistic counts them; the measured steps' breakdown comes from
counters.py, the trace gives the collectives, a Perfetto view, and a breakdown a report flags where
its sum is off the measured median. Each is
wrapped in a `harness.step#N` range (the analysis's step window) with the collectives annotated
(annotate.py) only while the profiler runs.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile

import torch

from harness.parallel_dims import ParallelDims
from harness.profiling.analysis import OPTIMIZER_PREFIXES, STEP_PREFIX
from harness.profiling.annotate import PREFIX, Annotations, AxisOf

MAX_EVENTS = 200_000  # a kept trace's complete events at most (about 20-30 MB of JSON before gzip)


def record(step_fn, steps: int, dims: ParallelDims, rank: int, device: torch.device, axis_of=None) -> dict:
    """Run step_fn(i) for i < steps under the profiler; the Chrome trace as a dict. `axis_of`: the
    run's AxisOf (the engine's own groups declared), else one from the degrees."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with Annotations(axis_of or AxisOf(dims, rank)), profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"{STEP_PREFIX}{i}"):
                step_fn(i)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="harness-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.unlink(path)


def _keep_first(e: dict) -> bool:
    name = str(e.get("name", ""))
    return name.startswith((STEP_PREFIX, PREFIX, *OPTIMIZER_PREFIXES))


def bounded(trace: dict, max_events: int = MAX_EVENTS) -> dict:
    """The trace with at most max_events complete events: the step, comm and optimizer ranges
    always, then the longest others; how many were dropped is said in the trace itself."""
    events = trace.get("traceEvents", [])
    complete = [e for e in events if e.get("ph") == "X"]
    if len(complete) <= max_events:
        return trace
    rest = [e for e in events if e.get("ph") != "X"]
    first = [e for e in complete if _keep_first(e)]
    others = sorted((e for e in complete if not _keep_first(e)), key=lambda e: -float(e.get("dur", 0)))
    kept = first + others[: max(0, max_events - len(first))]
    out = dict(trace, traceEvents=rest + sorted(kept, key=lambda e: e.get("ts", 0)))
    out["harness_trimmed"] = {
        "dropped_events": len(complete) - len(kept),
        "max_events": max_events,
        "rule": "the shortest events beyond the limit were dropped",
    }
    return out


def write(trace: dict, path: str, max_events: int = MAX_EVENTS) -> str:
    """Gzipped Chrome/Perfetto JSON (open it in ui.perfetto.dev or chrome://tracing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with gzip.open(path, "wt", compresslevel=1) as f:  # 5x faster than 6, about 1.3x the size
        f.write(json.dumps(bounded(trace, max_events)))  # the same text; dumps encodes in C, dump in Python (4x)
    return path
