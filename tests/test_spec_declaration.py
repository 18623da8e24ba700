"""Run, sweep and compare specs are declared one way (dataclasses read by harness.spec.build_spec)
and refused one way: `<field>: <why>`, naming the field. No processes."""

from __future__ import annotations

import pytest

from harness.compare.spec import CompareInput, parse_compare_spec
from harness.errors import SpecError
from harness.spec import build_spec, parse_spec
from harness.sweep.spec import SLURM_KEYS, SWEEP_KEYS, SweepSpec, parse_sweep

WORKLOAD = {"model": "tiny", "seq_len": 16, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}


def compare(entries=({"engine": "own"},), **top):
    return {"name": "t", "nproc": 2, "parity_steps": 1, "workload": dict(WORKLOAD), "runs": list(entries), **top}


def refusal(parse, raw) -> str:
    with pytest.raises(SpecError) as e:
        parse(raw)
    return str(e.value)


@pytest.mark.parametrize(
    "top,line",
    [
        ({"nproc": 0}, "nproc: must be a positive integer, got 0"),
        ({"nproc": True}, "nproc: must be a positive integer, got True"),
        ({"parity_steps": "5"}, "parity_steps: must be a positive integer, got '5'"),
        ({"tolerance": -1}, "tolerance: must be a non-negative number (max relative loss difference)"),
        ({"timeout_s": 0}, "timeout_s: must be a positive number, got 0"),
        ({"reference": "no"}, "reference: must be true or false, got 'no'"),
        ({"store": 123}, "store: must be a file path, got 123"),
        ({"workload": 5}, "workload: must be a mapping, got 5"),
        ({"runs": "own"}, "runs: must be a list of layouts"),
        ({"runs": []}, "runs: must be a non-empty list of layouts (or give a matrix)"),
        (
            {"runs": [], "matrix": {"engines": [{"engine": "own"}]}},
            "matrix.layouts: must be a non-empty list of mappings of layout fields",
        ),
        (
            {"runs": [], "matrix": {"engines": [], "layouts": [{}]}},
            "matrix.engines: must be a non-empty list of mappings of layout fields",
        ),
        (
            {"matrix": {"engines": [{"engine": "own"}], "layouts": [{}], "cells": 1}},
            "matrix.cells: unknown key; allowed: engines, layouts",
        ),
        (
            {"bogus": 1},
            "bogus: unknown key; allowed: " + ", ".join(f.name for f in __import__("dataclasses").fields(CompareInput)),
        ),
        ({"name": "a b"}, "name: 'a b': letters, digits, '-', '_' and '.' only (it names the report files), not ' '"),
        ({"name": "a/b"}, "name: 'a/b' names files and folders: no '/', '\\' or NUL, not '.' or '..'"),
    ],
)
def test_a_compare_spec_is_refused_naming_the_field(top, line):
    assert refusal(parse_compare_spec, compare(**top)) == line


def test_a_compare_spec_left_blank_takes_the_defaults():
    cs = parse_compare_spec(compare(name=None, nproc=None, timeout_s=None, tolerance=None, store=None))
    assert (cs.name, cs.nproc, cs.timeout_s, cs.tolerance, cs.store) == ("compare", 2, 600.0, 1e-5, None)


def test_an_nproc_that_the_run_does_not_divide_is_one_error_naming_its_dp():
    assert refusal(parse_compare_spec, compare([{"engine": "own", "tp": 2}], nproc=3)) == (
        "runs[0].dp: world size 3 is not divisible by tp=2 = 2 "
        "(nproc 3: a run that does not set dp takes nproc / (tp x cp x pp))"
    )
    cs = parse_compare_spec(compare([{"engine": "own", "tp": 2}], nproc=4))
    assert [(r.label, r.nproc, r.spec.layout.dp) for r in cs.runs[1:]] == [("own tp2", 4, 2)]


SWEEP = {"name": "s", "gpus": 2, "workload": WORKLOAD}


