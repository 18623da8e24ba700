"""A breakdown that is measured (compute clocked, what no clock covers its own
component), labels that say what a call did (pp transfers apart from the bubble, one-rank groups, the
expert group), and Why naming every component that moved between runs that differ in one factor."""

from __future__ import annotations

import time

import pytest
import torch

from harness.report.data import Breakdown
from harness.report.why import Case, comparisons, explain, factors

BASE = {
    "activation_checkpointing": "none",
    "attention": "sdpa",
    "engine": "own",
    "micro_batch_size": 2,
    "pipeline_schedule": "1f1b",
    "rmsnorm": "torch",
    "sequence_parallel": False,
    "dp": 1,
    "tp": 1,
    "pp": 1,
}


def _case(label, ms, parts, layout=None, engine="own"):
    b = Breakdown(parts, sum(parts.values()), "measured steps")
    lay = dict(BASE, **(layout or {}))
    ci = (ms * 0.99e-3, ms * 1.01e-3)
    return Case(label, engine, label, ms / 1e3, b, ci, None, fields=factors(lay))


def test_why_names_every_component_that_moved_either_way():
    # the committed report's megatron pp2 against megatron dp2: compute +12.6 ms was left out behind the bubble
    dp2 = _case("megatron dp2", 45.5, {"compute": 33.2, "dp_comm": 6.6, "wait": 1.7, "optimizer": 2.1, "other": 1.9})
    pp2 = _case("megatron pp2", 72.0, {"compute": 45.8, "dp_comm": 0.2, "bubble": 22.5, "optimizer": 1.7, "other": 1.8})
    text = explain(dp2, pp2)
    assert "pipeline bubble +22.5 ms (85% of the difference)" in text, text
    assert "compute +12.6 ms (48% of the difference)" in text, text
    assert "partly offset by exposed dp communication -6.4 ms" in text, text
    assert "optimizer" not in text  # -0.4 ms: under 10% of the difference


def test_an_engine_s_layouts_are_compared_only_where_one_factor_differs():
    parts = {"compute": 10.0, "tp_comm": 0.0, "dp_comm": 2.0}
    dp2 = _case("own dp2", 15.7, dict(parts), {"dp": 2})
    tp2 = _case("own tp2", 133.8, dict(parts, tp_comm=110.0, compute=23.8), {"tp": 2})
    naive = _case("own tp2 naive", 116.1, dict(parts, tp_comm=90.0, compute=24.1), {"tp": 2, "attention": "naive"})
    _, layouts = comparisons([dp2, tp2, naive])
    pairs = [s.split(" takes ")[0] + " / " + s.split(" than ")[1].split(" (")[0] for s in layouts if " takes " in s]
    # own tp2 naive against own dp2 changed the split and the kernel at once: never a pair
    assert "own tp2 naive / own dp2" not in pairs and "own tp2 / own dp2" in pairs, layouts
    assert "own tp2 / own tp2 naive" in pairs, layouts  # the kernel alone
    assert factors(dict(BASE, tp=2)).keys() == factors(dict(BASE, dp=2)).keys()


def test_a_run_no_other_run_is_one_factor_from_is_said_not_compared():
    parts = {"compute": 10.0, "dp_comm": 2.0}
    dp2 = _case("own dp2", 15.7, dict(parts), {"dp": 2})
    naive = _case("own tp2 naive", 116.1, dict(parts, compute=110.0), {"tp": 2, "attention": "naive"})
    _, layouts = comparisons([dp2, naive])
    assert layouts == [
        "Not compared (no run of the same engine differs from them in one layout field only): own tp2 naive."
    ]


# ---------------------------------------------------------------- item 4: compute measured, not the rest


def _counters(**degrees):
    from harness.parallel_dims import ParallelDims
    from harness.profiling.annotate import AxisOf
    from harness.profiling.counters import Counters

    dims = ParallelDims(**degrees)
    return Counters(AxisOf(dims, 0), pp=dims.pp)


class _Slow(torch.nn.Module):
    """A forward that sleeps (compute), calls a blocking dp collective inside it (communication, not
    compute), and whose backward sleeps too (compute, clocked through the autograd engine)."""

    def __init__(self, counters):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.counters = counters

    def forward(self, x):
        time.sleep(0.010)
        with self.counters._call() as call:  # what the wrapped torch.distributed call does
            call.mark("all_reduce", "dp", "sync", 16)
            time.sleep(0.008)
        return _SleepyGrad.apply(x * self.w)


