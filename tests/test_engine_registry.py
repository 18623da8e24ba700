"""An engine is one package, its facts (harness.registry.EngineFacts) and its adapter, plus one
registry line: the spec checks it, build_engine builds it, compare plans it and its report's
matrix names it. No processes."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest

from harness import registry
from harness.compare.spec import parse_compare_spec
from harness.errors import CapabilityError
from harness.frameworks import build_engine
from harness.report.compare_layouts import layout_matrix
from harness.spec import Layout, Workload, engine_variant, parse_spec
from harness.spec.honours import OPTIMIZER_CHOICES

TOY_FACTS = """
from harness.registry import ANY, EngineFacts
from harness.spec import EVERY_ENGINE

ENGINE = EngineFacts(
    name="toy",
    honours={**EVERY_ENGINE, "layout.dp": ANY, "layout.tp": ANY},
    capabilities=[("tp", lambda l: l.tp == 1, "engine {engine} has no tensor parallelism")],
    label=lambda lay: "toy engine",
)
"""
TOY_ADAPTER = """
def build(spec, shape, ctx):
    return ("built", spec.layout.engine, ctx)
"""
WORKLOAD = {"model": "tiny", "seq_len": 16, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy engine: its package (facts and adapter) on sys.path and its one registry line (both undone
    afterwards)."""
    package = tmp_path / "toy_engine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "facts.py").write_text(textwrap.dedent(TOY_FACTS))
    (package / "adapter.py").write_text(textwrap.dedent(TOY_ADAPTER))
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("toy_engine", "toy_engine.facts", "toy_engine.adapter"):
        monkeypatch.delitem(__import__("sys").modules, module, raising=False)
    monkeypatch.setitem(registry.ENGINES, "toy", "toy_engine")
    yield "toy"


def test_a_registered_engine_is_a_choice_checked_by_its_own_rules_and_built(toy):
    spec = parse_spec({"workload": WORKLOAD, "layout": {"engine": "toy", "dp": 2}})  # no precision or model limits
    assert engine_variant(spec.layout) == "toy engine"
    with pytest.raises(CapabilityError) as e:
        parse_spec({"workload": WORKLOAD, "layout": {"engine": "toy", "tp": 2}})
    assert str(e.value) == "layout.tp: engine toy has no tensor parallelism"
    assert build_engine(spec, spec.shape(), "ctx") == ("built", "toy", "ctx")


def test_a_registered_engine_is_named_in_the_compare_matrix(toy):
    cs = parse_compare_spec(
        {
            "name": "m",
            "nproc": 2,
            "parity_steps": 1,
            "reference": False,
            "workload": WORKLOAD,
            "matrix": {"engines": [{"engine": "own"}, {"engine": "toy"}], "layouts": [{"dp": 2}, {"tp": 2}]},
        }
    )
    assert [r.label for r in cs.runs] == ["own dp2", "toy engine dp2", "own tp2"]
    assert [r.launcher for r in cs.runs] == ["torchrun"] * 3
    assert cs.not_runnable[0]["why"] == "layout.tp: engine toy has no tensor parallelism"
    step = {"median": 0.01, "ci95_low": 0.009, "ci95_high": 0.012}
    summary = {
        "runs": [
            {
                "label": r.label,
                "layout": dataclasses.asdict(r.spec.layout),
                "status": "ok",
                "metrics": {"step_time_s": step},
            }
            for r in cs.runs
        ],
        "parity": {"runs": [{"label": r.label, "verdict": "pass"} for r in cs.runs]},
        "not_runnable": cs.not_runnable,
    }
    header, rows = layout_matrix(summary)
    assert header == ["layout", "own", "toy engine"]
    by_row = {r[0]: r[1:] for r in rows}
    assert by_row["tp2 mbs 1"][1] == "– layout.tp: engine toy has no tensor parallelism"
    assert by_row["dp2 mbs 1"] == ["10.0 ms [9.0, 12.0] (coverage not recorded) pass"] * 2  # no n, no ci_coverage


def test_the_registry_is_restored_after_a_test_registers_an_engine():
    assert "toy" not in registry.ENGINES
    assert set(registry.ENGINES) == {"single", "own", "deepspeed", "fsdp", "megatron"}


@pytest.mark.parametrize("name", sorted(registry.ENGINES))
def test_every_adapter_declares_its_facts_naming_real_fields(name):
    facts = registry.facts(name)
    layout, workload = {f.name for f in dataclasses.fields(Layout)}, {f.name for f in dataclasses.fields(Workload)}
    workload |= {path.partition(".")[2] for path in OPTIMIZER_CHOICES}  # "optimizer.name": honours.py checks them
    assert facts.name == name
    assert all(rule[0] in layout for rule in facts.capabilities + facts.batch_limits)
    assert all(rule[0] in workload for rule in facts.precision_limits)
    assert facts.launcher in ("torchrun", "deepspeed", "direct")
    assert facts.variant(dataclasses.asdict(Layout(engine=name))).split()[0] in (name, "FSDP2")
    fields = {"layout": layout, "workload": workload}
    for path in {**facts.honours, **facts.why_not, **facts.defaults}:
        part, _, field = path.partition(".")
        assert field in fields.get(part, ()), path
    assert not set(facts.honours) & set(facts.why_not)  # a reason not to honour a field it honours
    for path, value in facts.defaults.items():  # its own default is one it runs
        assert facts.runs(path, [value]) == [value], path


RAF = {"own": {}, "single": {}, "deepspeed": {"zero_stage": 1}, "megatron": {}}


