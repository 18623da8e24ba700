"""Engine megatron in every view: sweeps over engines, `harness plan --engine megatron` (its memory model
against a real run's census, per rank) and `harness plan --export megatron` (the exported Megatron-LM
arguments read back into a megatron spec, which builds the same layout). The real runs share one 2-rank
launch; the rest starts no process."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import shlex

import pytest
from conftest import megatron_parser

from harness.interop.megatron_out import export_megatron
from harness.model.presets import PRESETS, resolve_shape
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.memory_engines import engine_stage_items, engine_stage_memory, model_states
from harness.planner.memory_terms import stage_params
from harness.testing.launches import shared_launch

# ---------------------------------------------------------------- sweeps over engines


def test_a_sweep_over_engines_expands_and_labels_megatron():
    from harness.sweep.expand import describe, expand
    from harness.sweep.spec import parse_sweep

    sweep = parse_sweep(
        {
            "name": "engines",
            "gpus": 2,
            "layout": {"attention": "naive"},
            "workload": {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "device": "cpu"},
            "grid": {"engine": ["own", "megatron"], "tp": [1, 2], "zero_stage": [0, 1]},
            "points": [{"engine": "megatron", "pp": 2, "pipeline_schedule": "gpipe"}],
        }
    )
    points, drops = expand(sweep)
    labels = {p.label().split(" mb")[0] for p in points}
    assert labels == {
        "own tp1 pp1 dp2",
        "own tp2 pp1 dp1",
        "own ZeRO-1 tp1 pp1 dp2",
        "own ZeRO-1 tp2 pp1 dp1",
        "megatron tp1 pp1 dp2",
        "megatron tp2 pp1 dp1",
        "megatron DistOpt tp1 pp1 dp2",
        "megatron DistOpt tp2 pp1 dp1",
    }
    assert all(p.spec["layout"]["engine"] in ("own", "megatron") for p in points)
    # the one point Megatron cannot run is dropped before launch, with its engine's reason
    (drop,) = drops
    assert drop.coords["engine"] == "megatron" and "pipeline_schedule" in drop.reason and "gpipe" in drop.reason
    assert "megatron DistOpt tp2" in describe(points, drops)


# ---------------------------------------------------------------- harness plan --engine megatron


def test_megatron_model_states_are_its_ddp_and_distributed_optimizer():
    """bf16: parameters 2P, fp32 main gradients 4P, fp32 masters and Adam's moments (12P) sharded
    over dp by the distributed optimizer; whole without it."""
    P = 1000.0

    def multiples(zero, precision, dp, **dtypes):
        states = model_states(P, "megatron", zero, precision, dp, **dtypes)
        return {k: {d: b / P for d, b in v.items()} for k, v in states.items() if v}

    assert multiples(1, "bf16", 4) == {
        "parameters": {"bf16": 2},
        "gradients": {"fp32": 4},
        "master_parameters": {"fp32": 1},
        "optimizer_states": {"fp32": 2},
    }
    assert multiples(0, "bf16", 4) == {
        "parameters": {"bf16": 2},
        "gradients": {"fp32": 4},
        "master_parameters": {"fp32": 4},
        "optimizer_states": {"fp32": 8},
    }
    assert multiples(1, "fp32", 2) == {
        "parameters": {"fp32": 4},
        "gradients": {"fp32": 4},
        "optimizer_states": {"fp32": 4},
    }
    # main gradients in bf16 (grad_reduce_in_fp32 off): the masters' fp32 .grad beside them, sharded
    assert multiples(1, "bf16", 2, grad_accum="bf16", grad_reduce="bf16")["gradients"] == {"bf16": 2, "fp32": 2}


def test_megatron_splits_layers_uniformly():
    """Megatron-core gives every stage layers / pp (the own engine balances by cost: with a large
    vocabulary it puts fewer layers beside the LM head)."""
    shape = resolve_shape("tiny-256", {"vocab": 8192})
    mega = engine_stage_items(shape, PlannerLayout(1, 2, 1, 1, engine="megatron"), 32)
    own = engine_stage_items(shape, PlannerLayout(1, 2, 1, 1, engine="own"), 32)
    assert mega == ((True, 2, False), (False, 2, True)) and own != mega
    interleaved = PlannerLayout(1, 2, 1, 1, engine="megatron", pipeline_schedule="interleaved", virtual_stages=2)
    assert engine_stage_items(shape, interleaved, 32) == mega


def _plan(*argv) -> tuple[int, str, str]:
    from harness.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_plan_engine_megatron_offers_only_even_splits_and_zero_0_or_1():
    code, out, _ = _plan(
        *(
            "plan --model tiny-256 --seq-len 64 --global-batch-size 8 --gpus 8 --engine megatron --hardware cpu "
            "--format json"
        ).split()
    )
    assert code == 0
    import json

    rows = json.loads(out)
    assert rows and {r["pp"] for r in rows} <= {1, 2, 4}  # 4 layers: pp 8 would split them unevenly
    code, _, err = _plan(
        *"plan --model tiny-256 --seq-len 64 --global-batch-size 8 --gpus 2 --engine megatron --zero 2".split()
    )
    assert code == 2 and err.startswith("error: --zero:")


# ---------------------------------------------------------------- harness plan --export megatron


def megatron_args(text: str) -> argparse.Namespace:
    """Megatron-LM's pretrain_gpt.py arguments (megatron/training/arguments.py's parser), strictly: an
    argument it does not know fails."""
    return megatron_parser(exit_on_error=False).parse_args(shlex.split(text))


def megatron_spec(text: str, model: str, world: int) -> dict:
    """A run spec for engine megatron from exported Megatron-LM arguments, as `harness import megatron`
    reads them (dp: the world size over tp x pp, as Megatron-LM derives it). The model is the named
    preset, checked against the shape the arguments give."""
    from harness.interop.imports import import_megatron

    a = megatron_args(text)
    shape = resolve_shape(model)
    assert (
        a.num_layers,
        a.hidden_size,
        a.ffn_hidden_size,
        a.num_attention_heads,
        a.num_query_groups or a.num_attention_heads,
        a.rotary_base,
        a.layernorm_epsilon,
        not a.untie_embeddings_and_output_weights,
    ) == (
        shape.layers,
        shape.hidden,
        shape.ffn,
        shape.heads,
        shape.kv_heads,
        int(shape.rope_theta),
        shape.norm_eps,
        shape.tie_embeddings,
    )
    assert a.swiglu and a.normalization == "RMSNorm" and not a.add_bias_linear
    assert a.attention_dropout == 0 and a.hidden_dropout == 0
    if a.recompute_granularity == "full":
        assert (a.recompute_method, a.recompute_num_layers) == ("uniform", 1)
    if a.bf16:
        assert a.accumulate_allreduce_grads_in_fp32  # the planner's policy
    raw, _ = import_megatron(text, world)
    assert raw["workload"]["model"] == model and raw["layout"]["engine"] == "megatron"
    raw["workload"].update(steps=1, warmup_steps=0, device="cpu")
    return raw


PLANNED_FIELDS = (
    *(
        "tp pp dp micro_batch_size sequence_parallel activation_checkpointing pipeline_schedule virtual_stages "
        "attention rmsnorm"
    ).split(),
)


def assert_same_layout(spec_layout: dict, lay: PlannerLayout) -> None:
    planned = lay.to_spec()
    assert planned["engine"] == "megatron"
    for name in PLANNED_FIELDS:
        assert spec_layout[name] == planned[name], (name, spec_layout[name], planned[name])
    # the distributed optimizer has nothing to shard at dp 1: Megatron-LM is not told to use it
    assert spec_layout["zero_stage"] == (lay.zero_stage if lay.dp > 1 else 0)


# Layouts exported by export_megatron (what `harness plan --export megatron` prints) and read back.
KERNELS = {"attention": "naive", "rmsnorm": "torch", "engine": "megatron"}
EXPORTED = {  # id: (model, ranks, layout)
    "tp2-sp-selective": (
        "tiny",
        2,
        PlannerLayout(2, 1, 1, 2, sequence_parallel=True, activation_checkpointing="selective", **KERNELS),
    ),
    "pp2-interleaved-full": (
        "tiny-256",
        2,
        PlannerLayout(
            1, 2, 1, 1, activation_checkpointing="full", pipeline_schedule="interleaved", virtual_stages=2, **KERNELS
        ),
    ),
}
EXPORT_WORKLOAD = Workload(32, 8, 4)


@pytest.mark.parametrize("name", list(EXPORTED))
def test_exported_arguments_read_back_as_the_planned_layout(name):
    model, world, lay = EXPORTED[name]
    text, _ = export_megatron(PRESETS[model], lay, EXPORT_WORKLOAD)
    raw = megatron_spec(text, model, world)
    assert_same_layout(raw["layout"], lay)
    from harness.spec import parse_spec

    parse_spec(raw)  # engine megatron runs it (its capabilities, its even layer split)


def _plan_export() -> tuple[dict, PlannerLayout]:
    """`harness plan --export megatron` on the tiny model at 2 ranks: its arguments as a megatron spec,
    and the layout the planner chose (read from the same plan's JSON, best first)."""
    args = [
        *(
            "plan --model tiny --seq-len 64 --global-batch-size 8 --gpus 2 --hardware cpu --engine megatron "
            "--attention naive --rmsnorm torch"
        ).split()
    ]
    code, text, _ = _plan(*args, "--export", "megatron")
    assert code == 0
    import json

    code, out, _ = _plan(*args, "--format", "json")
    best = next(r for r in json.loads(out) if r["fits"])
    lay = PlannerLayout(
        best["tp"],
        best["pp"],
        best["dp"],
        best["micro_batch_size"],
        activation_checkpointing=best["activation_checkpointing"],
        sequence_parallel=best["sequence_parallel"],
        attention=best["attention"],
        rmsnorm=best["rmsnorm"],
        zero_stage=best["zero"],
        engine="megatron",
    )
    return megatron_spec(text.strip().splitlines()[0], "tiny", 2), lay


def test_plan_export_megatron_reads_back_as_the_plans_choice():
    raw, lay = _plan_export()
    assert_same_layout(raw["layout"], lay)


# ---------------------------------------------------------------- one launch: census and exported builds

CENSUS_WORKLOAD = {
    "model": "tiny-256",
    "seq_len": 32,
    "global_batch_size": 8,
    "steps": 1,
    "warmup_steps": 0,
    "device": "cpu",
    "precision": "bf16",
}
CENSUS = {  # id: (layout, workload overrides)
    "dp2-ddp": ({"dp": 2, "zero_stage": 0}, {}),
    "dp2-distopt": ({"dp": 2, "zero_stage": 1}, {}),
    "dp2-distopt-bf16-grads": ({"dp": 2, "zero_stage": 1}, {"grad_accum_dtype": "bf16", "grad_reduce_dtype": "bf16"}),
    "tp2-fp32": ({"tp": 2}, {"precision": "fp32"}),
    "pp2-large-vocab": ({"pp": 2}, {"model_overrides": {"vocab": 8192}}),
    "pp2-interleaved": ({"pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2}, {}),
}


def _census_raw(case) -> dict:
    layout, workload = case
    return {
        "workload": {**CENSUS_WORKLOAD, **workload},
        "layout": {"engine": "megatron", "attention": "naive", "micro_batch_size": 2, **layout},
    }


def _launched(ctx, census_runs: list[dict], exported_runs: list[dict]) -> dict:
    """Each census run's census after its first step, and each exported spec's engine: its layout,
    describe() and one step's loss; on every rank."""
    from harness.run import Trainer
    from harness.spec import parse_spec

    out = {"census": [], "exported": []}
    for raw in census_runs:
        spec = parse_spec(raw)
        trainer = Trainer(spec, ctx, spec.shape(), progress=False)
        trainer.step(0)
        out["census"].append({"census": trainer.engine.memory_census(), "pp_rank": trainer.engine.coord.pp})
        del trainer
    for raw in exported_runs:
        spec = parse_spec(raw)
        trainer = Trainer(spec, ctx, spec.shape(), progress=False)
        trainer.step(0)
        out["exported"].append(
            {"layout": spec.to_dict()["layout"], "describe": trainer.engine.describe(), "loss": trainer.losses[0]}
        )
        del trainer
    return out


_PLANNED: dict = {}  # the planner's layout of the plan exported for the launch


def _launch_args(folder) -> tuple:
    exported = [
        megatron_spec(export_megatron(PRESETS[m], lay, EXPORT_WORKLOAD)[0], m, w) for m, w, lay in EXPORTED.values()
    ]
    from_plan, _PLANNED["layout"] = _plan_export()
    return [_census_raw(c) for c in CENSUS.values()], exported + [from_plan]


_ranks = shared_launch("megatron", 2, _launched, prepare=_launch_args, timeout_s=600, threads=1, every_rank=True)


@pytest.fixture(scope="module")
def launched(_ranks):
    return _ranks, list(EXPORTED.values()) + [("tiny", 2, _PLANNED["layout"])]


def _predicted(case, pp_rank: int) -> tuple[dict, dict]:
    """model_states of this rank's parameters (stage_params of the planner's megatron split), and the
    planner's stage memory of the same rank (default policy only)."""
    raw = _census_raw(case)
    w, lay = raw["workload"], raw["layout"]
    shape = resolve_shape(w["model"], w.get("model_overrides"))
    dp = lay.get("dp", 1)
    planned = PlannerLayout(
        lay.get("tp", 1),
        lay.get("pp", 1),
        dp,
        lay["micro_batch_size"],
        attention="naive",
        rmsnorm="torch",
        zero_stage=lay.get("zero_stage", 0),
        pipeline_schedule=lay.get("pipeline_schedule", "1f1b"),
        virtual_stages=lay.get("virtual_stages", 1),
        engine="megatron",
    )
    params = stage_params(shape, *engine_stage_items(shape, planned, w["seq_len"])[pp_rank], planned.tp)
    states = model_states(
        params,
        "megatron",
        planned.zero_stage,
        w["precision"],
        dp,
        grad_accum=w.get("grad_accum_dtype", "fp32"),
        grad_reduce=w.get("grad_reduce_dtype", "fp32"),
    )
    wl = Workload(w["seq_len"], w["global_batch_size"], 2 if w["precision"] == "bf16" else 4)
    return states, engine_stage_memory(shape, planned, wl, pp_rank)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CENSUS)), ids=list(CENSUS))