class _SleepyGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.010)
        return g


def test_compute_is_clocked_and_what_no_clock_covers_is_unattributed():
    counters = _counters(dp=2)
    model = _Slow(counters)
    with counters:
        model(torch.ones(4)).sum().backward()
        time.sleep(0.005)  # host work outside every clock
    b = counters.parts(1.0)  # a step much longer than what the clocks saw: the rest is not compute
    # lower bounds only (they hold on any load): forward and backward slept 20 ms, the collective 8 ms
    assert b["compute"] >= 20.0 and b["exposed_comm"]["dp"] >= 8.0
    assert b["compute"] < 500.0  # before: compute was the step less the rest, 990 ms here
    assert b["unattributed"] >= 1000.0 - b["compute"] - b["exposed_comm"]["dp"] - b["optimizer"] - b["wait"] - 1e-6
    assert set(b["exposed_comm"]) == {"dp"}  # tp 1: no tp column


def test_a_breakdown_whose_clocks_overlap_fails_the_sum_check():
    from harness.report.why import against_median, representative

    b = Breakdown({"compute": 12.0, "dp_comm": 3.0, "unattributed": -5.0}, 10.0, "measured steps")
    assert not representative(b, 0.010) and against_median(b, 0.010).startswith("150%: above 110% (clocks overlap)")
    fine = Breakdown({"compute": 7.0, "dp_comm": 2.0, "unattributed": 1.0}, 10.0, "measured steps")
    assert representative(fine, 0.010) and against_median(fine, 0.010) == "90%"
    other_steps = Breakdown({"compute": 11.0, "dp_comm": 2.0, "unattributed": 1.0}, 14.0, "profiled steps")
    assert not representative(other_steps, 0.010)
    assert against_median(other_steps, 0.010) == (
        "130%; its step 140% of the median (off by more than 10%), not used by Why"
    )
    longer = Breakdown({"compute": 8.0, "dp_comm": 2.0, "unattributed": 4.0}, 14.0, "profiled steps")
    assert not representative(longer, 0.010)
    assert against_median(longer, 0.010).startswith("100%; its step 140% of the median (off by more than 10%)")


def test_what_no_clock_covers_closes_no_sum_and_is_no_component_of_an_explanation():
    """The sum check read +0% by construction: 'unattributed' (the step less its clocked parts) closed it.
    Now the clocked components' share of the median is shown and nothing closes it; what no clock covers
    is said apart in Why, with its share of the difference (how much the clocks leave unexplained), never
    as a component of the explanation."""
    from harness.report.why import Case, against_median, clocked_ms, explain, representative

    sparse = Breakdown({"compute": 6.0, "dp_comm": 2.0, "unattributed": 2.0}, 10.0, "measured steps")
    assert clocked_ms(sparse) == 8.0 and against_median(sparse, 0.010) == "80%"  # before: '+0%'
    assert representative(sparse, 0.010)  # its step is the median's: it explains, the 20% said apart

    def case(label, step_ms, **parts):
        b = Breakdown(parts, step_ms, "measured steps")
        return Case(label, "own", label, step_ms / 1e3, b, times_s=tuple([step_ms / 1e3] * 12))

    fast = case("a", 10.0, compute=8.0, dp_comm=1.5, unattributed=0.5)
    slow = case("b", 20.0, compute=16.5, dp_comm=2.0, unattributed=1.5)
    text = explain(fast, slow)
    assert "compute +8.5 ms (85% of the difference)" in text, text
    assert text.endswith("; not clocked +1.0 ms (10% of the difference, what no clock covers)."), text
    assert "unattributed" not in text


def _summary_run(label, compute, nproc, ref=False, gaps=None, profiled=None, layout=None):
    m = {"step_time_s": {"median": compute / 1e3 * 1.2}}
    if profiled is not None:
        m.update(breakdown_ms=profiled, breakdown_source="profiler", compute_host_gaps_ms=gaps)
    return {
        "label": label,
        "is_reference": ref,
        "status": "ok",
        "nproc": nproc,
        "layout": dict(BASE, **(layout or {})),
        "breakdown_ms": {"compute": compute, "optimizer": 1.0, "exposed_comm": {}, "step": compute + 1.0},
        "breakdown_source": "measured steps",
        "metrics": m,
    }


