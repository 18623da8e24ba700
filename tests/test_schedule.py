"""Pipeline schedules as instruction lists, checked without processes."""

from __future__ import annotations

import pytest

from harness.engine import schedules as S
from harness.testing.schedules import draw, simulate_grouped

CASES = (
    [("gpipe", pp, m, 1) for pp in (1, 2, 4) for m in (1, 3, 8)]
    + [("1f1b", pp, m, 1) for pp in (1, 2, 3, 4, 8) for m in (1, 2, 4, 8, 16)]
    + [("interleaved", pp, m, v) for pp in (1, 2, 4) for m in (pp, 2 * pp, 4 * pp) for v in (1, 2, 3)]
)


@pytest.mark.parametrize("schedule,pp,micro,chunks", CASES)
def test_programs_run_to_the_end(schedule, pp, micro, chunks):
    progs = S.all_programs(schedule, pp, micro, chunks)
    sim = S.simulate(progs)  # raises on deadlock, mismatch, or a repeated/missing compute
    for r, prog in enumerate(progs):
        computes = [(a.kind, a.chunk, a.micro) for a in prog if a.kind in ("F", "B")]
        assert sorted(computes) == sorted((k, c, m) for k in "FB" for c in range(chunks) for m in range(micro))
        assert prog[-1].kind == "STEP"
        # first stage never receives activations; last stage never receives gradients
        if r == 0:
            assert not any(a.kind == "RECV_F" and a.chunk == 0 for a in prog)
        if r == pp - 1:
            assert not any(a.kind == "RECV_B" and a.chunk == chunks - 1 for a in prog)
    assert len(sim.timeline) == pp


@pytest.mark.parametrize("pp,micro", [(2, 8), (4, 8), (4, 16), (8, 32), (3, 2)])
def test_1f1b_holds_at_most_pp_micro_batches(pp, micro):
    sim = S.simulate(S.all_programs("1f1b", pp, micro))
    assert sim.peak_in_flight[0] == min(pp, micro)
    assert all(p <= pp for p in sim.peak_in_flight)
    gpipe = S.simulate(S.all_programs("gpipe", pp, micro))
    assert gpipe.peak_in_flight[0] == micro


@pytest.mark.parametrize("pp,micro", [(2, 8), (4, 8), (4, 16)])
def test_1f1b_meets_the_ideal_bubble(pp, micro):
    """With F=1, B=2 the step takes (m + p - 1) x 3: the textbook 1F1B time."""
    sim = S.simulate(S.all_programs("1f1b", pp, micro))
    assert sim.finish == (micro + pp - 1) * 3


@pytest.mark.parametrize("pp,micro,chunks", [(2, 4, 2), (4, 8, 2), (4, 16, 4)])
def test_interleaving_shrinks_the_bubble(pp, micro, chunks):
    """Chunks cost 1/chunks of a stage; the bubble shrinks by about the number of chunks."""
    plain = S.simulate(S.all_programs("1f1b", pp, micro)).finish
    inter = S.simulate(S.all_programs("interleaved", pp, micro, chunks), f_cost=1 / chunks, b_cost=2 / chunks).finish
    ideal = micro * 3
    assert inter < plain
    assert inter - ideal <= (plain - ideal) / chunks + 1e-9 + 3 * (pp - 1) / chunks


def test_simulator_catches_a_deadlock_and_a_missing_receive():
    progs = S.all_programs("1f1b", 2, 2)
    swapped = [list(progs[0]), list(progs[1])]
    # rank 1 waits for a gradient that nobody sends before its own forward is received
    swapped[0] = [a for a in swapped[0] if a.kind != "SEND_F"]
    with pytest.raises(AssertionError, match="deadlock"):
        S.simulate(swapped)
    dropped = [list(progs[0]), [a for a in progs[1] if a.kind != "RECV_F"]]
    with pytest.raises(AssertionError):
        S.simulate(dropped)


def test_draw_shows_each_rank():
    text = draw(S.simulate(S.all_programs("1f1b", 2, 4)))
    assert text.count("rank") == 2


@pytest.mark.parametrize("schedule,pp,micro,chunks", [c for c in CASES if c[1] > 1])
def test_grouped_transfers_never_deadlock(schedule, pp, micro, chunks):
    """NCCL mode: with every group posted at once and waited for as a whole, the step still ends,
    and each rank's groups carry exactly its program's transfers in FIFO order per peer."""
    progs = S.all_programs(schedule, pp, micro, chunks)
    finish = simulate_grouped(progs)
    assert finish >= S.simulate(progs).finish
    grouped = S.grouped_programs(progs)
    for r in range(pp):
        sends = [t for g in grouped[r] if isinstance(g, list) for t in g if t.op == "send"]
        for peer in range(pp):
            if peer != r:
                assert [t.label for t in sends if t.peer == peer] == S.send_order(progs, r, peer)
        recvs = [t for g in grouped[r] if isinstance(g, list) for t in g if t.op == "recv"]
        for peer in range(pp):
            if peer != r:
                assert [t.label for t in recvs if t.peer == peer] == S.send_order(progs, peer, r)
        computes = [a for a in grouped[r] if not isinstance(a, list)]
        assert computes == [a for a in progs[r] if a.kind in ("F", "B", "STEP")]


def test_1f1b_grouped_is_as_fast_as_async():
    progs = S.all_programs("1f1b", 4, 16)
    assert simulate_grouped(progs) == S.simulate(progs).finish
