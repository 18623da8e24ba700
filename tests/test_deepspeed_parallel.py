"""DeepSpeed with pp > 1 (its PipelineModule + PipelineEngine.train_batch) and tp > 1 (AutoTP
training) against the single-device reference: losses and final weights within 1e-5 (fp32, CPU,
gloo), every layout DeepSpeed cannot run refused by the spec, and the configs filled for them.

The equivalence workload uses AdamW with lr=1 and eps=1 (the update is then nearly proportional
to the gradient, so a gradient wrong by a constant factor shows in the weights, which plain Adam
would hide) and grad_clip 0.5, below the reference's gradient norm (~0.8 on this workload), so
clipping acts on every step: the global norm over pipeline stages and tensor shards must be right.
One launch per world size runs all of that world's layouts in sequence.
"""

import pytest

from harness.errors import CapabilityError, SpecError
from harness.frameworks.deepspeed.config import build_config
from harness.spec import parse_spec
from harness.testing.launches import shared_launches
from harness.testing.reference import assert_matches_reference, reference_run
from harness.testing.spawn import run_losses
from harness.testing.workloads import tiny_workload

STEPS = 5
WORKLOAD = tiny_workload(steps=STEPS, warmup_steps=0, optimizer={"lr": 1.0, "eps": 1.0}, grad_clip=0.5)
PLANTED_SEED = 4321

# world size -> layouts run in one launch (micro_batch_size 2 unless given)
LAYOUTS = {
    2: [
        {"pp": 2, "activation_checkpointing": "full"},  # ZeRO-0 (the default) under the pipeline
        {"tp": 2, "zero_stage": 1, "activation_checkpointing": "full"},
        {"tp": 2, "zero_stage": 3, "model_impl": "hf"},
    ],
    4: [
        {"pp": 2, "dp": 2, "zero_stage": 1, "activation_checkpointing": "selective"},
        {"tp": 2, "dp": 2, "zero_stage": 1},
        {"tp": 2, "dp": 2, "zero_stage": 3},
    ],
}


def run_dict(layout: dict, **workload) -> dict:
    return {"workload": {**WORKLOAD, **workload}, "layout": {"engine": "deepspeed", "micro_batch_size": 2, **layout}}


@pytest.fixture(scope="module")
def reference():
    return reference_run(WORKLOAD, STEPS, micro_batch_size=2)


def _runs(world: int) -> list[dict]:
    """World's layouts; world 2 also runs the planted difference (last)."""
    runs = [run_dict(lay) for lay in LAYOUTS[world]]
    return runs + [run_dict({"tp": 2, "zero_stage": 1}, seed=PLANTED_SEED)] if world == 2 else runs


launched = shared_launches(  # DeepSpeed's tp and pp leave process-wide state: apart from its dp engines' pool
    "deepspeed-mp", {w: (_runs(w), STEPS, True) for w in LAYOUTS}, run_losses, timeout_s=400, every_rank=True
)  # get(world): every rank's results


PARAMS = [
    pytest.param(world, i, id=f"w{world}-" + "-".join(f"{k}{v}" for k, v in lay.items()))
    for world, layouts in LAYOUTS.items()
    for i, lay in enumerate(layouts)
]


@pytest.mark.slow
@pytest.mark.parametrize("world,index", PARAMS)
def test_matches_single_device_reference(launched, reference, world, index):
    per_rank = launched(world)
    layout = LAYOUTS[world][index]
    result = per_rank[0][index]
    ref_losses, ref_state = reference
    assert_matches_reference(result, ref_losses, ref_state, f"deepspeed {layout}")
    for r in range(1, world):  # the same global loss on every rank, the weights only on rank 0
        assert per_rank[r][index]["losses"] == result["losses"], r
        assert per_rank[r][index]["state"] is None
    d = result["describe"]
    assert (d["tp"], d["pp"], d["dp"]) == (layout.get("tp", 1), layout.get("pp", 1), layout.get("dp", 1))
    assert d["zero_stage"] == layout.get("zero_stage", 0)
    assert d["precision_policy"].startswith("fp32 throughout")
    assert "precision_note" not in d
    assert d["optimizer"].endswith("AdamW")
    if layout.get("pp", 1) > 1:
        assert "balanced_partition" in d["pipeline"]["partition"]
        assert d["pipeline"]["stage_layers"] == ["[0, 2)", "[2, 4)"]  # embedding + block 0 | block 1 + head
    if layout.get("tp", 1) > 1:  # AutoTP really cut wq, wk, wv, wo, w1, w2, w3 of both blocks
        assert d["autotp_sharded_parameters"] == 7 * 2
        assert "replicated: embedding" in d["tensor_parallel"]


