"""The gathered parameters FSDP2 allocates anew at every all-gather, kept from the count of what autograd saves
(harness.measure.census.SavedActivations): engine fsdp's, split from engine.py."""

from __future__ import annotations

import contextlib

import torch

from harness.measure import census


@contextlib.contextmanager
def gathered_parameters_are_not_activations(fsdp_params):
    """While an enclosing saved-tensor hook counts what autograd saves for backward
    (measure.census.SavedActivations, on the first step), the gathered parameters that autograd saves
    bypass it. They cannot be named up front (FSDPEngine.activation_exclusions): FSDP2 allocates each
    gathered parameter anew at every all-gather and frees it on reshard (_fsdp_param.py:
    alloc_storage / free_storage resize one storage object in place), so its address changes
    from micro-batch to micro-batch; the storage object itself does not, and is matched here.
    Autograd saves the same tensors either way; without an enclosing hook this is a no-op."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        yield
        return
    outer_pack, outer_unpack = top
    gathered: set[int] = set()  # the storage objects (not addresses) of the gathered parameters
    pending = fsdp_params()  # FSDP2 creates them at each group's first all-gather

    def is_gathered(t: torch.Tensor) -> bool:
        key = census.local_tensor(t).untyped_storage()._cdata
        if key not in gathered and pending:
            gathered.update(o.untyped_storage()._cdata for fp in pending for o in fp.all_gather_outputs)
            pending[:] = [fp for fp in pending if not fp.all_gather_outputs]
        return key in gathered

    def pack(t):
        return (True, t) if is_gathered(t) else (False, outer_pack(t))

    def unpack(packed):
        passed, value = packed
        return value if passed else outer_unpack(value)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