def test_compute_costing_more_than_the_reference_per_flop_is_flagged_with_where_it_went():
    from harness.report.compare_steps import compute_flags

    prof = {"compute": 40.0, "unattributed": 26.0, "optimizer": 2.0, "exposed_comm": {}, "step": 70.0}
    summary = {
        "runs": [
            _summary_run("reference (single device)", 25.9, 1, ref=True, gaps=3.0, profiled=dict(prof, compute=28.0)),
            _summary_run("own dp2", 12.0, 2, layout={"dp": 2}),
            _summary_run("FSDP2 tp2", 165.3, 2, gaps=26.0, profiled=prof, layout={"tp": 2}),
        ]
    }
    flags = compute_flags(summary)
    assert len(flags) == 2 and "own dp2" not in " ".join(flags)  # 0.93x: not flagged
    assert flags[1].startswith("**FSDP2 tp2**: compute 165.3 ms per rank on 2 ranks costs 12.8x the reference's")
    assert "40.0 ms of operators and 26.0 ms of host time between them" in flags[1], flags[1]


# ---------------------------------------------------------------- item 5: labels that say what a call did


def test_pp_transfers_are_split_from_the_bubble_by_the_peer_s_post_time():
    from harness.profiling.record import split_transfers

    # rank 0 blocked 100-150 ms receiving from rank 1, whose send was posted at 140 ms: 40 ms of waiting for
    # the peer (bubble), 10 ms of transfer; its own send, posted at 200 ms, blocked 200-203 after rank 1 had
    # posted the receive at 190: 3 ms of transfer
    row = {
        "compute": 10.0,
        "exposed_comm": {},
        "bubble": 60.0,
        "step": 300.0,
        "p2p": [
            {"kind": "recv", "peer": 1, "post": 0.100, "blocked": [(0.100, 0.150)]},
            {"kind": "send", "peer": 1, "post": 0.200, "blocked": [(0.200, 0.203)]},
        ],
    }
    posts = [{("recv", 1): [0.100], ("send", 1): [0.200]}, {("send", 0): [0.140], ("recv", 0): [0.190]}]
    out = split_transfers(row, 0, posts, "bubble")
    assert out["exposed_comm"]["pp"] == pytest.approx(13.0) and out["bubble"] == pytest.approx(47.0)
    assert "p2p" not in out
    # ranks on several hosts (no shared clock): not split, no pp column rather than a guess
    apart = split_transfers(row, 0, None, "bubble")
    assert "pp" not in apart["exposed_comm"] and apart["bubble"] == 60.0


def test_a_call_on_a_one_rank_group_is_no_tp_communication():
    counters = _counters(dp=2)
    with counters:
        with counters._call() as call:  # Megatron's cross-entropy all-reduce over its tp group at tp 1
            call.mark("all_reduce", "tp", "sync", 4)
        with counters._call() as call:
            call.mark("all_reduce", "tp+pp", "sync", 4)
    b = counters.parts(0.1)
    assert "tp" not in b["exposed_comm"] and "tp+pp" not in b["exposed_comm"] and "one-rank" in b["exposed_comm"]

    from harness.profiling.analysis import relabel
    from harness.report.data import component_title

    assert relabel({"tp": 1.2, "dp": 6.5, "tp+pp": 0.2}, {"tp": 1, "pp": 1, "dp": 2, "cp": 1, "ep": 1}) == {
        "one-rank": pytest.approx(1.4),
        "dp": 6.5,
    }
    assert component_title("one-rank_comm") == "calls on one-rank groups (no communication)"
    assert component_title("pp_comm") == "pipeline transfers"


def test_megatron_s_expert_group_by_another_name_is_ep(monkeypatch):
    import torch.distributed as dist

    from harness.parallel_dims import ParallelDims
    from harness.profiling.annotate import AxisOf

    class Group:  # Megatron's tp x ep group at tp 1: its ranks are the expert group's
        group_desc = "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP"

    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: [2, 3])
    assert AxisOf(ParallelDims(dp=4, ep=2), 3)(Group()) == "ep"  # before: 'other [2,3]', half on each rank's mean


