"""Counted, timed communication: every byte the engine moves goes through here.

Each call records (axis, op) -> count, bytes and bytes by dtype on this rank, and the seconds
it blocked, so the per-step report and the closed-form comm model (comm_model.py) can be
compared exactly. Bytes are the payload of the call on this rank: the tensor for all_reduce
and p2p, the gathered (full) tensor for all_gather, the input (full) tensor for
reduce_scatter, the input (= output) tensor for all_to_all; its dtype is named as the precision
policy names it ("fp32", "bf16").
A group of size one never calls torch.distributed and records nothing.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from harness.model.training import dtype_name


# torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
# Looked up at each call, so that harness.profiling's annotations see them too.
def _all_gather(*args, **kwargs):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StepClock:
    """Seconds per category within a step, measured where the work runs.

    On CPU a mark is perf_counter(). On CUDA a mark is an event recorded on the current
    stream, and spans are resolved once at the end of the step (`finish`), so measuring
    does not synchronise the device in the middle of the step (which would serialise the
    CPU with the GPU and change what is measured). A span between two marks is the time
    the compute stream spent there: for a blocking collective, its exposed cost.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, object, object]] = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, key: str, start, end) -> None:
        if self.cuda:
            self._pending.append((key, start, end))
        else:
            self.seconds[key] += end - start

    def elapsed(self, start, end) -> float:
        """Seconds between two marks (on CUDA only after finish())."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            for key, start, end in self._pending:
                self.seconds[key] += start.elapsed_time(end) / 1e3
            self._pending = []


def comm_entry() -> list:
    return [0, 0, defaultdict(int)]  # count, bytes, bytes per dtype name


def comm_dict(counts: dict) -> dict:
    """{axis: {op: [count, bytes, {dtype: bytes}]}} as the record keeps it:
    {axis: {op: {"count", "bytes", "bytes_by_dtype"}}} (comm_model builds the same)."""
    return {
        axis: {
            op: {"count": c, "bytes": b, "bytes_by_dtype": dict(sorted(by.items()))} for op, (c, b, by) in ops.items()
        }
        for axis, ops in counts.items()
    }


class CommStats:
    def __init__(self, clock: StepClock):
        self.clock = clock
        self.reset()

    def record(self, axis: str, op: str, t: torch.Tensor) -> None:
        """One call moving `t`'s payload (what nbytes(t) says, in t's dtype)."""
        entry = self.counts[axis][op]
        size = nbytes(t)
        entry[0] += 1
        entry[1] += size
        entry[2][dtype_name(t.dtype)] += size

    def reset(self) -> None:
        self.counts: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(comm_entry))

    def as_dict(self) -> dict:
        return comm_dict(self.counts)


class Axis:
    """Collectives over one process group, labelled with the axis name they are counted under.

    `time_key` is the breakdown category a blocking call charges its wait to.
    """

    def __init__(self, name: str, group, ranks: list[int], rank: int, stats: CommStats, time_key: str):
        self.name, self.group, self.ranks, self.stats, self.time_key = name, group, ranks, stats, time_key
        if name == "all":  # the step's world-wide reduction omits its group, as every engine's loss reduction
            self.group = None  # does: harness.profiling tells it from an axis that is the whole world by that
        self.size = len(ranks)
        self.index = ranks.index(rank)

    def labelled(self, name: str, time_key: str | None = None) -> Axis:
        """The same group counted under another axis name (SP shares the TP group)."""
        a = Axis.__new__(Axis)
        a.__dict__.update(self.__dict__)
        a.name = name
        a.time_key = time_key or self.time_key
        return a

    def _timed(self, fn):
        clock = self.stats.clock
        t0 = clock.mark()
        out = fn()
        clock.add(self.time_key, t0, clock.mark())
        return out

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        if self.size == 1:
            return None
        self.stats.record(self.name, "all_reduce", t)
        if async_op:
            return dist.all_reduce(t, op=op, group=self.group, async_op=True)
        self._timed(lambda: dist.all_reduce(t, op=op, group=self.group))
        return None

    def all_gather(self, t: torch.Tensor, out: torch.Tensor | None = None, async_op: bool = False):
        """Concatenate every rank's t along dim 0."""
        if self.size == 1:
            return t
        if out is None:
            out = torch.empty((t.shape[0] * self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        self.stats.record(self.name, "all_gather", out)
        if async_op:
            return _all_gather(out, t.contiguous(), group=self.group, async_op=True)
        self._timed(lambda: _all_gather(out, t.contiguous(), group=self.group))
        return out

    def reduce_scatter(self, t: torch.Tensor, out: torch.Tensor | None = None, async_op: bool = False):
        """Sum over ranks, then keep this rank's 1/size slice along dim 0."""
        if self.size == 1:
            return t
        if out is None:
            out = torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        self.stats.record(self.name, "reduce_scatter", t)
        if async_op:
            return _reduce_scatter(out, t.contiguous(), group=self.group, async_op=True)
        self._timed(lambda: _reduce_scatter(out, t.contiguous(), group=self.group))
        return out

    # p2p: peers are indices along this axis
    def isend(self, t: torch.Tensor, peer: int):
        self.stats.record(self.name, "send", t)
        return self._timed(lambda: dist.isend(t, dst=self.ranks[peer], group=self.group))

    def recv(self, t: torch.Tensor, peer: int) -> torch.Tensor:
        self.stats.record(self.name, "recv", t)
        self._timed(lambda: dist.recv(t, src=self.ranks[peer], group=self.group))
        return t

    def exchange(self, transfers: list[tuple[str, torch.Tensor, int]], tag: int = 0, post=None) -> list:
        """Post transfers ("send" or "recv", tensor, peer: an index along this axis) together, in their
        order, without waiting (`wait` blocks on the returned works): each counted as isend and recv
        count them. `post` posts the P2POps (torch.distributed.batch_isend_irecv by default; the pipeline's
        may be NCCL's coalesced stand-in) and returns its works."""
        ops = []
        for op, t, peer in transfers:
            self.stats.record(self.name, op, t)
            ops.append(dist.P2POp(dist.isend if op == "send" else dist.irecv, t, self.ranks[peer], self.group, tag))
        return (post or dist.batch_isend_irecv)(ops) if ops else []

    def wait(self, works: list) -> None:
        """Block on posted works; the wait is this axis's exposed communication time."""

        def run():
            for w in works:
                w.wait()

        self._timed(run)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """Piece r of t along dim 0 (size pieces) goes to rank r; piece r of the result came from rank r.
        Counted as "all_to_all" with t's payload (the same size as the result's)."""
        if self.size == 1:
            return t
        out = torch.empty_like(t)
        self.stats.record(self.name, "all_to_all", t)
        self._timed(lambda: dist.all_to_all_single(out, t.contiguous(), group=self.group))
        return out

    def all_to_all_v(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Unequal splits along dim 0: the first send[0] rows of t go to rank 0, the next send[1] to
        rank 1...; the result holds recv[r] rows from rank r, in rank order (expert dispatch and
        combine). Counted as "all_to_all" with t's payload (what this rank sends)."""
        if self.size == 1:
            return t
        out = t.new_empty((sum(recv), *t.shape[1:]))
        self.stats.record(self.name, "all_to_all", t)
        self._timed(
            lambda: dist.all_to_all_single(
                out, t.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=self.group
            )
        )
        return out


_OPS = ("all_reduce", "all_gather", "reduce_scatter", "isend", "recv", "exchange", "wait", "all_to_all", "all_to_all_v")


def opaque_to_compile() -> None:
    """Compiled blocks (layout.compile: blocks) call Axis's collectives inside their TP and CP regions:
    from now on in this process dynamo runs each as one opaque call, so a collective breaks the graph
    there (counted in the record) and its bookkeeping (counts, clocks: Python numbers that would become
    guards and recompile every step) never enters a graph. Called only when a run compiles: importing
    dynamo costs seconds that an eager run need not pay."""
    if getattr(Axis, "_opaque_to_compile", False):
        return
    for op in _OPS:
        setattr(Axis, op, torch.compiler.disable(getattr(Axis, op)))
    Axis._opaque_to_compile = True
