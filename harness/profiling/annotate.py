"""While profiling only: name every collective and every wait in the trace.

The Kineto trace of a gloo run shows c10d ops but not the process group they ran on, nor whether
they were asynchronous, and Work.wait() leaves no event at all. Inside `Annotations` each
torch.distributed collective (and the functional collectives DTensor issues) runs inside a
record_function range CALL whose first child, a marker range named
`comm|<kind>|<axis>|<mode>|<bytes>` (mode sync, async or wait), says what it was, so the analysis
can tell, from the trace alone, where the main thread was blocked and on which axis. CALL opens
before the wrapper's own bookkeeping, so that bookkeeping (and the marker) count as the call's
time, as a caller's clock around the call counts them. The same wrappers clock the measured
steps (counters.Counters: a clock instead of the ranges, a few microseconds a call); outside
both nothing is wrapped.

Bytes follow harness.engine.comm: the tensor for all_reduce, broadcast and p2p, the gathered
(full) tensor for all_gather, the full input for reduce_scatter.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

from harness.parallel_dims import ParallelDims

# torch's C++ range (0.7 us a range against record_function's 5 us): less of the wrapper's cost
# falls outside the range it names
record_function = getattr(torch._C._profiler, "_RecordFunctionFast", None) or torch.profiler.record_function

PREFIX = "comm|"
CALL = "comm|call"
WORLD = "all"  # the step's global loss/norm reduction (no group named): it waits for the slowest rank


def range_name(kind: str, axis: str, mode: str, nbytes: int) -> str:
    return f"{PREFIX}{kind}|{axis}|{mode}|{nbytes}"


def parse_range(name: str) -> dict | None:
    """The fields of an annotation's name; None for any other event."""
    if not name.startswith(PREFIX):
        return None
    parts = name.split("|")
    if name == CALL or len(parts) != 5:
        return None
    _, kind, axis, mode, nbytes = parts
    return {"kind": kind, "axis": axis, "mode": mode, "bytes": int(nbytes) if nbytes.isdigit() else 0}


def _size(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_size(x) for x in t)
    return 0


# Megatron-core's groups say what they are (parallel_state's group_desc): the name a report gives
# a group whose ranks are no axis of degree > 1 (a one-rank group at degree 1, the embedding group)
GROUP_DESC = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "DATA_PARALLEL_GROUP": "dp",
    "DATA_PARALLEL_GROUP_WITH_CP": "dp",  # the replica group (parallel_dims.REPLICA_AXES)
    "CONTEXT_PARALLEL_GROUP": "cp",
    "MODEL_PARALLEL_GROUP": "tp+pp",  # Megatron's model-parallel group: its norm and found-inf reductions
    "TENSOR_AND_DATA_PARALLEL_GROUP": "tp+dp",
    "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp+dp",
    "TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp+cp",
    "EXPERT_DATA_PARALLEL_GROUP": "dp",  # the expert-data-parallel group: expert gradients' reduction
    "EXPERT_TENSOR_PARALLEL_GROUP": "tp",
    # the experts' tp x ep (x pp) groups: at tp 1 (pp 1) their ranks are the ep group's, which AxisOf names first
    "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp+ep",
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp+ep+pp",
    "EMBEDDING_GROUP": "embedding",  # the first and last pipeline stage: tied embedding gradients
    "POSITION_EMBEDDING_GROUP": "embedding",
}


# The names an expert-parallel group (the all-to-all of a MoE's dispatch and combine) gives itself: the own
# engine's, Megatron-core's.
EXPERT_GROUPS = ("ep", "EXPERT_MODEL_PARALLEL_GROUP")


def other(ranks, dims: ParallelDims | None = None) -> str:
    """A group that is none of the layout's axes, named by what it is: the axes along which its ranks
    differ ('pp+dp'), 'part of' them where it holds fewer ranks than they span ('part of dp (2 of 4
    ranks)'), 'one-rank' for a group of one (it moves nothing); so that the same kind of group on other
    ranks (the [0,3] and [1,2] groups of one layout) has the same name, and each rank's time in it is
    averaged over the ranks that belong to one (record._mean_over_ranks). Without `dims`, by its ranks."""
    if dims is None:
        return f"other [{','.join(str(r) for r in ranks)}]"
    if len(ranks) == 1:
        return "one-rank"
    coords = [dims.coord(r)._asdict() for r in ranks]
    axes = [a for a in coords[0] if len({c[a] for c in coords}) > 1]
    span = 1
    for a in axes:
        span *= dims.degree(a)
    name = "+".join(axes)
    return name if len(ranks) == span else f"part of {name} ({len(ranks)} of {span} ranks)"


