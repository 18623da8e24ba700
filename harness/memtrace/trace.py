"""Trace one rank of the own engine, or of engine fsdp, at full size on fake tensors: what it
holds, and its peak. (Engine fsdp: _trace_fsdp_rank, at the end; what follows describes the own
engine, and the counters and stand-ins serve both.)

For each pipeline stage (tensor- and data-parallel ranks of a stage hold the same tensors, up to
a ZeRO-1 shard's padding), `trace_rank` starts a fake process group (torch's FakeStore, backend
"fake": collectives and transfers are no-ops on shapes) as that stage's first rank, builds
Engine3D under FakeTensorMode (tensors carry shapes and dtypes, no data: a 65B stage costs no
memory) and runs its real train_step: the schedule's forwards and backwards of the micro-batches,
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

Two mechanics of fake mode, neither changing what is held: Module.to_empty assigns fresh
parameters instead of swapping tensors (torch.utils.swap_tensors refuses tensors FakeTensorMode
keeps weak references to), and train_step's last line, float(loss), has no value to read on a
fake tensor: that error is expected there, after the optimizer step and the refresh have run.
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
from harness.measure import SavedActivations, _local, storage_identity, tensor_census
from harness.model.kernels import Kernels
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
        t = _local(t)
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
        """While open, UntypedStorage.resize_ reports to resized() (an in-place resize is no op
        output: __torch_dispatch__ does not see it)."""
        from unittest import mock

        plain = torch._C.StorageBase.resize_

        def resize_(storage, size):
            out = plain(storage, size)
            self.resized(storage)
            return out

        with mock.patch.object(torch.UntypedStorage, "resize_", resize_):
            yield

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


def traced_attention(kernel: str) -> str:
    """The kernel the trace runs for `kernel`: CPU flash SDPA for every flash-style kernel."""
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


def _assigning_to_empty(module, *, device, recurse=True):
    """Module.to_empty swaps each meta parameter for a new one, and torch.utils.swap_tensors
    refuses tensors FakeTensorMode keeps weak references to: the same result, assigned (own engine)."""
    for mod in module.modules() if recurse else [module]:
        for key, p in mod._parameters.items():
            if p is not None:
                mod._parameters[key] = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
        for key, b in mod._buffers.items():
            if b is not None:
                mod._buffers[key] = torch.empty_like(b, device=device)
    return module


@contextlib.contextmanager
def _target_behaviour(to_empty=_assigning_to_empty):
    """Patch, for the trace only, what differs between this CPU and the GPU the spec targets
    (see the module docstring); `to_empty` replaces Module.to_empty (engine fsdp: FSDP2's own,
    under fake mode)."""
    from unittest import mock

    import harness.engine.engine as engine_module
    import harness.frameworks.fsdp as fsdp_module

    plain_adamw, plain_fsdp_adamw = engine_module.make_adamw, fsdp_module.make_adamw
    plain_batch = dist.batch_isend_irecv

    def make_adamw(params, workload, **kw):
        return plain_adamw(params, workload, **{**kw, "fused": True})

    def fsdp_make_adamw(params, workload, **kw):
        return plain_fsdp_adamw(params, workload, **{**kw, "fused": True})

    def batch_isend_irecv(ops):  # NCCL: the group is one coalesced work
        works = plain_batch(ops)
        for w in works:
            w.wait()
        return works[:1]

    with mock.patch.object(torch.nn.Module, "to_empty", to_empty), \
            mock.patch.object(engine_module, "make_adamw", make_adamw), \
            mock.patch.object(fsdp_module, "make_adamw", fsdp_make_adamw), \
            mock.patch.object(dist, "batch_isend_irecv", batch_isend_irecv):
        yield


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
    new_lay = dataclasses.replace(lay, attention=traced_attention(lay.attention),
                                  pipeline_p2p="grouped" if lay.pipeline_p2p == "auto" and lay.pp > 1
                                  else lay.pipeline_p2p)
    batch = spec.workload.global_batch_size // m * m_run  # m_run of the step's m micro-batches
    wl = dataclasses.replace(spec.workload, global_batch_size=batch, device="cpu")
    return dataclasses.replace(spec, layout=new_lay, workload=wl), m, m_run


def stage_ranks(lay) -> list[int]:
    """The first rank (tp 0, dp 0) of each pipeline stage."""
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


def _is_final_float(exc: BaseException) -> bool:
    """True when a data-dependent error came from train_step's last line, `float(loss)` (engine
    fsdp: `.item()`): a fake tensor has no value to read; everything of the step ran before it."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "train_step":
            last = tb
        tb = tb.tb_next
    if last is None or not last.tb_frame.f_code.co_filename.endswith(("engine.py", "fsdp.py")):
        return False
    import linecache

    line = linecache.getline(last.tb_frame.f_code.co_filename, last.tb_lineno)
    return "float(" in line or ".item()" in line  # own: float(loss); fsdp: (total / lay.dp).item()


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


