"""Spec input that used to run, crash, run forever or answer in megabytes:
every spec file read strictly and within bounds, every number within its range, no key ignored,
and every refusal one short line `error: <field>: <reason>` with exit code 2. No processes: the
parsers are called directly, the commands through harness.cli.main in-process."""

from __future__ import annotations

import dataclasses
import json
import os
import typing

import pytest
import yaml

from harness.cli import main as cli_main
from harness.compare.spec import CompareInput, parse_compare_spec
from harness.errors import SpecError
from harness.files.yaml_reader import MAX_BYTES, MAX_VALUES
from harness.spec import Data, Layout, Optimizer, Workload, parse_spec
from harness.sweep.expand import expand
from harness.sweep.slurm import write_slurm
from harness.sweep.spec import Slurm, SweepSpec, parse_sweep

TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
TINY_YAML = "{model: tiny, seq_len: 32, global_batch_size: 4, steps: 2, warmup_steps: 1, device: cpu}"
SWEEP = {"name": "s", "gpus": 1, "workload": TINY, "grid": {"workload.seed": [1, 2]}}
COMPARE = {"name": "c", "workload": TINY, "runs": [{"engine": "own", "dp": 2}]}


def refusal(parse, raw) -> SpecError:
    with pytest.raises(SpecError) as e:
        parse(raw)
    return e.value