class AxisOf:
    """A call's axis. A call that names no group is WORLD: the step's global loss and norm
    reduction, which every engine (and the own engine's "all" axis) issues without one; a send or
    receive that names no group (DeepSpeed's pipeline) is on the axis along which its peer differs
    from this rank. A group named is the axis of ParallelDims whose group of this rank holds exactly
    its ranks (the degree owner's naming; FSDP2's mesh hands over the default group itself for an
    axis that spans the world); else the name the group gives itself (the own engine's Mesh names
    its groups by axis, Megatron's by GROUP_DESC); else the axis the engine declares it for
    (`declared`: {axis: [group, ...]}, e.g. DeepSpeed's ZeRO group at dp 1); else WORLD for a
    whole-world group; else named by the axes its ranks span (other)."""

    def __init__(self, dims: ParallelDims, rank: int, declared: dict | None = None):
        self.dims, self.rank = dims, rank
        self._cache: dict[int, str] = {}
        self._declared = {id(g): axis for axis, groups in (declared or {}).items() for g in groups if g is not None}

    def __call__(self, group) -> str:
        if group is None:
            return WORLD
        key = id(group)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = self._resolve(group)
        return found

    def peer(self, group, peer) -> str:
        """The axis of a send or receive: its group's, or where it names none (the default group,
        global peer ranks) the one axis along which `peer` differs from this rank."""
        if group is not None or not isinstance(peer, int) or not 0 <= peer < self.dims.world:
            return self(group)
        mine, theirs = self.dims.coord(self.rank)._asdict(), self.dims.coord(peer)._asdict()
        differ = [a for a in mine if mine[a] != theirs[a]]
        return differ[0] if len(differ) == 1 else other(sorted({self.rank, peer}), self.dims)

    def _resolve(self, group) -> str:
        named = getattr(group, "group_desc", None)  # a group that says its axis (the own engine's Mesh)
        if named in self.dims.sizes():
            return named
        if named in EXPERT_GROUPS:  # its ranks may be an axis's too (dp2 ep2: the dp group): its name decides
            return "ep"
        if self._declared.get(id(group)) == "ep":  # an engine's unnamed expert group (DeepSpeed's): the same
            return "ep"
        ranks = sorted(dist.get_process_group_ranks(group))
        found = self.dims.axis_of_group(self.rank, ranks)
        if found:
            return found
        if self.dims.ep > 1 and ranks == sorted(self.dims.expert_group_of(self.rank)):
            return "ep"  # a group holding exactly this rank's expert group (Megatron's tp x ep group at tp 1)
        if named in GROUP_DESC:
            return GROUP_DESC[named]
        if id(group) in self._declared:
            return self._declared[id(group)]
        return WORLD if len(ranks) == self.dims.world else other(ranks, self.dims)


# name -> (kind, index of the group argument, index of async_op (None: always async), the payload's index)
C10D = {
    "all_reduce": ("all_reduce", 2, 3, 0),
    "all_gather_into_tensor": ("all_gather", 2, 3, 0),
    "all_gather_single": ("all_gather", 2, 3, 0),
    "_all_gather_base": ("all_gather", 2, 3, 0),
    "all_gather": ("all_gather", 2, 3, 0),
    "reduce_scatter_tensor": ("reduce_scatter", 3, 4, 1),
    "reduce_scatter_single": ("reduce_scatter", 3, 4, 1),
    "_reduce_scatter_base": ("reduce_scatter", 3, 4, 1),
    "reduce_scatter": ("reduce_scatter", 3, 4, 1),
    "all_to_all_single": ("all_to_all", 4, 5, 1),
    "broadcast": ("broadcast", 2, 3, 0),
    "send": ("send", 2, -1, 0),
    "recv": ("recv", 2, -1, 0),
    "isend": ("send", 2, None, 0),
    "irecv": ("recv", 2, None, 0),
    "barrier": ("barrier", 0, 1, -1),
}
FUNCTIONAL = {  # torch.distributed._functional_collectives: (kind, group index, payload scale by group size)
    "all_reduce": ("all_reduce", 2, False),
    "all_gather_tensor": ("all_gather", 2, True),
    "reduce_scatter_tensor": ("reduce_scatter", 3, False),
    "all_to_all_single": ("all_to_all", 3, False),
}


def _global_peer(group, args, kwargs, names) -> int | None:
    """A send's or receive's peer as a global rank: its dst/src, or its group_dst/group_src in `group`
    (batch_isend_irecv passes the group's rank)."""
    peer = _arg(args, kwargs, 1, names[1] if len(names) > 1 else "peer")
    if isinstance(peer, int):
        return peer
    local = kwargs.get("group_dst", kwargs.get("group_src"))
    if not isinstance(local, int):
        return None
    try:
        return dist.get_global_rank(group, local) if group is not None else local
    except Exception:  # noqa: BLE001 - a group this torch cannot map: the peer stays unknown
        return None