@pytest.mark.parametrize(
    "top,line",
    [
        ({"gpus": None}, "sweep.gpus: required: the world size of every point"),
        ({"gpus": 0}, "sweep.gpus: must be a positive integer, got 0"),
        ({"gpus": 3, "nodes": 2}, "sweep.gpus: 3 GPUs do not split over 2 nodes"),
        ({"launcher": "mpi"}, "sweep.launcher: 'mpi' is not one of torchrun, deepspeed, direct, slurm"),
        ({"store": " "}, "sweep.store: must be a file path, got ' '"),
        ({"timeout_s": "fast"}, "sweep.timeout_s: must be a positive number, got 'fast'"),
        ({"env": [1]}, "sweep.env: must be a mapping, got [1]"),
        ({"include": [1]}, "sweep.include: must be a list of mappings"),
        ({"grid": {"tp": []}}, "sweep.grid.tp: must be a non-empty list"),
        (
            {"grid": {"tpp": [1]}},
            "sweep.grid.tpp: not a Layout field (use workload.<field> for the workload, or mapping values)",
        ),
        ({"points": [{"tp": 2, "env": 1}]}, "sweep.points[0].env: must be a mapping"),
        ({"slurm": {"cpus_per_task": 0}}, "sweep.slurm.cpus_per_task: must be a positive integer, got 0"),
        ({"slurm": {"exclusive": "yes"}}, "sweep.slurm.exclusive: must be true or false, got 'yes'"),
        ({"slurm": {"setup": "module load cuda"}}, "sweep.slurm.setup: must be a list of strings"),
        ({"slurm": {"time": "1\n2"}}, "sweep.slurm.time: must be a string (one line), got '1\\n2'"),
        ({"slurm": {"cpus-per-task": 4}}, "sweep.slurm.cpus-per-task: unknown key; allowed: " + ", ".join(SLURM_KEYS)),
        ({"bogus": 1}, "sweep.bogus: unknown key; allowed: " + ", ".join(SWEEP_KEYS)),
        (
            {"name": "a b"},
            "sweep.name: 'a b': letters, digits, '-', '_' and '.' only (it names folders, the Slurm job "
            "and the report), not ' '",
        ),
    ],
)
def test_a_sweep_spec_is_refused_naming_the_field(top, line):
    assert refusal(parse_sweep, {**SWEEP, **top}) == line


def test_a_sweep_spec_left_blank_takes_the_defaults_and_keeps_slurm_a_mapping():
    s = parse_sweep({**SWEEP, "nodes": None, "store": None, "slurm": {"partition": "gpu", "qos": None}})
    assert isinstance(s, SweepSpec)
    assert (s.nodes, s.store, s.launcher, s.gpus_per_node) == (1, "results.sqlite", "torchrun", 2)
    assert s.slurm == {"partition": "gpu", "qos": None}


def test_one_name_check_for_every_spec_that_names_files():
    sweep = refusal(parse_sweep, {**SWEEP, "name": "a:b"})
    comp = refusal(parse_compare_spec, compare(name="a:b"))
    assert sweep.split(": ", 1)[1].split(" (it names")[0] == comp.split(": ", 1)[1].split(" (it names")[0]


def test_the_builder_refuses_booleans_for_numbers_and_reads_lists_and_optionals():
    assert refusal(parse_spec, {"workload": {"steps": True}}) == "workload.steps: must be an integer, got True"

    import dataclasses

    @dataclasses.dataclass
    class Toy:
        items: list[str] = dataclasses.field(default_factory=list)
        limit: float | None = None

    assert build_spec(Toy, {"items": ["a"], "limit": "1e3"}, "toy") == Toy(["a"], 1000.0)
    assert build_spec(Toy, {"limit": None}, "toy") == Toy()
    assert refusal(lambda raw: build_spec(Toy, raw, "toy"), {"items": "a"}) == "toy.items: must be a list of strings"
