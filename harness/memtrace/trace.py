"""Trace one rank of the own engine, or of engine fsdp, at full size on fake tensors: what it
holds, and its peak. (Engine fsdp: _trace_fsdp_rank, at the end; what follows describes the own
engine, and the counters and stand-ins serve both.)

For each pipeline stage (tensor-, context- and data-parallel ranks of a stage hold the same
tensors, up to a ZeRO-1 shard's padding), `trace_rank` starts a fake process group (torch's
FakeStore, backend "fake": collectives and transfers are no-ops on shapes) as that stage's first
rank, builds
Engine3D under FakeTensorMode (tensors carry shapes and dtypes, no data: a 65B stage costs no
memory) and runs its real train_step: the schedule's forwards and backwards of the micro-batches
(under context parallelism its attention's K/V exchange too: the fake group's batch_isend_irecv,
all-gather, reduce-scatter and all_to_all_single return at once, leaving what they write unset),
the data-parallel reductions, the optimizer step, the parameter refresh. Three counters run
alongside:

  live tensors  a TorchDispatchMode that sees every op's outputs and counts each new storage
                once, with a weakref finalizer on the storage to subtract it when it is freed:
                the bytes of live tensors at every moment, its peak during the step, and which
                forward or backward (or the optimizer step) that peak fell in
  census        the engine's own census tensors (harness.measure.CensusAtStep's list) at the
                first optimizer step, by category and dtype, each storage once
  saved         bytes autograd saves for backward (saved-tensor hooks), parameters excluded,
                as harness.measure.SavedActivations counts them, and those of one forward

Fake storages all report data_ptr 0, so storages are told apart by their StorageImpl
(untyped_storage()._cdata), which a live storage keeps and which the finalizer releases. A DTensor
counts as its local shard (what the rank holds). A storage resized in place (FSDP2 frees each
gathered parameter by resizing its storage to 0 and re-allocates it so) counts at its new size.

What the target GPU runs and a CPU cannot is substituted by something with the same memory
behaviour, named in the result (`substitutions`):
  - attention: every flash-style kernel (sdpa, sdpa_flash, sdpa_efficient, sdpa_cudnn, flash2)
    runs torch's CPU flash SDPA, which saves q, k, v, the output and the fp32 log-sum-exp, no
    s x s matrix (on the meta device SDPA would fall back to the math path and save the scores);
    naive stays naive (it materialises the scores, as on a GPU)
  - rmsnorm fused: a kernel that saves its input and the fp32 per-row 1/rms and allocates only
    its outputs (flash-attn's Triton rms_norm_fn); on a CPU the engine would torch.compile one
  - AdamW fused, as the engine builds it on CUDA (no per-parameter temporaries)
  - pipeline transfers grouped, each group one coalesced work, as on NCCL (layout.pipeline_p2p
    auto); an explicit async stays async
The traced step is a steady-state one: AdamW's states are created before it (module function
_create_optimizer_states), as the previous step would have left them.
The micro-batches per step are cut to the fewest that reach the schedule's steady state (its
largest number of micro-batches in flight): every one for gpipe, min(m, pp - stage + 1) for
1F1B (stage s holds pp - s; one more passes through the steady state), min(m, 2 pp) for the
interleaved schedule, min(m, 2) without a pipeline (gradient accumulation). The model states,
buckets and reductions do not depend on the count, and one more micro-batch repeats the same
allocations in the same order.

The engines are built with harness.model.training.BuildOptions (the kernels above, the fused
optimizer, NCCL's coalesced transfer groups, weights not loaded, allocation under fake mode) and tell the tracer
their phases through its StepHooks; train_step's loss is a fake tensor, whose value nobody reads.
Under the own engine's build, modules on the meta device stay real meta tensors, as outside a
trace (_MetaStaysReal), so Module.to_empty assigns fresh fake parameters as it does to real ones.
Sizes are the tensors' storages, not the caching allocator's rounded blocks (its fragmentation is
a named term).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.errors import SpecError
from harness.measure import SavedActivations, local_tensor, storage_identity, tensor_census
from harness.model.kernels import Kernels
from harness.model.training import BuildOptions, StepHooks, make_adamw
from harness.parallel_dims import ParallelDims

GIB = 1024 ** 3
FLASH_STYLE = ("sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash2")


class LiveTensors(TorchDispatchMode):
    """Bytes of live tensor storages: every op output's storage counted when first seen and
    subtracted when its StorageImpl is freed. `peak`/`peak_at` since the last reset_peak()."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.pinned: dict[int, object] = {}  # resized storages (see resized)
        self.bytes = 0
        self.peak = 0
        self.peak_at = ""
        self.where = "build"

    def _free(self, key: int) -> None:
        self.bytes -= self.live.pop(key, 0)

    def _see(self, t: torch.Tensor) -> None:
        t = local_tensor(t)
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = storage_identity(storage)
        if key in self.live:
            return
        n = storage.nbytes()
        self.live[key] = n
        self.bytes += n
        weakref.finalize(storage, self._free, key)
        if self.bytes > self.peak:
            self.peak, self.peak_at = self.bytes, self.where

    def resized(self, storage) -> None:
        """A storage resized in place (FSDP2 frees and re-allocates each gathered parameter so:
        _fsdp_param.py, free_storage / alloc_storage): its new size counts from now. (A fake
        tensor's storage is on the meta device: storage.device tells nothing here.)"""
        key, n = storage_identity(storage), storage.nbytes()
        if key not in self.live:  # not an op's output seen here (a real meta tensor, before fake mode)
            return
        # A resized storage's Python object no longer outlives its references as a preserved one
        # does (its weakrefs fire while the StorageImpl lives on): kept here, so the finalizer
        # cannot subtract it early. FSDP2 keeps these storages as long as the engine anyway.
        self.pinned[key] = storage
        self.bytes += n - self.live[key]
        self.live[key] = n
        if self.bytes > self.peak:
            self.peak, self.peak_at = self.bytes, self.where

    @contextlib.contextmanager
    def counting_resizes(self):
        """While open, UntypedStorage.resize_ reports to resized().

        One of the trace's two overrides of torch (the other: _static_shapes_without_vote), for
        want of a public mechanism: FSDP2 frees and re-allocates each gathered parameter by
        resizing its storage in place (_fsdp_param.py, free_storage / alloc_storage), which is no
        operator on a tensor (__torch_dispatch__ and __torch_function__ do not see it), and a fake
        storage allocates nothing that an allocator or the profiler could see. The class's method
        is swapped while the trace runs and restored on the way out."""
        plain = torch._C.StorageBase.resize_

        def resize_(storage, size):
            out = plain(storage, size)
            self.resized(storage)
            return out

        own = torch.UntypedStorage.__dict__.get("resize_")  # None: torch._C.StorageBase's
        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            if own is None:
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = own

    def reset_peak(self) -> None:
        self.peak, self.peak_at = self.bytes, self.where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        return out