def _arg(args, kwargs, index, name, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if index is not None and 0 <= index < len(args) else default


class _Range:
    """An annotated call in the trace: the CALL range, with the marker that says what it was inside."""

    def __enter__(self):
        self.rf = record_function(CALL)
        self.rf.__enter__()
        return self

    def mark(self, kind: str, axis: str, mode: str, nbytes: int) -> None:
        with record_function(range_name(kind, axis, mode, nbytes)):
            pass

    def __exit__(self, *exc):
        self.rf.__exit__(*exc)
        return False

    def p2p(self, kind: str, peer: int | None) -> None:
        """A send or receive to or from global rank `peer` (the measured steps' clocks time its transfer)."""

    def returned(self, work) -> None:
        """The work an asynchronous call returned."""

    def waits_for(self, work) -> None:
        """The work a wait is on."""


class Annotations:
    """Context manager: wraps the collectives and Work.wait, restores them on exit. Each wrapped
    call runs inside self._call() (a CALL range here; counters.Counters clocks it instead)."""

    def _call(self):
        return _Range()

    def __init__(self, axis_of: AxisOf):
        self.axis_of = axis_of
        self.work_axis: dict[int, tuple[str, str]] = {}
        self.local = threading.local()
        self._saved: list[tuple[object, str, object]] = []

    def _patch(self, owner, name: str, new) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def _c10d(self, name: str, fn, kind: str, gi: int, ai: int | None, pi: int):
        import inspect

        names = list(inspect.signature(fn).parameters)
        group_name = names[gi] if gi < len(names) else "group"
        async_name = names[ai] if ai is not None and 0 <= ai < len(names) else "async_op"
        work_axis = self.work_axis

        payload_name = names[pi] if 0 <= pi < len(names) else "tensor"
        local = self.local

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if getattr(local, "inside", False):  # handed back by a TorchFunctionMode (torch.distributed calls
                return fn(*args, **kwargs)  # the module's name again, this wrapper): the outer call is the one
            with self._call() as call:
                group = _arg(args, kwargs, gi, group_name)
                if kind in ("send", "recv"):  # the peer (dst, src) is the argument after the tensor
                    axis = self.axis_of.peer(group, _arg(args, kwargs, 1, names[1] if len(names) > 1 else "peer"))
                else:
                    axis = self.axis_of(group)
                is_async = ai is None or bool(_arg(args, kwargs, ai, async_name, False))
                payload = _arg(args, kwargs, pi, payload_name) if pi >= 0 else None
                call.mark(kind, axis, "async" if is_async else "sync", _size(payload))
                if kind in ("send", "recv"):
                    call.p2p(kind, _global_peer(group, args, kwargs, names))
                local.inside = True  # the call's own waits are its time already: not annotated again
                try:
                    out = fn(*args, **kwargs)
                finally:
                    local.inside = False
                if is_async and out is not None:
                    work_axis[id(out)] = (axis, kind)
                    call.returned(out)
                return out

        return wrapped

    def _batch(self, fn):
        """batch_isend_irecv calls the (wrapped) isend/irecv per transfer: this range only groups them."""
        work_axis = self.work_axis

        @functools.wraps(fn)
        def wrapped(p2p_op_list):
            with self._call() as call:
                first = p2p_op_list[0] if p2p_op_list else None
                axis = self.axis_of.peer(first.group, first.peer) if first is not None else "other"
                call.mark("batch_p2p", axis, "async", 0)
                works = fn(p2p_op_list)
            for w in works or []:
                work_axis.setdefault(id(w), (axis, "p2p"))
            return works

        return wrapped

    def _functional(self, fn, kind: str, gi: int, gathered: bool):
        from torch.distributed import _functional_collectives as funcol

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self._call() as call:
                group = _arg(args, kwargs, gi, "group")
                try:
                    pg = dist.distributed_c10d._resolve_process_group(funcol._resolve_group_name(group))
                    axis, size = self.axis_of(pg), pg.size()
                except Exception:  # noqa: BLE001 - a group form this torch cannot resolve: still counted
                    axis, size = "other", 1
                nbytes = _size(args[0] if args else None) * (size if gathered else 1)
                call.mark(kind, axis, "async", nbytes)
                return fn(*args, **kwargs)

        return wrapped

    def __enter__(self):
        from torch._C._distributed_c10d import Work
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        for name, (kind, gi, ai, pi) in C10D.items():
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            new = self._c10d(name, fn, kind, gi, ai, pi)
            self._patch(c10d, name, new)
            if getattr(dist, name, None) is fn:
                self._patch(dist, name, new)
        batch = self._batch(c10d.batch_isend_irecv)
        self._patch(c10d, "batch_isend_irecv", batch)
        self._patch(dist, "batch_isend_irecv", batch)
        for name, (kind, gi, gathered) in FUNCTIONAL.items():
            if hasattr(funcol, name):
                self._patch(funcol, name, self._functional(getattr(funcol, name), kind, gi, gathered))
        wait, work_axis, local = Work.wait, self.work_axis, self.local

        def annotated_wait(work, *args, **kwargs):
            if getattr(local, "inside", False):
                return wait(work, *args, **kwargs)
            with self._call() as call:
                axis, kind = work_axis.pop(id(work), ("?", "wait"))
                call.mark(kind, axis, "wait", 0)
                call.waits_for(work)
                return wait(work, *args, **kwargs)

        self._patch(Work, "wait", annotated_wait)
        self._more_patches()
        return self

    def _more_patches(self) -> None:
        """What a subclass wraps besides (the trace shows functional waits as wait_tensor ops)."""

    def __exit__(self, *exc):
        for owner, name, old in reversed(self._saved):
            setattr(owner, name, old)
        self._saved.clear()
        self.work_axis.clear()
        return False
