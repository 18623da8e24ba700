"""Export then import (`harness plan --export` then `harness import`) gives back the spec it started from:
every field each format carries, over Megatron-LM, DeepSpeed and torchtitan, for dense, FP8 and MoE
layouts, and the same prediction (memory and step time) from the planner. The fields a format has no
place for are named per format (NOT_CARRIED), never skipped silently. Quick: no processes."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shlex

import pytest
import yaml
from conftest import megatron_parser

from harness.cli import main as cli
from harness.interop.exports import EXPORTERS, exportable
from harness.model.presets import PRESETS
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.predict import predict
from harness.spec import Layout, Optimizer
from harness.spec import Workload as SpecWorkload

OPT = {"lr": 1.5e-4, "betas": [0.85, 0.99], "eps": 1e-6, "weight_decay": 0.05}
# What a format has no place for, and why (the import writes harness.spec's default, or the arguments').
NOT_CARRIED = {
    "megatron": {},  # --seed is read back; the export leaves Megatron-LM's default, 1234, the harness's too
    "deepspeed": {
        "workload.steps": "a ds_config has no run length",
        "workload.seed": "a ds_config has no seed",
        "workload.moe_aux_loss_coeff": "AutoEP's load-balancing coefficient is the model config's",
        # the kernels (the model code's) come back from the export's top-level "harness" key (harness/interop/exact.py)
    },
    "torchtitan": {
        "workload.steps": "the recipe's training.steps is not written (the harness's run length)",
        "workload.seed": "the recipe's debug.seed is not written",
        "workload.moe_aux_loss_coeff": "torchtitan's qwen3 load-balancing is the model config's",
        "workload.grad_accum_dtype": "FSDP2 accumulates in its reduce dtype",
    },
}
ENGINE = {"megatron": "megatron", "deepspeed": "deepspeed", "torchtitan": "fsdp"}

CASES = {  # id: (format, model, workload fields, layout)
    "megatron-dense": (
        "megatron",
        "llama3-8b",
        {"precision": "bf16"},
        PlannerLayout(
            2,
            2,
            2,
            1,
            sequence_parallel=True,
            activation_checkpointing="full",
            pipeline_schedule="interleaved",
            virtual_stages=2,
            attention="flash2",
            rmsnorm="fused",
            zero_stage=1,
        ),
    ),
    "megatron-fp8": (
        "megatron",
        "llama3-8b",
        {"precision": "fp8", "fp8_recipe": "tensorwise"},
        PlannerLayout(
            2,
            1,
            2,
            1,
            cp=2,
            sequence_parallel=True,
            activation_checkpointing="selective",
            attention="sdpa_cudnn",
            rmsnorm="fused",
            zero_stage=1,
            precision="fp8",
        ),
    ),
    "megatron-moe": (
        "megatron",
        "qwen3-30b-a3b",
        {"precision": "bf16", "moe_aux_loss_coeff": 0.001},
        PlannerLayout(1, 2, 8, 1, ep=8, attention="flash2", rmsnorm="fused", zero_stage=1),
    ),
    "deepspeed-dense": (
        "deepspeed",
        "llama3-8b",
        {"precision": "bf16"},
        PlannerLayout(2, 1, 8, 2, zero_stage=1, attention="sdpa_flash", rmsnorm="fused"),
    ),
    "deepspeed-moe": (
        "deepspeed",
        "qwen3-30b-a3b",
        {"precision": "bf16"},
        PlannerLayout(1, 1, 8, 1, ep=4, zero_stage=2, attention="sdpa_cudnn", rmsnorm="torch"),
    ),
    "torchtitan-dense": (
        "torchtitan",
        "llama3-70b",
        {"precision": "bf16"},
        PlannerLayout(
            1,
            4,
            8,
            1,
            cp=2,
            cp_impl="allgather",
            fsdp=True,
            pipeline_schedule="interleaved",
            virtual_stages=2,
            attention="flash2",
            rmsnorm="torch",
            activation_checkpointing="full",
        ),
    ),
    "torchtitan-fp8": (
        "torchtitan",
        "llama3-8b",
        {"precision": "fp8", "fp8_recipe": "rowwise"},
        PlannerLayout(
            2, 1, 8, 1, sequence_parallel=True, fsdp=True, attention="sdpa_cudnn", rmsnorm="torch", precision="fp8"
        ),
    ),
    "torchtitan-dense-compiled": (  # varlen for sdpa_flash; a fused RMSNorm is torchtitan's compiled nn.RMSNorm
        "torchtitan",
        "llama3-8b",
        {"precision": "bf16"},
        PlannerLayout(
            2, 1, 4, 1, sequence_parallel=True, fsdp=True, attention="sdpa_flash", rmsnorm="fused", compile="blocks"
        ),
    ),
    "megatron-fp8-rowwise": (  # Transformer Engine's blockwise, read back as rowwise
        "megatron",
        "llama3-8b",
        {"precision": "fp8", "fp8_recipe": "rowwise"},
        PlannerLayout(
            4, 1, 2, 1, sequence_parallel=True, attention="flash2", rmsnorm="fused", zero_stage=1, precision="fp8"
        ),
    ),
    "torchtitan-moe": (
        "torchtitan",
        "qwen3-30b-a3b",
        {"precision": "bf16"},
        PlannerLayout(
            1, 1, 8, 2, ep=8, fsdp=True, attention="sdpa_efficient", rmsnorm="torch", activation_checkpointing="full"
        ),
    ),
    "torchtitan-selective-op": (  # torchtitan's SelectiveAC is its per-op policy: the spec's selective_op
        "torchtitan",
        "llama3-8b",
        {"precision": "bf16"},
        PlannerLayout(
            1, 1, 8, 1, fsdp=True, attention="sdpa_efficient", rmsnorm="torch", activation_checkpointing="selective_op"
        ),
    ),
    "torchtitan-mxfp8": (  # torchtitan's MXFP8LinearConverter on the block linears (fqns), read back as mxfp8
        "torchtitan",
        "llama3-8b",
        {"precision": "fp8", "fp8_recipe": "mxfp8"},
        PlannerLayout(1, 1, 8, 1, fsdp=True, attention="sdpa_efficient", rmsnorm="torch", precision="fp8"),
    ),
    "torchtitan-moe-mxfp8": (  # and its MXFP8GroupedExpertsConverter on the experts
        "torchtitan",
        "qwen3-30b-a3b",
        {"precision": "fp8", "fp8_recipe": "mxfp8"},
        PlannerLayout(1, 1, 8, 2, ep=8, fsdp=True, attention="sdpa_efficient", rmsnorm="torch", precision="fp8"),
    ),
    "torchtitan-moe-fp8": (  # Float8 with the router gate filtered out, the experts by Float8GroupedExpertsConverter
        "torchtitan",
        "qwen3-30b-a3b",
        {"precision": "fp8", "fp8_recipe": "rowwise"},
        PlannerLayout(1, 1, 8, 2, ep=8, fsdp=True, attention="sdpa_efficient", rmsnorm="torch", precision="fp8"),
    ),
    "torchtitan-moe-fp8-gw-hp": (  # Float8LinearConverter's recipe_name rowwise_with_gw_hp, read back as that recipe
        "torchtitan",
        "qwen3-30b-a3b",
        {"precision": "fp8", "fp8_recipe": "rowwise_with_gw_hp"},
        PlannerLayout(1, 1, 8, 2, ep=8, fsdp=True, attention="sdpa_efficient", rmsnorm="torch", precision="fp8"),
    ),
    "megatron-mxfp8": (  # Transformer Engine's MXFP8BlockScaling, e4m3 throughout (--fp8-format e4m3)
        "megatron",
        "llama3-8b",
        {"precision": "fp8", "fp8_recipe": "mxfp8"},
        PlannerLayout(
            2, 1, 4, 1, sequence_parallel=True, attention="flash2", rmsnorm="fused", zero_stage=1, precision="fp8"
        ),
    ),
}


def original(fmt: str, model: str, fields: dict, lay: PlannerLayout) -> dict:
    """The spec the plan stands for: the workload and the layout as harness.spec names them."""
    layout = {**lay.to_spec(), "engine": ENGINE[fmt]}
    if fmt == "torchtitan":
        layout.pop("zero_stage")  # FSDP2's full sharding: engine fsdp has no ZeRO stage
    if fmt == "deepspeed" and lay.ep > 1:
        layout["ds_moe"] = "autoep"  # DeepSpeed's MoE export is AutoEP's expert_parallel section
    workload = {"model": model, "seq_len": 4096, "global_batch_size": 64, "steps": 20, "optimizer": OPT}
    return {"workload": {**workload, "grad_clip": 0.5, **fields}, "layout": layout}


def complete(raw: dict) -> dict:
    """Every field, harness.spec's default where the raw spec leaves it out, flattened to dotted names."""
    workload = {**dataclasses.asdict(SpecWorkload()), **copy.deepcopy(raw["workload"])}
    workload["optimizer"] = {**dataclasses.asdict(Optimizer()), **workload["optimizer"]}
    workload["optimizer"]["betas"] = list(workload["optimizer"]["betas"])
    layout = {**dataclasses.asdict(Layout()), **raw["layout"]}
    out = {f"workload.{k}": v for k, v in workload.items() if k != "optimizer"}
    out.update({f"workload.optimizer.{k}": v for k, v in workload["optimizer"].items()})
    out.update({f"layout.{k}": v for k, v in layout.items()})
    return out


