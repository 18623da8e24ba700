"""A memory census: bytes per category and dtype of the tensors an engine holds (each storage once), taken
at its first optimizer step, and the bytes autograd saves for backward (activations)."""

from __future__ import annotations

import weakref

import torch

# buffers: communication scratch a framework keeps (DeepSpeed's reduce buckets), sized by its
# config, not by the model: not gradients, though gradients pass through them
# fp8: what persists of FP8 training between steps (FP8 weight copies, their scales: harness/model/float8.py)
CENSUS_CATEGORIES = ("parameters", "buffers", "gradients", "master_parameters", "optimizer_states", "fp8")


# torchao.float8's tensor subclasses (no storage of their own) -> the attribute holding their data: the
# weight FSDP2 all-gathers in FP8 (its bf16/fp32 shard), and an FP8 tensor (its float8 bytes; the scale apart)
TORCHAO_INNER = {"WeightWithDynamicFloat8CastTensor": "_tensor", "Float8TrainingTensor": "_data"}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank really holds: a DTensor's local shard, the result inside a pending
    functional collective (AsyncCollectiveTensor.elem), torchao's FP8 wrappers' data (TORCHAO_INNER)."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None)
        if inner is None and type(t).__name__ in TORCHAO_INNER:
            inner = getattr(t, TORCHAO_INNER[type(t).__name__], None)
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner


def _dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def storage_address(storage) -> int:
    """What tells two storages apart on a real device: their address. (Fake tensors, which
    `harness memory` traces, all have address 0: it passes storage_identity instead.)"""
    return storage.data_ptr()


def storage_identity(storage) -> int:
    """The storage's StorageImpl: unique while it lives, on fake tensors too."""
    return storage._cdata


def tensor_census(categories: dict[str, list], key=storage_address) -> dict[str, dict[str, int]]:
    """Bytes per category and dtype of the tensors an engine holds, each storage counted once
    (the first category that names it wins: a parameter that is its own master is a parameter;
    views into one flat buffer count the buffer once, padding included, as allocated)."""
    seen: set[int] = set()
    out: dict[str, dict[str, int]] = {}
    for category, tensors in categories.items():
        counts = out.setdefault(category, {})
        for t in tensors:
            if t is None:
                continue
            t = local_tensor(t)
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            k = key(storage)
            if k in seen or storage.nbytes() == 0:
                continue
            seen.add(k)
            counts[_dtype_key(t.dtype)] = counts.get(_dtype_key(t.dtype), 0) + storage.nbytes()
    return out


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's state (Adam's moments; the step counter too)."""
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


class SavedActivations:
    """Bytes autograd saves for backward while this context is open (torch's saved-tensor hooks),
    each storage once, parameters excluded: what activation memory a step holds. A storage is
    forgotten when the last saved tensor on it is freed, so an address the allocator reuses later
    in the step (pipeline schedules interleave forwards and backwards) counts again."""

    def __init__(self, parameters, key=storage_address):
        self.key = key
        self.skip = {key(local_tensor(p).untyped_storage()) for p in parameters}
        self.live: dict[int, int] = {}  # storage key -> saved tensors alive on it
        self.bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _release(self, key: int) -> None:
        self.live[key] -= 1
        if not self.live[key]:
            del self.live[key]

    def _pack(self, t):
        t_local = local_tensor(t)
        # parameters by identity too: ZeRO-3 gathers full parameters into storages that did not
        # exist when this context opened (DeepSpeed marks them with ds_id)
        if t_local.device.type != "meta" and not isinstance(t, torch.nn.Parameter) and not hasattr(t, "ds_id"):
            storage = t_local.untyped_storage()
            key = self.key(storage)
            if key not in self.skip:
                if key not in self.live:
                    self.bytes += storage.nbytes()
                    self.live[key] = 0
                self.live[key] += 1
                weakref.finalize(t, self._release, key)
        return t

    def __enter__(self):
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


class CensusAtStep:
    """tensor_census(tensors()) taken once, right after `optimizer` first steps: its states exist
    then and the gradients are not cleared yet, so all four categories are alive (the
    census 'held at the optimizer step'). `optimizer` is the torch optimizer that updates this
    rank's master (or only) parameters, also where a framework wraps it.

    `calls_per_step`: how many calls of optimizer.step make one training step. DeepSpeed's ZeRO-1/2
    steps its basic optimizer once per parameter group, that group alone swapped in (a MoE's expert
    groups apart from the dense one), so after the first call only the first group's states exist:
    the masters and optimizer states are counted again after each of the first step's calls (states
    persist: the last call holds every group's), the parameters, gradients and buffers stay those of
    the first call (DeepSpeed frees each group's gradients after its call)."""

    PERSISTENT = ("master_parameters", "optimizer_states")

    def __init__(self, optimizer, tensors, calls_per_step: int = 1):
        self.tensors, self.result = tensors, None
        self.calls, self.calls_per_step = 0, calls_per_step
        # kept registered (a no-op after the first step): removing a hook while the optimizer
        # iterates its hooks would break any hook registered after this one
        optimizer.register_step_post_hook(self._take)

    def _take(self, optimizer, args, kwargs) -> None:
        self.calls += 1
        if self.result is None:
            self.result = tensor_census(self.tensors())
        elif self.calls <= self.calls_per_step:
            later = tensor_census(self.tensors())
            self.result.update({k: later.get(k, {}) for k in self.PERSISTENT})
