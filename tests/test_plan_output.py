"""What `harness plan` hands a user to act on: distinct table rows, a sweep that `harness sweep` runs
as it is, DeepSpeed / Megatron-LM configs that parse (tests/test_plan_export.py reads each format back
with its tool's parser), and a plan path that imports no torch."""

from __future__ import annotations

import json
import shlex
import sqlite3
import subprocess
import sys

import pytest
import yaml
from conftest import heavy_imports_after, megatron_parser

from harness.cli import main as cli
from harness.interop.deepspeed_out import export_deepspeed
from harness.interop.exports import exportable
from harness.interop.megatron_out import export_megatron
from harness.model.presets import PRESETS
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.output import group
from harness.planner.predict import predict, predict_many

S13 = PRESETS["paper-13b"]
PLAN_13B = ["plan", "--model", "paper-13b", "--seq-len", "2048", "--global-batch-size", "2048", "--gpus", "64"]


def run(capsys, *argv):
    code = cli(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()[:1].isdigit()]


# ---------------------------------------------------------------- distinct rows


def test_kernels_predicted_alike_share_a_row(capsys):
    code, out, _ = run(capsys, *PLAN_13B, "--top", "10")
    assert code == 0
    rows = table_rows(out)
    assert len(rows) == 10
    # flash2 and the SDPA kernels that run FlashAttention-2 are one row, listed together
    assert any("flash2,sdpa,sdpa_flash,sdpa_cudnn" in row for row in rows)
    # no two rows are the same layout and prediction under another kernel name
    keys = [tuple(r.split()[:6]) + tuple(r.split()[7:]) for r in rows]
    assert len(set(keys)) == len(keys)


