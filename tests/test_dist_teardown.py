"""The end-of-run barrier must not keep a finished rank alive when a peer never arrives."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.launch import free_port

pytestmark = pytest.mark.slow  # every test here starts processes


def _rank(rank: int, port: int, out: str) -> None:
    from harness import runtime as hd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    hd.END_BARRIER_TIMEOUT_S = 3
    ctx = hd.init("cpu")
    dist.all_reduce(torch.ones(1))  # both ranks in the group
    if rank == 1:
        time.sleep(10)  # a peer stuck elsewhere: never reaches the end barrier
        os._exit(0)
    start = time.perf_counter()
    hd.teardown(ctx)
    with open(out, "w") as f:
        f.write(f"{time.perf_counter() - start:.1f}")


def test_end_barrier_gives_up_on_a_missing_peer(tmp_path, capfd):
    out = tmp_path / "rank0_teardown_s"
    ctx = mp.start_processes(_rank, args=(free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=5):
        assert time.monotonic() < deadline, "ranks did not end"
    waited = float(out.read_text())
    assert 2.5 <= waited < 9  # gave up after END_BARRIER_TIMEOUT_S, before the peer left
    assert "peers missing at the end barrier" in capfd.readouterr().out
