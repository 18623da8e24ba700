"""`harness plan --export` read back by each tool's own parser (DeepSpeed's config class, Megatron-LM's
argument parser as tests/data/megatron_lm_arguments.json holds it, a strict reader of torchtitan's
config fields), and `harness import` round-tripping each export into a spec harness.spec loads.
Quick: no processes."""

from __future__ import annotations

import ast
import json
import shlex

import pytest
from conftest import megatron_parser

from harness.cli import main as cli
from harness.interop.deepspeed_out import export_deepspeed
from harness.interop.exports import exportable
from harness.interop.megatron_out import export_megatron
from harness.interop.torchtitan_out import TORCHTITAN as TT_COMMIT
from harness.interop.torchtitan_out import export_torchtitan
from harness.model.presets import PRESETS
from harness.planner.layout import PlannerLayout, Workload
from harness.spec import Optimizer

L8 = PRESETS["llama3-8b"]
WL = Workload(8192, 64)
OPT = Optimizer(lr=1.5e-4, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.05)
CLIP = 0.5


def run(capsys, *argv):
    code = cli(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------- Megatron-LM

MEGATRON = {  # id: layout (world = its gpus)
    "tp2-sp-pp2-vp2-full": PlannerLayout(
        2,
        2,
        2,
        1,
        sequence_parallel=True,
        activation_checkpointing="full",
        pipeline_schedule="interleaved",
        virtual_stages=2,
        attention="flash2",
    ),
    "cp2-ring-selective-cudnn": PlannerLayout(
        1, 1, 4, 2, cp=2, activation_checkpointing="selective", attention="sdpa_cudnn"
    ),
    "tp4-naive-zero0": PlannerLayout(4, 1, 2, 1, attention="naive", zero_stage=0),
}


def megatron_layout(a, world: int) -> dict:
    """The layout Megatron-LM runs from its parsed arguments (dp: the world size over tp x pp x cp)."""
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size or 1
    return {
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "dp": world // (tp * pp * cp),
        "virtual_stages": a.num_virtual_stages_per_pipeline_rank or 1,
        "micro_batch_size": a.micro_batch_size,
        "activation_checkpointing": a.recompute_granularity or "none",
        "sequence_parallel": a.sequence_parallel,
    }


def planned(lay: PlannerLayout) -> dict:
    return {
        "tp": lay.tp,
        "pp": lay.pp,
        "cp": lay.cp,
        "dp": lay.dp,
        "virtual_stages": lay.virtual_stages,
        "micro_batch_size": lay.micro_batch_size,
        "activation_checkpointing": lay.activation_checkpointing,
        "sequence_parallel": lay.sequence_parallel,
    }


@pytest.mark.parametrize("name", list(MEGATRON))
def test_megatron_export_is_read_by_megatron_lm_parser_as_the_plan(name):
    lay = MEGATRON[name]
    text, notes = export_megatron(L8, lay, WL, OPT, CLIP)
    a = megatron_parser(exit_on_error=False).parse_args(shlex.split(text))  # an unknown flag fails
    assert megatron_layout(a, lay.gpus) == planned(lay)
    assert (a.optimizer, a.lr, a.min_lr, a.lr_decay_style, a.lr_warmup_iters) == ("adam", 1.5e-4, 1.5e-4, "constant", 0)
    assert (a.weight_decay, a.adam_beta1, a.adam_beta2, a.adam_eps, a.clip_grad) == (0.05, 0.85, 0.99, 1e-6, 0.5)
    assert (a.global_batch_size, a.seq_length, a.bf16) == (64, 8192, True)
    # what Megatron-LM's validate_args (megatron/training/arguments.py) asserts of these flags
    if a.overlap_param_gather:
        assert a.use_distributed_optimizer and a.overlap_grad_reduce
    assert a.use_distributed_optimizer == (lay.zero_stage >= 1)
    if a.attention_backend == "local":
        assert a.spec == ["local"] and a.transformer_impl == "local"
    if a.context_parallel_size:
        assert a.transformer_impl == "transformer_engine" and a.attention_backend != "local"
        assert a.seq_length % (2 * a.context_parallel_size) == 0
    assert any(n.startswith("for Megatron-LM d98e8a64ddf3") for n in notes)


def test_megatron_export_refuses_cp_outside_transformer_engine(capsys):
    why = exportable(PlannerLayout(1, 2, 2, 1, cp=2, attention="naive"), "megatron")
    assert "Transformer Engine" in why
    assert not exportable(PlannerLayout(1, 2, 2, 1, cp=2, attention="flash2"), "megatron")
    plan = "plan --model llama3-8b --seq-len 32768 --global-batch-size 16 --gpus 8 --hardware h100-sxm --cp 2".split()
    code, _, err = run(capsys, *plan, "--attention", "naive", "--export", "megatron")
    assert code == 2 and err.startswith("error: --export:") and "Transformer Engine" in err
    code, out, err = run(capsys, *plan, "--attention", "naive,flash2", "--export", "megatron")
    a = megatron_parser(exit_on_error=False).parse_args(shlex.split(out))
    assert code == 0 and a.context_parallel_size == 2
    assert (a.transformer_impl, a.attention_backend) == ("transformer_engine", "flash")


# ---------------------------------------------------------------- DeepSpeed


def deepspeed_config(text: str, dp: int, monkeypatch):
    """DeepSpeed's own DeepSpeedConfig of the JSON, its data-parallel world size dp (an mpu that says
    so; no process group: the rank is 0)."""
    import deepspeed.runtime.config as dsc

    monkeypatch.setattr(dsc.dist, "get_rank", lambda: 0)

    class Mpu:
        def get_data_parallel_world_size(self):
            return dp

    return dsc.DeepSpeedConfig(json.loads(text), mpu=Mpu())


DEEPSPEED = {
    "zero1-autotp2": PlannerLayout(2, 1, 8, 2, sequence_parallel=False),
    "fsdp-full": PlannerLayout(1, 1, 16, 1, fsdp=True, activation_checkpointing="full"),
    "ulysses-cp4": PlannerLayout(1, 1, 4, 1, cp=4, cp_impl="ulysses", zero_stage=2),
}


@pytest.mark.parametrize("name", list(DEEPSPEED))
def test_deepspeed_export_is_read_by_deepspeed_config_as_the_plan(name, monkeypatch):
    lay = DEEPSPEED[name]
    text, _ = export_deepspeed(L8, lay, WL, OPT, CLIP)
    c = deepspeed_config(text, lay.dp, monkeypatch)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (
        64,
        lay.micro_batch_size,
        64 // (lay.dp * lay.micro_batch_size),
    )
    assert c.gradient_clipping == CLIP and c.bfloat16_config.enabled
    assert c.optimizer_name == "adamw"
    assert c.optimizer_params == {"lr": 1.5e-4, "betas": [0.85, 0.99], "eps": 1e-6, "weight_decay": 0.05}
    z = c.zero_config
    assert z.stage == lay.sharding_stage
    assert (z.reduce_bucket_size, z.allgather_bucket_size, z.overlap_comm, z.contiguous_gradients) == (
        5e7,
        5e7,
        True,
        True,
    )
    if z.stage == 3:
        assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.max_live_parameters) == (
            5e7,
            10 * L8.hidden,
            1e9,
        )
    assert c._param_dict.get("tensor_parallel", {}).get("autotp_size", 1) == lay.tp
    assert c._param_dict.get("sequence_parallel_size", 1) == lay.cp