def test_planner_memory_model_equals_megatron_census_on_every_rank(launched, index):
    ranks, _ = launched
    case = list(CENSUS.values())[index]
    for rank, result in enumerate(ranks):
        got = result["census"][index]
        states, stage = _predicted(case, got["pp_rank"])
        census = got["census"]
        for category, want in states.items():  # term by term: 2%, Adam's step counters and alignment padding
            have = census.get(category, {})
            assert set(have) == set(want), (rank, category, have, want)
            for dtype, nbytes in want.items():
                assert abs(have[dtype] - nbytes) <= 0.02 * nbytes, (rank, category, dtype, have[dtype], nbytes)
        if "grad_reduce_dtype" not in case[1]:  # the plan's own numbers (its workload has the default policy)
            total = {k: sum(v.values()) for k, v in census.items()}
            assert abs(stage["weights"] - total["parameters"]) <= 0.02 * total["parameters"]
            assert abs(stage["gradients"] - total["gradients"]) <= 0.02 * total["gradients"]
            held = total.get("master_parameters", 0) + total["optimizer_states"]
            assert abs(stage["optimizer"] - held) <= 0.02 * held


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(EXPORTED) + 1), ids=list(EXPORTED) + ["plan-cli"])
def test_engine_built_from_exported_arguments_has_the_planned_layout(launched, index):
    ranks, planned = launched
    _, world, lay = planned[index]
    for result in ranks:
        got = result["exported"][index]
        assert_same_layout(got["layout"], lay)
        d = got["describe"]
        assert (d["mesh"]["tp"], d["mesh"]["pp"], d["mesh"]["dp"]) == (lay.tp, lay.pp, lay.dp)
        assert d["sequence_parallel"] == lay.sequence_parallel
        vp = lay.virtual_stages if lay.pipeline_schedule == "interleaved" else 1
        assert d["virtual_stages"] == vp
        schedule = {1: "forward_backward_no_pipelining"}.get(
            lay.pp,
            "forward_backward_pipelining_without_interleaving"
            if vp == 1
            else "forward_backward_pipelining_with_interleaving",
        )
        assert d["schedule"] == schedule
        assert (f"use_distributed_optimizer={lay.zero_stage == 1 and lay.dp > 1}") in d["ddp"]
        assert d["activation_checkpointing"].startswith(
            {"none": "none", "full": "recompute_granularity=full", "selective": "recompute_granularity=selective"}[
                lay.activation_checkpointing
            ]
        )
        assert math.isfinite(got["loss"])


