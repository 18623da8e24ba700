"""Every user mistake is one line `error: <field>: <reason>` and exit code 2, via the real CLI."""

import pytest
import yaml

from harness.errors import SpecError
from harness.spec import parse_spec

CASES = [
    ({"workload": {"seqlen": 128}}, "workload.seqlen", "unknown key"),
    ({"layout": {"bogus": 1}}, "layout.bogus", "unknown key"),
    ({"colour": "red"}, "colour", "unknown key"),
    ({"workload": {"seq_len": "long"}}, "workload.seq_len", "must be an integer"),
    ({"layout": {"sequence_parallel": "yes"}}, "layout.sequence_parallel", "true or false"),
    ({"workload": {"optimizer": {"lr": "fast"}}}, "workload.optimizer.lr", "must be a number"),
    ({"workload": {"seq_len": 0}}, "workload.seq_len", "must be positive"),
    ({"workload": {"global_batch_size": -4}}, "workload.global_batch_size", "must be positive"),
    ({"layout": {"micro_batch_size": 0}}, "layout.micro_batch_size", "must be positive"),
    ({"workload": {"model": "llama-7000b"}}, "workload.model", "unknown preset"),
    ({"workload": {"model": "/nonexistent/config.json"}}, "workload.model", "does not exist"),
    ({"workload": {"global_batch_size": 6}, "layout": {"engine": "own", "dp": 2, "micro_batch_size": 2}},
     "workload.global_batch_size", "not divisible by dp x micro_batch_size"),
    ({"layout": {"engine": "own", "tp": 3}}, "layout.tp", "attention heads are not divisible"),
    ({"workload": {"model": "tiny", "model_overrides": {"kv_heads": 1}}, "layout": {"engine": "own", "tp": 2}},
     "layout.tp", "KV heads are not divisible"),
    ({"layout": {"engine": "own", "pp": 4}}, "layout.pp", "layers cannot fill 4 pipeline stages"),
    ({"layout": {"attention": "magic"}}, "layout.attention", "is not one of"),
    ({"workload": {"precision": "fp8"}}, "workload.precision", "is not one of"),
    ({"layout": {"engine": "own", "sequence_parallel": True}}, "layout.sequence_parallel", "needs tp > 1"),
    ({"layout": {"engine": "deepspeed", "zero_stage": 4}}, "layout.zero_stage", "1, 2 or 3"),
]


@pytest.mark.parametrize("raw,field,reason", CASES, ids=[c[1] + ":" + c[2][:20] for c in CASES])
def test_invalid_spec_names_the_field(raw, field, reason):
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert e.value.field == field
    assert reason in e.value.reason


@pytest.mark.parametrize("raw,field,reason", CASES[::3] + CASES[11:15], ids=lambda c: str(c)[:30])
def test_invalid_spec_through_cli(tmp_path, cli, raw, field, reason):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    r = cli("train", str(path), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {field}: ") and reason in lines[0]
    assert "Traceback" not in r.stderr


def test_world_size_mismatch_through_cli(tmp_path, cli):
    path = tmp_path / "w.yaml"
    path.write_text(yaml.safe_dump({"layout": {"engine": "own", "dp": 2}, "workload": {"steps": 1}}))
    r = cli("train", str(path), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: layout: world size 1 != tp x pp x dp = 1 x 1 x 2"


def test_malformed_yaml_and_missing_file(tmp_path, cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload: [unclosed\n")
    r = cli("train", str(bad), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {bad}: not valid YAML")
    r = cli("train", str(tmp_path / "missing.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "error: spec: file" in r.stderr


def test_unavailable_kernel_is_an_error_before_the_run(tmp_path, cli):
    for kernel, field in (("flash2", "layout.attention"), ("sdpa_cudnn", "layout.attention")):
        path = tmp_path / "k.yaml"
        path.write_text(yaml.safe_dump({"layout": {"attention": kernel}, "workload": {"steps": 1}}))
        r = cli("train", str(path), cwd=tmp_path)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith(f"error: {field}: {kernel}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "results.sqlite").exists() or "ok" not in r.stdout
