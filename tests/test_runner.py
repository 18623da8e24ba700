"""The single-device runner end to end: summary, record, export, accumulation, data files, faults."""

import json
import os

import pytest
import torch
import yaml

from harness.data.source import token_source
from harness.run import run
from harness.runtime import RunContext
from harness.spec import parse_spec
from harness.store import ResultsStore
from harness.testing.launches import shared_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = RunContext(0, 1, 0, torch.device("cpu"), None)


def tiny(tmp_path, **layout):
    workload = layout.pop("workload", {})
    return parse_spec(
        {
            "workload": {"seq_len": 32, "global_batch_size": 4, "steps": 3, "warmup_steps": 1, **workload},
            "layout": layout,
            "store": str(tmp_path / "r.sqlite"),
        }
    )


def test_example_runs_and_exports(tmp_path, cli):
    r = cli("train", os.path.join(REPO, "examples", "tiny.yaml"), "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ": ok" in r.stdout and "step time: median" in r.stdout and "tokens/s" in r.stdout
    out = cli("results", "export", "--format", "jsonl", cwd=tmp_path)
    rec = json.loads(out.stdout.splitlines()[-1])
    assert rec["status"] == "ok" and rec["schema_version"] == 1
    m = rec["metrics"]
    assert m["step_time_s"]["n"] == 20 and len(m["losses"]) == 23
    assert m["step_time_s"]["ci95_low"] <= m["step_time_s"]["median"] <= m["step_time_s"]["ci95_high"]
    assert m["memory_kind"] == "peak_rss" and m["peak_memory_bytes"] > 0
    assert m["mfu"] is None  # no datasheet peak for a CPU: not invented
    assert m["mfu_vs_measured_matmul"]["palm"] > 0
    assert rec["fingerprint"]["torch"] == torch.__version__
    csv = cli("results", "export", "--format", "csv", cwd=tmp_path).stdout.splitlines()
    assert csv[0].startswith("run_id,") and len(csv) == 2


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    losses = []
    for mbs in (1, 2, 4):
        rec = run(tiny(tmp_path, micro_batch_size=mbs), CPU, progress=False)
        losses.append(rec["metrics"]["losses"])
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-5)


def test_bf16_run(tmp_path):
    rec = run(tiny(tmp_path, workload={"precision": "bf16"}), CPU, progress=False)
    assert rec["status"] == "ok" and all(loss == loss for loss in rec["metrics"]["losses"])


