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

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    hd.END_BARRIER_TIMEOUT_S = 3
    ctx = hd.init("cpu")
    dist.all_reduce(torch.ones(1))  # both ranks in the group
    if rank == 1:
        # A peer stuck elsewhere: it never reaches the end barrier and stays until rank 0's
        # teardown has returned (its file exists), so rank 0 can only have left without it. The
        # limit is a hang guard, 30x the barrier's timeout: past it rank 1 leaves and says so.
        deadline = time.monotonic() + 90
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.1)
        with open(out + ".peer", "w") as f:
            f.write("stayed" if os.path.exists(out) else "gave up waiting")
        os._exit(0)
    start = time.perf_counter()
    hd.teardown(ctx)
    with open(out + ".tmp", "w") as f:
        f.write(f"{time.perf_counter() - start:.1f}")
    os.replace(out + ".tmp", out)


def test_end_barrier_gives_up_on_a_missing_peer(tmp_path, capfd):
    out = tmp_path / "rank0_teardown_s"
    ctx = mp.start_processes(_rank, args=(free_port(), str(out)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 180  # a hang guard beyond rank 1's
    while not ctx.join(timeout=5):
        assert time.monotonic() < deadline, "ranks did not end"
    # rank 0 left while its peer was still there, after waiting the barrier's timeout (a lower
    # bound: load can only lengthen the wait, never shorten it)
    assert (tmp_path / "rank0_teardown_s.peer").read_text() == "stayed"
    assert float(out.read_text()) >= 2.5
    assert "peers missing at the end barrier" in capfd.readouterr().out