def test_a_call_handed_back_by_a_torch_function_mode_is_counted_once():
    """Megatron's pp2 sent and received 8 times a step against 4 for every other engine on the same schedule:
    under the harness's CPU shim (a TorchFunctionMode) torch.distributed hands each call back through the
    mode, by the module's name, which is the annotation's wrapper again: every call was counted twice."""
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    from harness.parallel_dims import ParallelDims
    from harness.profiling import annotate

    class Mode(TorchFunctionMode):  # what megatron shim._CudaToCpu does with a call it does not change
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    marks = []

    class Seen(annotate._Range):
        def mark(self, kind, axis, mode, nbytes):
            marks.append((kind, axis, mode))

    class Counted(annotate.Annotations):
        def _call(self):
            return Seen()

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Counted(annotate.AxisOf(ParallelDims(), 0)), Mode():
            dist.all_reduce(torch.ones(2))
    finally:
        if started:
            dist.destroy_process_group()
    assert marks == [("all_reduce", "all", "sync")]


def test_a_warm_up_step_runs_the_clocks_uncounted():
    """What the clocks cost once (dynamo looking at the module hooks of a compiled run) falls in the warm-up."""
    from harness.parallel_dims import ParallelDims
    from harness.profiling.counters import MeasuredSteps

    steps = MeasuredSteps(ParallelDims(dp=2), 0, {}, "cpu")
    assert steps.clock(False) is steps.counters  # before: no clocks in the warm-up
    steps.add(0.1)
    assert steps.counted == []


def test_a_report_shows_no_tp_communication_at_tp1_even_for_older_records():
    from harness.report.compare_steps import breakdown_rows

    run = _summary_run("megatron dp2", 33.2, 2, layout={"dp": 2})
    run["breakdown_ms"]["exposed_comm"] = {"tp": 1.2, "tp+pp": 0.2, "dp": 6.5, "pp": 0.0}
    header, rows = breakdown_rows({"runs": [run]})
    cells = dict(zip(header, rows[0], strict=True))
    assert "exposed tp communication" not in cells and "exposed pp communication" not in cells
    assert cells["calls on one-rank groups (no communication)"] == "1.4 ms (4%)"
    assert cells["exposed dp communication"] == "6.5 ms (19%)"


def test_a_group_that_is_no_axis_is_named_by_what_it_is_and_averaged_over_its_members(monkeypatch):
    """Generic groups were named by their ranks ('other [0,1]', 'other [2,3]': one kind of group under two
    names) and averaged over every rank (each showed half of what a member spends). Now one name for the kind,
    and its time averaged over the ranks that have such a group; a group every rank belongs to (an axis, or
    axes together) still counts 0 on a rank without calls on it."""
    import torch.distributed as dist

    from harness.parallel_dims import ParallelDims
    from harness.profiling.annotate import AxisOf
    from harness.profiling.record import _mean_over_ranks

    groups = {"a": [0, 1], "b": [2, 3], "c": [0, 2], "d": [1, 3]}

    class Group:
        def __init__(self, key):
            self.key = key

    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: groups[g.key])
    dims = ParallelDims(pp=2, dp=2, tp=2)
    named = {AxisOf(dims, r)(Group(k)) for k, r in (("a", 0), ("b", 2))}
    assert named == {"tp"}  # an axis's groups stay the axis
    dims = ParallelDims(pp=2, dp=4)
    assert AxisOf(dims, 0)(Group("a")) == AxisOf(dims, 2)(Group("b")) == "part of dp (2 of 4 ranks)"

    def row(comm):
        return {"compute": 10.0, "exposed_comm": comm, "step": 20.0}

    part = "part of dp (2 of 4 ranks)"
    rows = [row({"dp": 2.0, part: 4.0}), row({"dp": 2.0, part: 4.0}), row({"dp": 2.0}), row({"embedding": 1.0})]
    mean = _mean_over_ranks(rows)
    assert mean["exposed_comm"][part] == 4.0 and mean["exposed_comm"]["embedding"] == 1.0  # per member
    assert mean["exposed_comm"]["dp"] == 1.5  # every rank is in a dp group: the one without calls counts 0
    assert mean["group_members"] == {part: [2, 4], "embedding": [1, 4]}
    steps = _mean_over_ranks([row({part: 4.0}), row({})], ranks=False)  # one rank's steps: 0 where it had none
    assert steps["exposed_comm"][part] == 2.0 and "group_members" not in steps
