"""The trace's allocation counter: the bytes of live tensor storages at every moment of a traced
step, and its peak. Fake tensors allocate nothing an allocator or the profiler could see, so the
trace counts storages itself.

  live tensors  a TorchDispatchMode that sees every op's outputs and counts each new storage
                once, with a weakref finalizer on the storage to subtract it when it is freed:
                the bytes of live tensors at every moment, its peak during the step, and which
                forward or backward (or the optimizer step) that peak fell in

Fake storages all report data_ptr 0, so storages are told apart by their StorageImpl
(untyped_storage()._cdata), which a live storage keeps and which the finalizer releases. A DTensor
counts as its local shard (what the rank holds). A storage resized in place (FSDP2 frees each
gathered parameter by resizing its storage to 0 and re-allocates it so) counts at its new size.
Sizes are the tensors' storages, not the caching allocator's rounded blocks (its fragmentation is
a named term: terms.py).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness.measure.census import local_tensor, storage_identity


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
        self.events: list | None = None  # (+1, key, bytes) / (-1, key, 0) in order, while record_events()

    def record_events(self) -> None:
        """From now on keep the order of allocations and frees (allocator.py replays it)."""
        self.events = []

    def _free(self, key: int) -> None:
        if self.events is not None and key in self.live:
            self.events.append((-1, key, 0))
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
        if self.events is not None:
            self.events.append((1, key, n))
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
        if self.events is not None:  # the allocator frees the old block and allocates the new size
            self.events.append((1, key, n) if n else (-1, key, 0))
        self.bytes += n - self.live[key]
        self.live[key] = n
        if self.bytes > self.peak:
            self.peak, self.peak_at = self.bytes, self.where

    @contextlib.contextmanager
    def counting_resizes(self):
        """While open, UntypedStorage.resize_ reports to resized().

        One of the trace's two overrides of torch (the other: fsdp.py, _static_shapes_without_vote), for
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
