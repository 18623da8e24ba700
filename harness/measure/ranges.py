"""The harness's own named ranges inside an engine's step, which the profiler's trace and the measured
steps' counters (harness.profiling) keep apart from the engine's work."""

from __future__ import annotations

import contextlib
import functools

import torch

# The range around the harness's own loss reduction inside an engine's step (the global mean loss
# every engine returns for the parity check): a report keeps its collective apart from the engine's.
HARNESS_SYNC = "harness.loss_reduction"


# The range around each FP8 cast of torchao's float8 matmul (an input, a weight or an output gradient
# to e4m3/e5m2 with its amax and scale: harness.model.float8) and of its MXFP8 matmul (a block-scaled
# e4m3 cast along dim0 or dim1: harness.model.mxfp8): the profiled step's FP8 cast time, a part of its compute.
FP8_CAST = "harness.fp8_cast"

_in_harness_sync = [0]  # how deep the main thread is in harness_sync() (the step counters read it)


@contextlib.contextmanager
def harness_sync():
    """Around the harness's own collectives inside a step: a HARNESS_SYNC range for the profiler's
    trace and a flag for the measured steps' counters (harness.profiling), a few microseconds."""
    _in_harness_sync[0] += 1
    try:
        with torch.profiler.record_function(HARNESS_SYNC):
            yield
    finally:
        _in_harness_sync[0] -= 1


def in_harness_sync() -> bool:
    return _in_harness_sync[0] > 0


def ranged(fn, name: str = FP8_CAST):
    """`fn` run inside a `name` profiler range (a record_function costs microseconds): how the FP8 casts
    of torchao's matmuls, which run inside its autograd Functions, are told apart in a profiled step."""

    @functools.wraps(fn)
    def in_range(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return in_range
