"""The caching allocator's replay (harness/memtrace/allocator.py): its rules, each on a sequence whose reserved
bytes follow from c10/cuda/CUDACachingAllocator.cpp by hand, and a traced step replayed (no processes)."""

from __future__ import annotations

from harness.memtrace.allocator import LARGE_BUFFER, CachingAllocator, replay, round_size, segment_size

MIB, GIB = 1 << 20, 1 << 30


def test_sizes_round_as_the_allocator_does():
    assert round_size(1) == 512 and round_size(513) == 1024
    assert segment_size(1000) == 2 * MIB  # small pool: 2 MiB segments
    assert segment_size(3 * MIB) == LARGE_BUFFER  # 1-10 MiB: a 20 MiB segment, split
    assert segment_size(10 * MIB + 1) == 12 * MIB  # larger: rounded up to 2 MiB


def test_best_fit_split_and_a_freed_large_block_that_no_larger_request_reuses():
    a = CachingAllocator()
    a.malloc("x", 4 * GIB)
    a.malloc("y", 2 * GIB)
    a.free("x")  # 4 GiB cached, free
    a.malloc("z", 8 * GIB)  # fits in no free block: a new segment, the 4 GiB stays reserved
    assert a.reserved == 14 * GIB and a.allocated == 10 * GIB
    assert a.free_at_peak == [4 * GIB]  # what the request that set the peak could not use
    a.malloc("w", 1 * GIB)  # best fit: carved from the free 4 GiB block, no new segment
    assert a.reserved == 14 * GIB
    a.free("w")  # merges back with the 3 GiB left of its segment
    a.malloc("v", 4 * GIB)
    assert a.reserved == 14 * GIB


def test_segments_never_merge_but_an_expandable_one_grows_its_free_tail():
    plain, grown = CachingAllocator(), CachingAllocator(expandable=True)
    for a in (plain, grown):
        a.malloc("x", 2 * GIB)
        a.malloc("y", 2 * GIB)
        a.free("y")
        a.malloc("z", 3 * GIB)  # plain: the free 2 GiB segment cannot hold it; expandable: its tail grows by 1 GiB
    assert plain.reserved == 7 * GIB
    assert grown.reserved == 5 * GIB


def test_a_small_remainder_of_a_large_block_is_not_split_off():
    a = CachingAllocator()
    a.malloc("x", 12 * MIB)
    a.free("x")
    a.malloc("y", 12 * MIB - 512 * 1024)  # 0.5 MiB left: not more than 1 MiB, the whole block is taken
    assert a.allocated == 12 * MIB


def test_replay_steady_state_keeps_what_a_step_reserved():
    """Two steps of the same events: the second reuses the first's segments (no growth), and a storage left
    allocated at a step's end is freed as the next starts (zero_grad)."""
    events = [(1, 1, 4 * GIB), (1, 2, GIB), (-1, 1, 0), (1, 3, 6 * GIB), (-1, 3, 0)]
    one, two = replay(events, {}, repeats=1), replay(events, {}, repeats=2)
    assert one.peak_reserved == two.peak_reserved == 11 * GIB
    assert two.peak_allocated == 7 * GIB


def test_a_traced_step_replays_to_its_live_peak_and_reserves_at_least_that():
    from harness.memtrace.trace import trace_rank
    from harness.spec import parse_spec
    from harness.testing.workloads import tiny_workload

    raw = {**tiny_workload(model="tiny", seq_len=64, steps=2, warmup_steps=0), "global_batch_size": 8}
    spec = parse_spec({"workload": raw, "layout": {"engine": "fsdp", "dp": 2}})
    tr = trace_rank(spec, spec.shape(), 0)
    got = tr.extra["reserved"]
    # the replay's allocated peak is the live peak in 512-byte blocks
    assert tr.live_peak_bytes <= got["allocated"] <= tr.live_peak_bytes + 512 * 4096
    assert got["segments"] >= got["allocated"] and got["expandable"] >= got["allocated"]