# ---------------------------------------------------------------- torchtitan

# torchtitan 0.3.0 (TT_COMMIT; the wheel on PyPI, read in its source): torchtitan/config/configs.py's
# TrainingConfig and ParallelismConfig fields (their Literal choices), the names the recipe imports and
# where they are defined, default_adamw's AdamW kwargs, LRSchedulersContainer.Config's fields, the
# llama3 flavors and language-model attention backends (models/common/config_utils.py).
TT_FIELDS = {
    "training": {
        **dict.fromkeys(
            "local_batch_size global_batch_size seq_len max_norm steps enable_cpu_offload disable_cuda_graphs "
            "gc_freq gc_debug".split()
        ),
        "dtype": ("bfloat16", "float32"),
        "mixed_precision_param": ("bfloat16", "float32"),
        "mixed_precision_reduce": ("float32",),
    },
    "parallelism": {
        **dict.fromkeys(
            "data_parallel_replicate_degree data_parallel_shard_degree enable_fsdp_symm_mem tensor_parallel_degree "
            "enable_sequence_parallel pipeline_parallel_degree module_fqns_per_model_part "
            "pipeline_parallel_first_stage_less_layers pipeline_parallel_last_stage_less_layers "
            "pipeline_parallel_layers_per_stage pipeline_parallel_schedule pipeline_parallel_schedule_csv "
            "pipeline_parallel_microbatch_size context_parallel_degree context_parallel_load_balancer "
            "context_parallel_ptrr_mask_key expert_parallel_degree".split()
        ),
        "fsdp_reshard_after_forward": ("default", "always", "never"),
        "spmd_backend": ("partial_dtensor", "full_dtensor", "spmd_types"),
    },
}
TT_IMPORTS = {
    "torchtitan.components.optimizer": {"LRSchedulersContainer", "default_adamw"},
    "torchtitan.config": {"CompileConfig"},
    "torchtitan.distributed.activation_checkpoint": {"FullAC", "SelectiveAC"},
    "torchtitan.models.llama3": {"model_registry"},
    "torchtitan.models.llama3.config_registry": {"llama3_8b", "llama3_70b", "llama3_405b"},
    "torchtitan.models.qwen3": {"model_registry"},
    "torchtitan.models.qwen3.config_registry": {"qwen3_30b_a3b"},
    "torchtitan.components.quantization": {"Float8LinearConverter"},
    "torchtitan.trainer": {"Trainer"},
}
TT_ADAMW = {"lr", "betas", "eps", "weight_decay"}
TT_COMPILE = {"enable", "enable_async_tensor_parallel", "components", "backend"}  # CompileConfig's fields
TT_LR_SCHEDULER = {"warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"}
TT_FLAVORS = {"debugmodel", "1B", "3B", "8B", "70B", "405B", "30B-A3B", "235B-A22B"}
TT_BACKENDS = {"flex", "flex_flash", "varlen"}


