"""The own engine's zero-bubble programs (zbv's V and interleaved zero_bubble, the backward split into B and W),
checked by the simulator."""

from __future__ import annotations

import pytest

from harness.engine import schedules as S
from harness.testing.schedules import draw, simulate_grouped

ZBV = [(pp, m) for pp in (2, 4) for m in (1, 2, 3, 4, 7, 8, 16)]


@pytest.mark.parametrize("pp,micro", ZBV)
def test_zbv_programs_run_every_micro_batch_through_every_stage_once(pp, micro):
    """simulate raises on a deadlock, an unreceived message, a compute repeated or missing, a B before its F
    or a W before its B; here also the V: rank r holds stages r and 2pp-1-r, every (chunk, micro) has its
    F, B and W on its rank."""
    progs = S.all_programs("zbv", pp, micro)
    S.simulate(progs)
    simulate_grouped(progs)
    for r, prog in enumerate(progs):
        computes = sorted((a.kind, a.chunk, a.micro) for a in prog if a.kind in "FBW")
        assert computes == sorted((k, c, m) for k in "FBW" for c in (0, 1) for m in range(micro))
        assert {(a.chunk, a.stage) for a in prog if a.kind == "F"} == {(0, r), (1, 2 * pp - 1 - r)}
        assert prog[-1].kind == "STEP"
    # the embedding's stage (0) and the loss's (2pp-1) are rank 0's: nothing comes before or after them
    assert not any(a.kind == "RECV_F" and a.stage == 0 for a in progs[0])
    assert not any(a.kind == "RECV_B" and a.stage == 2 * pp - 1 for a in progs[0])
    # the V's turn (stage pp-1 to pp) stays on rank pp-1
    assert {a.peer for a in progs[pp - 1] if a.kind == "SEND_F" and a.stage == pp - 1} == {pp - 1}


