"""The planner's one-round interleaved order (schedules.chunk_in_flight) against torch's own
ScheduleInterleaved1F1B order, which memory_fsdp.one_round_chunks reads: no processes, torch's order only."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from harness.planner.schedules import chunk_in_flight


def _torch_order(pp: int, m: int, v: int, rank: int):
    """torch's compute actions of `rank` (its _calculate_single_rank_operations, on the fields it reads)."""
    rounds = max(1, m // pp)
    fields = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=pp, _n_microbatches=m)
    return [a for a in ScheduleInterleaved1F1B._calculate_single_rank_operations(fields, rank) if a is not None]


@pytest.mark.parametrize("pp,m,v", [(8, 8, 2), (4, 4, 2), (4, 6, 3), (4, 3, 2), (2, 2, 4)])
def test_chunk_in_flight_is_torchs_one_round_order(pp, m, v):
    """At each chunk's first backward a rank holds the chunk-forwards torch ran less the backwards it ran, and each
    chunk's backwards run back to back (so one chunk's unsharded gradients live at a time)."""
    for rank in range(pp):
        forwards = backwards = 0
        seen, last = [], None
        for a in _torch_order(pp, m, v, rank):
            chunk = a.stage_index // pp
            if a.computation_type == _ComputationType.FORWARD:
                forwards += 1
                continue
            if chunk != last:
                assert chunk not in seen, (rank, a)  # contiguous: a chunk's backwards never resume later
                seen.append(chunk)
                assert chunk_in_flight(v, pp, rank, m, chunk) * v == forwards - backwards, (pp, m, v, rank, chunk)
                last = chunk
            backwards += 1
        assert seen == list(range(v - 1, -1, -1))