def bomb(levels: int, key: str = "name") -> str:
    """A spec whose `key` holds 10**levels values through nested aliases, in a few hundred bytes."""
    lines = ["a0: &a0 [" + ", ".join(["x"] * 10) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\n{key}: *a{levels - 1}\n"


# ---------------------------------------------------------------- every spec file, read strictly


@pytest.mark.parametrize(
    "argv, text",
    [
        (["train", "f.yaml"], f"workload: {TINY_YAML}\nlayout: {{engine: single}}\nworkload: {{seq_len: 64}}\n"),
        (["memory", "f.yaml"], "workload: {model: tiny, seq_len: 32, seq_len: 64}\n"),
        (["compare", "f.yaml"], f"name: c\nworkload: {TINY_YAML}\nruns: [{{engine: own}}]\nname: d\n"),
        (["sweep", "f.yaml", "--dry-run"], f"gpus: 1\nworkload: {TINY_YAML}\ngrid: {{tp: [1], tp: [2]}}\n"),
    ],
    ids=["train", "memory", "compare", "sweep"],
)
def test_a_key_given_twice_is_refused_in_every_spec_file(no_launch, one_line_error, argv, text):
    (no_launch / "f.yaml").write_text(text)
    line = one_line_error(cli_main(argv))
    assert line.startswith("error: f.yaml: not valid YAML: line ") and "is given twice (first on line" in line, line


def test_a_key_given_twice_in_a_set_value_is_refused(no_launch, one_line_error):
    (no_launch / "t.yaml").write_text(f"workload: {TINY_YAML}\n")
    line = one_line_error(cli_main(["train", "t.yaml", "--set", "workload={seq_len: 8, seq_len: 16}"]))
    assert line.startswith("error: --set: workload: not valid YAML: ") and "'seq_len' is given twice" in line


def test_merge_keys_may_still_be_overridden():
    from harness.files.yaml_reader import load_yaml

    assert load_yaml("base: &b {tp: 1, pp: 2}\nrun: {<<: *b, tp: 4}\n", "f")["run"] == {"tp": 4, "pp": 2}


@pytest.mark.parametrize(
    "text, reason",
    [
        (bomb(9), f"aliases expand it to more than {MAX_VALUES} values"),  # 82 s, then MemoryError
        (bomb(6), f"aliases expand it to more than {MAX_VALUES} values"),  # an 8 MB error line
        ("name: &a [*a]\n", "an alias refers to the value that holds it"),
        ("gpus: " + "[" * 500 + "]" * 500 + "\n", "nested more than 100 levels deep"),
    ],
    ids=["1e9-values", "1e6-values", "recursive", "deep"],
)
def test_aliases_and_nesting_are_bounded(no_launch, one_line_error, text, reason):
    (no_launch / "s.yaml").write_text(text)
    line = one_line_error(cli_main(["sweep", "s.yaml", "--dry-run"]))
    assert line.startswith("error: s.yaml: not valid YAML: line ") and reason in line, line


def test_a_spec_file_beyond_the_size_limit_is_refused_unread(no_launch, one_line_error):
    (no_launch / "t.yaml").write_text(f"workload: {TINY_YAML}\nname: '{'x' * MAX_BYTES}'\n")
    line = one_line_error(cli_main(["train", "t.yaml"]))
    assert line == f"error: t.yaml: is {os.path.getsize('t.yaml'):,} bytes; a spec file is at most {MAX_BYTES:,}"


# ---------------------------------------------------------------- a message quotes a value cut short


def test_an_error_quotes_a_huge_value_cut_short(no_launch, one_line_error):
    many = "[" + ", ".join(["1"] * 5_000) + "]"  # within MAX_VALUES: refused by the field, not the reader
    (no_launch / "t.yaml").write_text(f"workload: {{model: {many}}}\n")
    line = one_line_error(cli_main(["train", "t.yaml"]))
    assert line.startswith("error: workload.model: must be a string, got [1, 1, ") and len(line) < 200, line[:300]
    (no_launch / "t.yaml").write_text(f"workload: {{seq_len: '{'9' * 50_000}x'}}\n")
    line = one_line_error(cli_main(["train", "t.yaml"]))
    assert line.startswith("error: workload.seq_len: must be an integer, got '999") and len(line) < 200, line[:300]


def test_every_spec_error_is_cut_to_a_line_a_terminal_shows():
    e = SpecError("f" * 10**6, "got " + repr(list(range(10**6))))
    assert len(str(e)) < 1300 and "characters cut" in e.field and "characters cut" in e.reason
    assert str(e.reason).startswith("got [0, 1, 2") and str(e.reason).endswith("999998, 999999]")


# ---------------------------------------------------------------- no key is ignored


@pytest.mark.parametrize(
    "data, field",
    [
        ({"path": "d.bin"}, "workload.data.path"),
        ({"dtype": "uint32"}, "workload.data.dtype"),
        ({"kind": "synthetic", "path": "d.bin"}, "workload.data.path"),
    ],
)
def test_a_token_file_key_without_kind_file_is_refused(data, field):
    e = refusal(parse_spec, {"workload": {**TINY, "data": data}})
    assert e.field == field and e.reason.startswith("applies only with kind: file, and kind is synthetic"), str(e)
    assert e.reason.endswith("set kind: file")


@pytest.mark.parametrize(
    "key, rule, field",
    [
        ("exclude", {"workload.sed": 1}, "sweep.exclude[0].workload.sed"),
        ("exclude", {"tp": 1, "mirco_batch_size": 1}, "sweep.exclude[0].mirco_batch_size"),
        ("include", {"layout.tpp": [1, 2]}, "sweep.include[0].layout.tpp"),
    ],
)
def test_a_filter_key_that_names_no_field_is_refused(key, rule, field):
    e = refusal(parse_sweep, {**SWEEP, key: [rule]})
    assert e.field == field, str(e)


def test_a_filter_on_a_known_field_still_filters():
    points, drops = expand(parse_sweep({**SWEEP, "exclude": [{"workload.seed": 2}], "include": [{"layout.tp": 1}]}))
    assert [p.coords for p in points] == [{"workload.seed": 1}] and "excluded by exclude[0]" in drops[0].reason


def test_a_dry_run_refuses_a_sweep_that_would_run_nothing(no_launch, one_line_error, capsys):
    (no_launch / "s.yaml").write_text(yaml.safe_dump({**SWEEP, "include": [{"workload.seed": 3}]}))
    line = one_line_error(cli_main(["sweep", "s.yaml", "--dry-run"]))
    assert line.startswith("error: sweep: all 2 points were dropped (first: not matched by any include filter)")


# ---------------------------------------------------------------- every number within its range


def _numeric(cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    numeric = (int, float, int | None, float | None, float | None, tuple[float, float])
    return [f.name for f in dataclasses.fields(cls) if f.init and hints[f.name] in numeric]


@pytest.mark.parametrize(
    "cls", [Workload, Optimizer, Layout, Data, CompareInput, SweepSpec, Slurm], ids=lambda c: c.__name__
)
def test_every_numeric_field_declares_its_check(cls):
    assert [n for n in _numeric(cls) if "check" not in cls.__dataclass_fields__[n].metadata] == []


RANGES = [  # (raw spec as YAML reads it, the field, the reason's start)
    ({"workload": {"seed": "1e30"}}, "workload.seed", "must be at most 4,294,967,295, got '1e30'"),
    ({"workload": {"seed": -1}}, "workload.seed", "must not be negative"),
    ({"workload": {"steps": "1e30"}}, "workload.steps", "must be at most 100,000"),
    ({"workload": {"warmup_steps": 10**9}}, "workload.warmup_steps", "must be at most 100,000"),
    ({"workload": {"optimizer": {"weight_decay": -0.1}}}, "workload.optimizer.weight_decay", "must not be negative"),
    ({"workload": {"optimizer": {"lr": 0}}}, "workload.optimizer.lr", "must be positive"),
    ({"workload": {"optimizer": {"betas": [0.9, 1.5]}}}, "workload.optimizer.betas[1]", "must be in [0, 1)"),
    ({"workload": {"grad_clip": -1}}, "workload.grad_clip", "must not be negative (0 disables clipping)"),
    (
        {"workload": {"model_overrides": {"hidden": 36, "heads": 4}}},
        "workload.model_overrides",
        "hidden 36 / heads 4 = 9 channels a head, an odd number",
    ),
    ({"layout": {"zero_stage": 7}}, "layout.zero_stage", "must be 0, 1, 2 or 3"),
    ({"layout": {"dp_bucket_mb": 0}}, "layout.dp_bucket_mb", "must be positive"),
    ({"layout": {"tp": 2**21}}, "layout.tp", "must be at most 1,048,576"),
    ({"layout": {"virtual_stages": 0}}, "layout.virtual_stages", "must be positive"),
]


@pytest.mark.parametrize("raw, field, reason", RANGES, ids=[c[1] + ":" + str(c[0])[-14:] for c in RANGES])
def test_a_number_out_of_its_range_is_refused_naming_its_field(raw, field, reason):
    raw = {"workload": {**TINY, **raw.get("workload", {})}, "layout": raw.get("layout", {})}
    e = refusal(parse_spec, raw)
    assert e.field == field and e.reason.startswith(reason), str(e)


@pytest.mark.parametrize(
    "text, line",
    [
        ("seed: 1e30", "error: workload.seed: must be at most 4,294,967,295, got '1e30'"),
        ("steps: 1e30", "error: workload.steps: must be at most 100,000, got '1e30'"),
        ("optimizer: {weight_decay: -0.1}", "error: workload.optimizer.weight_decay: must not be negative, got -0.1"),
    ],
)
def test_a_number_out_of_range_stops_train_before_the_launch(no_launch, one_line_error, text, line):
    (no_launch / "t.yaml").write_text(f"workload: {{model: tiny, device: cpu, {text}}}\n")
    assert one_line_error(cli_main(["train", "t.yaml"])) == line


def test_the_compare_and_sweep_counts_have_ranges():
    assert refusal(parse_compare_spec, {**COMPARE, "nproc": 2**21}).field == "nproc"
    assert refusal(parse_sweep, {**SWEEP, "gpus": 2**21}).field == "sweep.gpus"
    assert refusal(parse_sweep, {**SWEEP, "nodes": 2**21}).field == "sweep.nodes"


@pytest.mark.parametrize(
    "raw, field",
    [
        ({**COMPARE, "tolerance": float("nan")}, "tolerance"),
        ({**COMPARE, "tolerance": float("inf")}, "tolerance"),
        ({**COMPARE, "timeout_s": float("nan")}, "timeout_s"),
        ({**COMPARE, "workload": {**TINY, "grad_clip": float("nan")}}, "workload.grad_clip"),
        (
            {**COMPARE, "workload": {**TINY, "model_overrides": {"rope_theta": float("inf")}}},
            "workload.model_overrides.rope_theta",
        ),
    ],
)
def test_a_non_finite_number_is_refused(raw, field):
    e = refusal(parse_compare_spec, raw)
    assert e.field == field and ("finite" in e.reason or "positive number" in e.reason), str(e)


def test_a_huge_global_batch_is_named_as_itself():
    e = refusal(parse_spec, {"workload": {**TINY, "global_batch_size": "1e30"}})
    assert e.field == "workload.global_batch_size", str(e)


def test_a_sequence_beyond_the_models_positions_is_refused_unless_raised():
    e = refusal(parse_spec, {"workload": {**TINY, "seq_len": 4096}})
    assert str(e) == (
        "workload.seq_len: 4096 is beyond the 2048 positions of tiny (its max_position_embeddings); "
        "workload.model_overrides.max_positions raises it"
    )
    parse_spec({"workload": {**TINY, "seq_len": 4096, "model_overrides": {"max_positions": 4096}}})


# ---------------------------------------------------------------- Slurm's formats


@pytest.mark.parametrize("time", ["30", "30:00", "00:30:00", "1-12", "1-12:30", "1-12:30:00", "UNLIMITED"])
def test_a_slurm_time_in_each_of_its_formats_is_written(tmp_path, time):
    sweep = parse_sweep({**SWEEP, "slurm": {"time": time, "partition": "gpu,gpu-long", "constraint": "a100&ib"}})
    script = open(write_slurm(sweep, expand(sweep)[0], str(tmp_path), timeout_s=60)).read()
    assert f"#SBATCH --time={time}\n" in script and "#SBATCH --partition=gpu,gpu-long\n" in script


@pytest.mark.parametrize(
    "slurm, field, reason",
    [
        ({"time": "half an hour"}, "sweep.slurm.time", "'half an hour' is not a Slurm time: minutes, MM:SS"),
        ({"time": "1:2:3:4"}, "sweep.slurm.time", "is not a Slurm time"),
        ({"time": 1800}, "sweep.slurm.time", "give it quoted"),  # `time: 00:30:00` unquoted: YAML 1.1's 1800
        ({"partition": "gpu; rm -rf ~"}, "sweep.slurm.partition", "not ' ;~'"),
        ({"account": "a b"}, "sweep.slurm.account", "not ' '"),
        ({"qos": "$(id)"}, "sweep.slurm.qos", "not '$()'"),
        ({"constraint": "a100`x`"}, "sweep.slurm.constraint", "not '`'"),
        ({"extra": ["mem=0"]}, "sweep.slurm.extra[0]", "is not an sbatch option"),
        ({"extra": ["--mem=0\n#SBATCH --x"]}, "sweep.slurm.extra[0]", "one line"),
    ],
)
def test_a_slurm_value_that_sbatch_would_misread_is_refused(slurm, field, reason):
    e = refusal(parse_sweep, {**SWEEP, "slurm": slurm})
    assert e.field == field and reason in e.reason, str(e)


# ---------------------------------------------------------------- the planner's flags, the spec's ranges


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--seq-len", "1000000000000"],
            "error: --seq-len: 1e+12 is beyond the 2048 positions of tiny (its max_position_embeddings)",
        ),
        (["--global-batch-size", str(10**16)], "error: --global-batch-size: 1e+16 sequences of 128 tokens need "),
        (["--gpus", str(2**21), "--global-batch-size", str(2**21)], "error: --gpus: must be at most 1,048,576"),
    ],
)
def test_the_planners_flags_have_the_ranges_of_a_spec(no_launch, one_line_error, flags, line):
    argv = [*"plan --model tiny --seq-len 128 --global-batch-size 8 --gpus 8 --hardware cpu".split()]
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        argv[argv.index(flag) + 1] = value
    assert one_line_error(cli_main(argv)).startswith(line)


def test_a_non_finite_number_in_a_config_json_is_refused(tmp_path):
    config = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 176,
        "vocab_size": 256,
        "max_position_embeddings": 2048,
        "rope_theta": float("nan"),
    }
    (tmp_path / "config.json").write_text(json.dumps(config))  # json writes NaN, and reads it back
    e = refusal(parse_spec, {"workload": {**TINY, "model": str(tmp_path / "config.json")}})
    assert e.field == "workload.model" and e.reason.startswith("rope_theta must be a positive number, got nan"), str(e)
