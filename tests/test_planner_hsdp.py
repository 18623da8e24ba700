"""Hybrid sharding (HSDP) in the planner: engine fsdp's states sharded within a group of dp_shard
ranks and replicated across the others (torchtitan's data_parallel_shard_degree inside
data_parallel_replicate_degree): its memory, its collectives' links, its candidates and its flag."""

from __future__ import annotations

import json

import pytest

from harness.cli import main as cli
from harness.errors import SpecError
from harness.model.presets import PRESETS
from harness.planner import candidates as en
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.memory import GIB, stage_memory
from harness.planner.memory_fsdp import fsdp_step_bytes
from harness.planner.predict import predict, validate
from harness.planner.timing import _data_parallel, _stage_kinds

TINY, S13 = PRESETS["tiny"], PRESETS["paper-13b"]


def fsdp(dp: int, dp_shard: int = 0, **kw) -> PlannerLayout:
    return PlannerLayout(kw.pop("tp", 1), kw.pop("pp", 1), dp, 1, engine="fsdp", fsdp=True, dp_shard=dp_shard, **kw)


def test_hsdp_states_are_sharded_over_the_group_exactly():
    """Engine fsdp's states (fp32 parameters, fp32 gradients, Adam's two moments: 16 bytes per
    parameter) divide by the sharding group; what FSDP2 gathers and reduce-scatters does not."""
    wl = Workload(64, 8)
    full, hybrid, none = (stage_memory(TINY, fsdp(8, s), wl, 0) for s in (0, 4, 1))
    phi = full["params"]
    step = fsdp_step_bytes(TINY, fsdp(8, 4), wl, True, TINY.layers, True)
    assert hybrid["optimizer"] == 2 * 4 * phi / 4
    assert hybrid["weights"] == 4 * phi / 4 + step["gathered"]
    assert hybrid["gradients"] == 4 * phi / 4 + step["reduce_scatter"]
    # between full sharding and plain replication, in every state and in total
    for part in ("weights", "gradients", "optimizer", "total"):
        assert full[part] < hybrid[part] < none[part], part
    # the activations are the sharding's business of no one
    assert full["activations"] == hybrid["activations"] == none["activations"]


def test_a_group_of_every_replica_rank_is_full_sharding():
    """dp_shard = dp x cp and dp_shard = 0 predict the same, to the byte and the second."""
    prof, wl = load_profile("h100-sxm"), Workload(2048, 256)
    a, b = (predict(S13, fsdp(32, s, tp=2, cp=2), wl, prof) for s in (0, 64))
    assert (a.memory_breakdown_gib, a.step_time_s) == (b.memory_breakdown_gib, b.step_time_s)


def test_dp_shard_must_divide_the_replica_ranks_and_belongs_to_fsdp():
    wl = Workload(2048, 256)
    with pytest.raises(SpecError, match="layout.dp_shard.*does not divide dp x cp = 32"):
        validate(S13, fsdp(32, 12), wl)
    with pytest.raises(SpecError, match="layout.dp_shard"):
        validate(S13, PlannerLayout(1, 1, 32, 1, engine="own", dp_shard=8), wl)
    lay = fsdp(32, 8)
    assert "dp_shard" not in lay.to_spec()  # the spec has no sharding group: a spec layout shards fully
    back = PlannerLayout.from_spec(lay.to_spec())
    assert back.fsdp and back.dp_shard == 0 and back.shard_group == 32