def torchtitan_recipe(text: str) -> dict:
    """A strict reading of a torchtitan recipe: only the names above, each value a literal."""
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            assert {a.name for a in node.names} <= TT_IMPORTS[node.module], node.module
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    out = {"training": {}, "parallelism": {}}
    for st in fn.body:
        if isinstance(st, ast.Return):
            continue
        (target,) = st.targets
        path = ast.unparse(target).split(".")
        if path == ["config"]:
            out["recipe"] = ast.unparse(st.value.func)
        elif path[1] in ("training", "parallelism"):
            value = ast.literal_eval(st.value)
            choices = TT_FIELDS[path[1]][path[2]]  # KeyError: a field torchtitan does not have
            assert choices is None or value in choices, (path, value)
            out[path[1]][path[2]] = value
        elif path[1] == "model_spec":
            assert ast.unparse(st.value.func) == "model_registry"
            out["flavor"] = ast.literal_eval(st.value.args[0])
            kw = {k.arg: k.value for k in st.value.keywords}
            out["attn_backend"] = ast.literal_eval(kw["attn_backend"])
            assert set(kw) <= {"attn_backend", "converters"}
            out["converters"] = ast.unparse(kw["converters"]) if "converters" in kw else None
        elif path[1] == "optimizer":
            assert ast.unparse(st.value.func) == "default_adamw"
            out["optimizer"] = {k.arg: ast.literal_eval(k.value) for k in st.value.keywords}
            assert set(out["optimizer"]) <= TT_ADAMW
        elif path[1] == "lr_scheduler":
            assert ast.unparse(st.value.func) == "LRSchedulersContainer.Config"
            out["lr_scheduler"] = {k.arg: ast.literal_eval(k.value) for k in st.value.keywords}
            assert set(out["lr_scheduler"]) <= TT_LR_SCHEDULER
        elif path[1] == "compile":
            assert ast.unparse(st.value.func) == "CompileConfig"
            out["compile"] = {k.arg: ast.literal_eval(k.value) for k in st.value.keywords}
            assert set(out["compile"]) <= TT_COMPILE
        else:
            assert path[1] == "activation_checkpoint", path
            out["ac"] = ast.unparse(st.value)
    assert out["flavor"] in TT_FLAVORS and out["attn_backend"] in TT_BACKENDS
    return out


TORCHTITAN = {
    "fsdp16-selective": PlannerLayout(1, 1, 16, 2, activation_checkpointing="selective", fsdp=True),
    "tp2-sp-pp2-interleaved-full": PlannerLayout(
        2,
        2,
        4,
        1,
        sequence_parallel=True,
        activation_checkpointing="full",
        pipeline_schedule="interleaved",
        virtual_stages=2,
    ),
    "cp4-allgather": PlannerLayout(1, 1, 4, 1, cp=4, cp_impl="allgather", fsdp=True),
    "fsdp16-compiled": PlannerLayout(1, 1, 16, 2, fsdp=True, compile="blocks"),
}


