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

- compute: clocked, not inferred: the time inside forward (the outermost module call, a global module
  hook pair) and backward (the autograd engine's run_backward, whoever calls it), less the wrapped
  collectives and waits inside them (a ZeRO-3 or FSDP2 gather in a pre-forward hook is communication)
  and any optimizer step inside them;
- exposed communication per axis of degree > 1: blocked in a synchronous collective or a wait on that
  axis (posting an asynchronous tp/dp collective is host work, as in the trace analysis); a call on a
  group of one rank (Megatron's tp group at tp 1) moves nothing: ONE_RANK, its own component;
- pp transfers: the part of a pp send's or receive's blocked time after its peer had posted the other
  side (record.split_transfers, from every rank's post times on the host's monotonic clock);
- bubble where pp > 1, else wait ("waiting for other ranks"): blocked on pp before the peer was ready,
  or on the world-wide reductions, the harness's own loss reduction (measure.ranges.harness_sync) included;
- optimizer: inside torch optimizers' step(), less what it was blocked on a collective;
- unattributed: what no clock covers (the loss outside a module, gradient clipping outside the
  optimizer, a framework's host bookkeeping, posting asynchronous calls outside forward and backward):
  the step less the clocked parts, negative where clocks overlapped (the sum check then shows it).
The module hooks (registered once per process: _install_module_hooks) cost about 5 us per module call
while a step is clocked and 2.5 us idle (76 modules' forward and backward, 1 thread, on the 2-core CPU here
at load 10: 1.17 ms without them, 1.53 ms clocked, 1.36 ms installed and idle; the tiny model's step makes
about 160 module calls); inside a compiled region they do nothing (its outermost module call is clocked).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from harness.measure.ranges import in_harness_sync
from harness.profiling.analysis import AXES, BUBBLE_AXES, HARNESS, ONE_RANK, one_rank, waiting_key
from harness.profiling.annotate import Annotations, AxisOf


class _Clock:
    """One wrapped call: its time goes to the axis its mark names, if it blocked the thread; a pp send or
    receive keeps its post time and the intervals it blocked (record.split_transfers reads them)."""

    def __init__(self, counters: Counters):
        self.c, self.fields, self.event, self.work = counters, None, None, None

    def __enter__(self):
        self.c.depth += 1
        self.t0 = time.perf_counter()
        return self

    def mark(self, kind: str, axis: str, mode: str, nbytes: int) -> None:
        self.fields = (axis, mode)

    def p2p(self, kind: str, peer: int | None) -> None:
        if self.fields and self.fields[0] == "pp":
            self.event = {"kind": kind, "peer": peer, "post": self.t0, "blocked": []}
            self.c.p2p.append(self.event)

    def returned(self, work) -> None:
        if self.event is not None:
            self.c.p2p_work[id(work)] = self.event

    def waits_for(self, work) -> None:
        self.event = self.c.p2p_work.pop(id(work), None)

    def __exit__(self, *exc):
        t1 = time.perf_counter()
        self.c.depth -= 1
        blocked = self.fields is not None and self.fields[1] != "async"
        if self.event is not None and blocked and self.c.depth == 0:
            self.event["blocked"].append((self.t0, t1))
        if self.c.depth == 0 and self.fields is not None:  # a batch's own transfers are its time already
            self.c.add(*self.fields, t1 - self.t0)
        return False


class _Engine:
    """The autograd engine, its run_backward clocked as compute (every backward: Tensor.backward,
    autograd.backward and grad, Megatron's custom_backward all call it); everything else as it is."""

    def __init__(self, inner, counters: Counters):
        self._inner, self._c = inner, counters

    def run_backward(self, *args, **kwargs):
        self._c.compute_enter()
        try:
            return self._inner.run_backward(*args, **kwargs)
        finally:
            self._c.compute_exit()

    def __getattr__(self, name):
        return getattr(self._inner, name)


_LIVE: list = [None]  # the Counters whose step is running: what the module hooks clock into
_MODULE_HOOKS: list = []  # registered once per process, never removed (see _install_module_hooks)


def _forward_pre(module, args) -> None:
    if torch.compiler.is_compiling():  # inside a compiled region: its outermost module is clocked
        return
    if _LIVE[0] is not None:
        _LIVE[0].compute_enter()


def _forward_post(module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    if _LIVE[0] is not None:
        _LIVE[0].compute_exit()


def _install_module_hooks() -> None:
    """The global module hook pair, once per process: dynamo guards a compiled block on the global hooks'
    keys, so hooks registered anew each step would recompile every step (error_on_recompile: the run
    fails); kept, they cost a dictionary lookup per module call when no step is clocked."""
    if not _MODULE_HOOKS:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        _MODULE_HOOKS.append(register_module_forward_pre_hook(_forward_pre))
        _MODULE_HOOKS.append(register_module_forward_hook(_forward_post, always_call=True))


class Counters(Annotations):
    """Context manager around one measured step (enter resets, parts() reads it after the step)."""

    def __init__(self, axis_of: AxisOf, pp: int):
        super().__init__(axis_of)
        self.waiting = waiting_key(pp)
        self.handles: list = []
        self.engine = None

    def _call(self):
        return _Clock(self)

    def add(self, axis: str, mode: str, seconds: float) -> None:
        if axis == "?":  # a wait on a work no wrapped call returned (a coalescing manager's): the latest call's
            axis = self.last_call
        if in_harness_sync():
            axis = HARNESS
        self.calls += 1
        self.comm_s += seconds  # inside forward or backward: not compute, whether it blocked or posted
        if mode != "wait":
            self.last_call = axis
        if mode == "async":
            self.last_async = axis
            if axis not in BUBBLE_AXES:
                return  # posting an overlappable collective is host work where it runs
        self.blocked[axis] += seconds

    # ------------------------------------------------------------ compute: forward and backward, clocked

    def compute_enter(self) -> None:
        if self.compute_depth == 0:
            self.compute_start = (time.perf_counter(), self.comm_s, self.optimizer_s)
        self.compute_depth += 1

    def compute_exit(self) -> None:
        self.compute_depth -= 1
        if self.compute_depth == 0:
            t0, comm0, opt0 = self.compute_start
            self.compute_s += time.perf_counter() - t0 - (self.comm_s - comm0) - (self.optimizer_s - opt0)

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
        from torch.autograd.variable import Variable
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.blocked: dict[str, float] = defaultdict(float)
        self.depth = self.opt_depth = self.calls = self.compute_depth = 0
        self.optimizer_s = self.compute_s = self.comm_s = 0.0
        self.last_async, self.last_call = "other", "other"
        self.p2p: list[dict] = []
        self.p2p_work: dict[int, dict] = {}
        self.handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
        _install_module_hooks()
        _LIVE[0] = self
        self.engine = Variable._execution_engine
        Variable._execution_engine = _Engine(self.engine, self)
        return super().__enter__()

    def __exit__(self, *exc):
        from torch.autograd.variable import Variable

        for h in self.handles:
            h.remove()
        self.handles = []
        _LIVE[0] = None
        if self.engine is not None:
            Variable._execution_engine, self.engine = self.engine, None
        return super().__exit__(*exc)

    def parts(self, step_s: float) -> dict:
        """The step just run, in the breakdown's shape (ms), from its measured time `step_s`: compute as
        clocked, an axis's exposed communication only where its degree is above 1 (a call on a group of one
        rank moves nothing: ONE_RANK), what no clock covered UNATTRIBUTED (negative where clocks overlap:
        the sum check then fails), and the pp transfers' raw events (P2P, split by record.split_transfers)."""
        waiting = sum(self.blocked.get(a, 0.0) for a in BUBBLE_AXES)
        dims = self.axis_of.dims
        exposed: dict[str, float] = {a: 0.0 for a in AXES if a != "pp" and getattr(dims, a, 1) > 1}
        for axis, s in sorted(self.blocked.items()):
            if axis in BUBBLE_AXES:
                continue
            key = ONE_RANK if one_rank(axis, dict(dims.sizes(), ep=dims.ep)) else axis
            exposed[key] = exposed.get(key, 0.0) + s
        clocked = self.compute_s + waiting + self.optimizer_s + sum(exposed.values())
        return {
            "compute": self.compute_s * 1e3,
            "optimizer": self.optimizer_s * 1e3,
            "exposed_comm": {a: s * 1e3 for a, s in exposed.items()},
            self.waiting: waiting * 1e3,
            UNATTRIBUTED: (step_s - clocked) * 1e3,
            "step": step_s * 1e3,
            P2P: [dict(e, blocked=list(e["blocked"])) for e in self.p2p],
        }


UNATTRIBUTED = "unattributed"  # what no clock covers: host work outside forward, backward, optimizer and calls
P2P = "p2p"  # a step's pp sends and receives, raw (post time, blocked intervals), until split


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
        """The clocks around a step: a warm-up step (`counting` False) runs them too, uncounted, so that
        what they cost once (dynamo looking at the module hooks of a compiled run: about 0.2 s on the
        loaded 2-core CPU here) falls in the warm-up, and every step carries the same wrappers."""
        self.counting = counting and self.enabled
        return self.counters if self.enabled else contextlib.nullcontext()

    def add(self, step_s: float) -> None:
        """After the step clock() was entered for: its breakdown, if it was a measured one."""
        if not self.counting:
            return
        self.counted.append(self.counters.parts(step_s))
        self.calls = max(self.calls, self.counters.calls)
