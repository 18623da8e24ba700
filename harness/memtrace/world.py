"""The fake world a traced rank runs in: this process as one global rank of the layout over a
fake process group (torch's FakeStore, backend "fake": collectives and transfers are no-ops on
shapes), so that an engine builds its process groups and runs its collectives in one CPU process.
(Under context parallelism the own engine's K/V exchange too: the fake group's batch_isend_irecv,
all-gather, reduce-scatter and all_to_all_single return at once, leaving what they write unset.)
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(rank: int, world: int, forget):
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