def test_shard_group_in_a_node_talks_on_nvlink_and_replicas_across_nodes():
    """dp 32 on 8-GPU nodes: a sharding group of 8 ranks (tp 1) lies in one node: its all-gathers
    (forward and backward of every micro-batch) and reduce-scatters on NVLink; the all-reduce of its
    1/8 shard across the 4 replicate groups crosses nodes. Under tp 2 the same group spans two
    nodes; sharding over all 32 ranks has no replicate groups."""
    prof, wl = load_profile("h100-sxm"), Workload(2048, 256)
    lay = fsdp(32, 8)
    kinds = _stage_kinds(S13.layers, 1)
    dpx, _ = _data_parallel(S13, lay, wl, prof, kinds)
    m = wl.micro_batches(lay)
    frac = 7 / 8  # (s - 1) / s of a ring over the 8 ranks
    # per micro-batch: two bf16 all-gathers and one fp32 reduce-scatter (engine fsdp's default accumulation)
    shard = (2 * m * 2 + m * 4) * frac * dims_params(lay) / (prof.nvlink_gbps * 1e9)
    assert dpx["nvlink"] == pytest.approx(shard, rel=1e-12)  # the same formula, float rounding only
    assert dpx["internode"] > 0
    two_nodes, _ = _data_parallel(S13, fsdp(16, 8, tp=2), wl, prof, kinds)
    assert set(two_nodes) == {"internode"}
    full, _ = _data_parallel(S13, fsdp(32), wl, prof, kinds)
    assert set(full) == {"internode"}


def dims_params(lay: PlannerLayout) -> float:
    """The parameters of the layout's single stage on one tp rank."""
    from harness.planner.memory import stage_params

    return stage_params(S13, True, S13.layers, True, lay.tp)


def test_fsdp_candidates_range_over_whole_node_sharding_groups():
    """Under engine fsdp each layout comes with full sharding (0) and the powers of two below
    dp x cp spanning whole nodes; other engines have no sharding groups; --dp-shard picks."""
    kw = dict(
        attention=["flash2"],
        rmsnorm=["fused"],
        micro_batch_sizes=[1],
        checkpointing=["none"],
        sequence_parallel=[False],
        zero_stage=1,
        pp_values=[1],
        cp_values=[1],
    )
    wl = Workload(2048, 64)

    def shards(engine, asked=None):
        lays = en.layouts(S13, wl, 64, 8, engine=engine, fsdp=engine == "fsdp", dp_shards=asked, **kw)
        out: dict = {}
        for lay in lays:
            out.setdefault((lay.tp, lay.dp), []).append(lay.dp_shard)
        return out

    got = shards("fsdp")
    assert got[(1, 64)] == [0, 8, 16, 32]
    assert got[(4, 16)] == [0, 2, 4, 8]
    assert got[(8, 8)] == [0, 2, 4]
    assert all(v == [0] for v in shards("own").values())
    asked = shards("fsdp", [8, 64, 3])  # 64 on dp 64 is full sharding; 3 divides no dp
    assert asked[(1, 64)] == [8, 0] and asked[(8, 8)] == [0]


