"""The own engine's mixture of experts (harness/engine/experts.py) and expert parallelism (layout.ep).

Quick tier: the dispatch's bookkeeping (sorting the routed slots by expert, the splits, grouping what
a rank receives by expert), the ep and edp groups the mesh builds against ParallelDims', the parameter
list and buckets, the facts' refusals, and the layer without ep against harness.model.moe's
(output and input gradient bit for bit).

Slow tier: tiny-moe, fp32, seq 16, 3 steps, one gloo launch per world size (2 and 4) against the single
reference at rtol 1e-5 on every loss and every final weight, the bound every fp32 layout of this engine
is held to: the layouts differ from the reference only in the order of fp32 sums (the DP reduction, TP
partial sums, an expert's batch made of several ranks' tokens), a few ulps (~1e-7 relative) per step,
and lr=1 with eps=1 keeps the updates proportional to the gradients, so 3 steps stay well inside 1e-5;
a top-k flip or a gradient off by a factor (a divisor over the wrong group, an aux loss counted tp times)
would be far outside. One bf16 case is held to the own engine's bf16 tolerances (equivalence.py), whose
derivation holds here too: both sides compute in bf16 and differ where sums are ordered differently.
The routing statistics summed over ranks equal the reference's exactly in fp32 (each routed token
counted once: the same integers). In bf16 only their totals are exact: a layout's bf16 parameters and
activations may differ from the reference's by a rounding (one bf16 ulp, 2^-8 relative, on each factor
of a router logit), so a token whose k-th and (k+1)-th logits lie within the rounding bound of their gap
(_near_ties: those roundings independent, the bound the gap's normal tail over every token of the run) may
take the other expert; the counts may then differ by at most 2k per such token, and by nothing more.
In fp8 without ep the counts are exact, as in fp32: each rank's micro-batch is one of the reference's
(micro_batch_size 1 on both sides), so every FP8 cast (tensorwise: the amax of the tensor; rowwise: of a
row, or in backward of a column over the micro-batch's tokens) takes the reference's scale, and the FP8
values are the reference's bit for bit; what differs is the fp32 reduction order, as in fp32. Under ep an
expert's GEMM takes the tokens routed to it from every rank of the ep group (two micro-batches of the
reference, as torchtitan's and Megatron's grouped GEMMs take them). Under fp8_recipe rowwise_with_gw_hp the
counts are exact still: its forward casts per token row and per weight channel and its input gradient per
row of the output gradient (with the weight's one scale), none over tokens, so each row's FP8 values and
products are the reference's whatever rows share the GEMM (tests/test_fp8_gw_hp.py); its weight gradient, a
high-precision product over the tokens, is accumulated in fp32 into the main gradient by the reference and
the own engine alike (harness/model/float8.py, Megatron's gradient_accumulation_fusion), so one GEMM over two
micro-batches differs from two GEMMs by the order of fp32 additions only. That product is what moved slots:
measured over seeds 1234, 1, 2, 3, 4 (own dp2 ep2, tiny-moe seq 16, 3 steps, both layers summed), routed slots
moved 6, 2, 8, 4, 4 with torchao's bf16 product, 0 in every seed with the fp32 accumulation (losses then
within 6e-7 of the reference's). Under tensorwise and rowwise the counts need not be exact: an expert's
dynamic scales (tensorwise: input and output gradient; rowwise: the weight gradient's casts over tokens)
are amaxes over two micro-batches, and no single-device run has those operands (its dense layers would
need one micro-batch, its experts two): they moved 2 to 16; nor is bf16 under ep (the expert's weight-gradient
GEMM sums both ranks' tokens into one bf16 product, the cause above: 2 routed slots per layer over 3
steps, measured once). A cast element then moves by one e4m3 step (2^-3
relative) with probability 2^-5, so fp8's rounding in the bound above is bf16's x 2^2.5, as
harness.testing.equivalence derives the fp8 tolerances. mxfp8 (e4m3 elements, one power-of-two
scale per block of 32 along each GEMM's reduction dim) is held to the same: without ep every block is the
reference's; under ep an expert's weight-gradient blocks run along tokens of two micro-batches.
"""

from __future__ import annotations

import pytest
import torch

