"""A mistake in a spec is one line `error: <field>: <reason>` and exit code 2: checked by parse_spec,
through the real CLI (slow tier), and for sweep names in-process (harness.cli.main, as
tests/test_cli_errors.py). Numbers are read as users write them.

A command's arguments and every command's bad input are tests/test_cli_errors.py; token data,
tests/test_data_errors.py."""

import pytest
import yaml

from harness.cli import main as cli_main
from harness.errors import SpecError
from harness.spec import parse_spec

TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
SWEEP = {"gpus": 1, "workload": TINY, "grid": {"workload.seed": [1, 2]}}

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
    (
        {"workload": {"global_batch_size": 6}, "layout": {"engine": "own", "dp": 2, "micro_batch_size": 2}},
        "workload.global_batch_size",
        "not divisible by dp x micro_batch_size",
    ),
    ({"layout": {"engine": "own", "tp": 3}}, "layout.tp", "attention heads are not divisible"),
    (
        {"workload": {"model": "tiny", "model_overrides": {"kv_heads": 1}}, "layout": {"engine": "own", "tp": 2}},
        "layout.tp",
        "KV heads are not divisible",
    ),
    ({"layout": {"engine": "own", "pp": 4}}, "layout.pp", "layers cannot fill 4 pipeline stages"),
    ({"layout": {"attention": "magic"}}, "layout.attention", "is not one of"),
    ({"workload": {"precision": "fp16"}}, "workload.precision", "is not one of"),
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
    assert r.stderr.strip() == "error: layout: world size 1 != tp x cp x pp x dp = 1 x 1 x 1 x 2"


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


def test_numbers_as_users_write_them():
    """YAML 1.1 reads `1e-4` and `1e3` as strings: numeric strings are numbers in number fields."""
    spec = parse_spec(
        yaml.safe_load("workload: {optimizer: {lr: 1e-4, eps: 1e-8}, seq_len: 1e2, model_overrides: {layers: '4'}}")
    )
    assert spec.workload.optimizer.lr == 1e-4 and spec.workload.optimizer.eps == 1e-8
    assert spec.workload.seq_len == 100 and isinstance(spec.workload.seq_len, int)
    assert spec.workload.model_overrides == {"layers": 4}


# ---------------------------------------------------------------- sweep names


def _write_sweep(root, name: str, raw: dict) -> None:
    (root / name).write_text(yaml.safe_dump(raw))


@pytest.mark.parametrize(
    "name, bad",
    [("a b", "' '"), ("x|y", "'|'"), ("two\nlines", "'\\n'"), ("a:b", "':'"), ("*bold*", "'*'")],
    ids=["space", "pipe", "newline", "colon", "markdown"],
)
def test_sweep_name_is_a_plain_folder_and_job_name(no_launch, one_line_error, name, bad):
    _write_sweep(no_launch, "s.yaml", {**SWEEP, "name": name})
    line = one_line_error(cli_main(["sweep", "s.yaml", "--dry-run"]))
    assert line.startswith("error: sweep.name: ") and "letters, digits, '-', '_' and '.' only" in line, line
    assert f"not {bad}" in line, line


def test_sweep_name_from_the_file_name_says_how_to_set_one(no_launch, one_line_error):
    _write_sweep(no_launch, "my sweep.yaml", SWEEP)
    line = one_line_error(cli_main(["sweep", "my sweep.yaml", "--dry-run"]))
    assert line.startswith("error: sweep.name: 'my sweep': ") and "set `name:` in the spec" in line


def test_a_plain_sweep_name_passes(no_launch, capsys):
    _write_sweep(no_launch, "s.yaml", {**SWEEP, "name": "study-13b_seq2048.v2"})
    assert cli_main(["sweep", "s.yaml", "--dry-run"]) == 0