def test_predict_many_equals_one_call_each():
    prof, wl = load_profile("a100-80gb"), Workload(2048, 2048)
    lays = [
        PlannerLayout(2, 2, 16, 1, attention=a, rmsnorm="fused")
        for a in ("flash2", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flash1", "naive", "fused_softmax")
    ]
    for many, lay in zip(predict_many(S13, lays, wl, prof), lays, strict=True):
        one = predict(S13, lay, wl, prof)
        assert many.layout == lay
        assert (many.memory_gib, many.step_time_s, many.fits, many.available) == (
            one.memory_gib,
            one.step_time_s,
            one.fits,
            one.available,
        )
    rows = group(predict_many(S13, lays, wl, prof))
    assert [r.kernels for r in rows][0] == ["flash2", "sdpa", "sdpa_flash", "sdpa_cudnn"]
    assert len(rows) == 5  # flash2 class, mem_efficient, flash1, naive, fused_softmax


def test_memory_reads_only_whether_attention_is_materialised():
    """predict_many computes memory once per memory_key: every flash-style kernel alike, on every
    engine the planner models (a kernel-specific memory term must change memory_key too)."""
    from harness.planner.layout import planner_engines
    from harness.planner.memory import worst_stage_memory
    from harness.planner.predict import memory_key

    for engine in planner_engines():
        for seq, gbs in ((2048, 2048), (8192, 512)):
            for ck in ("none", "full", "selective"):
                lays = [
                    PlannerLayout(
                        2, 2, 16, 1, activation_checkpointing=ck, attention=a, engine=engine, fsdp=engine == "fsdp"
                    )
                    for a in ("flash2", "flash1", "sdpa", "sdpa_efficient")
                ]
                assert len({memory_key(lay) for lay in lays}) == 1
                totals = {worst_stage_memory(S13, lay, Workload(seq, gbs))[1]["total"] for lay in lays}
                assert len(totals) == 1, (engine, seq, ck, totals)
    assert memory_key(PlannerLayout(2, 2, 16, 1, attention="naive")) != memory_key(
        PlannerLayout(2, 2, 16, 1, attention="fused_softmax")
    )


# ---------------------------------------------------------------- --export


def test_export_deepspeed_cli(capsys):
    code, out, err = run(capsys, *PLAN_13B, "--export", "deepspeed")
    assert code == 0
    cfg = json.loads(out)
    mb, gbs = cfg["train_micro_batch_size_per_gpu"], cfg["train_batch_size"]
    assert gbs == 2048 and cfg["bf16"]["enabled"] is True and cfg["zero_optimization"]["stage"] == 1
    dp = int(err.split(" dp ")[1].split()[0])
    assert cfg["gradient_accumulation_steps"] * mb * dp == gbs
    assert f"micro-batch {mb} " in err


def test_export_deepspeed_layout_fields():
    wl = Workload(2048, 512)
    cfg = json.loads(export_deepspeed(S13, PlannerLayout(4, 1, 16, 2, activation_checkpointing="full"), wl)[0])
    assert cfg["tensor_parallel"] == {"autotp_size": 4}
    assert cfg["gradient_accumulation_steps"] == 512 // (16 * 2) and "pipeline" not in cfg
    assert "activation_checkpointing" in cfg
    cfg = json.loads(export_deepspeed(S13, PlannerLayout(1, 4, 16, 1, activation_checkpointing="full"), wl)[0])
    assert cfg["pipeline"]["stages"] == 4 and cfg["pipeline"]["activation_checkpoint_interval"] == 1
    assert "tensor_parallel" not in cfg
    assert exportable(PlannerLayout(2, 2, 16, 1), "deepspeed")  # AutoTP with the pipeline engine: no
    assert exportable(PlannerLayout(2, 1, 32, 1, sequence_parallel=True), "deepspeed")
    assert not exportable(PlannerLayout(2, 1, 32, 1), "deepspeed")


def test_export_megatron_cli(capsys):
    code, out, err = run(capsys, *PLAN_13B, "--export", "megatron")
    assert code == 0
    a = megatron_parser().parse_args(shlex.split(out))
    assert (a.global_batch_size, a.seq_length, a.num_layers, a.hidden_size, a.ffn_hidden_size) == (
        2048,
        2048,
        40,
        5120,
        13824,
    )
    assert a.bf16 and a.swiglu and a.untie_embeddings_and_output_weights and a.normalization == "RMSNorm"
    assert f"tp {a.tensor_model_parallel_size} pp {a.pipeline_model_parallel_size} " in err
    assert f"micro-batch {a.micro_batch_size} " in err


def test_export_megatron_layout_fields():
    wl = Workload(4096, 1024)
    lay = PlannerLayout(
        4,
        4,
        8,
        2,
        activation_checkpointing="full",
        sequence_parallel=True,
        attention="flash2",
        pipeline_schedule="interleaved",
        virtual_stages=2,
    )
    a = megatron_parser().parse_args(shlex.split(export_megatron(S13, lay, wl)[0]))
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.micro_batch_size) == (4, 4, 2)
    assert a.sequence_parallel and a.attention_backend == "flash" and a.use_distributed_optimizer
    assert (a.recompute_granularity, a.recompute_method, a.recompute_num_layers) == ("full", "uniform", 1)
    assert a.num_virtual_stages_per_pipeline_rank == 2
    a = megatron_parser().parse_args(
        shlex.split(
            export_megatron(
                PRESETS["llama2-70b"],
                PlannerLayout(8, 1, 8, 1, activation_checkpointing="selective", attention="naive"),
                wl,
            )[0]
        )
    )
    assert a.recompute_granularity == "selective" and a.attention_backend == "local" and not a.sequence_parallel
    assert a.group_query_attention and a.num_query_groups == PRESETS["llama2-70b"].kv_heads
    assert a.context_parallel_size is None and a.cp_comm_type is None  # no cp: Megatron-LM's default 1


@pytest.mark.parametrize("impl, comm", [("ring", "p2p"), ("allgather", "all_gather"), ("ulysses", "a2a")])
def test_export_megatron_carries_cp(impl, comm):
    lay = PlannerLayout(2, 1, 4, 1, sequence_parallel=True, cp=4, cp_impl=impl)
    text, notes = export_megatron(PRESETS["llama3-8b"], lay, Workload(65536, 32))
    a = megatron_parser().parse_args(shlex.split(text))
    assert (a.tensor_model_parallel_size, a.context_parallel_size, a.cp_comm_type) == (2, 4, [comm])
    assert any("x cp)" in n for n in notes) and any("Transformer Engine" in n for n in notes)


def test_export_megatron_cli_of_a_cp_plan(capsys):
    code, out, err = run(
        capsys,
        *(
            "plan --model llama3-8b --seq-len 65536 --global-batch-size 32 --gpus 16 --hardware h100-sxm "
            "--max-positions 65536 --cp 4 --attention flash2 --export megatron"
        ).split(),
    )
    assert code == 0
    a = megatron_parser().parse_args(shlex.split(out))  # strict: an unknown flag fails
    assert a.context_parallel_size == 4 and a.cp_comm_type[0] in ("p2p", "all_gather", "a2a")
    assert a.transformer_impl == "transformer_engine" and a.attention_backend != "local"  # cp runs in TE
    assert a.seq_length == 65536 and "cp 4 " in err


