"""Where the measured steps' time goes: clocks around the collectives during the measured steps.

The profiler cannot describe the measured steps: it costs a few microseconds per recorded op, so
on tiny CPU models its steps run far longer than the measured ones (own pp2 on 2 cores: 18.8 ms
profiled against 10.7 ms measured), and no rule can take its cost back out of each component.
So during every measured step the wrappers that name the collectives in a trace
(annotate.Annotations) run with a clock instead of ranges: a perf_counter pair per collective or
wait, and torch's global optimizer step hooks. A wrapped call costs about 12 us on the 2-core CPU
here under load (0.1 us unwrapped); the record keeps the most calls a measured step made
(breakdown_measured_calls_per_step: tiny tp2 about 60 a step of 60 ms or more, about 1%).
Per step and rank, in ms, summing to the rank's own step:

- exposed communication per axis: blocked in a synchronous collective or a wait on that axis
  (posting an asynchronous tp/dp collective is host work, as in the trace analysis);
- bubble where pp > 1, else wait ("waiting for other ranks"): blocked on pp or on the world-wide
  reductions, the harness's own loss reduction (measure.ranges.harness_sync) included;
- optimizer: inside torch optimizers' step(), less what it was blocked on a collective;
- compute: the rest (forward, backward, gradient clipping, host work between ops).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from harness.measure.ranges import in_harness_sync
from harness.profiling.analysis import AXES, BUBBLE_AXES, HARNESS, OPTIONAL, waiting_key
from harness.profiling.annotate import Annotations, AxisOf


class _Clock:
    """One wrapped call: its time goes to the axis its mark names, if it blocked the thread."""

    def __init__(self, counters: Counters):
        self.c, self.fields = counters, None

    def __enter__(self):
        self.c.depth += 1
        self.t0 = time.perf_counter()
        return self

    def mark(self, kind: str, axis: str, mode: str, nbytes: int) -> None:
        self.fields = (axis, mode)

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t0
        self.c.depth -= 1
        if self.c.depth == 0 and self.fields is not None:  # a batch's own transfers are its time already
            self.c.add(*self.fields, dt)
        return False


class Counters(Annotations):
    """Context manager around one measured step (enter resets, parts() reads it after the step)."""

    def __init__(self, axis_of: AxisOf, pp: int):
        super().__init__(axis_of)
        self.waiting = waiting_key(pp)
        self.handles: list = []

    def _call(self):
        return _Clock(self)

    def add(self, axis: str, mode: str, seconds: float) -> None:
        if axis == "?":  # a wait on a work no wrapped call returned (a coalescing manager's): the latest call's
            axis = self.last_call
        if in_harness_sync():
            axis = HARNESS
        self.calls += 1
        if mode != "wait":
            self.last_call = axis
        if mode == "async":
            self.last_async = axis
            if axis not in BUBBLE_AXES:
                return  # posting an overlappable collective is host work where it runs
        self.blocked[axis] += seconds

    def _more_patches(self) -> None:
        """Functional collectives (DTensor) block in funcol.wait_tensor: the latest asynchronous call's axis."""
        from torch.distributed import _functional_collectives as funcol

        wait = funcol.wait_tensor

        def clocked_wait(tensor):
            t0 = time.perf_counter()
            try:
                return wait(tensor)
            finally:
                if self.depth == 0:
                    self.add(self.last_async, "wait", time.perf_counter() - t0)

        self._patch(funcol, "wait_tensor", clocked_wait)

    def _pre(self, optimizer, args, kwargs) -> None:
        if self.opt_depth == 0:
            self.opt_start = (time.perf_counter(), sum(self.blocked.values()))
        self.opt_depth += 1

    def _post(self, optimizer, args, kwargs) -> None:
        self.opt_depth -= 1
        if self.opt_depth == 0:
            t0, blocked0 = self.opt_start
            self.optimizer_s += time.perf_counter() - t0 - (sum(self.blocked.values()) - blocked0)

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.blocked: dict[str, float] = defaultdict(float)
        self.depth = self.opt_depth = self.calls = 0
        self.optimizer_s, self.last_async, self.last_call = 0.0, "other", "other"
        self.handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []
        return super().__exit__(*exc)

    def parts(self, step_s: float) -> dict:
        """The step just run, in the breakdown's shape (ms), from its measured time `step_s`."""
        waiting = sum(self.blocked.get(a, 0.0) for a in BUBBLE_AXES)
        exposed = {a: self.blocked.get(a, 0.0) for a in AXES if a not in OPTIONAL or a in self.blocked}
        exposed["pp"] = 0.0  # a transfer's wait cannot be told from its peer's lateness: bubble
        exposed.update({a: s for a, s in sorted(self.blocked.items()) if a not in AXES and a not in BUBBLE_AXES})
        rest = step_s - waiting - self.optimizer_s - sum(exposed.values())
        return {
            "compute": max(0.0, rest) * 1e3,  # host work between ops included: no 'other' to split off
            "optimizer": self.optimizer_s * 1e3,
            "exposed_comm": {a: s * 1e3 for a, s in exposed.items()},
            self.waiting: waiting * 1e3,
            "step": step_s * 1e3,
        }


class MeasuredSteps:
    """The counters over one run's measured steps: clock(counting) around each step, add() after it.

    On CPU only: there a collective blocks the thread that issued it (gloo), so the clocks see the
    waits; on a GPU a collective returns once its kernel is queued, the wait happens on the device,
    and the clocks would call it compute. There the report takes the profiled steps' kernel
    timeline (analysis.cuda_breakdown) and sets its sum against the measured median.

    `groups`: the engine's declared groups (TrainingEngine.process_groups), those whose ranks alone
    do not name their axis."""

    def __init__(self, dims, rank: int, groups: dict, device_type: str = "cpu"):
        self.axis_of = AxisOf(dims, rank, groups)
        self.enabled = device_type == "cpu"
        self.counters = Counters(self.axis_of, dims.pp)
        self.counted: list[dict] = []
        self.counting = False
        self.calls = 0  # the most wrapped calls a measured step made (what the clocks cost is per call)

    def clock(self, counting: bool):
        self.counting = counting and self.enabled
        return self.counters if self.counting else contextlib.nullcontext()

    def add(self, step_s: float) -> None:
        """After the step clock() was entered for: its breakdown, if it was a measured one."""
        if not self.counting:
            return
        self.counted.append(self.counters.parts(step_s))
        self.calls = max(self.calls, self.counters.calls)