@pytest.mark.parametrize("name", list(TORCHTITAN))
def test_torchtitan_export_is_a_recipe_of_the_plan(name):
    from torch.distributed.pipelining.schedules import get_schedule_class

    lay = TORCHTITAN[name]
    text, notes = export_torchtitan(L8, lay, WL, OPT, CLIP)
    r = torchtitan_recipe(text)
    par, tr = r["parallelism"], r["training"]
    get_schedule_class(par["pipeline_parallel_schedule"])  # a schedule torch's pipelining has
    dp = par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"]
    per_stage = par.get("pipeline_parallel_layers_per_stage")
    # torchtitan's count (distributed/pipeline_parallel.py): ceil((layers + first + last) / per stage) stages
    extra = par.get("pipeline_parallel_first_stage_less_layers", 1) + par.get(
        "pipeline_parallel_last_stage_less_layers", 1
    )
    got = {
        "tp": par["tensor_parallel_degree"],
        "pp": par["pipeline_parallel_degree"],
        "cp": par["context_parallel_degree"],
        "dp": dp,
        "virtual_stages": -(-(L8.layers + extra) // per_stage) // lay.pp if per_stage else 1,
        "micro_batch_size": par["pipeline_parallel_microbatch_size"] if lay.pp > 1 else tr["local_batch_size"],
        "activation_checkpointing": {"FullAC.Config()": "full", "SelectiveAC.Config()": "selective", "None": "none"}[
            r["ac"]
        ],
        "sequence_parallel": lay.tp > 1 and par["enable_sequence_parallel"],
    }
    assert got == planned(lay)
    assert ("blocks" if r["compile"]["enable"] and r["compile"]["components"] == ["model"] else "none") == lay.compile
    assert (r["recipe"], r["flavor"]) == ("llama3_8b", "8B")
    assert tr["global_batch_size"] == 64 and tr["seq_len"] == 8192
    # per data-parallel rank and accumulation step; with pp, every micro-batch of the step in the pipeline
    assert tr["local_batch_size"] == (64 // lay.dp if lay.pp > 1 else lay.micro_batch_size)
    if lay.pp > 1:
        assert tr["disable_cuda_graphs"]  # torchtitan refuses CUDA graphs with pp
    assert r["optimizer"] == {"lr": 1.5e-4, "betas": (0.85, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    assert tr["max_norm"] == CLIP and r["lr_scheduler"] == {"warmup_steps": 0, "decay_ratio": 0.0}
    assert f"torchtitan {TT_COMMIT}" in text and TT_COMMIT == "0.3.0" and any("February 2026" in n for n in notes)


def test_plan_export_torchtitan_needs_a_llama3_flavor(capsys):
    plan = "plan --seq-len 8192 --global-batch-size 64 --gpus 16 --hardware h100-sxm --export torchtitan".split()
    code, out, err = run(capsys, *plan, "--model", "llama3-8b")
    assert code == 0
    r = torchtitan_recipe(out)
    par = r["parallelism"]
    world = par["data_parallel_shard_degree"] * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"]
    assert world * par["context_parallel_degree"] == 16 and r["flavor"] == "8B"
    code, out, err = run(capsys, *plan, "--model", "paper-13b")  # no torchtitan flavor has its shape
    assert code == 2 and err.startswith("error: --export:") and "no flavor" in err


def test_an_fp8_plan_exports_megatron_and_torchtitan_fp8_and_deepspeed_refuses_it():
    """Megatron-LM's FP8 is its arguments (Transformer Engine's current scaling: hybrid formats, the
    tensorwise recipe), read by its parser; torchtitan's is its Float8LinearConverter (rowwise, the one
    recipe it has); DeepSpeed's config holds no FP8 setting, so an fp8 layout is not its to export."""
    lay = PlannerLayout(2, 1, 4, 1, sequence_parallel=True, attention="te_fused", engine="megatron", precision="fp8")
    text, _ = export_megatron(L8, lay, WL, OPT, CLIP)
    a = megatron_parser(exit_on_error=False).parse_args(shlex.split(text))
    assert (a.fp8, a.fp8_recipe, a.transformer_impl) == ("hybrid", "tensorwise", "transformer_engine")
    bf16 = export_megatron(L8, PlannerLayout(2, 1, 4, 1, sequence_parallel=True, attention="te_fused"), WL)[0]
    assert "--fp8" not in bf16
    assert "FP8 is not a setting this export writes" in exportable(lay, "deepspeed")
    tt = PlannerLayout(
        2, 1, 4, 1, sequence_parallel=True, fsdp=True, attention="flash2", rmsnorm="torch", precision="fp8"
    )
    assert exportable(tt, "torchtitan", L8) == ""
    # the LM head filtered out: torchtitan's converter takes every linear of sizes multiple of 16 otherwise
    converter = 'converters=[Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["lm_head"])]'
    assert converter in export_torchtitan(L8, tt, WL)[0]
