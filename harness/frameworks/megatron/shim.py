"""Megatron-core on CPU: the few CUDA calls it hard-codes, answered by the CPU, while a block runs.

Megatron never runs on CPU in its own tests. On the paths engine megatron takes (GPTModel on the
local spec, parallel_state, its DDP and optimizers, the schedules, the MoE layer), it reaches CUDA in
these ways, each answered here and nowhere else (megatron-core 0.16.1 and 0.19.2, the same list for both: the
tripwire finds no other; harness/frameworks/megatron/engine.py):

  RNG       tensor_parallel/random.py forks the CUDA RNG tracker (DotProductAttention always does,
            dropout 0 or not; activation recomputation saves and restores the state): the CPU
            generator's state in place of the CUDA one (torch.cuda.get/set_rng_state, manual_seed,
            random.py's _get/_set_cuda_rng_state);
  device    buffers and receive tensors allocated on torch.cuda.current_device(): it answers "cpu";
  sync      torch.cuda.synchronize and empty_cache: nothing to wait for or free;
  factories a literal device="cuda" (optimizer.py's found_inf, clip_grads.py's norm, schedules.py's
            total_num_tokens, transformer/utils.py's causal mask) and .cuda() / .to("cuda"): one
            TorchFunctionMode maps them to the CPU (and keeps itself on through torch.autograd.backward,
            where full recomputation runs the forward again);
  types     `param.type() == "torch.cuda.FloatTensor"` checks (optimizer.py, distrib_optimizer.py,
            clip_grads.py): .type() without arguments reports the CUDA type name;
  streams   the MoE alltoall dispatcher copies its split sizes to the host on a side stream
            (token_dispatcher.py: torch.cuda.Stream(), current_stream(), torch.cuda.stream(), its
            wait_stream and record_event().synchronize()): one in-order stand-in stream, whose waits
            and events have nothing to wait for;
  host      moe_utils.maybe_move_tensor_to_cpu turns the split sizes into numpy only from a CUDA tensor,
            so on the CPU all_to_all_single got tensors (a TypeError): CPU tensors become numpy as CUDA
            ones do;
  no TE     moe_utils' router gating reads te_general_gemm, bound only when Transformer Engine imports
            (a NameError without it): None there, Megatron's own torch.mm path;
  gloo      under tp > 1 the alltoall dispatcher gathers and reduce-scatters over tp the tokens each rank
            received, in uneven parts (mappings.py: torch.distributed.all_gather of a list of different
            sizes, torch.distributed.reduce_scatter of a list): gloo takes equal parts only, so those two
            run as the same sums on equal parts (padded all-gather; all-reduce, then this rank's part).

Process-local and scoped: `active()` patches on entry and restores on exit, so only the megatron
engine's own calls run under it, never on a GPU (the engine does not enter it there), and other
engines in the same process see torch unchanged. `tripwire()` (tests) records every other torch.cuda
function called while active: an update of Megatron that reaches one the shim does not cover shows up.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# torch.cuda's functions the shim replaces while active (the tripwire watches every other one).
COVERED = (
    "current_device",
    "synchronize",
    "empty_cache",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "manual_seed_all",
    "current_stream",
    "stream",
)
# torch.cuda queries that answer truthfully on a CPU build and change nothing: not CUDA work.
HARMLESS = ("is_available", "device_count", "is_initialized", "is_current_stream_capturing")


def _cpu(device):
    """`device` with a CUDA one replaced by the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a CUDA ordinal (torch.cuda.current_device()'s usual answer)
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _CudaToCpu(TorchFunctionMode):
    """device="cuda" in any torch function, .cuda(), .to("cuda") -> the CPU; .type() -> the CUDA name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.autograd.backward:
            return self._backward(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = (args[0], *(_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args[1:]))
        return func(*args, **kwargs)

    def _backward(self, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
        """torch.autograd.backward with this mode kept on while the autograd engine runs (a mode is off
        inside its own handler, and recomputation in backward runs Megatron's forward again): the C++
        engine called directly, as Megatron's own custom_backward does."""
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = (
            (grad_tensors,) if grad_tensors is None or isinstance(grad_tensors, torch.Tensor) else tuple(grad_tensors)
        )
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True))
        with self:
            torch.autograd.Variable._execution_engine.run_backward(
                tensors,
                grads,
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                tuple(inputs or ()),
                allow_unreachable=True,
                accumulate_grad=True,
            )