@pytest.mark.slow
def test_planted_difference_is_caught(launched, reference):
    """The same layout with another seed must fail the comparison (the check is not vacuous)."""
    planted = launched(2)[0][-1]
    ref_losses, ref_state = reference
    with pytest.raises(AssertionError, match="step 0: loss"):
        assert_matches_reference(planted, ref_losses, ref_state, "another seed")


def test_clipping_acts_on_the_equivalence_workload(reference):
    """The premise of the workload: clipping at 0.5 changes the reference's training."""
    unclipped, _ = reference_run({**WORKLOAD, "grad_clip": 0.0}, 2, micro_batch_size=2)
    assert unclipped[1] != reference[0][1]


# ------------------------------------------------------------------ what DeepSpeed cannot run


def ds_layout(**layout):
    return {
        "workload": {"model": "tiny", "global_batch_size": 8},
        "layout": {"engine": "deepspeed", "micro_batch_size": 2, **layout},
    }


REFUSED = [
    (dict(pp=2, zero_stage=2), "layout.zero_stage", "ZeRO stage 0 or 1 only"),
    (dict(pp=2, zero_stage=3), "layout.zero_stage", "ZeRO stage 0 or 1 only"),
    (dict(zero_stage=0), "layout.zero_stage", "1, 2 or 3"),
    (dict(tp=2, pp=2, zero_stage=1), "layout.tp", "does not combine with its pipeline engine"),
    (dict(tp=2, zero_stage=1, sequence_parallel=True), "layout.sequence_parallel", "no Megatron-style"),
    (dict(pp=2, zero_stage=1, pipeline_schedule="gpipe"), "layout.pipeline_schedule", "1F1B"),
    (dict(pp=2, zero_stage=1, pipeline_schedule="interleaved"), "layout.pipeline_schedule", "1F1B"),
    # virtual stages need the interleaved schedule, which DeepSpeed's pipeline engine does not run
    (dict(zero_stage=1, pipeline_schedule="interleaved", virtual_stages=2), "layout.pipeline_schedule", "1F1B"),
    (dict(pp=2, zero_stage=1, model_impl="hf"), "layout.model_impl", "not a pipeline of layers"),
    (
        dict(zero_stage=1, model_impl="hf", activation_checkpointing="selective"),
        "layout.activation_checkpointing",
        "selective is not offered",
    ),
    (dict(tp=2, zero_stage=1, model_impl="hf", attention="sdpa_flash"), "layout.attention", "naive (eager) or sdpa"),
    (dict(zero_stage=1, model_impl="hf", rmsnorm="fused"), "layout.rmsnorm", "fused needs model_impl own"),
    (dict(pp=2, zero_stage=1, pipeline_p2p="grouped"), "layout.pipeline_p2p", "own engine"),
]


@pytest.mark.parametrize("layout,field,reason", REFUSED, ids=[f"{c[1]}:{i}" for i, c in enumerate(REFUSED)])
def test_refused_before_launch(layout, field, reason):
    with pytest.raises(SpecError) as e:
        parse_spec(ds_layout(**layout))
    assert e.value.field == field
    assert reason in e.value.reason