# ---------------------------------------------------------------- the GPU script, in its CPU mode


@pytest.mark.slow
def test_gpu_engines_script_runs_on_cpu(tmp_path):
    """scripts/gpu_engines.sh's smoke test (DEVICE=cpu: a tiny shape, nothing installed): a row per
    engine with the measured peak beside the traced one (own) and the planner's, in JSON and Markdown."""
    import json
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "PYTHONPATH": root}
    done = subprocess.run(
        ["bash", os.path.join(root, "scripts", "gpu_engines.sh"), "--engines", "own,megatron"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["engine"]: r for r in json.loads((tmp_path / "engines.json").read_text())["rows"]}
    assert set(rows) == {"own", "megatron"} and all(r["status"] == "ok" for r in rows.values()), rows
    assert rows["own"]["traced_live_peak_gib"] > 0 and "not traced" in rows["megatron"]["traced"]
    for r in rows.values():
        assert r["measured_peak_gib"] > 0 and r["planner_tensors_gib"] > 0 and r["memory_kind"] == "peak_rss"
        # the census the run measured is the planner's model states (and the trace's, for own)
        planned = r["planner_model_states_gib"]
        assert abs(r["measured_model_states_gib"] - planned) <= 0.02 * planned
    assert "megatron-core" in rows["megatron"]["framework"]
    assert "| megatron | ok |" in (tmp_path / "engines.md").read_text()