# ---------------------------------------------------------------- stand-ins with the target's memory


class _FusedRMSNorm(torch.autograd.Function):
    """The memory of a fused RMSNorm kernel (flash-attn's rms_norm_fn): saves its input, the
    weight and the fp32 per-row 1/rms; allocates only its outputs. Shapes only: no values."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, weight, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


def traced_attention(kernel: str, lay=None) -> str:
    """The kernel the trace runs for `kernel`: CPU flash SDPA for every flash-style kernel; under the
    own engine's context parallelism with cp_impl ring or allgather the layout's own (its blocks run
    naive's math or, for sdpa, torch's CPU flash kernel: harness/engine/context_parallel.py)."""
    if lay is not None and lay.cp > 1 and lay.cp_impl != "ulysses":
        return kernel
    return "sdpa_flash" if kernel in FLASH_STYLE else kernel


def traced_kernels(lay) -> Kernels:
    """The kernels the traced engine is built with (its build-time seam): the layout's, with
    fused RMSNorm replaced by _fused_rmsnorm (attention is substituted in the spec: traced_spec)."""
    kernels = Kernels.of(lay.attention, lay.rmsnorm)
    return dataclasses.replace(kernels, rmsnorm=_fused_rmsnorm) if lay.rmsnorm == "fused" else kernels


def _fused_rmsnorm(x, weight, eps):
    """_FusedRMSNorm on plain tensors, or on the local shards of DTensors (engine fsdp's norms
    under TP: the kernel runs on what the rank holds; the output keeps the input's placements)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return _FusedRMSNorm.apply(x, weight.to_local() if isinstance(weight, DTensor) else weight, eps)
    local_weight = weight.to_local() if isinstance(weight, DTensor) else weight
    out = _FusedRMSNorm.apply(x.to_local(), local_weight, eps)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


def _fused_adamw(params, workload, **kw):
    """AdamW as the engines build it on CUDA: fused."""
    return make_adamw(params, workload, **{**kw, "fused": True})


def _coalesced_batch_isend_irecv(ops):
    """NCCL's batch_isend_irecv: the group is one coalesced work."""
    works = dist.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    return works[:1]


def _traced_options(lay, hooks: StepHooks, materialize=None) -> BuildOptions:
    """How the trace builds an engine: the target's kernels, optimizer and transfers, no weight values."""
    return BuildOptions(kernels=traced_kernels(lay), make_optimizer=_fused_adamw,
                        batch_isend_irecv=_coalesced_batch_isend_irecv, materialize=materialize,
                        load_weights=False, hooks=hooks)


class _MetaStaysReal(TorchDispatchMode):
    """Under FakeTensorMode, an op on the meta device (a module built under torch.device("meta"))
    runs outside it: real meta tensors, as outside a trace. Module.to_empty then assigns each one
    a fresh fake parameter; a fake meta parameter it would swap, and torch.utils.swap_tensors
    refuses the tensors FakeTensorMode keeps weak references to. Entered inside FakeTensorMode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if "device" in kwargs:
            meta = torch.device(kwargs["device"]).type == "meta"
        else:
            meta = bool(tensors) and all(t.device.type == "meta" and not isinstance(t, FakeTensor) for t in tensors)
        if not meta:
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


# ---------------------------------------------------------------- one rank


def traced_micro_batches(lay, m: int, stage: int) -> int:
    """Micro-batches the trace runs on `stage` (module docstring): the fewest that reach the
    schedule's largest number in flight there, and pass through its steady state once."""
    if lay.pp == 1 and lay.virtual_stages == 1:
        return min(m, 2)
    if lay.engine == "fsdp" and lay.pipeline_schedule == "1f1b":  # torch's Schedule1F1B takes at least pp
        return min(m, lay.pp + 1)
    if lay.pipeline_schedule == "gpipe":
        return m
    if lay.pipeline_schedule == "interleaved":
        return min(m, 2 * lay.pp)
    return min(m, lay.pp - stage + 1)  # 1F1B: pp - stage in flight after the warm-up


def traced_spec(spec, stage: int = 0, full_micro: bool = False):
    """The spec the trace runs: the substituted kernels, NCCL's transfers, fewer micro-batches.
    Each stage runs its own program only, so each may run its own count."""
    from harness.spec import micro_batches_per_step

    lay = spec.layout
    m = micro_batches_per_step(spec)
    m_run = m if full_micro else traced_micro_batches(lay, m, stage)
    new_lay = dataclasses.replace(lay, attention=traced_attention(lay.attention, lay),
                                  pipeline_p2p="grouped" if lay.pipeline_p2p == "auto" and lay.pp > 1
                                  else lay.pipeline_p2p)
    batch = spec.workload.global_batch_size // m * m_run  # m_run of the step's m micro-batches
    wl = dataclasses.replace(spec.workload, global_batch_size=batch, device="cpu")
    return dataclasses.replace(spec, layout=new_lay, workload=wl), m, m_run


def stage_ranks(lay) -> list[int]:
    """The first rank (tp 0, cp 0, dp 0) of each pipeline stage: its tensor-, context- and
    data-parallel ranks hold tensors of the same sizes (cp: every rank seq / cp tokens, two equal
    chunks; the ring's blocks are the same sizes in another order)."""
    dims = ParallelDims.of(lay)
    return [dims.rank(pp=s) for s in range(lay.pp)]


@dataclass
class RankTrace:
    rank: int
    stage: int
    layers: list
    census: dict            # category -> dtype -> bytes, at the optimizer step
    states_bytes: int       # live bytes when the step starts (model states and buffers)
    live_peak_bytes: int    # the largest live bytes during the step
    peak_at: str            # where in the step it occurred
    forward_backward_peak_bytes: int
    optimizer_peak_bytes: int
    saved_bytes_step: int   # saved for backward over the step (each storage once while saved)
    saved_bytes_forward: int  # saved by the first forward of the step
    micro_batches: int      # per step in the workload
    micro_batches_traced: int
    seconds: float
    extra: dict = field(default_factory=dict)


def _create_optimizer_states(optimizer) -> None:
    """What a previous step leaves behind: AdamW's states exist at the start of every step but
    the first. One AdamW step on zero gradients creates them (a parameter whose gradient is not
    attached until the step gets a zero one for it, then none again)."""
    lent = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                lent.append(p)
    optimizer.step()
    for p in lent:
        p.grad = None


@contextlib.contextmanager
def _fake_world(rank: int, world: int, forget):
    """This process as global `rank` of `world` over a fake process group (FakeStore, backend
    "fake": collectives and transfers are no-ops on shapes); the RunContext the engines take.
    On the way out `forget` drops what the trace cached by process group, and the group goes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.runtime import RunContext

    if dist.is_initialized():
        raise RuntimeError("harness memory traces in a process without a process group")
    excepthook = sys.excepthook  # init_process_group prefixes tracebacks with the rank; undone below
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield RunContext(rank=rank, world_size=world, local_rank=0, device=torch.device("cpu"), backend="fake")
    finally:
        forget()
        dist.destroy_process_group()
        sys.excepthook = excepthook


class _Phases(StepHooks):
    """The trace's StepHooks: the live counter's phase named as the engine says, what the first
    forward saves (saved, set once the engine exists), and the forward/backward peak, kept when
    the optimizer phase starts."""

    def __init__(self, live: LiveTensors):
        self.live, self.saved = live, None
        self.start, self.first_forward = 0, None
        self.fb, self.fb_at, self.ended = 0, "", False

    def forward(self, where: str) -> None:
        self.live.where = where
        self.start = self.saved.bytes

    def forward_end(self) -> None:
        if self.first_forward is None:
            self.first_forward = self.saved.bytes - self.start

    def backward(self, where: str) -> None:
        self.live.where = where

    def optimizer(self, where: str) -> None:
        if not self.ended:
            self.ended = True
            self.fb, self.fb_at = self.live.peak, self.live.peak_at
            self.live.where = where
            self.live.reset_peak()


def _run_step(eng, batch, live, saved, phases: _Phases) -> tuple[int, int, int, int, str]:
    """One traced train_step: (live bytes at its start, its peak, the forward/backward peak, the
    optimizer step's peak, where the peak fell). Its loss, a fake tensor, has no value to read."""
    live.where = "step start"
    live.reset_peak()
    base = live.bytes
    phases.saved = saved
    with saved:
        eng.train_step(batch)
    peak_opt, peak_fb = live.peak, phases.fb
    where = live.peak_at if peak_opt > peak_fb else phases.fb_at
    return base, max(peak_fb, peak_opt), peak_fb, peak_opt, where


def _census_at_step(optimizer, held) -> dict:
    """The census of what `held()` lists (the engine's census list, CensusAtStep's, by category),
    taken at the optimizer's first step, by storage identity (fake storages have no address)."""
    census: dict = {}

    def take(*args):
        if not census:
            census.update(tensor_census(held(), key=storage_identity))

    optimizer.register_step_post_hook(take)
    return census


def _rank_trace(rank, stage, layers, census, step, saved, phases, m, m_run) -> RankTrace:
    """The RankTrace of a traced step: `step` is what _run_step returns."""
    base, peak, peak_fb, peak_opt, where = step
    return RankTrace(rank=rank, stage=stage, layers=layers, census=census, states_bytes=base,
                     live_peak_bytes=peak, peak_at=where, forward_backward_peak_bytes=peak_fb,
                     optimizer_peak_bytes=peak_opt, saved_bytes_step=saved.bytes,
                     saved_bytes_forward=phases.first_forward or 0,
                     micro_batches=m, micro_batches_traced=m_run, seconds=0.0)


def trace_rank(spec, shape, rank: int, full_micro: bool = False) -> RankTrace:
    """Build the spec's engine (own or fsdp) as global `rank` of its layout on fake tensors and
    run one step."""
    if spec.layout.engine == "fsdp":
        return _trace_fsdp_rank(spec, shape, rank, full_micro)
    return _trace_own_rank(spec, shape, rank, full_micro)


def _trace_own_rank(spec, shape, rank: int, full_micro: bool = False) -> RankTrace:
    """Build the own engine as global `rank` of the spec's layout on fake tensors and run one step."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.engine.engine import Engine3D
    from harness.engine.topology import Mesh

    dims = ParallelDims.of(spec.layout)
    run_spec, m, m_run = traced_spec(spec, dims.coord(rank).pp, full_micro)
    lay = run_spec.layout
    world = dims.world
    t0 = time.perf_counter()
    cached = set(Mesh._cache)

    def forget_meshes():
        for key in set(Mesh._cache) - cached:
            Mesh._cache.pop(key, None)

    with _fake_world(rank, world, forget_meshes) as ctx:
        Mesh.get(dims, rank, True)  # the process groups, outside fake mode
        live = LiveTensors()
        phases = _Phases(live)
        with FakeTensorMode(allow_non_fake_inputs=True), live, contextlib.redirect_stderr(io.StringIO()):
            with _MetaStaysReal():
                eng = Engine3D(run_spec, shape, ctx, options=_traced_options(lay, phases))
            eng.census.result = {}  # its census keys storages by address, which fake ones lack: ours below
            _create_optimizer_states(eng.optimizer)
            census = _census_at_step(eng.optimizer, eng.census.tensors)
            batch = torch.zeros((run_spec.workload.global_batch_size, run_spec.workload.seq_len + 1),
                                dtype=torch.int64)
            saved = SavedActivations(eng.activation_exclusions(), key=storage_identity)
            step = _run_step(eng, batch, live, saved, phases)
        layers = [[p.layers.start, p.layers.stop] for p in eng.plans]
        out = _rank_trace(rank, dims.coord(rank).pp, layers, census, step, saved, phases, m, m_run)
        del eng
        out.seconds = time.perf_counter() - t0
        return out


def _static_shapes_without_vote(schedule) -> None:
    """torch.distributed.pipelining's first step votes over P2P whether every stage has static
    shapes and reads the vote with .item(), which a fake tensor cannot answer. Engine fsdp gives
    every PipelineStage its input and output shapes up front (fsdp/pipeline.py), so the vote of
    a real run is static: set, without the vote (its 2-rank warm-up transfers carry no memory).

    One of the trace's two overrides of torch (the other: LiveTensors.counting_resizes), for want
    of a public mechanism: the vote runs in the schedule's private _warmup_p2p at every first
    step, no schedule or stage argument skips it, and the stage's mode it sets is private too.
    Overridden on this schedule object only."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warmup


def _trace_fsdp_rank(spec, shape, rank: int, full_micro: bool = False) -> RankTrace:
    """Build engine fsdp (harness/frameworks/fsdp/engine.py) as global `rank` of the spec's layout and
    run one step on fake tensors.

    Everything up to the parameters' allocation runs as in a real run, outside fake mode: the
    DeviceMesh over the fake process group (its rank tables are real tensors), the model on the
    meta device, DTensor TP/SP and fully_shard (FSDP2's sharding bookkeeping, on meta). Module.to_empty
    (FSDP2's own: its _apply override re-points every FSDPParam at the new sharded storage,
    reset_sharded_param) then runs under FakeTensorMode (the build's `materialize`), and so does
    the step: FSDP2's all-gathers and reduce-scatters, DTensor's collectives and the optimizer on
    fake tensors. The reference weights are not loaded (values only); AdamW fused as the engine
    builds it on CUDA. FakeTensorMode admits the meta tensors to_empty reads (allow_non_fake_inputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.frameworks.fsdp.engine import FSDPEngine

    dims = ParallelDims.of(spec.layout)
    run_spec, m, m_run = traced_spec(spec, dims.coord(rank).pp, full_micro)
    lay = run_spec.layout
    world = dims.world
    t0 = time.perf_counter()
    with _fake_world(rank, world, _clear_dtensor_caches) as ctx:
        live = LiveTensors()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        phases = _Phases(live)

        def materialize(module, device):
            with fake, live:
                return module.to_empty(device=device)

        with contextlib.redirect_stderr(io.StringIO()), live.counting_resizes():
            eng = FSDPEngine(run_spec, shape, ctx, options=_traced_options(lay, phases, materialize))
            if eng.pipeline is not None:
                _static_shapes_without_vote(eng.pipeline.schedule)
            eng.census.result = {}  # its census keys storages by address, which fake ones lack: ours below
            with fake, live:
                _create_optimizer_states(eng.optimizer)
                census = _census_at_step(eng.optimizer, eng._census_tensors)
                batch = torch.zeros((run_spec.workload.global_batch_size, run_spec.workload.seq_len + 1),
                                    dtype=torch.int64)
                saved = SavedActivations(eng.activation_exclusions(), key=storage_identity)
                step = _run_step(eng, batch, live, saved, phases)
        if eng.pipeline is None:
            layers = [[0, shape.layers]]
        else:  # the stage modules' blocks, named by their layer numbers
            layers = [[min(map(int, part.layers.keys())), max(map(int, part.layers.keys())) + 1]
                      for part in eng.parts if len(part.layers)]
        out = _rank_trace(rank, dims.coord(rank).pp, layers, census, step, saved, phases, m, m_run)
        del eng
        out.seconds = time.perf_counter() - t0
        return out


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions and redistribution plans by mesh; a later trace's mesh
    with the same shape compares equal to this one's, whose process groups are gone."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch fast path's
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    type(prop)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()


def substitutions(spec) -> list[str]:
    lay = spec.layout
    out = []
    if traced_attention(lay.attention, lay) != lay.attention:
        out.append(f"attention {lay.attention}: traced as CPU flash SDPA (same saved tensors: q, k, v, output, "
                   "fp32 log-sum-exp; no s x s)")
    if lay.rmsnorm == "fused":
        out.append("rmsnorm fused: a kernel saving its input and fp32 1/rms, allocating only outputs")
    out.append("AdamW fused (the engine's CUDA optimizer)")
    if lay.engine == "fsdp":
        if lay.pp > 1:
            out.append("torch.distributed.pipelining's P2P shape vote skipped: static (every stage's shapes are given)")
        return out
    if lay.pp > 1 and lay.pipeline_p2p == "auto":
        out.append("pipeline transfers grouped, one coalesced work per group (NCCL)")
    return out


def check_traceable(spec) -> None:
    if spec.layout.engine == "fsdp" and spec.layout.cp > 1:
        raise SpecError("layout.cp", "harness memory traces context parallelism under engine own; torch's "
                                     "context_parallel (engine fsdp) dispatches only CUDA attention kernels")
    if spec.layout.engine == "deepspeed":
        raise SpecError("layout.engine", "harness memory traces engines own and fsdp; DeepSpeed's initialize is "
                                          "not traceable on fake tensors (set engine: own or fsdp)")
    if spec.layout.engine not in ("own", "fsdp"):
        raise SpecError("layout.engine", f"harness memory traces engines own and fsdp; {spec.layout.engine!r} is "
                                          "not traced (set engine: own or fsdp to trace this layout under it)")
