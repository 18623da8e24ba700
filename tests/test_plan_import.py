"""`harness import megatron|torchtitan|deepspeed FILE`: each export read back as the same layout and
optimizer, written as a spec harness.spec loads; what it cannot carry one line each; bad input one
line and exit 2. Quick: no processes."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from test_plan_export import CLIP, DEEPSPEED, L8, MEGATRON, OPT, TORCHTITAN, WL, planned, run

from harness.interop.deepspeed_out import export_deepspeed
from harness.interop.megatron_out import export_megatron
from harness.interop.torchtitan_out import export_torchtitan
from harness.spec import Layout, parse_spec


def without_te(raw: dict) -> dict:
    """A raw spec of engine megatron with what only Transformer Engine runs set to what runs here (the
    rest checked as it is)."""
    if raw["layout"]["engine"] == "megatron":
        lay = raw["layout"]
        lay.update(attention="naive", rmsnorm="torch", dp=lay["dp"] * lay.get("cp", 1), cp=1)
        lay.pop("cp_impl", None)
        raw["workload"]["precision"] = "bf16" if raw["workload"]["precision"] == "fp8" else raw["workload"]["precision"]
        raw["workload"].pop("fp8_recipe", None)
    return raw


EXPORTS = {
    **{f"megatron-{k}": ("megatron", export_megatron, lay) for k, lay in MEGATRON.items()},
    **{f"deepspeed-{k}": ("deepspeed", export_deepspeed, lay) for k, lay in DEEPSPEED.items()},
    **{f"torchtitan-{k}": ("torchtitan", export_torchtitan, lay) for k, lay in TORCHTITAN.items()},
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_import_round_trips_an_export_into_a_spec(name, tmp_path, capsys):
    fmt, export, lay = EXPORTS[name]
    text, _ = export(L8, lay, WL, OPT, CLIP)
    src, out = tmp_path / "in.txt", tmp_path / "spec.yaml"
    src.write_text(text)
    extra = {"megatron": [], "deepspeed": ["--model", "llama3-8b", "--seq-len", "8192"]}
    code, _, err = run(capsys, "import", fmt, str(src), "--out", str(out), "--gpus", str(lay.gpus), *extra.get(fmt, []))
    assert code == 0, err
    assert all(line.startswith("import: ") for line in err.splitlines())
    # harness.spec's reading, for engine megatron without Transformer Engine's kernels (not installed here)
    raw = yaml.safe_load(out.read_text())
    kept = any(line.startswith(f"import: layout.engine: {raw['layout']['engine']} kept;") for line in err.splitlines())
    # harness.spec's reading where this machine's engine trains it (else the import's planner check ran)
    spec = parse_spec({"workload": raw["workload"]}) if kept else parse_spec(raw)
    got = {k: raw["layout"].get(k, getattr(Layout(), k)) for k in planned(lay)}
    want = planned(lay)
    if fmt == "torchtitan" and want["activation_checkpointing"] == "selective":
        want["activation_checkpointing"] = "selective_op"  # SelectiveAC is per-op only: the export's note says so
    assert got == want
    assert spec.layout.compile == (lay.compile if fmt == "torchtitan" else "none")  # the others write no compile
    w = spec.workload
    assert (w.model, w.seq_len, w.global_batch_size, w.precision) == ("llama3-8b", 8192, 64, "bf16")
    assert (w.optimizer.lr, tuple(w.optimizer.betas), w.optimizer.eps, w.optimizer.weight_decay) == (
        OPT.lr,
        OPT.betas,
        OPT.eps,
        OPT.weight_decay,
    )
    assert w.grad_clip == CLIP


TORCHTITAN_MAIN = """\
def mine() -> Trainer.Config:
    config = llama3_8b()
    config.parallelism.tensor_parallel_degree = 2
    config.parallelism.data_parallel_shard_degree = 4
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.num_pp_microbatches = 8
    config.training.num_tokens_per_microbatch_per_dp_rank = 16384
    config.training.max_context_length = 8192
    config.activation_checkpoint = FullAC.Config()
    config.optimizer = default_adamw(lr=3e-4)
    config.compile.enable = True
    return config