def _run_step(eng, batch, live, saved, phases) -> tuple[int, int, int, int, str]:
    """One traced train_step: (live bytes at its start, its peak, the forward/backward peak, the
    optimizer step's peak, where the peak fell). `phases` gets the forward/backward peak ("fb",
    "fb_at") from the engine's hook where its schedule ends."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    live.where = "step start"
    live.reset_peak()
    base = live.bytes
    with saved:
        try:
            eng.train_step(batch)
        except DataDependentOutputException as e:
            if not _is_final_float(e):
                raise
    peak_opt, peak_fb = live.peak, phases.get("fb", 0)
    where = live.peak_at if peak_opt > peak_fb else phases.get("fb_at", "")
    return base, max(peak_fb, peak_opt), peak_fb, peak_opt, where


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
        with FakeTensorMode(), _target_behaviour(), live, contextlib.redirect_stderr(io.StringIO()):
            eng = Engine3D(run_spec, shape, ctx, kernels=traced_kernels(lay))
            eng.census.result = {}  # its census keys storages by address, which fake ones lack: ours below
            _create_optimizer_states(eng.optimizer)
            census: dict = {}
            held = eng.census.tensors  # the engine's census list (CensusAtStep's), by category
            eng.optimizer.register_step_post_hook(lambda *a: census or census.update(tensor_census(held(), key=storage_identity)))
            batch = torch.zeros((run_spec.workload.global_batch_size, run_spec.workload.seq_len + 1),
                                dtype=torch.int64)
            ex = eng.executor
            plain_forward, plain_backward, plain_run = ex._forward, ex._backward, ex.run
            saved = SavedActivations(eng.activation_exclusions(), key=storage_identity)
            first_forward = []
            phases = {}

            def forward(a, *args):
                live.where = f"forward chunk {a.chunk} micro-batch {a.micro}"
                before = saved.bytes
                plain_forward(a, *args)
                if not first_forward:
                    first_forward.append(saved.bytes - before)

            def backward(a):
                live.where = f"backward chunk {a.chunk} micro-batch {a.micro}"
                plain_backward(a)

            def run(*args):
                out = plain_run(*args)
                phases["fb"], phases["fb_at"] = live.peak, live.peak_at
                live.where = "optimizer step (reductions, AdamW, parameter refresh)"
                live.reset_peak()
                return out

            ex._forward, ex._backward, ex.run = forward, backward, run
            base, peak, peak_fb, peak_opt, where = _run_step(eng, batch, live, saved, phases)
        layers = [[p.layers.start, p.layers.stop] for p in eng.plans]
        out = RankTrace(rank=rank, stage=dims.coord(rank).pp, layers=layers, census=census, states_bytes=base,
                        live_peak_bytes=peak, peak_at=where, forward_backward_peak_bytes=peak_fb,
                        optimizer_peak_bytes=peak_opt, saved_bytes_step=saved.bytes,
                        saved_bytes_forward=first_forward[0] if first_forward else 0,
                        micro_batches=m, micro_batches_traced=m_run, seconds=0.0)
        del eng
        out.seconds = time.perf_counter() - t0
        return out


def _label_pipeline_stage(stage, live, saved, first_forward) -> None:
    """Name each of a torch.distributed.pipelining stage's forwards and backwards where the live
    peak falls, and count what the first forward saves."""
    plain_forward, plain_backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(chunk, *args, **kwargs):
        live.where = f"forward stage {stage.stage_index} micro-batch {chunk}"
        before = saved.bytes
        out = plain_forward(chunk, *args, **kwargs)
        if not first_forward:
            first_forward.append(saved.bytes - before)
        return out

    def backward_one_chunk(chunk, *args, **kwargs):
        live.where = f"backward stage {stage.stage_index} micro-batch {chunk}"
        return plain_backward(chunk, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


@contextlib.contextmanager
def _static_pipeline_warmup():
    """torch.distributed.pipelining's first step votes over P2P whether every stage has static
    shapes and reads the vote with .item(), which a fake tensor cannot answer. Engine fsdp gives
    every PipelineStage its input and output shapes up front (native_pipeline.py), so the vote
    of a real run is static: set, without the vote (its 2-rank warm-up transfers carry no memory)."""
    from unittest import mock

    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    with mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", warmup):
        yield


def _trace_fsdp_rank(spec, shape, rank: int, full_micro: bool = False) -> RankTrace:
    """Build engine fsdp (harness/frameworks/fsdp.py) as global `rank` of the spec's layout and
    run one step on fake tensors.

    Everything up to the parameters' allocation runs as in a real run, outside fake mode: the
    DeviceMesh over the fake process group (its rank tables are real tensors), the model on the
    meta device, DTensor TP/SP and fully_shard (FSDP2's sharding bookkeeping, on meta). Module.to_empty
    (FSDP2's own: its _apply override re-points every FSDPParam at the new sharded storage,
    reset_sharded_param) then runs under FakeTensorMode, and so does the step: FSDP2's
    all-gathers and reduce-scatters, DTensor's collectives and the optimizer on fake tensors. The
    reference weights are not loaded (values only); AdamW fused as the engine builds it on CUDA.
    FakeTensorMode admits the meta tensors to_empty reads (allow_non_fake_inputs)."""
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    import harness.frameworks.fsdp as fsdp_module

    dims = ParallelDims.of(spec.layout)
    run_spec, m, m_run = traced_spec(spec, dims.coord(rank).pp, full_micro)
    lay = run_spec.layout
    world = dims.world
    t0 = time.perf_counter()
    with _fake_world(rank, world, _clear_dtensor_caches) as ctx:
        live = LiveTensors()
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        plain_to_empty = torch.nn.Module.to_empty

        def to_empty(module, *, device, recurse=True):
            with fake, live:
                return plain_to_empty(module, device=device, recurse=recurse)

        with _target_behaviour(to_empty), contextlib.redirect_stderr(io.StringIO()), live.counting_resizes(), \
                _static_pipeline_warmup(), \
                mock.patch.object(fsdp_module, "_load_reference_shards", lambda module, reference: None):
            eng = fsdp_module.FSDPEngine(run_spec, shape, ctx, kernels=traced_kernels(lay))
            eng.census.result = {}  # its census keys storages by address, which fake ones lack: ours below
            with fake, live:
                _create_optimizer_states(eng.optimizer)
                census: dict = {}
                held = eng._census_tensors  # the engine's census list (CensusAtStep's), by category
                eng.optimizer.register_step_post_hook(lambda *a: census or census.update(tensor_census(held(), key=storage_identity)))
                batch = torch.zeros((run_spec.workload.global_batch_size, run_spec.workload.seq_len + 1),
                                    dtype=torch.int64)
                saved = SavedActivations(eng.activation_exclusions(), key=storage_identity)
                first_forward, phases, micro = [], {}, [-1]
                forward_start = [0]

                def forward_pre(module, args):
                    micro[0] += 1
                    live.where = f"forward micro-batch {micro[0]}"
                    forward_start[0] = saved.bytes

                plain_loss = fsdp_module.lm_loss

                def loss(logits, targets):
                    out = plain_loss(logits, targets)
                    if not first_forward:
                        first_forward.append(saved.bytes - forward_start[0])
                    live.where = f"loss and backward micro-batch {micro[0]}"
                    return out

                def optimizer_phase(*args):
                    if "fb" not in phases:
                        phases["fb"], phases["fb_at"] = live.peak, live.peak_at
                        live.where = "optimizer step (gradient clipping, AdamW)"
                        live.reset_peak()

                plain_clip = eng._clip_grad_norm

                def clip(max_norm):
                    optimizer_phase()
                    return plain_clip(max_norm)

                eng._clip_grad_norm = clip
                eng.optimizer.register_step_pre_hook(optimizer_phase)
                if eng.pipeline is None:
                    for part in eng.parts:
                        part.register_forward_pre_hook(forward_pre)
                for stage in eng.pipeline.stages if eng.pipeline is not None else []:
                    _label_pipeline_stage(stage, live, saved, first_forward)
                with mock.patch.object(fsdp_module, "lm_loss", loss):
                    base, peak, peak_fb, peak_opt, where = _run_step(eng, batch, live, saved, phases)
        if eng.pipeline is None:
            layers = [[0, shape.layers]]
        else:  # the stage modules' blocks, named by their layer numbers
            layers = [[min(map(int, part.layers.keys())), max(map(int, part.layers.keys())) + 1]
                      for part in eng.parts if len(part.layers)]
        out = RankTrace(rank=rank, stage=dims.coord(rank).pp, layers=layers, census=census, states_bytes=base,
                        live_peak_bytes=peak, peak_at=where, forward_backward_peak_bytes=peak_fb,
                        optimizer_peak_bytes=peak_opt, saved_bytes_step=saved.bytes,
                        saved_bytes_forward=first_forward[0] if first_forward else 0,
                        micro_batches=m, micro_batches_traced=m_run, seconds=0.0)
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
    if traced_attention(lay.attention) != lay.attention:
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
    if spec.layout.engine == "deepspeed":
        raise SpecError("layout.engine", "harness memory traces engines own and fsdp; DeepSpeed's initialize is "
                                          "not traceable on fake tensors (set engine: own or fsdp)")
    if spec.layout.engine not in ("own", "fsdp"):
        raise SpecError("layout.engine", f"harness memory traces engines own and fsdp; {spec.layout.engine!r} is "
                                          "not traced (set engine: own or fsdp to trace this layout under it)")
