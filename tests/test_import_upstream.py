"""`harness import` of the frameworks' own example files (tests/data/upstream/, sources in its README):
each imports as its authors wrote it, with the fields checked, or is refused in one line naming the one
thing the harness cannot carry. Quick: no processes."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from harness.cli import main as cli

UPSTREAM = pathlib.Path(__file__).parent / "data" / "upstream"
LLAMA3 = UPSTREAM / "torchtitan" / "llama3__config_registry.py.txt"
QWEN3 = UPSTREAM / "torchtitan" / "qwen3__config_registry.py.txt"


def run_import(capsys, fmt: str, path: pathlib.Path, *argv: str) -> tuple[int, dict | None, list[str]]:
    code = cli(["import", fmt, str(path), *argv])
    out = capsys.readouterr()
    lines = out.err.splitlines()
    if code == 0:
        assert all(line.startswith("import: ") for line in lines), out.err
    else:
        assert code == 2 and out.out == "" and len(lines) == 1 and lines[0].startswith("error: "), out.err
    return code, yaml.safe_load(out.out) if code == 0 else None, lines


def fields(raw: dict) -> dict:
    """The workload's and layout's fields as dotted names (optimizer and overrides flattened)."""
    out = {}
    for section in ("workload", "layout"):
        for k, v in raw[section].items():
            if isinstance(v, dict):
                out.update({f"{section}.{k}.{kk}": vv for kk, vv in v.items()})
            else:
                out[f"{section}.{k}"] = v
    return out


# file, extra arguments, the fields the import must give (a subset of the spec) or the refusal's start
IMPORTS = {
    "megatron-llama3-8b-fp8": (
        "megatron/llama__train_llama3_8b_h100_fp8.sh",
        [],
        {
            "workload.model": "llama3-8b",  # by shape; the script's rope base and no rope scaling as overrides
            "workload.model_overrides.rope_theta": 1e6,
            "workload.model_overrides.rope_factor": 1.0,
            "workload.seq_len": 8192,
            "workload.global_batch_size": 128,
            "workload.precision": "fp8",
            "workload.fp8_recipe": "tensorwise",  # Megatron-core's default recipe, delayed: per-tensor scaling
            "workload.grad_accum_dtype": "bf16",  # --grad-reduce-in-bf16
            "workload.optimizer.lr": 1.5e-4,
            "layout.engine": "megatron",
            "layout.tp": 1,
            "layout.dp": 8,  # the script's torchrun: 8 a node x 1 node
            "layout.sequence_parallel": False,  # Megatron-LM turns it off at tp 1
            "layout.attention": "sdpa_cudnn",  # --attention-backend fused
            "layout.rmsnorm": "fused",
            "layout.zero_stage": 1,
        },
    ),
    "megatron-gpt3-175b": (
        "megatron/gpt3__train_gpt3_175b_distributed.sh",
        ["--gpus", "128"],
        {
            "workload.model_overrides.layers": 96,
            "workload.model_overrides.hidden": 12288,
            "workload.model_overrides.ffn": 4 * 12288,  # Megatron-LM's default without --swiglu
            "workload.global_batch_size": 1536,
            "workload.precision": "bf16",  # --fp16, said in one line
            "layout.tp": 8,
            "layout.pp": 16,
            "layout.dp": 1,
            "layout.attention": "sdpa",  # --attention-backend auto, said in one line
        },
    ),
    "megatron-gpt3-175b-8-ranks": ("megatron/gpt3__train_gpt3_175b_distributed.sh", [], "error: --gpus:"),
    "megatron-mixtral-8x7b": (
        "megatron/mixtral__train_mixtral_8x7b_distributed.sh",
        ["--gpus", "32"],
        {
            "workload.model": "mixtral-8x7b",
            "workload.moe_aux_loss_coeff": 0.01,
            "workload.seq_len": 4096,
            "layout.pp": 4,
            "layout.ep": 8,
            "layout.dp": 8,
            "layout.sequence_parallel": False,
            "layout.zero_stage": 1,
        },
    ),
    "megatron-mixtral-8-ranks": (
        "megatron/mixtral__train_mixtral_8x7b_distributed.sh",
        [],
        "error: --expert-model-parallel-size:",
    ),
    "megatron-gpt-oss": ("megatron/gptoss__02_train.sh", [], "error: --quick-geglu:"),
    "megatron-fsdp": ("megatron/megatron_fsdp__train_llama3_8b_fsdp_h100_fp8.sh", [], "error: --use-megatron-fsdp:"),
    "megatron-bert": ("megatron/bert__train_bert_340m_distributed.sh", [], "error: pretrain_bert.py:"),
    "deepspeed-squad": (
        "deepspeed/BingBertSquad__deepspeed_bsz24_config.json",
        ["--gpus", "8", "--model", "llama3-8b", "--seq-len", "4096"],
        {
            "workload.global_batch_size": 24,
            "workload.precision": "bf16",  # fp16, said in one line
            "workload.optimizer.lr": 3e-5,
            "workload.optimizer.weight_decay": 0.0,
            "workload.optimizer.betas": [0.9, 0.999],  # DeepSpeed's Adam defaults
            "layout.engine": "deepspeed",
            "layout.micro_batch_size": 3,
            "layout.dp": 8,
            "layout.zero_stage": 0,
        },
    ),
    "deepspeed-squad-no-gpus": (
        "deepspeed/BingBertSquad__deepspeed_bsz24_config.json",
        [],
        "error: gradient_accumulation_steps:",
    ),
    "deepspeed-zenflow-offload": (
        "deepspeed/DeepSpeed-ZenFlow__finetuning__zf_config.json",
        ["--gpus", "8"],
        "error: zero_optimization.offload_optimizer:",
    ),
    "deepspeed-autotuning-z3": (
        "deepspeed/autotuning__hf__dsconfigs__ds_config_z3.json",
        ["--gpus", "8"],
        {"workload.global_batch_size": 8, "layout.micro_batch_size": 1, "layout.dp": 8, "layout.zero_stage": 3},
    ),
    "deepspeed-bert-lamb": (
        "deepspeed/bing_bert__deepspeed_bsz64k_lamb_config_seq128.json",
        ["--gpus", "64"],
        {"workload.global_batch_size": 65536, "layout.micro_batch_size": 64, "layout.dp": 64},
    ),
    "deepspeed-imagenet-z1": (
        "deepspeed/imagenet__config__ds_fp16_z1_config.json",
        ["--gpus", "8"],
        {"workload.global_batch_size": 256, "layout.micro_batch_size": 32, "layout.zero_stage": 1},
    ),
    "deepspeed-pipeline": (
        "deepspeed/pipeline_parallelism__ds_config.json",
        ["--gpus", "8"],
        {"workload.global_batch_size": 256, "layout.micro_batch_size": 8, "workload.optimizer.lr": 1e-3},
    ),
    "deepspeed-autotp-hf": (
        "deepspeed/tensor_parallel__hf_integration__configs__ds_config.json",
        ["--gpus", "8", "--model", "llama3-8b"],
        {"layout.tp": 4, "layout.dp": 2, "layout.zero_stage": 2, "workload.global_batch_size": 8},
    ),
    "deepspeed-harness-zero1": (
        "../../../ds_configs/zero1.json",
        ["--gpus", "4"],
        {"layout.zero_stage": 1, "layout.dp": 4, "workload.precision": "fp32"},
    ),
    "torchtitan-llama3-8b": (
        "torchtitan/llama3__config_registry.py.txt",
        ["--recipe", "llama3_8b", "--gpus", "64"],
        {
            "workload.model": "llama3-8b",
            "workload.seq_len": 8192,
            "workload.global_batch_size": 64,  # one 8192-token micro-batch per dp rank
            "workload.optimizer.lr": 3e-4,
            "layout.engine": "fsdp",
            "layout.dp": 64,
            "layout.activation_checkpointing": "selective_op",  # SelectiveAC: per-op
        },
    ),
    "torchtitan-llama3-70b": (
        "torchtitan/llama3__config_registry.py.txt",
        ["--recipe", "llama3_70b", "--gpus", "64"],
        {
            "workload.model": "llama3-70b",  # its preset, not 8B with overrides
            "layout.tp": 8,
            "layout.dp": 8,
            "layout.micro_batch_size": 8,
            "layout.activation_checkpointing": "full",
        },
    ),
    "torchtitan-llama3-405b": (
        "torchtitan/llama3__config_registry.py.txt",
        ["--recipe", "llama3_405b", "--gpus", "128"],
        {"workload.model": "llama3-405b", "workload.precision": "fp8", "workload.fp8_recipe": "rowwise"},
    ),
    "torchtitan-llama3-debugmodel": (
        "torchtitan/llama3__config_registry.py.txt",
        ["--recipe", "llama3_debugmodel"],
        "error: model_spec:",
    ),
    "torchtitan-llama3-mxfp8": (  # MXFP8LinearConverter: the harness's mxfp8 (its converted LM head in a line)
        "torchtitan/llama3__config_registry.py.txt",
        ["--recipe", "llama3_8b_mxfp8", "--gpus", "8"],
        {
            "workload.model": "llama3-8b",
            "workload.seq_len": 8192,
            "workload.precision": "fp8",
            "workload.fp8_recipe": "mxfp8",
        },
    ),
    "torchtitan-no-recipe-named": ("torchtitan/llama3__config_registry.py.txt", [], "error: --recipe:"),
    "torchtitan-qwen3-30b-a3b": (
        "torchtitan/qwen3__config_registry.py.txt",
        ["--recipe", "qwen3_30b_a3b", "--gpus", "16"],
        {
            "workload.model": "qwen3-30b-a3b",
            "workload.seq_len": 4096,
            "workload.global_batch_size": 32,
            "layout.activation_checkpointing": "full",
        },
    ),
    "torchtitan-qwen3-14b": (
        "torchtitan/qwen3__config_registry.py.txt",
        ["--recipe", "qwen3_14b", "--gpus", "16"],
        "error: model_spec:",
    ),
}


@pytest.mark.parametrize("name", list(IMPORTS))
def test_upstream_file_imports_or_is_refused_in_one_line(name, capsys):
    path, argv, want = IMPORTS[name]
    fmt = name.split("-")[0]
    code, raw, lines = run_import(capsys, fmt, UPSTREAM / path, *argv)
    if isinstance(want, str):
        assert lines[0].startswith(want), lines
        return
    assert code == 0, lines
    got = fields(raw)
    assert {k: got.get(k) for k in want} == want


def test_derived_recipe_takes_its_base_recipe_values(tmp_path, capsys):
    """A recipe derived from one of the same file (or torchtitan's own llama3 ones) starts from that
    recipe's values, not Trainer.Config's defaults: llama3_8b_mxfp8 takes llama3_8b's; a user's
    recipe derived from llama3_70b keeps its seq 8192, tp 8 and full checkpointing."""
    src = tmp_path / "mine.py"
    src.write_text(
        LLAMA3.read_text() + "\n\ndef mine() -> Trainer.Config:\n    config = llama3_70b()\n"
        "    config.parallelism.pipeline_parallel_degree = 2\n    return config\n"
    )
    code, raw, lines = run_import(capsys, "torchtitan", src, "--recipe", "mine", "--gpus", "64")
    assert code == 0, lines
    got = fields(raw)
    assert (got["workload.seq_len"], got["layout.tp"], got["layout.pp"], got["layout.activation_checkpointing"]) == (
        8192,
        8,
        2,
        "full",
    )
    imported = tmp_path / "imported.py"  # the base imported from torchtitan, not in the file
    imported.write_text(
        "from torchtitan.models.llama3.config_registry import llama3_70b\n\n\ndef mine():\n"
        "    config = llama3_70b()\n    return config\n"
    )
    code, raw, lines = run_import(capsys, "torchtitan", imported, "--gpus", "64")
    got = fields(raw)
    assert code == 0 and (got["workload.model"], got["layout.tp"], got["workload.seq_len"]) == ("llama3-70b", 8, 8192)
    assert (got["layout.micro_batch_size"], got["workload.global_batch_size"]) == (8, 64)  # 8 x 8192 tokens, dp 8


def test_a_toml_job_config_is_named_as_torchtitans_old_format(tmp_path, capsys):
    src = tmp_path / "llama3_8b.toml"
    src.write_text('[job]\ndump_folder = "./outputs"\n\n[training]\nlocal_batch_size = 1\nseq_len = 8192\n')
    code, _, lines = run_import(capsys, "torchtitan", src)
    assert code == 2 and lines[0].startswith("error: recipe: a TOML job config") and "February 2026" in lines[0]


def _recipe_names(path: pathlib.Path) -> list[str]:
    import ast

    return [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)]


@pytest.mark.parametrize(
    "path, recipe", [(p, r) for p in (LLAMA3, QWEN3) for r in _recipe_names(p)], ids=lambda v: getattr(v, "stem", v)
)
def test_every_torchtitan_recipe_imports_or_is_refused_in_one_line(path, recipe, capsys):
    """Every function of torchtitan's llama3 and qwen3 config_registry: a spec, or one line naming why."""
    code, raw, lines = run_import(capsys, "torchtitan", path, "--recipe", recipe, "--gpus", "64")
    if code == 0:
        assert raw["workload"]["model"] in ("llama3-8b", "llama3-70b", "llama3-405b", "qwen3-30b-a3b")
    else:
        # a flavor without a preset, a converter the harness does not run, per-parameter-group optimizers
        assert lines[0].startswith(("error: model_spec:", "error: model_spec.converters:", "error: optimizer:")), lines