"""


def test_import_torchtitan_main_names_the_batch_in_tokens(tmp_path, capsys):
    """torchtitan's main branch (b5bcd76) spells the batch as token budgets: read as the same layout."""
    src = tmp_path / "mine.py"
    src.write_text(TORCHTITAN_MAIN)
    code, out, err = run(capsys, "import", "torchtitan", str(src), "--out", str(tmp_path / "s.yaml"))
    assert code == 0, err
    raw = yaml.safe_load((tmp_path / "s.yaml").read_text())
    assert raw["layout"]["engine"] == "fsdp"  # kept: engine fsdp here refuses compiled blocks under tp (one line)
    assert "import: layout.engine: fsdp kept; `harness train` on this machine refuses it (layout.compile:" in err
    spec = parse_spec({"workload": raw["workload"], "layout": {**raw["layout"], "compile": "none"}})
    lay = dataclasses.replace(spec.layout, compile=raw["layout"]["compile"])
    assert (lay.tp, lay.pp, lay.dp, lay.micro_batch_size, lay.activation_checkpointing) == (2, 2, 4, 2, "full")
    # num_tokens_per_train_step unset: one micro-batch of 2 sequences x 8 pipeline micro-batches x dp 4
    assert (spec.workload.seq_len, spec.workload.global_batch_size) == (8192, 64)
    assert (spec.workload.optimizer.lr, tuple(spec.workload.optimizer.betas)) == (3e-4, (0.9, 0.95))  # default_adamw's
    assert lay.compile == "blocks"  # compile.enable with CompileConfig's default components (model, loss)
    assert "import: compile.components: not carried: loss" in err


MEGATRON_SCRIPT = """\
#!/bin/bash
# a user's launch script
torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py \\
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \\
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \\
    --group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 131072 \\
    --micro-batch-size 1 --global-batch-size 128 --rotary-base 500000 --untie-embeddings-and-output-weights \\
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --bf16 --grad-reduce-in-bf16 \\
    --use-distributed-optimizer --attention-backend flash --data-path /data/tokens --fp8-format hybrid
"""


def test_import_megatron_script_lists_what_it_cannot_carry(tmp_path, capsys):
    src = tmp_path / "train.sh"
    src.write_text(MEGATRON_SCRIPT)
    code, out, err = run(capsys, "import", "megatron", str(src), "--out", str(tmp_path / "s.yaml"))
    assert code == 0, err
    raw = yaml.safe_load((tmp_path / "s.yaml").read_text())
    assert raw["layout"]["engine"] == "megatron" and raw["layout"]["attention"] == "flash2"
    assert (raw["workload"]["precision"], raw["workload"]["fp8_recipe"]) == ("fp8", "tensorwise")  # delayed's kind
    spec = parse_spec(without_te(raw))
    assert (spec.layout.tp, spec.layout.pp, spec.layout.dp, spec.layout.sequence_parallel) == (2, 2, 4, True)
    assert spec.workload.model == "llama3-8b" and spec.workload.global_batch_size == 128
    # --bf16 --grad-reduce-in-bf16: Megatron-LM's validate_args drops fp32 accumulation and reduction
    assert (spec.workload.grad_accum_dtype, spec.workload.grad_reduce_dtype) == ("bf16", "bf16")
    lines = err.splitlines()
    for field in ("--data-path", "--lr-decay-style"):
        assert sum(line.startswith(f"import: {field}: not carried: ") for line in lines) == 1, err


@pytest.mark.parametrize(
    "fmt, text, argv, first",
    [
        (
            "megatron",
            "--tensor-model-parallel-size two --num-layers 2",
            ["--gpus", "2"],
            "error: --tensor-model-parallel-size:",
        ),
        (
            "megatron",
            "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 1",
            [],
            "error: --gpus:",
        ),
        ("deepspeed", "{not json", [], "error: ds_config:"),
        (
            "deepspeed",
            '{"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1}',
            [],
            "error: train_micro_batch_size_per_gpu:",
        ),
        (
            "torchtitan",
            "def f():\n    config = llama3_8b()\n    config.activation_checkpoint = MyAC()\n",
            [],
            "error: activation_checkpoint:",
        ),
        ("torchtitan", "def f():\n    config = mine()\n", [], "error: recipe:"),
    ],
)
def test_import_bad_input_is_one_line_naming_the_field(fmt, text, argv, first, tmp_path, capsys):
    src = tmp_path / "in"
    src.write_text(text)
    code, out, err = run(capsys, "import", fmt, str(src), *argv)
    assert code == 2 and out == ""
    assert err.startswith(first) and len(err.strip().splitlines()) == 1, err
