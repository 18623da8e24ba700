"""Context parallelism balanced for causal attention. The own engine's split (cp_token_index: chunks i and
2cp-1-i of 2cp) gives every rank the same share of the causal mask's work, where a contiguous split gives
rank r (2r+1)/cp of the average; its ring's blocks are of equal work, which the planner's overlap of each
K/V hop with one block assumes; and the planner's attention term of a cp rank is 1/cp of the whole
sequence's, the balanced share, for every implementation and kernel class. Quick: no processes."""

from __future__ import annotations

import dataclasses

import pytest

from harness.model.presets import PRESETS
from harness.planner.features import _flash_seq_eff, attention_features
from harness.planner.hardware import load_profile
from harness.planner.layout import ATTENTION_CLASS, PlannerLayout, Workload

L8 = PRESETS["llama3-8b"]
H100 = dataclasses.replace(load_profile("h100-sxm"), calibrated={})


def causal_pairs(positions) -> int:
    """The (query, key) pairs a causal mask lets queries at `positions` see: key position <= query's."""
    return sum(int(p) + 1 for p in positions)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_holds_the_same_share_of_the_causal_work(cp):
    from harness.model.llama import cp_token_index

    seq = 64 * cp
    whole = causal_pairs(range(seq))
    shares = [causal_pairs(cp_token_index(seq, cp, r)) for r in range(cp)]
    assert shares == [whole // cp] * cp  # head and tail chunk pair: (c(2i+1) + c(4cp-2i-1)) c/2, i-free
    chunk = seq // cp  # the naive split's: rank r's pairs are (2r+1) chunk^2 / 2 (+ its diagonal's chunk / 2),
    contiguous = [causal_pairs(range(r * chunk, (r + 1) * chunk)) for r in range(cp)]  # the average cp chunk^2 / 2
    assert [2 * n - chunk for n in contiguous] == [(2 * r + 1) * chunk**2 for r in range(cp)]
    assert max(contiguous) / shares[0] == pytest.approx((2 * cp - 1) / cp, rel=1 / chunk)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_rings_blocks_are_of_equal_work(cp):
    """Each block a rank computes in the ring (harness/engine/context_parallel._ring_rows) covers s^2/2 of
    the causal pairs (the diagonal block's own diagonal aside): the planner's per-hop overlap is one block's
    attention, the layer's over the steps (features.cp_exchange)."""
    from harness.engine.context_parallel import _ring_rows
    from harness.model.llama import cp_token_index

    seq = 16 * cp
    s, c = seq // cp, seq // (2 * cp)
    for i in range(cp):
        q = cp_token_index(seq, cp, i).tolist()
        for j in range(cp):
            k = cp_token_index(seq, cp, j).tolist()
            rows, cols = _ring_rows(i, j, c)
            seen = sum(kp <= qp for qp in q[rows] for kp in k[cols])
            visible = sum(kp <= qp for qp in q for kp in k)
            assert seen == visible  # the rows and columns cut hold every visible pair
            assert visible == s * s // 2 + (c if i == j else 0)


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("attention", ["sdpa_flash", "flash2", "naive", "sdpa"])
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_planners_cp_attention_is_the_balanced_share(cp, attention, impl):
    """A cp rank's attention is 1/cp of the whole sequence's causal attention (flash-class: its FLOPs, at
    the kernel length's efficiency), never the last contiguous rank's (2cp-1)/cp of it. Materialised kernels
    compute masked scores too: the ring its own block whole and half of every other (the engine's blocks),
    allgather and ulysses every key."""
    seq, b = 32768, 1
    one = PlannerLayout(1, 1, 8, b, attention=attention)
    lay = dataclasses.replace(one, cp=cp, cp_impl=impl)
    wl = Workload(seq, 8 * b)
    whole, rank = attention_features(L8, one, wl, H100), attention_features(L8, lay, wl, H100)
    cls = ATTENTION_CLASS[attention]
    if cls in rank:  # flash class: the work over the kernel's efficiency
        length = seq if impl == "ulysses" else seq // cp
        assert rank[cls] * _flash_seq_eff(length) == pytest.approx(whole[cls] * _flash_seq_eff(seq) / cp, rel=1e-12)
    else:  # materialised: the scores computed, masked ones included
        s = seq // cp
        keys = s * (cp + 1) / 2 if impl == "ring" else seq
        score = next(k for k in rank if k != "gemm")
        assert rank[score] / whole[score] == pytest.approx(s * keys / seq**2, rel=1e-12)