from harness.engine.comm import Axis, CommStats, StepClock
from harness.engine.data_parallel import plan_buckets
from harness.engine.experts import ExpertParallelMoE, group_by_expert, held_experts, sort_by_expert, splits
from harness.engine.model import rank_params
from harness.engine.parallel import ParallelContext
from harness.engine.partition import ChunkPlan
from harness.engine.topology import Mesh
from harness.memtrace.standins import even_counts
from harness.model.moe import MoEFeedForward, set_router_losses
from harness.model.presets import resolve_shape
from harness.parallel_dims import ParallelDims
from harness.testing import equivalence as E
from harness.testing.equivalence import (
    BF16_LOSS_RTOL,
    BF16_WEIGHTS_RTOL,
    FP8_LOSS_RTOL,
    FP8_WEIGHTS_RTOL,
    MXFP8_LOSS_RTOL,
    MXFP8_WEIGHTS_RTOL,
)
from harness.testing.moe_parity import near_ties, rounding_step, tail

MOE = resolve_shape("tiny-moe", {})


def _axis(ranks: list[int], rank: int) -> Axis:
    return Axis("ep", None, ranks, rank, CommStats(StepClock(torch.device("cpu"))), "ep_comm")


def test_sort_by_expert_is_stable_and_counts():
    experts = torch.tensor([[3, 0], [0, 2], [3, 1]])
    order, token, counts = sort_by_expert(experts, 4)
    assert experts.reshape(-1)[order].tolist() == [0, 0, 1, 2, 3, 3]
    assert token.tolist() == [0, 1, 2, 1, 0, 2]  # within an expert in token order, as nonzero() gives them
    assert counts.tolist() == [2, 1, 1, 2]
    assert splits(counts.tolist(), 2) == [3, 3] and splits(counts.tolist(), 4) == [2, 1, 1, 2]
    assert even_counts(10, 4) == [3, 3, 2, 2]


def test_group_by_expert_orders_received_rows_by_expert_then_source():
    # 2 sources, 2 held experts: source 0 sent 1 row for expert a and 2 for b; source 1 sent 2 and 0
    perm, sizes = group_by_expert([[1, 2], [2, 0]])
    # received rows: s0a=0, s0b=1,2, s1a=3,4 -> grouped: a: 0,3,4; b: 1,2
    assert perm.tolist() == [0, 3, 4, 1, 2] and sizes == [3, 2]
    perm, sizes = group_by_expert([[0, 0, 0], [0, 0, 0]])
    assert perm.numel() == 0 and sizes == [0, 0, 0]


def test_held_experts_are_the_ep_index_share():
    assert held_experts(MOE, None) == range(8)
    assert [held_experts(MOE, _axis([4, 5], r)) for r in (4, 5)] == [range(0, 4), range(4, 8)]
    assert held_experts(MOE, _axis([0, 1, 2, 3], 2)) == range(4, 6)


@pytest.mark.parametrize(
    "dims", [ParallelDims(dp=2, ep=2), ParallelDims(tp=2, dp=4, ep=2), ParallelDims(pp=2, dp=2, cp=2, ep=4)]
)
def test_mesh_groups_are_parallel_dims_expert_groups(dims):
    for r in range(dims.world):
        mesh = Mesh(dims, r, distributed=False)
        assert mesh.ranks["ep"] == dims.expert_group_of(r)
        assert mesh.ranks["edp"] == dims.expert_data_group_of(r)
        # ep x edp tile the replica group: the edp sum of expert gradients sees every replica's tokens once
        assert sorted(a for e in mesh.ranks["edp"] for a in dims.expert_group_of(e)) == dims.flat_group_of(r)


def test_mesh_without_ep_uses_the_replica_group():
    mesh = Mesh(ParallelDims(dp=2, tp=2), 3, distributed=False)
    assert mesh.ranks["ep"] == [3] and mesh.ranks["edp"] == mesh.ranks["replica"] == [1, 3]