@pytest.mark.parametrize("engine", sorted(RAF))
def test_a_field_the_engine_does_not_honour_is_refused_through_harness_train(no_launch, one_line_error, engine):
    """reshard_after_forward is FSDP2's: any other engine refuses it rather than ignore it."""
    import yaml

    from harness.cli import main as cli_main

    raw = {"workload": WORKLOAD, "layout": {"engine": engine, "reshard_after_forward": False, **RAF[engine]}}
    (no_launch / "s.yaml").write_text(yaml.safe_dump(raw))
    line = one_line_error(cli_main(["train", "s.yaml"]))
    assert line == f"error: layout.reshard_after_forward: engine {engine} does not use it"


def test_a_new_field_no_engine_declares_is_refused_unless_at_its_default():
    """A field added to the layout is in no engine's facts until one declares it: every engine refuses any
    value but its default, in one line naming field and engine."""
    from harness.spec import capability_error

    grown = dataclasses.make_dataclass("GrownLayout", [("new", int, dataclasses.field(default=1))], bases=(Layout,))
    for name in registry.ENGINES:
        extra = {path.split(".")[1]: value for path, value in registry.facts(name).defaults.items()}
        extra.update({"zero_stage": 1} if name == "deepspeed" else {})  # its own defaults, a ZeRO stage it runs
        assert capability_error(grown(engine=name, new=1, **extra)) is None, name
        error = capability_error(grown(engine=name, new=4, **extra))
        assert str(error) == f"layout.new: engine {name} does not use it"


def test_an_unknown_or_absent_engine_is_a_spec_error_not_a_key_error(monkeypatch):
    from harness.errors import SpecError

    with pytest.raises(SpecError, match="layout.engine: 'nope' is not one of single, own"):
        registry.facts("nope")
    monkeypatch.setitem(registry.ENGINES, "gone", "harness.frameworks.no_such_engine")
    assert not registry.available("gone") and engine_variant({"engine": "gone"}) == "gone"
    with pytest.raises(SpecError, match="not available in this checkout"):
        registry.facts("gone")


@pytest.mark.slow  # a fresh Python process
def test_reading_every_engines_facts_imports_no_torch():
    """The spec's checks and every report's labels read the engines' facts: the adapters declare
    them without importing torch or DeepSpeed (their build() imports the engine)."""
    from conftest import heavy_imports_after

    code = (
        "from harness import registry\n"
        "from harness.spec import engine_variant, parse_spec\n"
        "for name in registry.ENGINES:\n"
        "    registry.facts(name)\n"
        "    engine_variant({'engine': name})\n"
        "parse_spec({'layout': {'engine': 'deepspeed', 'dp': 2, 'zero_stage': 1}})\n"
    )
    heavy = heavy_imports_after(code)
    assert not heavy, heavy[:5]


def test_a_new_value_of_a_choice_field_is_refused_until_an_engine_lists_it(monkeypatch):
    """Engines that run every value of a choice field name them through the last one they were written for
    (harness.spec.honours), not any: a value added to the schema's vocabulary later (appended to its tuple)
    is refused by every engine, in one line naming the field, until one lists it."""
    import importlib
    import sys

    from harness.spec import capability_error, honours

    for name in registry.ENGINES:
        extra = {path.split(".")[1]: value for path, value in registry.facts(name).defaults.items()}
        # DeepSeek's bidirectional DualPipe: no engine lists it (dualpipev, its V variant, is engine fsdp's)
        error = capability_error(Layout(engine=name, **extra, pipeline_schedule="dualpipe"))
        assert str(error).startswith("layout.pipeline_schedule: "), (name, error)
    # every choice field's tuple with one more value, and each engine's facts built again against it
    for path, values in honours.CHOICES.items():
        monkeypatch.setitem(honours.CHOICES, path, (*values, "new"))
    for name, package in registry.ENGINES.items():
        monkeypatch.setattr(importlib.import_module(package), "facts", importlib.import_module(package + ".facts"))
        monkeypatch.delitem(sys.modules, package + ".facts")
        facts = registry.facts(name)
        for path in honours.CHOICES:
            if path != "layout.engine":  # the engine's name: its choices are the registry's
                assert facts.refuses(path, "new", "default") is not None, (name, path)


@pytest.mark.parametrize("name", sorted(registry.ENGINES))
def test_every_value_of_every_choice_field_is_run_or_refused_with_a_reason(name):
    """For each engine, every value the schema gives a choice field is run (its facts name it, or it is the
    field's default) or refused in words; and every value is run by some engine (a value no engine opts
    into is not yet the vocabulary's)."""
    from harness.spec import honours

    facts = registry.facts(name)
    for path, values in honours.CHOICES.items():
        default = facts.default(path, honours.FIELDS[path].default)
        for value in values:
            ran = value == default or facts.runs(path, [value]) == [value]  # a default asks for nothing
            assert ran or facts.refuses(path, value, default), (path, value)
    for path, values in honours.CHOICES.items():
        for value in values:
            assert any(registry.facts(e).runs(path, [value]) for e in registry.ENGINES), (path, value)


def test_facts_name_only_values_the_schema_has():
    """A facts module's values are checked against the schema when it is built: a typo, a value the schema
    dropped or a choice field given without the last value it runs fails at import."""
    from harness.spec import honoured, some

    with pytest.raises(ValueError, match="'flash9' not among"):
        some("layout.attention", "naive", "flash9", why="")
    with pytest.raises(ValueError, match="'flash9' not among"):
        honoured("layout", attention="flash9")
    with pytest.raises(ValueError, match="a choice field"):
        honoured("layout", "tp attention")
    with pytest.raises(ValueError, match="not a field of the spec"):
        honoured("layout", "tq")
    assert honoured("layout", rmsnorm="torch")["layout.rmsnorm"].values == ("torch",)
