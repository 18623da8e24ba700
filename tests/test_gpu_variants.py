"""scripts/gpu_variants.py (the GPU script's variants phase) without a GPU and without processes: every
variant's spec is either taken or refused in one line naming a field (so the script skips it with that
reason before and after the fields it names exist), and its one-process cp2 ring blocks check agrees on
this CPU for the ops the CPU has."""

from __future__ import annotations

import argparse
import importlib.util
import os

import pytest

from harness.errors import SpecError
from harness.spec import parse_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_variants", os.path.join(ROOT, "scripts", "gpu_variants.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(**kw):
    base = dict(out="/nonexistent", model="tiny", layers=4, seq_len=32, global_batch_size=4, steps=4, device="cpu")
    return argparse.Namespace(**{**base, **kw})


def test_every_variant_is_taken_or_refused_in_one_line(script, tmp_path):
    names = [v[0] for v in script.VARIANTS]
    assert len(set(names)) == len(names)
    for name, world, layout, workload, base in script.VARIANTS:
        assert base is None or names.index(base) < names.index(name)  # a baseline runs before its rows
        raw = script.raw_spec(_args(out=str(tmp_path)), name, layout, workload)
        assert raw["workload"]["warmup_steps"] >= 1  # compile blocks compiles in warm-up
        try:
            spec = parse_spec(raw)
        except SpecError as e:
            assert e.field.startswith(("layout.", "workload.")) and len(str(e).splitlines()) == 1, name
            continue
        assert spec.layout.engine == layout["engine"]
        assert spec.layout.cp * spec.layout.pp * spec.layout.tp * spec.layout.dp == world, name


def test_mentions_finds_what_a_record_says_about_a_variant(script):
    rec = {"metrics": {"compile": {"seconds": 3.0, "graphs": 4}, "losses": [1.0]}, "layout": {"fp8_recipe": "x"}}
    want = {"metrics.compile.seconds": 3.0, "metrics.compile.graphs": 4, "layout.fp8_recipe": "x"}
    assert script.mentions(rec) == want


def test_the_cp_blocks_check_on_this_cpu(script):
    rows = {r["kernel"]: r for r in script.cp_blocks(_args(cp_seq_len=64))}
    assert set(rows) == set(script.BLOCK_KERNELS)
    for kernel in ("sdpa_flash", "sdpa", "naive"):
        assert rows[kernel]["status"] == "ok", rows[kernel]
    assert rows["sdpa_efficient"]["status"] == rows["sdpa_cudnn"]["status"] == "skipped"
