"""The CLI follows the field's conventions: python -m, --version, help with examples, internal flags
hidden, --set overrides, progress with elapsed time and ETA."""

import os
import subprocess
import sys

import pytest

from harness import cli
from harness.progress import Progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = list(cli.COMMANDS)


@pytest.mark.slow
def test_python_dash_m_harness_and_version():
    r = subprocess.run(
        [sys.executable, "-m", "harness", "--version"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"harness {cli.version()}"
    assert cli.version().count(".") >= 1


def test_version_in_process(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("harness ")


@pytest.mark.parametrize("command", COMMANDS + ["results export", "data prepare"])
def test_every_subcommand_has_a_description_and_an_example(command, capsys):
    with pytest.raises(SystemExit):
        cli.main(command.split() + ["--help"])
    out = capsys.readouterr().out
    usage, _, rest = out.partition("\n\n")
    assert rest.strip() and not rest.startswith(("positional arguments", "options")), out  # a description
    examples = out.split("examples:\n", 1)
    assert len(examples) == 2, out
    assert f"harness {command}" in examples[1], out


def test_internal_flags_hidden_but_accepted(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--run-id", "--sweep", "--point-key"):
        assert flag not in out
    parser, _ = cli.build_parser(["train"])
    args = parser.parse_args(["train", "--run-id", "r1", "--sweep", "s", "--point-key", "k"])
    assert (args.run_id, args.sweep, args.point_key) == ("r1", "s", "k")


def _capture_parse(monkeypatch, module, name):
    """Run `harness ...` up to the parsed spec: the parser's result is captured, nothing runs."""
    seen = {}

    class Parsed(Exception):
        pass

    real = getattr(module, name)

    def fake(raw, *a, **kw):
        seen["spec"] = real(raw, *a, **kw)
        raise Parsed

    monkeypatch.setattr(module, name, fake)
    return seen, Parsed


def test_set_on_train(monkeypatch):
    import harness.spec as spec_mod

    seen, Parsed = _capture_parse(monkeypatch, spec_mod, "parse_spec")
    with pytest.raises(Parsed):
        cli.main(
            [
                "train",
                os.path.join(REPO, "examples", "tiny.yaml"),
                *"--set workload.seq_len=256 --set layout.attention=naive --set workload.steps=3".split(),
            ]
        )
    s = seen["spec"]
    assert (s.workload.seq_len, s.layout.attention, s.workload.steps) == (256, "naive", 3)


def test_set_on_train_default_spec(monkeypatch):
    import harness.spec as spec_mod

    seen, Parsed = _capture_parse(monkeypatch, spec_mod, "parse_spec")
    with pytest.raises(Parsed):
        cli.main(["train", "--set", "workload.seq_len=32"])
    assert seen["spec"].workload.seq_len == 32


def test_set_on_compare(monkeypatch):
    import harness.compare.spec as cspec

    seen, Parsed = _capture_parse(monkeypatch, cspec, "parse_compare_spec")
    with pytest.raises(Parsed):
        cli.main(["compare", "--set", "workload.steps=3", "--set", "parity_steps=2", "--set", "runs.0.label=first"])
    cs = seen["spec"]
    assert cs.parity_steps == 2
    assert all(r.spec.workload.steps == 3 for r in cs.runs)
    assert "first" in [r.label for r in cs.runs]
    from harness.compare.spec import DEFAULT

    assert DEFAULT["workload"]["steps"] == 8  # the built-in default is not changed by an override


def test_set_on_sweep(capsys):
    path = os.path.join(REPO, "sweeps", "cpu-demo.yaml")
    assert (
        cli.main(
            [
                "sweep",
                path,
                *(
                    "--dry-run --store /nonexistent-dir/x.sqlite --set grid.attention=[naive] --set "
                    "grid.micro_batch_size=[1]"
                ).split(),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("9 points, 3 dropped"), out  # 33 points without the overrides
    grid = out.splitlines()[1:4]
    assert all("naive/" in ln and " mb1 " in ln for ln in grid), grid


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "--set", "workload"], "error: --set: 'workload': give KEY.PATH=VALUE"),
        (["train", "--set", "workload.sq_len=256"], "error: --set: workload.sq_len=256: unknown key"),
        (["train", "--set", "layout.attention=bogus"], "error: --set: layout.attention=bogus: 'bogus' is not one of"),
        (["train", "--set", "workload.seq_len=[1"], "error: --set: workload.seq_len: not valid YAML"),
        (["compare", "--set", "workload.stepz=3"], "error: --set: workload.stepz=3: unknown key"),
        (["compare", "--set", "runs.99.engine=own"], "error: --set: runs.99.engine: runs is a list of"),
        (["compare", "--set", "nproc.x=1"], "error: --set: nproc.x: nproc is 2, not a mapping"),
        (
            ["sweep", os.path.join(REPO, "sweeps", "cpu-demo.yaml"), "--dry-run", "--set", "bogus=1"],
            "error: --set: bogus=1: unknown key",
        ),
    ],
)
def test_bad_set_is_one_line_exit_2(argv, expected, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected), err
    assert err.count("\n") == 1


def test_progress_shows_elapsed_and_eta(monkeypatch, capsys):
    clock = iter([100.0, 110.0])  # created at 100 s; step 2 of 10 ends at 110 s
    monkeypatch.setattr("harness.run.time.monotonic", lambda: next(clock))
    bar = Progress(True, 10)
    bar.tty = False
    bar.update(1, 5.0, 1000, 2.5, None)
    line = capsys.readouterr().err.strip()
    assert line.startswith("step 2/10 | 200 tok/s | loss 2.5000")
    assert "0:10 elapsed" in line and "ETA 0:40" in line  # 5 s a step so far, 8 steps left
    assert Progress.clock(3725) == "1:02:05"