def test_token_file_data(tmp_path, cli):
    text = tmp_path / "corpus.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"document {i} " * 20}) for i in range(40)))
    r = cli("data", "prepare", str(text), "--out", str(tmp_path / "c.bin"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    spec = tiny(tmp_path, workload={"data": {"kind": "file", "path": str(tmp_path / "c.bin")}})
    batch = token_source(spec.workload, 256).global_batch_at(0)
    raw = (tmp_path / "c.bin").read_bytes()
    assert bytes(batch[0].tolist()) == raw[0:66:2]  # uint16 little-endian bytes of the first window
    assert run(spec, CPU, progress=False)["status"] == "ok"


def test_fault_hook_records_oom(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_FAULT", "oom:2")
    spec = tiny(tmp_path)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run(spec, CPU, run_id="abc", progress=False)
    rec = ResultsStore(spec.store).get("abc")
    assert rec["status"] == "oom" and "CUDA out of memory" in rec["error"]


def test_slurm_environment_is_adopted(monkeypatch):
    from harness import runtime

    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NODELIST": "gpu[003-004,007],cpu01",
    }
    monkeypatch.setattr(os, "environ", env)  # a private environment: nothing leaks to later tests
    runtime.adopt_slurm_env()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("5", "1", "8")
    assert os.environ["MASTER_ADDR"] == "gpu003"


def test_deepspeed_style_local_rank_argument_is_accepted(tmp_path, cli):
    path = tmp_path / "s.yaml"
    path.write_text(
        yaml.safe_dump({"workload": {"seq_len": 16, "global_batch_size": 2, "steps": 2, "warmup_steps": 0}})
    )
    r = cli("train", "--local_rank=0", str(path), "--no-progress", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_every_engine_declares_what_the_runner_asks_of_it():
    """The runner asks the contract (TrainingEngine), never guesses from what a step returned: every engine
    class has each of its members, and only the own engine times its own communication."""
    from harness.engine.engine import Engine3D
    from harness.frameworks import TrainingEngine
    from harness.frameworks.deepspeed.engine import DeepSpeedEngine
    from harness.frameworks.deepspeed.pipe import DeepSpeedPipelineEngine
    from harness.frameworks.fsdp.engine import FSDPEngine
    from harness.frameworks.megatron.engine import MegatronEngine
    from harness.frameworks.single.engine import SingleDeviceEngine

    members = {n for n in vars(TrainingEngine) if not n.startswith("_")} | set(TrainingEngine.__annotations__)
    assert {"router_stats", "process_groups", "times_own_communication"} <= members
    engines = (Engine3D, SingleDeviceEngine, DeepSpeedEngine, DeepSpeedPipelineEngine, FSDPEngine, MegatronEngine)
    for cls in engines:
        assert all(hasattr(cls, m) for m in members), (cls, sorted(m for m in members if not hasattr(cls, m)))
    assert [cls for cls in engines if cls.times_own_communication] == [Engine3D]


def test_the_measured_matmul_peak_is_in_the_dtype_the_policy_computes_in():
    """fp8 runs' linears compute from bf16 parameters: their reference peak is bf16's (as the datasheet's)."""
    from harness.model.training import precision_policy

    dtypes = {
        p: precision_policy(parse_spec({"workload": {"precision": p}}).workload).peak_matmul_dtype
        for p in ("fp32", "bf16", "fp8")
    }
    assert dtypes == {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def _trainer_steps(ctx, layouts):
    from harness.run import Trainer

    out = []
    for lay in layouts:
        spec = parse_spec(
            {
                "workload": {
                    "model": "tiny",
                    "seq_len": 32,
                    "global_batch_size": 8,
                    "steps": 1,
                    "warmup_steps": 0,
                    "precision": "fp32",
                    "device": "cpu",
                },
                "layout": {"micro_batch_size": 2, **lay},
            }
        )
        trainer = Trainer(spec, ctx, spec.shape(), progress=False)
        trainer.step(0)
        out.append((trainer.activations_saved_bytes, trainer.engine.memory_census()))
    return out


TRAINER_LAYOUTS = [
    {"engine": "own", "tp": 2, "sequence_parallel": True},
    {"engine": "fsdp", "tp": 2},
    {"engine": "fsdp", "tp": 2, "sequence_parallel": True},
    {"engine": "fsdp", "pp": 2},
    {"engine": "deepspeed", "tp": 2, "zero_stage": 1},
]
trainer_steps = shared_launch("deepspeed-mp", 2, _trainer_steps, TRAINER_LAYOUTS)  # DeepSpeed tp2, last


@pytest.mark.slow
def test_parallel_layouts_of_every_engine_run_through_the_trainer(trainer_steps):
    """The runner's first step counts saved activations and takes the census: that must work on
    DTensor (TP/SP), pipelining stages and AutoTP shards, not only on plain tensors."""
    layouts = TRAINER_LAYOUTS
    for lay, (activations, census) in zip(layouts, trainer_steps, strict=True):
        assert activations and activations > 0, lay
        assert census and census["parameters"]["fp32"] > 0, lay


def test_the_matmul_microbenchmark_samples_as_long_as_the_environment_says_and_at_least_once(monkeypatch):
    """HARNESS_MATMUL_SECONDS sets how long the peak is sampled (this suite's conftest shortens it); a value
    that is not a positive finite number leaves the default; even a deadline passed already takes one sample."""
    from harness.measure import mfu

    for given, seconds in (("0.2", 0.2), ("0", 0.5), ("-1", 0.5), ("inf", 0.5), ("nan", 0.5), ("x", 0.5), ("", 0.5)):
        monkeypatch.setenv(mfu.MATMUL_SECONDS_ENV, given)
        assert mfu.matmul_seconds() == seconds, given
    assert mfu.measure_matmul_tflops(torch.device("cpu"), torch.float32, seconds=-1.0) > 0
