"""The exports (megatron, deepspeed, torchtitan) read by each tool's own parser and checks: DeepSpeed
0.19.8's DeepSpeedConfig
(AutoTP without an mpu, as a config-only launch runs it) and AutoEP's validate_autoep_config;
Megatron-LM's argument parser (tests/data/megatron_lm_arguments.json: megatron.training is not in the
megatron-core wheel installed here) for the run length, mock data and MoE flags; torchtitan's own
pipeline stage count (distributed/pipeline_parallel.py) and cp backend for a 70B recipe (torchtitan is
not installed here: the strict reader of test_plan_export stands in for its config classes). Quick."""

from __future__ import annotations

import json
import shlex

from conftest import megatron_parser
from test_plan_export import torchtitan_recipe

from harness.interop.deepspeed_out import export_deepspeed
from harness.interop.exports import exportable
from harness.interop.megatron_out import export_megatron
from harness.interop.torchtitan_out import export_torchtitan
from harness.model.presets import PRESETS
from harness.planner.layout import PlannerLayout, Workload

WL = Workload(8192, 64)


def test_deepspeed_autotp_export_passes_deepspeeds_batch_check_without_an_mpu(monkeypatch):
    """DeepSpeed's config-only AutoTP path has no mpu: its batch check counts all 16 ranks. The export
    leaves train_batch_size to DeepSpeed, which derives micro x accumulation x 16 and checks it."""
    import deepspeed.runtime.config as dsc

    lay = PlannerLayout(2, 1, 8, 2, zero_stage=1)
    text, notes = export_deepspeed(PRESETS["llama3-8b"], lay, WL)
    monkeypatch.setattr(dsc.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dsc.dist, "get_world_size", lambda *a, **k: lay.gpus)
    c = dsc.DeepSpeedConfig(json.loads(text))  # raises on a batch that does not check
    assert c.world_size == 16 and c.train_micro_batch_size_per_gpu == 2 and c.gradient_accumulation_steps == 4
    assert c.train_batch_size // lay.tp == 64  # the sequences a step: each micro-batch shared by the tp ranks
    assert any("no train_batch_size" in n for n in notes)


def test_deepspeed_moe_export_is_autoeps_expert_parallel_block():
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config

    shape = PRESETS["qwen3-30b-a3b"]
    lay = PlannerLayout(1, 1, 8, 1, ep=4, zero_stage=2, attention="sdpa", rmsnorm="torch")
    assert exportable(lay, "deepspeed", shape) == ""
    cfg = json.loads(export_deepspeed(shape, lay, WL)[0])
    ep = parse_autoep_config(cfg["expert_parallel"])
    assert (ep.enabled, ep.autoep_size, ep.preset_model) == (True, 4, "qwen3_moe")
    validate_autoep_config(ep, lay.gpus, 1, 1, 1, zero_stage=2)  # DeepSpeed's own check: raises if wrong
    mixtral = json.loads(export_deepspeed(PRESETS["mixtral-8x7b"], lay, WL)[0])
    assert mixtral["expert_parallel"]["preset_model"] == "mixtral"


def test_megatron_export_launches_past_its_arguments():
    """pretrain_gpt.py stops without --train-iters, a tokenizer and data: the export writes the run's
    steps, mock data and a tokenizer that needs no files."""
    lay = PlannerLayout(2, 1, 4, 1, sequence_parallel=True, attention="flash2", rmsnorm="fused")
    text, notes = export_megatron(PRESETS["llama3-8b"], lay, WL, steps=30)
    a = megatron_parser(exit_on_error=False).parse_args(shlex.split(text))
    assert (a.train_iters, a.eval_iters, a.mock_data, a.tokenizer_type, a.vocab_size) == (
        30,
        0,
        True,
        "NullTokenizer",
        128256,
    )
    assert any("128512 rows" in n for n in notes)  # NullTokenizer's end-of-document id, padded to 128 x tp


def test_megatron_moe_export_routes_in_fp32_with_the_models_aux_loss():
    lay = PlannerLayout(1, 2, 8, 1, ep=8, attention="flash2", rmsnorm="fused")
    text, _ = export_megatron(PRESETS["qwen3-30b-a3b"], lay, WL)
    a = megatron_parser(exit_on_error=False).parse_args(shlex.split(text))
    assert (a.moe_router_dtype, a.moe_permute_fusion, a.moe_aux_loss_coeff) == ("fp32", True, [0.001])
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.expert_model_parallel_size) == (128, 8, 768, 8)
    mixtral = export_megatron(PRESETS["mixtral-8x7b"], lay, WL, moe_aux_loss_coeff=0.0)[0]
    assert megatron_parser(exit_on_error=False).parse_args(shlex.split(mixtral)).moe_aux_loss_coeff == [0.0]


def test_torchtitan_70b_pp4_vp2_cp2_counts_stages_as_torchtitan_does():
    """torchtitan makes ceil((layers + first + last less layers) / layers per stage) virtual stages and
    raises unless pp divides them; its cp runs in FlexAttention (varlen has none), all-gathering K/V."""
    shape = PRESETS["llama3-70b"]
    lay = PlannerLayout(
        1, 4, 8, 1, cp=2, cp_impl="allgather", fsdp=True, pipeline_schedule="interleaved", virtual_stages=2,
        attention="flash2", rmsnorm="torch",
    )  # fmt: skip
    assert exportable(lay, "torchtitan", shape) == ""
    assert "ring" in exportable(PlannerLayout(1, 1, 8, 1, cp=2, fsdp=True, rmsnorm="torch"), "torchtitan", shape)
    text, notes = export_torchtitan(shape, lay, WL)
    r = torchtitan_recipe(text)
    par = r["parallelism"]
    first, last = par["pipeline_parallel_first_stage_less_layers"], par["pipeline_parallel_last_stage_less_layers"]
    stages = -(-(shape.layers + first + last) // par["pipeline_parallel_layers_per_stage"])
    assert stages % par["pipeline_parallel_degree"] == 0 and stages // par["pipeline_parallel_degree"] == 2
    assert r["attn_backend"] == "flex_flash" and par["context_parallel_degree"] == 2
    assert any("all-gathers K and V" in n for n in notes)


def test_torchtitan_moe_export_is_a_qwen3_recipe_with_expert_parallelism():
    shape = PRESETS["qwen3-30b-a3b"]
    lay = PlannerLayout(1, 1, 8, 1, ep=8, fsdp=True, attention="flash2", rmsnorm="torch")
    assert exportable(lay, "torchtitan", shape) == ""
    r = torchtitan_recipe(export_torchtitan(shape, lay, WL)[0])
    assert (r["recipe"], r["flavor"], r["parallelism"]["expert_parallel_degree"]) == ("qwen3_30b_a3b", "30B-A3B", 8)
