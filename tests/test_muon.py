"""Muon (workload.optimizer.name: muon, harness/model/muon.py): torch.optim.Muon's update on the blocks' 2-D
weights, AdamW on the rest, under engines single, own (dp2, dp2 ZeRO-1 with the gather Newton-Schulz needs,
pp2; dp2 ep2 ZeRO-1 on a MoE) and fsdp (dp2, each DTensor matrix gathered whole; pp2; dp2 and dp2 ep2 on a MoE), against
the single-device reference.

Tolerance: the usual fp32 one (1e-5 on losses and on every final weight relative to its tensor's scale),
as for AdamW: under the fp32 policy Newton-Schulz runs in fp32 too (harness.model.muon.newton_schulz says
why not in torch's bf16), so the runs differ only by the order of fp32 sums. The workload keeps the
equivalence tests' AdamW eps=1 (an update nearly proportional to the gradient: a wrong gradient shows) and
takes Muon's usual lr 0.02 (lr 1 would move each matrix by about its own size per step).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.errors import SpecError
from harness.model.muon import MuonWithAdamW, muon_matrix, newton_schulz
from harness.spec import parse_spec
from harness.testing.launches import shared_launch
from harness.testing.optimizers import run_optimizer_cases
from harness.testing.reference import assert_matches_reference, reference_run

STEPS = 5
WORKLOAD = {
    "model": "tiny",
    "seq_len": 16,
    "global_batch_size": 8,
    "steps": STEPS,
    "warmup_steps": 0,
    "precision": "fp32",
    "device": "cpu",
    "optimizer": {"name": "muon", "lr": 0.02, "eps": 1.0},
}
LAYOUTS = {
    "own dp2 ZeRO-1": {"engine": "own", "dp": 2, "zero_stage": 1, "dp_bucket_mb": 0.05},
    "own dp2": {"engine": "own", "dp": 2},
    "own pp2": {"engine": "own", "pp": 2},
    "fsdp dp2": {"engine": "fsdp", "dp": 2},
    "fsdp pp2": {"engine": "fsdp", "pp": 2, "reshard_after_forward": False},
}
RUNS = [{"workload": WORKLOAD, "layout": lay} for lay in LAYOUTS.values()]
launched = shared_launch("torch", 2, run_optimizer_cases, RUNS, STEPS, every_rank=True, keys=None)
# a MoE's experts (2-D each: Muon's) over their expert-data-parallel group, their own buckets and ZeRO-1 shards
MOE_WORKLOAD = {**WORKLOAD, "model": "tiny-moe"}
MOE_LAYOUTS = {
    "own dp2 ep2 ZeRO-1": {"engine": "own", "dp": 2, "ep": 2, "zero_stage": 1, "dp_bucket_mb": 0.05},
    "fsdp dp2": {"engine": "fsdp", "dp": 2},
    # the experts on a one-rank dp_mod_ep mesh (fsdp/experts.py): each expert's matrix whole on its rank, no gather
    "fsdp dp2 ep2": {"engine": "fsdp", "dp": 2, "ep": 2},
}
moe_launched = shared_launch(
    "torch", 2, run_optimizer_cases, [{"workload": MOE_WORKLOAD, "layout": lay} for lay in MOE_LAYOUTS.values()], STEPS
)


def _muon_elements(shape=None) -> tuple[int, int, int]:
    """(Muon's elements, AdamW's elements, AdamW's tensors) of the tiny model, by the split."""
    from harness.model.llama import build_model

    model = build_model(parse_spec({"workload": WORKLOAD}).shape(), 0, "sdpa", "torch", "none", device="meta")
    named = [(n, tuple(p.shape), p.numel()) for n, p in model.named_parameters()]
    m = sum(k for n, s, k in named if muon_matrix(n, s))
    a = [k for n, s, k in named if not muon_matrix(n, s)]
    return m, sum(a), len(a)


# ---------------------------------------------------------------- quick: no processes


def _tensors():
    torch.manual_seed(0)
    shapes = {"layers.0.a.weight": (6, 4), "layers.0.b.weight": (4, 9), "norm.weight": (4,), "output.weight": (5, 4)}
    return [(n, torch.nn.Parameter(torch.randn(s))) for n, s in shapes.items()]


def test_bf16_step_is_torch_muon_and_adamw_to_the_bit():
    """Under bf16 (torch's own bf16 Newton-Schulz) MuonWithAdamW is torch.optim.Muon on the matrices and
    torch.optim.AdamW on the rest, bit for bit, momentum buffers included."""
    w = parse_spec({"workload": {**WORKLOAD, "precision": "bf16"}}).workload
    ours, theirs = _tensors(), _tensors()
    matrices = [p for n, p in ours if muon_matrix(n, p.shape)]
    opt = MuonWithAdamW(matrices, [p for n, p in ours if not muon_matrix(n, p.shape)], w, [p.shape for p in matrices])
    muon = torch.optim.Muon([p for n, p in theirs if muon_matrix(n, p.shape)], lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW(
        [p for n, p in theirs if not muon_matrix(n, p.shape)], lr=0.02, betas=(0.9, 0.95), eps=1.0, weight_decay=0.1
    )
    for _ in range(3):
        for (_, p), (_, q) in zip(ours, theirs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        muon.step()
        adamw.step()
    for (n, p), (_, q) in zip(ours, theirs, strict=True):
        assert torch.equal(p, q), n
    assert torch.equal(opt.state[matrices[0]]["momentum_buffer"], muon.state[theirs[0][1]]["momentum_buffer"])


def test_fp32_newton_schulz_is_the_quintic_iteration():
    """newton_schulz in fp32 against the same iteration in float64 written out here (tall and wide)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    for shape in ((7, 3), (3, 7)):
        g = torch.randn(shape, dtype=torch.float64)
        x = g.T if shape[0] > shape[1] else g
        x = x / x.norm()
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        want = x.T if shape[0] > shape[1] else x
        got = newton_schulz(g.float(), torch.float32).double()
        assert (got - want).abs().max() < 1e-5 * want.abs().max(), shape


def test_split_follows_the_policy():
    assert muon_matrix("layers.3.attention.wq.weight", (64, 64))
    assert muon_matrix("layers.0._orig_mod.feed_forward.w2.weight", (64, 176))  # a compiled block's
    assert not muon_matrix("layers.0.attention_norm.weight", (64,))
    assert not muon_matrix("tok_embeddings.weight", (256, 64))
    assert not muon_matrix("output.weight", (256, 64))


def test_single_engine_census_shows_the_momentum_buffers():
    """The reference's census at its first step: one fp32 momentum per Muon element, AdamW's two moments and
    a step counter per other tensor, nothing else."""
    from harness.frameworks.single.engine import SingleDeviceEngine
    from harness.testing.optimizers import state_bytes

    spec = parse_spec({"workload": WORKLOAD})
    engine = SingleDeviceEngine(spec, spec.shape(), torch.device("cpu"))
    engine.train_step(torch.randint(0, 256, (8, 17)))
    m, a, tensors = _muon_elements()
    assert state_bytes(engine.optimizer) == {
        "momentum_buffer": 4 * m,
        "exp_avg": 4 * a,
        "exp_avg_sq": 4 * a,
        "step": 4 * tensors,
    }
    assert engine.memory_census()["optimizer_states"] == {"fp32": 4 * m + 8 * a + 4 * tensors}


@pytest.mark.parametrize(
    "layout, field",
    [
        ({"engine": "deepspeed", "dp": 2, "zero_stage": 1}, "workload.optimizer.name"),
        ({"engine": "megatron", "dp": 2}, "workload.optimizer.name"),
        ({"engine": "own", "tp": 2}, "workload.optimizer.name"),
        ({"engine": "fsdp", "tp": 2}, "workload.optimizer.name"),
    ],
)
def test_engines_that_cannot_run_muon_refuse_in_one_line(layout, field):
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": WORKLOAD, "layout": layout})
    assert e.value.field == field and "\n" not in str(e.value)


def test_muon_fields_apply_to_muon_only():
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": {"optimizer": {"muon_momentum": 0.9}}})
    assert e.value.field == "workload.optimizer.muon_momentum"


def test_comm_model_counts_the_gather_under_zero1_only():
    from harness.engine.comm_model import rank_comm

    shape = parse_spec({"workload": WORKLOAD}).shape()
    zero = parse_spec({"workload": WORKLOAD, "layout": LAYOUTS["own dp2 ZeRO-1"]}).layout
    plain = parse_spec({"workload": WORKLOAD, "layout": LAYOUTS["own dp2"]}).layout
    assert "dp_muon" in rank_comm(shape, zero, 16, 8, 0, optimizer="muon")
    assert "dp_muon" not in rank_comm(shape, zero, 16, 8, 0)
    assert "dp_muon" not in rank_comm(shape, plain, 16, 8, 0, optimizer="muon")


# ---------------------------------------------------------------- slow: 2 gloo processes


@pytest.mark.slow
def test_muon_matches_the_reference_under_own_and_fsdp(launched):
    ref_losses, ref_state = reference_run(WORKLOAD, STEPS)
    for label, per_rank in zip(LAYOUTS, zip(*launched, strict=True), strict=True):
        assert_matches_reference(per_rank[0], ref_losses, ref_state, label)


@pytest.mark.slow
def test_muon_matches_the_reference_with_expert_parallelism(moe_launched):
    ref_losses, ref_state = reference_run(MOE_WORKLOAD, STEPS)
    for label, result in zip(MOE_LAYOUTS, moe_launched, strict=True):
        assert_matches_reference(result, ref_losses, ref_state, label)


@pytest.mark.slow
def test_the_gather_is_counted_as_the_comm_model_says(launched):
    """Own ZeRO-1: every rank's counters equal the closed form (its dp_muon all-gathers included); fsdp: one
    all-gather of each whole fp32 matrix per step."""
    from harness.engine.comm_model import rank_comm

    shape = parse_spec({"workload": WORKLOAD}).shape()
    lay = parse_spec({"workload": WORKLOAD, "layout": LAYOUTS["own dp2 ZeRO-1"]}).layout
    for rank in range(2):
        got = launched[rank][0]["details"]["comm"]
        assert got == rank_comm(shape, lay, 16, 8, rank, optimizer="muon"), rank
        assert got["dp_muon"]["all_gather"]["count"] > 0
    m, _, _ = _muon_elements()
    gathers = launched[0][3]["details"]["comm"]["dp_muon"]["all_gather"]
    assert gathers["count"] == 2 * 7 and gathers["bytes"] == 4 * m  # tiny: 2 blocks of 7 matrices


@pytest.mark.slow
def test_census_shows_sharded_momentum_buffers(launched):
    """The census's optimizer states are the Muon momentum and AdamW's states each rank holds; sharded
    (ZeRO-1, FSDP2) the ranks' momentum buffers add up to one per Muon element, replicated each holds all."""
    m, a, _ = _muon_elements()
    for i, label in enumerate(LAYOUTS):
        ranks = [launched[r][i] for r in range(2)]
        for r in ranks:
            assert r["census"]["optimizer_states"] == {"fp32": sum(r["optimizer_state_bytes"].values())}, label
        momentum = [r["optimizer_state_bytes"]["momentum_buffer"] for r in ranks]
        if label in ("own dp2 ZeRO-1", "fsdp dp2"):
            assert sum(momentum) == 4 * m, label
            assert sum(r["optimizer_state_bytes"]["exp_avg"] for r in ranks) == 4 * a, label
        elif label == "own dp2":
            assert momentum == [4 * m, 4 * m]
        else:  # pp2: each stage its blocks' matrices
            assert sum(momentum) == 4 * m


@pytest.mark.parametrize(
    "layout, shard",
    [({"engine": "own"}, 1), ({"engine": "own", "dp": 2, "zero_stage": 1}, 2), ({"engine": "fsdp", "dp": 2}, 2)],
)
def test_planner_holds_one_momentum_per_muon_element(layout, shard):
    """The planner's optimizer memory under muon: AdamW's minus one fp32 state per Muon element of the model's own
    split (what the census above counts), sharded as the engine shards its optimizer states."""
    from harness.planner.layout import PlannerLayout, Workload
    from harness.planner.memory import stage_memory

    shape = parse_spec({"workload": WORKLOAD}).shape()
    lay = PlannerLayout.from_spec({"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 1, **layout}, "bf16")
    lay = dataclasses.replace(lay, engine=layout["engine"])  # whose memory: the engine's, not the study's
    adamw = stage_memory(shape, lay, Workload(16, 8, 4), 0)
    muon = stage_memory(shape, lay, Workload(16, 8, 4, "muon"), 0)
    m, _, _ = _muon_elements()
    assert adamw["optimizer"] - muon["optimizer"] == 4 * m / shard
    assert adamw["total"] - muon["total"] == 4 * m / shard


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["own", "fsdp"])
def test_harness_memory_traces_muon_as_the_planner_models_it(engine):
    """`harness memory` traces a Muon step (its gathers one bucket or matrix at a time) and the planner's peak is
    within the 10% it keeps elsewhere (measured, llama2-7b cut to 4 layers, seq 1024, dp2 bf16: own ZeRO-1 12.639
    GiB traced and 12.638 planned, fsdp 10.870 and 10.940; AdamW's census optimizer states 3.992 GiB, Muon's 2.485)."""
    from harness.memtrace.result import trace_spec

    def traced(name):
        lay = {"engine": engine, "dp": 2, "attention": "sdpa", "rmsnorm": "torch"}
        lay.update({"zero_stage": 1} if engine == "own" else {})
        workload = {"model": "llama2-7b", "model_overrides": {"layers": 4}, "seq_len": 1024, "global_batch_size": 16}
        return trace_spec(
            parse_spec({"workload": {**workload, "precision": "bf16", "optimizer": {"name": name}}, "layout": lay})
        )

    adamw, muon = traced("adamw"), traced("muon")
    assert abs(muon["planner_peak_gib"] - muon["traced_peak_gib"]) <= 0.10 * muon["traced_peak_gib"]
    states = [r["ranks"][0]["census_gib"]["optimizer_states"] for r in (adamw, muon)]
    assert states[1] < states[0]


# ------------------------------------------------------------------ DeepSpeed (harness/frameworks/deepspeed/muon.py)

BF16_MUON = {**WORKLOAD, "precision": "bf16"}
DS = {"engine": "deepspeed", "dp": 2, "zero_stage": 1}


@pytest.mark.parametrize(
    "workload, layout, says",
    [
        (WORKLOAD, DS, "original_muon.py:47"),  # fp32: DeepSpeed's Newton-Schulz is bf16
        ({**BF16_MUON, "grad_accum_dtype": "bf16"}, DS, "stage_1_and_2.py:2741"),  # clips the updates
        (BF16_MUON, {**DS, "zero_stage": 2}, "bf16_optimizer.py:59"),
        ({**BF16_MUON, "model": "tiny-moe"}, DS, "no MoE"),
        ({**BF16_MUON, "optimizer": {**BF16_MUON["optimizer"], "muon_adjust_lr": "match_rms_adamw"}}, DS, "original"),
    ],
)
def test_deepspeed_runs_muon_where_its_muon_is_the_workloads_only(workload, layout, says):
    with pytest.raises(SpecError) as e:
        parse_spec({"workload": workload, "layout": layout})
    assert e.value.field.startswith("workload.optimizer.") and says in str(e.value) and "\n" not in str(e.value)
    parse_spec({"workload": BF16_MUON, "layout": DS})  # bf16, fp32 accumulation, ZeRO-1: DeepSpeed's BF16_Optimizer


def test_deepspeed_muon_is_its_muon_with_auxadam_over_the_workloads_split():
    """The config carries no optimizer section (DeepSpeed's would retag the head as Muon); the client optimizer
    tags every parameter by muon_matrix and holds the workload's hyperparameters, Newton-Schulz standard."""
    from harness.frameworks.deepspeed.config import build_config
    from harness.frameworks.deepspeed.muon import muon_optimizer
    from harness.model.llama import build_model

    spec = parse_spec({"workload": BF16_MUON, "layout": DS})
    cfg, _, _ = build_config(spec, spec.shape(), device_type="cpu")
    assert "optimizer" not in cfg
    model = build_model(spec.shape(), 0, "sdpa", "torch", "none", device="cpu")
    opt = muon_optimizer(model, spec.workload)
    named = dict(model.named_parameters())
    assert {n for n, p in named.items() if p.use_muon} == {n for n, p in named.items() if muon_matrix(n, p.shape)}
    assert not named["output.weight"].use_muon and not named["tok_embeddings.weight"].use_muon
    muon, adam = opt.param_groups
    assert muon["use_muon"] and muon["ns_method"] == "standard" and muon["momentum"] == 0.95
    assert (muon["lr"], muon["weight_decay"]) == (adam["lr"], adam["weight_decay"]) == (0.02, 0.1)
    assert adam["betas"] == (0.9, 0.95) and adam["eps"] == 1.0 and isinstance(opt.aux_optimizer, torch.optim.AdamW)


def test_deepspeed_refuses_an_explicit_optimizer_section_under_muon(tmp_path):
    """A ds_config's AdamW values would contradict Muon: the file's template (every value auto) is dropped,
    an explicit value refused in one line before launch."""
    import json

    from harness.frameworks.deepspeed.config import DS_CONFIG_DIR, build_config

    with open(f"{DS_CONFIG_DIR}/zero1.json") as f:
        cfg = json.load(f)
    cfg["optimizer"]["params"]["lr"] = 1e-3
    path = tmp_path / "my_ds.json"
    path.write_text(json.dumps(cfg))
    spec = parse_spec({"workload": BF16_MUON, "layout": {**DS, "ds_config": str(path)}})
    with pytest.raises(SpecError) as e:
        build_config(spec, spec.shape(), device_type="cpu")
    assert e.value.field.endswith("my_ds.json: optimizer") and "Muon" in e.value.reason