class _Event:
    """What the stand-in stream records: the CPU has done the work by the time anyone asks."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """torch.cuda.Stream on the CPU: work runs in order on one device, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _Stream()


def _host_copy(original):
    """moe_utils.maybe_move_tensor_to_cpu answering a CPU tensor as it answers a CUDA one (numpy when asked)."""

    def move(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def _uneven_all_gather(original):
    """torch.distributed.all_gather whose parts differ in their first dimension, on gloo: each padded to
    the largest, gathered, cut back."""

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rest = {tuple(t.shape[1:]) for t in tensor_list} | {tuple(tensor.shape[1:])}
        even = len({t.shape for t in tensor_list} | {tensor.shape}) == 1
        if even or async_op or len(rest) != 1 or dist.get_backend(group) != "gloo":
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in [*tensor_list, tensor])
        mine = tensor.new_zeros((rows, *tensor.shape[1:]))
        mine[: tensor.shape[0]] = tensor
        padded = [torch.empty_like(mine) for _ in tensor_list]
        original(padded, mine, group=group)
        for out, part in zip(tensor_list, padded, strict=True):
            out.copy_(part[: out.shape[0]])
        return None

    return all_gather


def _listed_reduce_scatter(original):
    """torch.distributed.reduce_scatter of a list of parts on gloo: the whole summed, this rank's part kept."""

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or op != dist.ReduceOp.SUM or dist.get_backend(group) != "gloo":
            return original(output, input_list, op=op, group=group, async_op=async_op)
        whole = torch.cat([t.reshape(t.shape[0], -1) for t in input_list])
        dist.all_reduce(whole, group=group)
        rank = dist.get_rank(group)
        start = sum(t.shape[0] for t in input_list[:rank])
        output.copy_(whole[start : start + input_list[rank].shape[0]].view_as(output))
        return None

    return reduce_scatter


def _replacements() -> dict:
    return {
        "current_stream": lambda *a, **k: _CURRENT_STREAM,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "current_device": lambda: "cpu",
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
    }  # torch.manual_seed calls it after seeding the CPU


class _Tripwire:
    def __init__(self):
        self.calls: set[str] = set()

    def wrap(self, name, fn):
        def recorded(*args, **kwargs):
            self.calls.add(name)
            return fn(*args, **kwargs)

        return recorded


_TRIPWIRE: _Tripwire | None = None


@contextlib.contextmanager
def tripwire():
    """While open, every `active()` block records the uncovered torch.cuda functions it calls:
    yields the set of their names (HARMLESS ones included; the test decides)."""
    global _TRIPWIRE
    _TRIPWIRE = _Tripwire()
    try:
        yield _TRIPWIRE.calls
    finally:
        _TRIPWIRE = None


@contextlib.contextmanager
def active():
    """Megatron's CUDA calls answered by the CPU for the duration of the block (see the module)."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    saved: list[tuple[object, str, object]] = []
    absent = object()

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name, absent)))
        setattr(owner, name, value)

    for name, value in _replacements().items():
        patch(torch.cuda, name, value)
    patch(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    patch(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    patch(torch.cuda, "Stream", _Stream)
    patch(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _Stream())
    host_copy = _host_copy(moe_utils.maybe_move_tensor_to_cpu)
    for module in (moe_utils, token_dispatcher):  # token_dispatcher imported the function by name
        patch(module, "maybe_move_tensor_to_cpu", host_copy)
    patch(dist, "all_gather", _uneven_all_gather(dist.all_gather))
    patch(dist, "reduce_scatter", _listed_reduce_scatter(dist.reduce_scatter))
    if not hasattr(moe_utils, "te_general_gemm"):
        patch(moe_utils, "te_general_gemm", None)
    if _TRIPWIRE is not None:
        for name, fn in list(vars(torch.cuda).items()):
            if name.startswith("_") or name in COVERED or not inspect.isfunction(fn):
                continue
            patch(torch.cuda, name, _TRIPWIRE.wrap(name, fn))
    try:
        with _CudaToCpu():
            yield
    finally:
        for owner, name, value in reversed(saved):
            if value is absent:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