def test_parameter_list_names_the_held_experts_and_buckets_the_router_apart():
    dims = ParallelDims(tp=2, dp=2, ep=2)  # rank 2: tp index 0, ep index 1 (experts 4-7)
    specs = rank_params(MOE, [ChunkPlan(0, 0, range(2), True, True)], ParallelContext.unconnected(dims, 2))
    names = [s.name for s in specs]
    assert "layers.1.feed_forward.router.weight" in names
    assert (
        "layers.0.feed_forward.experts.4.w1.weight" in names
        and "layers.0.feed_forward.experts.3.w1.weight" not in names
    )
    w2 = next(s for s in specs if s.name == "layers.0.feed_forward.experts.5.w2.weight")
    assert w2.expert and w2.shard_dim == 1 and w2.local == (MOE.hidden, MOE.moe_ffn // 2)
    router = [i for i, s in enumerate(specs) if s.tp_partial]
    assert len(router) == 2 and all(not specs[i].expert for i in router)
    dense = [i for i, s in enumerate(specs) if not s.expert]
    sep = [b for b in plan_buckets([specs[i] for i in dense], 10**9, 2, sp=False) if b["sp"]]
    assert len(sep) == 1 and len(sep[0]["indices"]) == 2  # the routers: summed over tp before dp


def test_layer_without_ep_is_the_reference_layer():
    torch.manual_seed(0)
    ref = MoEFeedForward(MOE)
    mine = ExpertParallelMoE(MOE, ParallelContext.unconnected(ParallelDims()))
    mine.load_state_dict(ref.state_dict())
    for m in (ref, mine):
        set_router_losses(m, 0.01, 0.001, 2)
    x = torch.randn(16, 2, MOE.hidden)
    outs = []
    for m in (ref, mine):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * y).sum().backward()
        outs.append((y, xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    for n, g in outs[0][2].items():
        assert torch.allclose(g, outs[1][2][n], rtol=1e-6, atol=1e-9), n


@pytest.mark.parametrize(
    "workload,layout,words",
    [
        ({}, {"compile": "blocks"}, "compiled"),
        ({"precision": "fp8", "model_overrides": {"layers": 4, "ffn": 192, "moe_ffn": 112}}, {"tp": 2}, "moe_ffn/tp"),
    ],
)
def test_facts_refuse_what_the_moe_is_not_built_for(workload, layout, words):
    from harness.errors import SpecError
    from harness.spec import parse_spec

    four = {"model": "tiny-moe", "seq_len": 16, "model_overrides": {"layers": 4}, **workload}
    with pytest.raises(SpecError, match=words):
        parse_spec({"workload": four, "layout": {"engine": "own", **layout}})
    parse_spec({"workload": {**four, "precision": "fp32"}, "layout": {"engine": "own", "dp": 2, "ep": 2}})
    parse_spec({"workload": {**four, "precision": "fp8"}, "layout": {"engine": "own", "dp": 2, "ep": 2}})


def test_memory_traces_the_experts_with_even_routing():
    """harness memory builds the engine on fake tensors: the dispatch's splits cannot come from data there,
    so the layer routes evenly (even_counts) and the trace says so."""
    from harness.memtrace.result import trace_spec
    from harness.spec import parse_spec

    raw = {"model": "tiny-moe", "seq_len": 16, "global_batch_size": 8, "precision": "bf16"}
    r = trace_spec(parse_spec({"workload": raw, "layout": {"engine": "own", "dp": 2, "ep": 2, "tp": 2}}))
    assert r["traced_peak_gib"] > 0
    assert any("routing even" in line for line in r["substitutions"])


# ------------------------------------------------------------------ against the reference (slow)

M = {"model": "tiny-moe", "seq_len": 16, "steps": 3}
LOSSES = {**M, "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001}
CASES = {
    2: [
        {"workload": M, "layout": {"dp": 2, "ep": 2}},
        {"workload": M, "layout": {"dp": 2}},
        {"workload": LOSSES, "layout": {"dp": 2, "ep": 2, "activation_checkpointing": "full", "zero_stage": 1}},
        # bf16 at the own engine's bf16 tolerances (harness.testing.equivalence): measured 4.6e-6 on a loss,
        # 2.8e-3 of a tensor's scale in the final masters
        {
            "workload": {**M, "precision": "bf16"},
            "layout": {"dp": 2, "ep": 2, "zero_stage": 1},
            "rtol": BF16_LOSS_RTOL,
            "weights_rtol": BF16_WEIGHTS_RTOL,
        },
        # context parallelism: the router statistics summed over the cp ranks, the experts shared over them
        {"workload": LOSSES, "layout": {"cp": 2, "ep": 2}},
        # fp8 experts (torchao's float8 linears; an expert that receives no token runs its empty batch
        # unconverted: harness/model/float8.py) at the fp8 tolerances; under ep an expert's batch holds both
        # ranks' tokens, so its input's dynamic scale is the amax of two micro-batches, not one
        *(
            {
                "workload": {**M, "precision": "fp8", "fp8_recipe": recipe},
                "layout": {"dp": 2, "ep": 2},
                "rtol": FP8_LOSS_RTOL,
                "weights_rtol": FP8_WEIGHTS_RTOL,
            }
            for recipe in ("tensorwise", "rowwise")
        ),
        # rowwise_with_gw_hp under ep: every FP8 cast per token row or per weight channel, the weight gradient
        # accumulated in fp32 into the main gradient (harness/model/float8.py): the router counts are exact
        {
            "workload": {**M, "precision": "fp8", "fp8_recipe": "rowwise_with_gw_hp"},
            "layout": {"dp": 2, "ep": 2},
            "rtol": FP8_LOSS_RTOL,
            "weights_rtol": FP8_WEIGHTS_RTOL,
        },
        # fp8 without ep: every cast the reference's, so the router counts are the reference's exactly
        *(
            {
                "workload": {**M, "precision": "fp8", "fp8_recipe": recipe},
                "layout": {"dp": 2},
                "rtol": FP8_LOSS_RTOL,
                "weights_rtol": FP8_WEIGHTS_RTOL,
            }
            for recipe in ("tensorwise", "rowwise")
        ),
        # mxfp8 (harness/model/mxfp8.py: attention and the experts, moe_ffn 96 a multiple of its 32-blocks) at
        # its tolerance (harness.testing.equivalence), with and without ep
        *(
            {
                "workload": {**M, "precision": "fp8", "fp8_recipe": "mxfp8"},
                "layout": layout,
                "rtol": MXFP8_LOSS_RTOL,
                "weights_rtol": MXFP8_WEIGHTS_RTOL,
            }
            for layout in ({"dp": 2}, {"dp": 2, "ep": 2})
        ),
    ],
    4: [
        {"workload": M, "layout": {"tp": 2, "dp": 2, "ep": 2}},
        {"workload": LOSSES, "layout": {"dp": 2, "cp": 2, "ep": 4, "zero_stage": 1}},
        {"workload": M, "layout": {"pp": 2, "dp": 2, "ep": 2}},
        {
            "workload": {**M, "moe_aux_loss_coeff": 0.01},
            "layout": {"tp": 2, "dp": 2, "ep": 2, "sequence_parallel": True},
        },
        {"workload": M, "layout": {"dp": 4, "ep": 2, "zero_stage": 1, "dp_bucket_mb": 0.01}},
        {
            "workload": {**M, "model_overrides": {"layers": 4}},
            "layout": {"pp": 2, "dp": 2, "ep": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2},
        },
        # the backward split into B (the exchanges' backward: on the input's path) and W (no collective)
        {
            "workload": {**M, "model_overrides": {"layers": 4}, "moe_aux_loss_coeff": 0.01},
            "layout": {"pp": 2, "dp": 2, "ep": 2, "pipeline_schedule": "zbv"},
        },
    ],
}
STEPS = 3
PARAMS = [
    pytest.param(w, i, id=f"w{w}-{i}", marks=pytest.mark.slow) for w, cases in CASES.items() for i in range(len(cases))
]


launched = E.shared(CASES, steps=STEPS)


# the relative rounding each factor of a router logit carries per precision (moe_parity.rounding_step says why)
STEP = {"bf16": rounding_step("bf16"), "fp8": rounding_step("fp8"), "mxfp8": rounding_step("fp8", "mxfp8")}
# the tokens each layer routes over the run, summed over the layers (the reference's: steps x batch x seq)
ROUTED = MOE.layers * STEPS * E.BASE["workload"]["global_batch_size"] * M["seq_len"]
TAIL = tail(ROUTED)  # a near tie missed with probability below 1e-3 over the run (moe_parity.tail)


def _near_ties(layer: MoEFeedForward, x2: torch.Tensor, logits: torch.Tensor, step: float) -> int:
    """moe_parity.near_ties at TAIL."""
    return near_ties(layer, x2, logits, step, TAIL)


def test_a_near_tie_is_a_gap_within_the_rounding_bound_of_the_k_th_and_next_logits():
    """_near_ties on logits set by hand: token 0's k-th and (k+1)-th logits equal (a tie at any step), token 1's
    4 sd of their gap apart (near at TAIL > 4, not at half the step, where they are 8 sd apart), token 2's top k
    far above the rest; the other gaps (equal logits among the held, among the rest) play no part."""
    torch.manual_seed(0)
    layer = MoEFeedForward(MOE)
    k, n = layer.k, MOE.experts
    x = torch.randn(3, MOE.hidden)
    w = layer.router.weight.detach().float()
    step = STEP["bf16"]
    t_k, t_m = x[1] * w[0], x[1] * w[1]
    sd = float((step**2 / 3 * ((t_k - t_m).square() + t_k.square() + t_m.square()).sum()).sqrt())
    held, rest = [100.0] * (k - 1), [-100.0] * (n - k - 1)
    logits = torch.tensor(
        [
            [0.0, 0.0, *held, *rest],  # expert 0 the k-th, expert 1 the (k+1)-th
            [0.0, -4 * sd, *held, *rest],
            [1e3, 1e3, *([-1.0] * (n - 2))],
        ]
    )
    assert TAIL > 4 and k == 2
    assert _near_ties(layer, x, logits, step) == 2
    assert _near_ties(layer, x, logits, step / 2) == 1


def _reference_counts(case: dict) -> tuple[dict, dict]:
    """The single engine's routed slots per expert over STEPS steps, by layer, and its near ties by layer."""
    from harness.data.source import token_source
    from harness.frameworks.single.engine import SingleDeviceEngine
    from harness.testing import equivalence as E

    spec = E.make_spec(
        {
            **case,
            "layout": {
                "engine": "single",
                **{k: v for k, v in case["layout"].items() if k in ("micro_batch_size", "activation_checkpointing")},
            },
        }
    )
    eng = SingleDeviceEngine(spec, spec.shape(), torch.device("cpu"))
    src = token_source(spec.workload, spec.shape().vocab)
    ties: dict = {}
    names = {}

    precision, recipe = case["workload"].get("precision", "fp32"), case["workload"].get("fp8_recipe")
    step = STEP.get("mxfp8" if precision == "fp8" and recipe == "mxfp8" else precision, 0.0)  # fp32: exact

    def gate(layer, x2):
        out = MoEFeedForward.gate(layer, x2)
        ties[names[layer]] = ties.get(names[layer], 0) + _near_ties(layer, x2, out[3].detach(), step)
        return out

    for name, layer in eng.model.named_modules():
        if isinstance(layer, MoEFeedForward):
            names[layer] = name
            layer.gate = gate.__get__(layer)
    for i in range(STEPS):  # not `step`: gate reads the rounding step above
        eng.train_step(src.global_batch_at(i))
    return {k: v["counts"] for k, v in eng.router_stats().items()}, ties


@pytest.mark.parametrize("world,index", PARAMS)
def test_moe_layouts_match_the_reference(launched, world, index):
    from conftest import assert_case_matches_reference

    from harness.testing import equivalence as E

    per_rank = launched(world)
    case = CASES[world][index]
    ref_losses, ref_state = E.reference(case, STEPS)
    assert_case_matches_reference(per_rank, world, index, case, ref_losses, ref_state)
    summed: dict = {}
    for r in range(world):
        for layer, s in per_rank[r][index]["router"].items():
            summed[layer] = [a + b for a, b in zip(summed.get(layer, [0.0] * MOE.experts), s["counts"], strict=True)]
    counts, ties = _reference_counts(case)
    precision, lay = case["workload"].get("precision", "fp32"), case["layout"]
    exact_fp8 = lay.get("ep", 1) == 1 or case["workload"].get("fp8_recipe") == "rowwise_with_gw_hp"
    if precision == "fp32" or (precision == "fp8" and exact_fp8):
        assert summed == counts
    else:
        assert summed.keys() == counts.keys()
        for layer, ref in counts.items():
            assert sum(summed[layer]) == sum(ref), layer  # every routed slot counted once
            moved = sum(abs(a - b) for a, b in zip(summed[layer], ref, strict=True))
            assert moved <= 2 * MOE.experts_per_token * ties[layer], (layer, moved, ties[layer])
    comm = per_rank[0][index]["comm"]
    if lay.get("ep", 1) > 1:  # the dispatch's all-to-alls on their own axis, their wait in its breakdown
        assert comm["ep"]["all_to_all"]["count"] > 0 and "ep_comm" in per_rank[0][index]["details"]["breakdown_s"]
    else:
        assert "ep" not in comm