def prediction(raw: dict):
    w = raw["workload"]
    shape = PRESETS[w["model"]]
    lay = dataclasses.replace(PlannerLayout.from_spec(raw["layout"], w["precision"]), engine=raw["layout"]["engine"])
    p = predict(shape, lay, Workload(w["seq_len"], w["global_batch_size"]), load_profile("h100-sxm"))
    return round(p.memory_gib, 9), round(p.step_time_s, 9)


@pytest.mark.parametrize("name", list(CASES))
def test_export_then_import_gives_back_every_field_and_the_same_prediction(name, tmp_path, capsys):
    fmt, model, fields, lay = CASES[name]
    shape = PRESETS[model]
    assert exportable(lay, fmt, shape) == ""
    spec = original(fmt, model, fields, lay)
    w = spec["workload"]
    kwargs = {"steps": w["steps"], "moe_aux_loss_coeff": w.get("moe_aux_loss_coeff", 0.0)} if fmt == "megatron" else {}
    kwargs.update({"fp8_recipe": w["fp8_recipe"]} if "fp8_recipe" in w else {})
    text, _ = EXPORTERS[fmt](shape, lay, Workload(4096, 64), Optimizer(**OPT), 0.5, **kwargs)
    src, out = tmp_path / "exported", tmp_path / "spec.yaml"
    src.write_text(text)
    extra = ["--model", model, "--seq-len", "4096"] if fmt == "deepspeed" else []
    code = cli(["import", fmt, str(src), "--gpus", str(lay.gpus), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert code == 0, err
    back = yaml.safe_load(out.read_text())
    want, got = complete(spec), complete(back)
    skipped = set(NOT_CARRIED[fmt])
    differ = {k: (want[k], got[k]) for k in want if k not in skipped and want[k] != got[k]}
    assert differ == {}, err
    assert prediction(back) == prediction(spec)
    said = [line for line in err.splitlines() if line.startswith("import: ")]
    unsaid = [k for k in skipped if want[k] != got[k] and not any(k.split(".")[-1] in line for line in said)]
    assert unsaid == [], err  # each field a format has no place for is named in an import: line


def test_megatron_stays_megatron_without_transformer_engine_here(tmp_path, capsys):
    """The planning machine has no Transformer Engine: the import keeps engine megatron and its kernels,
    and says in one line that `harness train` here refuses them."""
    fmt, model, fields, lay = CASES["megatron-fp8"]
    text, _ = EXPORTERS[fmt](PRESETS[model], lay, Workload(4096, 64))
    (tmp_path / "a.txt").write_text(text)
    assert cli(["import", "megatron", str(tmp_path / "a.txt"), "--gpus", str(lay.gpus)]) == 0
    out = capsys.readouterr()
    raw = yaml.safe_load(out.out)
    assert (raw["layout"]["engine"], raw["layout"]["attention"], raw["workload"]["precision"]) == (
        "megatron",
        "sdpa_cudnn",
        "fp8",
    )
    assert sum(line.startswith("import: layout.engine: megatron kept") for line in out.err.splitlines()) == 1


# Megatron-LM's arguments are pretrain_gpt.py's, parsed strictly: no place for the plan's own kernel where
# one setting stands for several. What comes back, and the one line that says so.
MEGATRON_MANY_TO_ONE = {  # plan's (attention, rmsnorm): imported (attention, rmsnorm)
    ("sdpa_flash", "torch"): ("flash2", "fused"),  # --attention-backend flash; Transformer Engine's fused norm
    ("sdpa", "fused"): ("flash2", "fused"),
}


@pytest.mark.parametrize("kernels", list(MEGATRON_MANY_TO_ONE))
def test_megatron_kernels_a_setting_stands_for_several_of_come_back_as_its_own_said_in_one_line(
    kernels, tmp_path, capsys
):
    attention, rmsnorm = kernels
    lay = PlannerLayout(2, 1, 4, 1, sequence_parallel=True, attention=attention, rmsnorm=rmsnorm, zero_stage=1)
    text, notes = EXPORTERS["megatron"](PRESETS["llama3-8b"], lay, Workload(4096, 64))
    assert "#" not in text  # the arguments as pretrain_gpt.py takes them, nothing else
    (tmp_path / "a.txt").write_text(text)
    assert cli(["import", "megatron", str(tmp_path / "a.txt"), "--gpus", "8"]) == 0
    out = capsys.readouterr()
    raw = yaml.safe_load(out.out)
    assert (raw["layout"]["attention"], raw["layout"]["rmsnorm"]) == MEGATRON_MANY_TO_ONE[kernels]
    said = [line for line in out.err.splitlines() if line.startswith("import: kernels: not carried exactly: ")]
    assert len(said) == 1 and "--attention-backend flash runs flash2, sdpa, sdpa_flash" in said[0], out.err


def test_fp8_recipe_a_tool_lacks_is_said_at_export():
    """torchtitan 0.3.0's Float8LinearConverter takes rowwise (or rowwise_with_gw_hp) only: a tensorwise
    workload is exported rowwise, and the note says so; Megatron-LM writes rowwise as TE's blockwise."""
    lay = PlannerLayout(1, 1, 8, 1, fsdp=True, attention="flash2", rmsnorm="torch", precision="fp8")
    text, notes = EXPORTERS["torchtitan"](PRESETS["llama3-8b"], lay, Workload(4096, 64), fp8_recipe="tensorwise")
    assert 'recipe_name="rowwise"' in text
    assert any("tensorwise has no recipe_name there" in n for n in notes), notes
    lay = PlannerLayout(2, 1, 4, 1, sequence_parallel=True, attention="flash2", zero_stage=1, precision="fp8")
    text, notes = EXPORTERS["megatron"](PRESETS["llama3-8b"], lay, Workload(4096, 64), fp8_recipe="rowwise")
    assert "--fp8-recipe blockwise" in text and any("no rowwise recipe" in n for n in notes)
    assert "--fp8-recipe tensorwise" in EXPORTERS["megatron"](PRESETS["llama3-8b"], lay, Workload(4096, 64))[0]


def test_mxfp8_exports_as_the_tools_own_mx_recipe():
    """mxfp8 is torchtitan 0.3.0's MX converters (no Float8 note) and Transformer Engine's MXFP8BlockScaling with
    e4m3 throughout, as torchao's mx_mm casts every operand (its --fp8-format read by Megatron-LM's parser); the
    other recipes' formats are torchao's gradient casts too: tensorwise e5m2 (hybrid), rowwise e4m3."""
    lay = PlannerLayout(1, 1, 8, 1, fsdp=True, attention="flash2", rmsnorm="torch", precision="fp8")
    text, notes = EXPORTERS["torchtitan"](PRESETS["llama3-8b"], lay, Workload(4096, 64), fp8_recipe="mxfp8")
    assert 'converters=[MXFP8LinearConverter.Config(fqns=["attention", "feed_forward"]' in text
    assert "Float8" not in text and "MXFP8GroupedExpertsConverter" not in text
    assert [n for n in notes if "FP8" in n] == [next(n for n in notes if n.startswith("FP8 mxfp8: "))]
    moe = PlannerLayout(1, 1, 8, 1, ep=8, fsdp=True, attention="flash2", rmsnorm="torch", precision="fp8")
    text, _ = EXPORTERS["torchtitan"](PRESETS["qwen3-30b-a3b"], moe, Workload(4096, 64), fp8_recipe="mxfp8")
    assert 'MXFP8GroupedExpertsConverter.Config(recipe_name="mxfp8_rceil", pad_multiple=32' in text
    lay = PlannerLayout(2, 1, 4, 1, sequence_parallel=True, attention="flash2", zero_stage=1, precision="fp8")
    for recipe, want in {
        "mxfp8": ("e4m3", "mxfp8"),
        "rowwise": ("e4m3", "blockwise"),
        None: ("hybrid", "tensorwise"),
    }.items():
        text, _ = EXPORTERS["megatron"](PRESETS["llama3-8b"], lay, Workload(4096, 64), fp8_recipe=recipe)
        a = megatron_parser(exit_on_error=False).parse_args(shlex.split(text))
        assert (a.fp8, a.fp8_recipe) == want


@pytest.mark.parametrize(
    "edit, want",
    [  # an edited mxfp8 recipe: what the harness cannot carry, one line each (or one error line)
        (('fqns=["attention", "feed_forward"]', "fqns=[]"), "import: model_spec.converters.fqns: not carried: empty"),
        (('fqns=["attention", "feed_forward"]', 'fqns=["attention"]'), "leaves block linears in bf16"),
        (('fqns=["attention", "feed_forward"]', 'fqns=["attention", "feed_forward", "lm_head"]'), ": lm_head; "),
        (
            (
                "MXFP8LinearConverter.Config(",
                'Float8LinearConverter.Config(recipe_name="rowwise"), MXFP8LinearConverter.Config(',
            ),
            "error: model_spec.converters: Float8 and MXFP8",
        ),
    ],
)
def test_an_mxfp8_recipe_the_harness_cannot_carry_is_said_in_one_line(edit, want, tmp_path, capsys):
    lay = PlannerLayout(1, 1, 8, 1, fsdp=True, attention="flash2", rmsnorm="torch", precision="fp8")
    text, _ = EXPORTERS["torchtitan"](PRESETS["llama3-8b"], lay, Workload(4096, 64), fp8_recipe="mxfp8")
    edited = text.replace(*edit)
    assert edited != text
    (tmp_path / "r.py").write_text(edited)
    code = cli(["import", "torchtitan", str(tmp_path / "r.py"), "--gpus", "8"])
    out = capsys.readouterr()
    assert sum(want in line for line in out.err.splitlines()) == 1, out.err
    if want.startswith("error: "):
        assert code == 2 and out.err.startswith(want)
    else:
        assert code == 0 and yaml.safe_load(out.out)["workload"]["fp8_recipe"] == "mxfp8"


@pytest.mark.parametrize(
    "recipe, edit, want",
    [  # an edited MoE FP8 recipe: the experts or the router not as the harness runs them, one line each
        ("mxfp8", (r", MXFP8GroupedExpertsConverter\.Config\([^)]*\)", ""), "keeps the experts in bf16"),
        ("rowwise", (r", Float8GroupedExpertsConverter\.Config\([^)]*\)", ""), "keeps the experts in bf16"),
        ("rowwise", (r', "router\.gate"', ""), "converts the router gate too"),
    ],
)
def test_a_moe_fp8_recipe_the_harness_cannot_carry_is_said_in_one_line(recipe, edit, want, tmp_path, capsys):
    lay = PlannerLayout(1, 1, 8, 1, ep=8, fsdp=True, attention="flash2", rmsnorm="torch", precision="fp8")
    text, _ = EXPORTERS["torchtitan"](PRESETS["qwen3-30b-a3b"], lay, Workload(4096, 64), fp8_recipe=recipe)
    edited = re.sub(*edit, text)
    assert edited != text
    (tmp_path / "r.py").write_text(edited)
    assert cli(["import", "torchtitan", str(tmp_path / "r.py"), "--gpus", "8"]) == 0
    out = capsys.readouterr()
    assert yaml.safe_load(out.out)["workload"]["fp8_recipe"] == recipe
    assert sum(want in line for line in out.err.splitlines()) == 1, out.err
    (tmp_path / "r.py").write_text(text)  # as exported: nothing of the converters said
    assert cli(["import", "torchtitan", str(tmp_path / "r.py"), "--gpus", "8"]) == 0
    assert "model_spec.converters" not in capsys.readouterr().err


def test_megatron_fp8_format_other_than_the_recipes_gradients_is_said_in_one_line(tmp_path, capsys):
    """--fp8-format hybrid (e5m2 gradients) with --fp8-recipe mxfp8: the harness's mxfp8 casts them to e4m3."""
    lay = PlannerLayout(2, 1, 4, 1, sequence_parallel=True, attention="flash2", zero_stage=1, precision="fp8")
    text, _ = EXPORTERS["megatron"](PRESETS["llama3-8b"], lay, Workload(4096, 64), fp8_recipe="mxfp8")
    for fmt, lines in (("e4m3", 0), ("hybrid", 1)):
        (tmp_path / "a.txt").write_text(text.replace("--fp8-format e4m3", f"--fp8-format {fmt}"))
        assert cli(["import", "megatron", str(tmp_path / "a.txt"), "--gpus", "8"]) == 0
        out = capsys.readouterr()
        assert yaml.safe_load(out.out)["workload"]["fp8_recipe"] == "mxfp8"
        said = [line for line in out.err.splitlines() if line.startswith("import: --fp8-format: not carried: ")]
        assert len(said) == lines and all("hybrid (e5m2 gradients)" in line for line in said), out.err
    (tmp_path / "a.txt").write_text(text.replace("--fp8-format e4m3", "--fp8-format e5m2"))
    assert cli(["import", "megatron", str(tmp_path / "a.txt"), "--gpus", "8"]) == 2
    assert capsys.readouterr().err.startswith("error: --fp8-format: 'e5m2' is not one of e4m3, hybrid")


def test_an_exact_kernel_the_tools_setting_does_not_run_loses_to_it_in_one_line(tmp_path, capsys):
    """An edited file: the tool's own setting decides, and one line says which exact value was not taken."""
    lay = PlannerLayout(1, 1, 8, 1, fsdp=True, attention="sdpa", rmsnorm="torch")
    text, _ = EXPORTERS["torchtitan"](PRESETS["llama3-8b"], lay, Workload(4096, 64))
    edited = text.replace('attn_backend="varlen"', 'attn_backend="flex"')
    assert edited != text
    (tmp_path / "r.py").write_text(edited)
    assert cli(["import", "torchtitan", str(tmp_path / "r.py"), "--gpus", "8"]) == 0
    out = capsys.readouterr()
    assert yaml.safe_load(out.out)["layout"]["attention"] == "sdpa_efficient"  # flex
    assert sum("harness attention=sdpa not taken" in line for line in out.err.splitlines()) == 1, out.err

    text, _ = EXPORTERS["deepspeed"](PRESETS["llama3-8b"], lay, Workload(4096, 64))
    cfg = json.loads(text)
    assert cfg["harness"] == {"attention": "sdpa", "rmsnorm": "torch"}
    cfg["harness"]["rmsnorm"] = "apex"
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    argv = [
        "import",
        "deepspeed",
        str(tmp_path / "ds.json"),
        "--gpus",
        "8",
        "--model",
        "llama3-8b",
        "--seq-len",
        "4096",
    ]
    assert cli(argv) == 0
    out = capsys.readouterr()
    assert yaml.safe_load(out.out)["layout"]["rmsnorm"] == "torch"
    assert sum("harness rmsnorm=apex not taken" in line for line in out.err.splitlines()) == 1, out.err


def test_deepspeed_parses_the_export_with_its_harness_key(monkeypatch):
    """DeepSpeed 0.19.8's own DeepSpeedConfig takes the ds_config with the plan's kernels beside its keys."""
    dsc = pytest.importorskip("deepspeed.runtime.config")
    fmt, model, fields, lay = CASES["deepspeed-dense"]
    text, _ = EXPORTERS[fmt](PRESETS[model], lay, Workload(4096, 64))
    monkeypatch.setattr(dsc.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dsc.dist, "get_world_size", lambda *a, **k: lay.gpus)
    c = dsc.DeepSpeedConfig(json.loads(text))
    assert c.train_micro_batch_size_per_gpu == lay.micro_batch_size


def test_torchtitan_selective_ac_is_the_per_op_policy_and_a_megatron_style_plan_is_told_so(tmp_path, capsys):
    """A plan with Megatron-style selective recomputation exports as SelectiveAC (torchtitan has no other
    selective policy), its note says the policy differs, and the import reads SelectiveAC as selective_op."""
    lay = PlannerLayout(
        1, 1, 8, 1, fsdp=True, attention="sdpa_efficient", rmsnorm="torch", activation_checkpointing="selective"
    )
    assert lay.selective_policy == "megatron"
    text, notes = EXPORTERS["torchtitan"](PRESETS["llama3-8b"], lay, Workload(4096, 64))
    assert "config.activation_checkpoint = SelectiveAC.Config()" in text
    assert any(n.startswith("SelectiveAC is torchtitan's per-op policy") for n in notes), notes
    (tmp_path / "r.py").write_text(text)
    assert cli(["import", "torchtitan", str(tmp_path / "r.py"), "--gpus", "8"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["layout"]["activation_checkpointing"] == "selective_op"


@pytest.mark.parametrize("name", ["megatron-dense", "megatron-fp8", "megatron-moe"])
def test_megatron_export_says_the_environment_its_validate_args_needs(name):
    """Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tp or cp before Blackwell
    (scripts/megatron_lm_args_check.py ran it on these exports): the note says so exactly there."""
    fmt, model, fields, lay = CASES[name]
    _, notes = EXPORTERS[fmt](PRESETS[model], lay, Workload(4096, 64))
    said = [n for n in notes if "CUDA_DEVICE_MAX_CONNECTIONS=1" in n]
    assert len(said) == (1 if lay.tp > 1 or lay.cp > 1 else 0), notes