def test_plan_flag_and_outputs_name_the_sharding_group(capsys):
    argv = ["plan", "--model", "paper-13b", "--seq-len", "2048", "--global-batch-size", "256", "--gpus", "64"]
    assert cli([*argv, "--dp-shard", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dp-shard" in err and "fsdp" in err
    assert cli([*argv, "--engine", "fsdp", "--dp-shard", "3"]) == 2
    assert capsys.readouterr().err == "error: --dp-shard: 3 divides the dp x cp of no layout of 64 GPUs\n"
    assert cli([*argv, "--engine", "fsdp", "--dp-shard", "8", "--format", "json", "--top", "50"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["dp_shard"] for r in rows} <= {8} | {r["dp"] for r in rows}
    assert any(r["dp_shard"] == 8 < r["dp"] for r in rows)
    assert cli([*argv, "--engine", "fsdp", "--dp-shard", "8", "--top", "3"]) == 0
    assert "shard" in capsys.readouterr().out.splitlines()[1]
    assert cli([*argv, "--top", "3", "--format", "json"]) == 0
    assert all(r["dp_shard"] is None for r in json.loads(capsys.readouterr().out))


def test_memory_of_a_hybrid_layout_in_gib_is_below_replication():
    """A 13B layout that does not fit replicated fits sharded in groups of one node."""
    prof, wl = load_profile("h100-sxm"), Workload(2048, 256)
    one_node = predict(S13, fsdp(64, 8), wl, prof)
    replicated = predict(S13, fsdp(64, 1), wl, prof)
    assert one_node.fits and not replicated.fits
    # Adam's two fp32 moments of this rank's 1/8 (float rounding only)
    assert one_node.memory_breakdown_gib["optimizer"] == pytest.approx(8 * dims_params(one_node.layout) / 8 / GIB)


def test_full_sharding_reduce_scatters_and_gathers_only():
    """FSDP2 reduce-scatters the fp32 gradients (after every micro-batch's backward without a
    pipeline) and gathers the bf16 weights for forward and backward of every micro-batch; the
    ZeRO-1 all-reduce and post-step gather the planner counted before are not FSDP's. dp 32 on
    four 8-GPU nodes: the ring crosses nodes on 8 NICs a node (DP_NIC_AGGREGATION, 4 nodes)."""
    prof, wl = load_profile("h100-sxm"), Workload(2048, 256)
    lay = fsdp(32)
    dpx, _ = _data_parallel(S13, lay, wl, prof, _stage_kinds(S13.layers, 1))
    m, bw = wl.micro_batches(lay), min(8 * prof.internode_gbps, prof.nvlink_gbps) * 1e9
    assert m == 8 and 4 <= prof.rail_aggregation_max_nodes
    assert dpx == {"internode": pytest.approx((2 * m * 2 + m * 4) * 31 / 32 * dims_params(lay) / bw, rel=1e-12)}


def test_torchtitan_export_names_the_replicate_and_shard_degrees():
    from harness.interop.exports import exportable
    from harness.interop.torchtitan_out import export_torchtitan
    from harness.model.presets import PRESETS

    wl = Workload(8192, 256)
    lay = fsdp(32, 8, tp=2, sequence_parallel=True, rmsnorm="torch")  # torchtitan's RMSNorm (not compiled)
    assert exportable(lay, "torchtitan") == ""
    text, _ = export_torchtitan(PRESETS["llama3-8b"], lay, wl)
    assert "data_parallel_replicate_degree = 4\n" in text and "data_parallel_shard_degree = 8\n" in text
    assert "HSDP" in exportable(lay, "deepspeed")
    # torchtitan shards over data_parallel_shard_degree x cp: a group of 2 of 4 cp ranks it cannot express
    assert "HSDP" in exportable(fsdp(8, 2, cp=4, cp_impl="allgather"), "torchtitan")


def test_hsdp_with_ep_shards_the_experts_over_the_group_over_ep():
    """ep is carved from the sharding group (torchtitan's dp_shard_mod_ep; engine fsdp's dp_mod_ep), so a group
    of g ranks holds an expert's states over g / ep ranks: the states a rank of full sharding over g replicas
    holds (whose expert states `harness memory`'s trace of fsdp dp 4/8 ep 2/4 meets, Adam's step counters
    aside). Before, the experts were divided by g, not g / ep: dp_shard 16 of 32 replicas at ep 8 held less
    than full sharding (55.9 against 65.4 GiB on qwen3-30b-a3b)."""
    shape, wl = PRESETS["qwen3-30b-a3b"], Workload(4096, 256)
    hybrid = stage_memory(shape, fsdp(32, 16, ep=8), wl, 0)
    alone = stage_memory(shape, fsdp(16, 0, ep=8), wl, 0)  # the group's 16 ranks, fully sharded
    full = stage_memory(shape, fsdp(32, 0, ep=8), wl, 0)
    assert hybrid["optimizer"] == alone["optimizer"] == 2 * full["optimizer"]
    assert full["total"] < hybrid["total"]
    with pytest.raises(SpecError, match="layout.dp_shard: ep=8 does not divide the sharding group of 4 ranks"):
        validate(shape, fsdp(32, 4, ep=8), wl)
    hybrid_ep = [lay for lay in _moe_candidates(shape, wl) if lay.dp_shard and lay.ep > 1]
    assert hybrid_ep and all(lay.dp_shard % lay.ep == 0 for lay in hybrid_ep)


def _moe_candidates(shape, wl):
    kw = dict(attention=["flash2"], rmsnorm=["fused"], micro_batch_sizes=[1], checkpointing=["full"], zero_stage=1)
    kw.update(pp_values=[1], cp_values=[1], sequence_parallel=[False])
    return list(en.layouts(shape, wl, 64, 8, engine="fsdp", fsdp=True, **kw))