def test_pipeline_without_zero_refuses_fp32_accumulation_of_bf16():
    """DeepSpeed raises 'unsupported mix' for bf16 parameters with fp32 accumulation and no ZeRO:
    the spec refuses it first, with the way out; bf16 accumulation or ZeRO-1 are accepted."""
    spec = ds_layout(pp=2)
    spec["workload"] = {**spec["workload"], "precision": "bf16"}
    with pytest.raises(CapabilityError) as e:
        parse_spec(spec)
    assert e.value.field == "workload.grad_accum_dtype"
    assert "zero_stage: 1" in e.value.reason and "grad_accum_dtype: bf16" in e.value.reason
    parse_spec({**spec, "workload": {**spec["workload"], "grad_accum_dtype": "bf16"}})
    parse_spec({**spec, "layout": {**spec["layout"], "zero_stage": 1}})


def test_precision_refusal_through_cli(tmp_path, cli):
    """One line, exit code 2, before anything launches."""
    import yaml

    spec = ds_layout(pp=2)
    spec["workload"] = {**spec["workload"], "precision": "bf16", "device": "cpu"}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    r = cli("train", "spec.yaml", "--store", str(tmp_path / "r.sqlite"), cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("error: workload.grad_accum_dtype: DeepSpeed's pipeline engine without ZeRO")
    ), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "layout",
    [
        dict(pp=2),
        dict(pp=2, dp=2, zero_stage=1, activation_checkpointing="full"),
        dict(tp=2, zero_stage=3),
        dict(tp=2, dp=2, zero_stage=2, model_impl="hf"),
    ],
    ids=str,
)
def test_accepted(layout):
    parse_spec(ds_layout(**layout))


# ------------------------------------------------------------------ configs for pp and tp


def test_config_for_tensor_parallel_counts_dp_without_tp():
    spec = parse_spec(ds_layout(tp=2, dp=2, zero_stage=3))
    cfg, _, filled = build_config(spec, dp=2, device_type="cpu")
    assert cfg["tensor_parallel"]["autotp_size"] == 2 and "tensor_parallel.autotp_size" in filled
    assert cfg["gradient_accumulation_steps"] == 2  # 8 / (dp 2 x mbs 2), not / world 4
    assert cfg["train_batch_size"] == 8


def test_pipeline_at_zero_0_uses_its_own_config_file():
    cfg, file, _ = build_config(parse_spec(ds_layout(pp=2)), dp=1, device_type="cpu")
    assert file.endswith("zero0.json") and cfg["zero_optimization"]["stage"] == 0
    assert cfg["gradient_accumulation_steps"] == 4 and "tensor_parallel" not in cfg


def config_file(tmp_path, **sections) -> str:
    """ds_configs/zero1.json with `sections` set, written to tmp_path."""
    import json

    from harness.frameworks.deepspeed.config import DS_CONFIG_DIR

    with open(f"{DS_CONFIG_DIR}/zero1.json") as f:
        cfg = json.load(f)
    cfg.update(sections)
    path = tmp_path / "my_ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("layout,autotp", [(dict(tp=2, zero_stage=1), 4), (dict(zero_stage=1), 2)], ids=str)
def test_contradicting_autotp_size_refused(tmp_path, layout, autotp):
    path = config_file(tmp_path, tensor_parallel={"autotp_size": autotp})
    with pytest.raises(SpecError) as e:
        build_config(parse_spec(ds_layout(ds_config=path, **layout)), device_type="cpu")
    assert e.value.field.endswith("my_ds.json: tensor_parallel.autotp_size")
    assert "layout.tp" in e.value.reason


def test_pipeline_checkpoint_interval_follows_the_layout(tmp_path):
    path = config_file(tmp_path, pipeline={"activation_checkpoint_interval": 2})
    with pytest.raises(SpecError) as e:
        build_config(parse_spec(ds_layout(pp=2, zero_stage=1, ds_config=path)), device_type="cpu")
    assert e.value.field.endswith("my_ds.json: pipeline.activation_checkpoint_interval")
    assert "layout.activation_checkpointing" in e.value.reason
    path = config_file(tmp_path, pipeline={"activation_checkpoint_interval": "auto"})
    cfg, _, filled = build_config(parse_spec(ds_layout(pp=2, zero_stage=1, ds_config=path)), device_type="cpu")
    assert (
        cfg["pipeline"]["activation_checkpoint_interval"] == 0 and "pipeline.activation_checkpoint_interval" in filled
    )