def test_export_deepspeed_carries_ulysses_only():
    wl = Workload(65536, 32)
    cfg = json.loads(export_deepspeed(S13, PlannerLayout(1, 1, 4, 1, cp=4, cp_impl="ulysses"), wl)[0])
    assert cfg["sequence_parallel_size"] == 4 and cfg["train_batch_size"] == 32
    assert cfg["gradient_accumulation_steps"] == 32 // 4
    assert "sequence_parallel_size" not in json.loads(export_deepspeed(S13, PlannerLayout(1, 1, 16, 1), wl)[0])
    assert "no ring" in exportable(PlannerLayout(1, 1, 4, 1, cp=4), "deepspeed")
    assert exportable(PlannerLayout(1, 2, 2, 1, cp=4, cp_impl="ulysses"), "deepspeed")  # not with its pipeline


def test_export_refuses_when_nothing_fits(capsys):
    code, _, err = run(
        capsys, *"plan --model paper-65b --seq-len 2048 --global-batch-size 64 --gpus 1 --export megatron".split()
    )
    assert code == 2 and "error: --export:" in err


# ---------------------------------------------------------------- --emit-sweep

TINY = [*"plan --model tiny --seq-len 64 --global-batch-size 8 --gpus 2 --hardware cpu --rmsnorm torch".split()]


def test_emitted_sweep_is_a_sweep_this_harness_runs(tmp_path, capsys, monkeypatch):
    out = tmp_path / "top.yaml"
    code, _, _ = run(capsys, *TINY, "--top", "4", "--emit-sweep", str(out))
    assert code == 0
    raw = yaml.safe_load(out.read_text())
    assert raw["gpus"] == 2 and raw["workload"]["precision"] == "fp32" and raw["workload"]["device"] == "cpu"
    assert len(raw["points"]) == 4
    assert all("predicted" not in p for p in raw["points"])  # the prediction is a comment, not a field
    assert out.read_text().count("# predicted") == 4
    monkeypatch.chdir(tmp_path)
    code, text, _ = run(capsys, "sweep", str(out), "--dry-run")
    assert code == 0 and "4 points, 0 dropped" in text


def test_emitted_sweep_names_only_kernels_the_harness_runs(tmp_path, capsys):
    out = tmp_path / "gpu.yaml"
    code, _, _ = run(
        capsys, *PLAN_13B, "--attention", "flash1,fused_softmax,flash2", "--top", "6", "--emit-sweep", str(out)
    )
    assert code == 0
    raw = yaml.safe_load(out.read_text())
    from harness.sweep.expand import expand
    from harness.sweep.spec import parse_sweep

    assert raw["gpus"] == 64 and raw["nodes"] == 8 and raw["workload"]["precision"] == "bf16"
    assert {p["attention"] for p in raw["points"]} == {"flash2"}
    assert all(p["engine"] == "own" for p in raw["points"])
    points, drops = expand(parse_sweep(raw))
    assert len(points) == len(raw["points"]) and not drops


@pytest.mark.slow  # starts 2 processes that train for 2 steps
def test_emitted_sweep_runs_one_tiny_point(tmp_path):
    out = tmp_path / "one.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "harness.cli", *TINY, "--attention", "sdpa", "--top", "1", "--emit-sweep", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "sweep",
            str(out),
            "--set",
            "workload.steps=2",
            "--set",
            "workload.warmup_steps=1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    with sqlite3.connect(tmp_path / "results.sqlite") as db:
        statuses = [row[0] for row in db.execute("SELECT status FROM runs")]
    assert statuses == ["ok"]


# ---------------------------------------------------------------- the plan path imports no torch


@pytest.mark.slow  # a fresh Python process
def test_plan_imports_no_torch():
    """The plan command, run to its end in a fresh interpreter, never imports torch, transformers or
    DeepSpeed (importing torch alone takes longer than the whole plan should)."""
    code = (
        "from harness.cli import main\n"
        "import harness.commands.plan, harness.planner.output, harness.planner.predict\n"
        "assert main(['plan', '--model', 'paper-13b', '--seq-len', '2048', '--global-batch-size', '2048',\n"
        "             '--gpus', '64', '--top', '3', '--export', 'megatron']) == 0\n"
        "assert main(['plan', '--model', 'paper-13b', '--seq-len', '2048', '--global-batch-size', '2048',\n"
        "             '--gpus', '64', '--top', '3']) == 0\n"
    )
    heavy = heavy_imports_after(code)
    assert not heavy, heavy[:5]