def test_placement_of_a_v():
    place = S.Placement.of("zbv", 4)
    assert [place.stage(r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [place.rank(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    inter = S.Placement.of("interleaved", 4, 2)
    assert [inter.rank(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_zbv_bubble_against_1f1b_with_w_split_out(pp, extra):
    """Same work per micro-batch: a stage's F = 1 and whole backward = 2 under 1F1B; each of zbv's two chunks
    (half the layers) F = 0.5 and backward 1, split into B (input gradient) and W (weight gradients).

    At F = B = W (0.5 each, the zero-bubble papers' balanced case) the simulated zbv step beats the ideal
    (m x 3) by exactly (pp - 1) x 0.5, a sixth of 1F1B's (pp - 1) x 3: torch's ZBV order (which this is)
    keeps one W-sized slot per hop of the warm-up. With a smaller W (0.25: the GEMMs' weight part of a backward
    whose attention has none) the saving shrinks, but zbv stays ahead of 1F1B; with no W to defer (0) it still
    does, by the V's halved chunks. Exact values: unit costs and no transfer time make every time a multiple of
    0.25, so equality holds to 1e-9."""
    micro = 2 * pp - 1 + extra  # torch's ZBV fills its pipeline from 2pp - 1 micro-batches on
    ideal = micro * 3
    one_f_one_b = S.simulate(S.all_programs("1f1b", pp, micro)).finish - ideal
    assert one_f_one_b == pytest.approx((pp - 1) * 3, abs=1e-9)
    balanced = S.simulate(S.all_programs("zbv", pp, micro), 0.5, 1.0, 0.5).finish - ideal
    assert balanced == pytest.approx((pp - 1) * 0.5, abs=1e-9)
    bubbles = [S.simulate(S.all_programs("zbv", pp, micro), 0.5, 1.0, w).finish - ideal for w in (0.5, 0.25, 0.0)]
    assert bubbles == sorted(bubbles) and bubbles[-1] < one_f_one_b


def test_zbv_holds_1f1b_s_activations_on_the_first_rank():
    """Peak (chunk, micro) activations held (F to W), each half a stage's: rank 0 holds 2pp halves = pp stages'
    worth, 1F1B's first rank's pp; the turn's rank holds as many."""
    for pp in (2, 4):
        sim = S.simulate(S.all_programs("zbv", pp, 4 * pp), 0.5, 1.0, 0.5)
        assert sim.peak_in_flight == [2 * pp] * pp


def test_the_simulator_catches_a_w_before_its_b():
    progs = S.all_programs("zbv", 2, 4)
    prog = list(progs[1])
    b = next(i for i, a in enumerate(prog) if a.kind == "B")
    w = next(i for i, a in enumerate(prog) if a.kind == "W" and (a.chunk, a.micro) == (prog[b].chunk, prog[b].micro))
    prog.insert(b, prog.pop(w))
    with pytest.raises(AssertionError, match="weight gradient .* before its input gradient"):
        S.simulate([progs[0], prog])


def test_a_chart_shows_w_as_capitals():
    text = draw(S.simulate(S.all_programs("zbv", 2, 4), 1, 2, 1))
    assert "A" in text and "a" in text and "0" in text


ZB = [
    (pp, v, m) for pp in (2, 3, 4) for v in (2, 3) for m in (1, pp, pp + 1, 2 * pp, 4 * pp) if m % max(1, m // pp) == 0
]


@pytest.mark.parametrize("pp,chunks,micro", ZB)
def test_zero_bubble_programs_run_to_the_end(pp, chunks, micro):
    """torch's ScheduleInterleavedZeroBubble order as the own engine's programs: deadlock-free in both transfer
    modes, each (chunk, micro-batch) F, B and W once on its rank, chunk c at stage c * pp + rank."""
    progs = S.all_programs("zero_bubble", pp, micro, chunks)
    S.simulate(progs)
    simulate_grouped(progs)
    for r, prog in enumerate(progs):
        computes = sorted((a.kind, a.chunk, a.micro) for a in prog if a.kind in "FBW")
        assert computes == sorted((k, c, m) for k in "FBW" for c in range(chunks) for m in range(micro))
        assert {(a.chunk, a.stage) for a in prog if a.kind == "F"} == {(c, c * pp + r) for c in range(chunks)}


@pytest.mark.parametrize("pp,micro,chunks", [(2, 8, 2), (4, 8, 2), (4, 16, 4)])
def test_zero_bubble_fills_the_interleaved_bubble_with_w(pp, micro, chunks):
    """Chunks of 1/v of a stage, F = B (input gradient) = W = 1/v: the deferred W fills two thirds of interleaved
    1F1B's bubble, (pp - 1) x 3 / v, leaving (pp - 1) / v (exact: multiples of 1/4)."""
    v = chunks
    ideal = micro * 3
    inter = S.simulate(S.all_programs("interleaved", pp, micro, v), 1 / v, 2 / v).finish - ideal
    zb = S.simulate(S.all_programs("zero_bubble", pp, micro, v), 1 / v, 2 / v, 1 / v).finish - ideal
    assert inter == pytest.approx((pp - 1) * 3 / v, abs=1e-9)
    assert zb == pytest.approx((pp - 1) / v, abs=1e-9)


@pytest.mark.parametrize("gemm_share", [0.5, 0.75, 1.0])
def test_the_planner_s_bubble_factors_against_the_simulator(gemm_share):
    """The planner's convention (harness/planner/schedules.py): a stage's F = t/3, whole backward 2t/3, W = g t/3
    (g: the GEMMs' share), each of v chunks 1/v of it. Interleaved and zero_bubble: the planner's bubble factor
    (of 1F1B's) is the simulated one exactly (pp 4, 32 micro-batches: steady state dominates, the factors are
    ratios of multiples of t/24, hence 1e-9). zbv: the planner's closed form of torch's ZBV order (which both
    engines run), exactly too; dualpipev: the planner simulates it (at 4pp micro-batches, the same steady state)."""
    from harness.planner.schedules import bubble_factor

    pp, micro, g = 4, 32, gemm_share
    base = S.simulate(S.all_programs("1f1b", pp, micro), 1 / 3, 2 / 3).finish - micro

    def simulated(schedule, chunks):
        f, b, w = 1 / 3 / chunks, 2 / 3 / chunks, g / 3 / chunks
        progs = S.all_programs(schedule, pp, micro, chunks)
        return (S.simulate(progs, f, b, w).finish - micro) / base

    assert simulated("interleaved", 2) == pytest.approx(bubble_factor("interleaved", 2, pp, g), abs=1e-9)
    assert simulated("zero_bubble", 2) == pytest.approx(bubble_factor("zero_bubble", 2, pp, g), abs=1e-9)
    assert simulated("zbv", 2) == pytest.approx(bubble_factor("zbv", 1, pp, g), abs=1e-9)
    assert simulated("dualpipev", 2) == pytest.approx(bubble_factor("dualpipev", 1, pp, g), abs=1e-9)


@pytest.mark.parametrize("pp,micro", [(pp, m) for pp in (2, 3, 4) for m in (2 * pp, 2 * pp + 1, 4 * pp)])
def test_dualpipev_programs_run_to_the_end(pp, micro):
    """torch's ScheduleDualPipeV order (its overlapped F and B pairs one after the other): deadlock-free in both
    transfer modes; each (chunk, micro-batch) F and B once on its V's rank, a W exactly for the backwards it
    splits (the simulator checks each W follows its B)."""
    progs = S.all_programs("dualpipev", pp, micro)
    S.simulate(progs)
    simulate_grouped(progs)
    for r, prog in enumerate(progs):
        computes = sorted((a.kind, a.chunk, a.micro) for a in prog if a.kind in "FB")
        assert computes == sorted((k, c, m) for k in "FB" for c in (0, 1) for m in range(micro))
        assert {(a.chunk, a.stage) for a in prog if a.kind == "F"} == {(0, r), (1, 2 * pp - 1 - r)}
    assert any(a.kind == "W" for a in progs[0])
