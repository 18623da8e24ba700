"""`harness memory` (harness/memtrace): full-size memory traces on fake tensors, against a real
run at small scale and against the planner's own-engine memory model at full scale.

Exactness (slow: real gloo ranks): at tiny size, the census each rank holds at its optimizer
step and the bytes autograd saves in a step, traced on fake tensors over a fake process group,
equal those of the real engine on real tensors, rank by rank.

Agreement (slow: full-size traces): for one layout per case, covering 13B/30B/65B, sequence
2048 and 8192, no/selective/full checkpointing, SP off and on, the planner's prediction for the
own engine (planner/memory_engines.py, engine_stage_memory) is within 10% of the trace, stage by stage
and at the worst stage; the table and the trace times are printed (the time target is
benchmarks/memory_speed.py's).

Engine fsdp likewise: exact against a real 2-rank gloo run at tiny size (dp2, tp2, tp2 + SP, pp2;
fp32 and bf16, one launch), and the planner's fsdp branch within 10% of full-size traces.
"""

from __future__ import annotations

import json

import pytest

from harness.spec import parse_spec
from harness.testing.launches import shared_launch

WORLD = 4
TINY_CASES = [  # bf16 on 4 ranks (one launch), each rank traced against the real rank
    dict(tp=2, pp=2, dp=1, micro_batch_size=1, sequence_parallel=True, attention="sdpa_flash"),
    dict(tp=1, pp=1, dp=4, micro_batch_size=2, zero_stage=1, attention="naive", activation_checkpointing="selective"),
    dict(tp=2, pp=1, dp=2, micro_batch_size=2, zero_stage=1, activation_checkpointing="full", attention="sdpa_flash"),
    # context parallelism: every rank traced (cp index 0 stands for its stage), the exchange on the fake group
    dict(tp=1, cp=2, dp=2, micro_batch_size=1, zero_stage=1, attention="naive", cp_impl="ring"),
    dict(tp=2, cp=2, micro_batch_size=2, sequence_parallel=True, attention="sdpa_flash", cp_impl="ulysses"),
    dict(cp=2, dp=2, micro_batch_size=2, attention="sdpa", cp_impl="allgather", activation_checkpointing="full"),
    dict(cp=4, micro_batch_size=1, attention="sdpa_flash", cp_impl="ring"),  # ring blocks: torch's flash op
]


def _tiny_spec(layout: dict, model: str = "tiny-4l", precision: str = "bf16"):
    """A spec for the real and the traced run: 2 steps of 8 sequences of 32 tokens on the CPU,
    the torch RMSNorm; layout names the engine (own when it does not)."""
    workload = dict(model=model, seq_len=32, global_batch_size=8, steps=2, precision=precision, device="cpu")
    return parse_spec({"workload": workload, "layout": {"engine": "own", "rmsnorm": "torch", **layout}})


def _real(ctx, specs):
    """On each rank, per spec: the census at the first optimizer step and the bytes saved in the
    next step (harness.measure's counters, on real tensors)."""
    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.measure.census import SavedActivations

    out = []
    for spec in specs:
        shape = spec.shape()
        eng = build_engine(spec, shape, ctx)
        src = token_source(spec.workload, shape.vocab)
        eng.train_step(src.global_batch_at(0))
        with SavedActivations(eng.activation_exclusions()) as saved:
            eng.train_step(src.global_batch_at(1))
        out.append({"census": eng.memory_census(), "saved": saved.bytes})
        del eng
    return out


@pytest.fixture(scope="module")
def tracers():
    """Worker processes for this file's traces, two or more at a time: a trace is single-threaded Python
    (fake tensors), so one at a time would leave all but one core idle. The tests submit their own."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(
        min(4, max(2, os.cpu_count() or 1)), mp_context=multiprocessing.get_context("spawn")
    ) as ex:
        yield ex


def _assert_traces_equal_real_runs(world: int, specs: list, labels: list[str], real: list, tracers):
    """Each spec run for real on `world` gloo ranks (`real`: every rank's _real, from one launch) and
    traced rank by rank (in `tracers`): the census and the saved bytes of every rank equal the real rank's."""
    from harness.memtrace.trace import trace_rank

    traced = [[tracers.submit(trace_rank, spec, spec.shape(), rank, True) for rank in range(world)] for spec in specs]
    for i, (_, label) in enumerate(zip(specs, labels, strict=True)):
        for rank in range(world):
            fake = traced[i][rank].result()
            got = real[rank][i]
            assert got["census"] and got["saved"] > 0
            census = {c: by for c, by in fake.census.items() if by}
            assert census == {c: by for c, by in got["census"].items() if by}, f"{label} rank {rank}"
            assert fake.saved_bytes_step == got["saved"], (
                f"{label} rank {rank}: saved {fake.saved_bytes_step} vs {got['saved']}"
            )


TINY_SPECS = [_tiny_spec(layout) for layout in TINY_CASES]
real_tiny = shared_launch("torch", WORLD, _real, TINY_SPECS, threads=1, every_rank=True)


@pytest.mark.slow
def test_fake_trace_equals_a_real_run(real_tiny, tracers):
    _assert_traces_equal_real_runs(WORLD, TINY_SPECS, [f"{layout}" for layout in TINY_CASES], real_tiny, tracers)


FSDP_WORLD = 2
FSDP_CASES = [  # engine fsdp on 2 ranks (one launch): dp2 under both policies, tp2, tp2 with SP, pp2 (1F1B)
    ("fp32", dict(dp=2)),
    ("bf16", dict(dp=2)),
    ("bf16", dict(tp=2)),
    ("fp32", dict(tp=2, sequence_parallel=True, activation_checkpointing="full")),
    ("bf16", dict(pp=2, micro_batch_size=1)),
]


def _tiny_fsdp_spec(precision: str, layout: dict):
    return _tiny_spec({"engine": "fsdp", "micro_batch_size": 2, **layout}, model="tiny", precision=precision)


FSDP_SPECS = [_tiny_fsdp_spec(*case) for case in FSDP_CASES]
real_fsdp = shared_launch("torch", FSDP_WORLD, _real, FSDP_SPECS, threads=1, every_rank=True)


@pytest.mark.slow
def test_fsdp_fake_trace_equals_a_real_run(real_fsdp, tracers):
    """Engine fsdp (FSDP2 over dp, DTensor TP/SP): the census each rank holds at its optimizer
    step and the bytes autograd saves in a step, traced, equal a real 2-rank gloo run's."""
    _assert_traces_equal_real_runs(
        FSDP_WORLD, FSDP_SPECS, [f"{precision} {layout}" for precision, layout in FSDP_CASES], real_fsdp, tracers
    )


# One layout per case; together every model, both sequence lengths, each checkpointing mode, SP
# off and on (attention sdpa, flash-style; the naive kernel and fused RMSNorm were checked the same
# way while the model was built: within 0.3%).
AGREEMENT = [
    ("paper-13b", 2048, 2048, dict(tp=2, pp=4, dp=4)),
    ("paper-30b", 8192, 512, dict(tp=4, pp=2, dp=8, sequence_parallel=True, activation_checkpointing="selective")),
    ("paper-65b", 2048, 2048, dict(tp=8, pp=2, dp=8)),
    (
        "paper-13b",
        8192,
        512,
        dict(tp=4, pp=2, dp=8, sequence_parallel=True, activation_checkpointing="full", rmsnorm="fused"),
    ),
]


def _full_spec(model, seq, gbs, layout):
    return parse_spec(
        {
            "workload": {"model": model, "seq_len": seq, "global_batch_size": gbs, "precision": "bf16"},
            "layout": {"engine": "own", "zero_stage": 1, "attention": "sdpa", "rmsnorm": "torch", **layout},
        }
    )


@pytest.fixture(scope="module")
def agreement(tracers):
    from harness.memtrace.result import trace_spec

    traced = [tracers.submit(trace_spec, _full_spec(model, seq, gbs, layout)) for model, seq, gbs, layout in AGREEMENT]
    rows = [t.result() for t in traced]
    print("\nlayout | traced peak GiB | planner GiB | difference | trace s")
    for r in rows:
        lay = r["layout"]
        label = (
            f"{r['model']} s{r['seq_len']} tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} "
            f"{lay['activation_checkpointing']} sp {'on' if lay['sequence_parallel'] else 'off'} {lay['rmsnorm']}"
        )
        diff = (r["planner_peak_gib"] - r["traced_peak_gib"]) / r["traced_peak_gib"] * 100
        print(f"{label} | {r['traced_peak_gib']:.2f} | {r['planner_peak_gib']:.2f} | {diff:+.1f}% | {r['seconds']:.1f}")
    return rows


@pytest.mark.slow
def test_planner_agrees_with_the_trace(agreement):
    for r in agreement:
        assert abs(r["planner_peak_gib"] - r["traced_peak_gib"]) <= 0.10 * r["traced_peak_gib"], r["layout"]
        assert (
            r["planner_worst_stage"] == r["traced_worst_stage"]
            or abs(r["planner_peak_gib"] - r["traced_peak_gib"]) <= 0.02 * r["traced_peak_gib"]
        )
        for rank in r["ranks"]:
            assert abs(rank["planner_gib"] - rank["total_gib"]) <= 0.10 * rank["total_gib"], (r["layout"], rank)


# Context parallelism at full size: llama3-8b at 65,536 and 131,072 tokens on cp 4 or 8 (a
# rank holds 8,192 or 16,384 tokens of each sequence), each implementation as the own engine runs it
# (ring and allgather one block per source rank, naive's fp32 math or torch's CPU flash kernel;
# ulysses the layout's kernel on a head shard), the planner (planner/context.py's cp terms) within 5%
# of the trace. A trace takes 5-13 s here (printed; the target, under 120 s, is a time and lives
# outside the assertions). Three layouts, to keep the suite's time: allgather, ring with sdpa,
# ulysses with naive, ring at 131,072 tokens and tp2 cp4 SP ring agreed within 2.0%, 0.0%, 0.2%, 2.4%
# and 2.5% when they were in this list; the tiny exact trace above runs tp2 cp2 SP.
CP_AGREEMENT = [
    (65536, dict(cp=8, cp_impl="ring", attention="naive")),
    (131072, dict(cp=8, dp=2, zero_stage=1, cp_impl="ulysses", attention="sdpa_flash")),  # ZeRO-1 over dp x cp
    (65536, dict(cp=4, pp=2, cp_impl="ring", attention="naive")),  # 1F1B: two micro-batches in flight on stage 0
]


def _traced(header: str, cases: list[tuple[str, dict]], tracers) -> list[dict]:
    """Each (label, raw spec) parsed and traced at full size (in `tracers`), a table row printed per trace."""
    from harness.memtrace.result import trace_spec

    print(f"\n{header} | traced peak GiB | planner GiB | difference | trace s")
    rows = []
    traced = [tracers.submit(trace_spec, parse_spec(raw)) for _, raw in cases]
    for (label, _), future in zip(cases, traced, strict=True):
        r = future.result()
        diff = (r["planner_peak_gib"] - r["traced_peak_gib"]) / r["traced_peak_gib"] * 100
        print(f"{label} | {r['traced_peak_gib']:.2f} | {r['planner_peak_gib']:.2f} | {diff:+.1f}% | {r['seconds']:.1f}")
        rows.append(r)
    return rows


def _assert_planner_within(r: dict, rel: float):
    """The planner's peak within rel of the traced peak, and each rank's total of its trace."""
    assert abs(r["planner_peak_gib"] - r["traced_peak_gib"]) <= rel * r["traced_peak_gib"], r["layout"]
    for rank in r["ranks"]:
        assert abs(rank["planner_gib"] - rank["total_gib"]) <= rel * rank["total_gib"], (r["layout"], rank)


@pytest.mark.slow
def test_cp_planner_agrees_with_the_trace(tracers):
    cases = [
        (
            f"llama3-8b s{seq} {layout}",
            {
                "workload": {
                    "model": "llama3-8b",
                    "seq_len": seq,
                    "global_batch_size": 8,
                    "precision": "bf16",
                    "model_overrides": {"max_positions": seq},
                },
                "layout": {"engine": "own", "rmsnorm": "fused", **layout},
            },
        )
        for seq, layout in CP_AGREEMENT
    ]
    for r in _traced("cp layout", cases, tracers):
        assert r["layout"]["cp"] > 1
        _assert_planner_within(r, 0.05)


# Engine fsdp at full size (bf16, sdpa, eager RMSNorm, micro-batch 1, global batch 512): FSDP2 over
# dp, DTensor TP with and without SP, torch.distributed.pipelining; the planner's fsdp branch
# (planner/memory_fsdp.py, fsdp_step_bytes) within 10% of the trace at every stage.
FSDP_AGREEMENT = [
    ("llama2-7b", 2048, dict(dp=8, reshard_after_forward=False)),  # every block gathered until its backward
    ("paper-13b", 2048, dict(tp=2, dp=4, sequence_parallel=True)),
    ("paper-13b", 2048, dict(tp=2, pp=2, dp=2, sequence_parallel=True)),
]


@pytest.mark.slow
def test_fsdp_planner_agrees_with_the_trace(tracers):
    cases = [
        (
            f"{model} s{seq} {layout}",
            {
                "workload": {"model": model, "seq_len": seq, "global_batch_size": 512, "precision": "bf16"},
                "layout": {"engine": "fsdp", "attention": "sdpa", "rmsnorm": "torch", **layout},
            },
        )
        for model, seq, layout in FSDP_AGREEMENT
    ]
    for r in _traced("fsdp layout", cases, tracers):
        assert r["engine"] == "fsdp", r["layout"]  # its time: benchmarks/memory_speed.py
        _assert_planner_within(r, 0.10)


# ---------------------------------------------------------------- fast: the command and the planner


def _memory_json(capsys, spec, *sets: str) -> dict:
    """`harness memory SPEC [--set ...] --format json`, in this process: what it prints."""
    from harness.cli import main

    assert main(["memory", str(spec), *sets, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_command_json(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "workload: {model: tiny, seq_len: 32, global_batch_size: 4, precision: bf16}\n"
        "layout: {engine: own, tp: 2, pp: 2, dp: 1, zero_stage: 0, sequence_parallel: true}\n"
    )
    out = _memory_json(capsys, spec)
    assert {"traced_peak_gib", "planner_peak_gib", "ranks"} <= set(out)
    assert [r["stage"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert set(r["census"]) == {"parameters", "gradients", "master_parameters", "optimizer_states"}
        assert r["census"]["parameters"] == {"bf16": r["census"]["parameters"]["bf16"]}
        assert set(r["terms_gib"]) == {"cuda_context_and_workspaces", "allocator_fragmentation"}
        assert r["live_peak_gib"] >= r["states_gib"] > 0
    worst = max(r["total_gib"] for r in out["ranks"])
    assert out["traced_peak_gib"] == worst
    from harness.memtrace.result import table_lines

    table = "\n".join(table_lines(out))  # what the table format prints for the same result
    assert "traced peak" in table and "planner" in table and "stage 1" in table


def test_memory_command_fsdp(tmp_path, capsys):
    """Engine fsdp traced in this process (tiny: FSDP2 over dp with DTensor TP/SP): FSDP2's
    census (fp32 sharded parameters, their gradients, Adam states; no master copy), a live peak
    above it, both pipeline stages under pp."""
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "workload: {model: tiny, seq_len: 32, global_batch_size: 8, precision: bf16}\n"
        "layout: {engine: fsdp, tp: 2, dp: 2, sequence_parallel: true}\n"
    )
    out = _memory_json(capsys, spec)
    assert out["engine"] == "fsdp" and [r["stage"] for r in out["ranks"]] == [0]
    (r,) = out["ranks"]
    assert {c: set(by) for c, by in r["census"].items() if by} == {
        "parameters": {"fp32"},
        "gradients": {"fp32"},
        "optimizer_states": {"fp32"},
    }
    assert r["census"]["parameters"]["fp32"] == r["census"]["gradients"]["fp32"]
    assert r["census"]["parameters"]["fp32"] > 0 and r["live_peak_gib"] >= r["states_gib"]
    assert out["planner_peak_gib"] > 0
    out = _memory_json(capsys, spec, "--set", "layout.pp=2", "--set", "layout.dp=1")
    assert [r["stage"] for r in out["ranks"]] == [0, 1] and [r["layers"] for r in out["ranks"]] == [[[0, 1]], [[1, 2]]]


def test_memory_command_traces_a_ring_layout_with_flash_blocks(tmp_path, capsys):
    """Own-engine cp4 ring with attention sdpa_flash (blocks: torch's flash op with its LSE) at full
    width (llama3-8b, 2 layers, 8,192 tokens): traced with no attention stand-in, the planner within
    the 5% of the full-size cp agreement above; sdpa_efficient (a CUDA op) traces as the CPU flash op,
    said so, with the same bytes (both save q, k, v, output and LSE per block, no s x s)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "workload: {model: llama3-8b, seq_len: 8192, global_batch_size: 2, precision: bf16,\n"
        "           model_overrides: {layers: 2, max_positions: 8192}}\n"
        "layout: {engine: own, cp: 4, cp_impl: ring, attention: sdpa_flash, rmsnorm: fused}\n"
    )
    out = _memory_json(capsys, spec)
    assert out["layout"]["cp"] == 4 and not any(s.startswith("attention") for s in out["substitutions"])
    assert abs(out["planner_peak_gib"] - out["traced_peak_gib"]) <= 0.05 * out["traced_peak_gib"]
    gpu = _memory_json(capsys, spec, "--set", "layout.attention=sdpa_efficient")
    assert any(s.startswith("attention sdpa_efficient: traced as CPU flash") for s in gpu["substitutions"])
    assert gpu["traced_peak_gib"] == out["traced_peak_gib"]


@pytest.mark.parametrize(
    "argv,field",
    [
        (["memory", "/no/such/spec.yaml"], "spec"),
        (["memory", "examples/tiny.yaml"], "layout.engine"),
        (
            ["memory", "examples/tiny.yaml", "--set", "layout.engine=deepspeed", "--set", "layout.zero_stage=1"],
            "--set: layout.engine=deepspeed: harness memory traces engines own and fsdp",  # the override named
        ),
        (["memory", "examples/tiny.yaml", "--set", "layout.engine=own", "--set", "layout.tp=3"], "--set"),
    ],
)
def test_memory_bad_input_is_one_line_exit_2(argv, field, capsys):
    from harness.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}")


def test_planner_engines():
    """paper stays the study's model (the default of a planner PlannerLayout); own, deepspeed and fsdp
    differ by their model states as model_states says."""
    import dataclasses

    from harness.model.presets import PRESETS
    from harness.planner.layout import PlannerLayout, Workload
    from harness.planner.memory import GIB, worst_stage_memory
    from harness.planner.memory_engines import model_states

    shape, wl = PRESETS["paper-13b"], Workload(2048, 2048)
    lay = PlannerLayout(2, 4, 8, 1, attention="sdpa", rmsnorm="torch")
    assert lay.engine == "paper"
    paper = worst_stage_memory(shape, lay, wl)
    assert paper == worst_stage_memory(shape, dataclasses.replace(lay, engine="paper"), wl)
    own = worst_stage_memory(shape, dataclasses.replace(lay, engine="own"), wl)[1]
    states = sum(sum(v.values()) for v in model_states(own["params"], "own", 1, "bf16", 8).values())
    assert abs(own["weights"] + own["gradients"] + own["optimizer"] - states) < 1e-6 * states
    ds3 = worst_stage_memory(shape, dataclasses.replace(lay, engine="deepspeed", zero_stage=3, pp=1, dp=32), wl)[1]
    ds1 = worst_stage_memory(shape, dataclasses.replace(lay, engine="deepspeed", zero_stage=1, pp=1, dp=32), wl)[1]
    assert ds3["total"] < ds1["total"]
    fsdp = worst_stage_memory(shape, dataclasses.replace(lay, engine="fsdp", fsdp=True, pp=1, dp=32), wl)[1]
    assert fsdp["gradients"] < 0.1 * GIB * 40 and fsdp["total"] < ds1["total"]


def test_plan_engine_flag(capsys):
    from harness.cli import main

    base = [
        *(
            "plan --model paper-13b --seq-len 2048 --global-batch-size 2048 --gpus 64 --format json --attention "
            "flash2 --micro-batch-sizes 1"
        ).split()
    ]
    got = {}
    for engine in ("own", "paper", "deepspeed", "fsdp"):
        assert main(base + ["--engine", engine]) == 0
        got[engine] = {
            (r["tp"], r["pp"], r["dp"], r["activation_checkpointing"], r["sequence_parallel"], r["rmsnorm"]): r[
                "memory_gib"
            ]
            for r in json.loads(capsys.readouterr().out)
        }
    key = (2, 4, 8, "none", False, "fused")
    assert len({got[e][key] for e in got}) == 4  # each engine its own memory
    assert main(base[:-4] + ["--engine", "own", "--zero", "3"]) == 2
    assert capsys.readouterr().err.startswith("error: --zero")


@pytest.mark.slow
def test_fsdp_planner_agrees_with_the_trace_of_one_interleaved_round(tracers):
    """torch's ScheduleInterleaved1F1B in one round (4 micro-batches at pp 4) reduces each chunk's gradients after
    its last backward and runs one chunk's backwards at a time: the planner holds one chunk's unsharded gradients
    (memory_fsdp.one_round_chunks), within 10% of the trace at every stage (+15% when it held both chunks')."""
    layout = dict(pp=4, dp=2, pipeline_schedule="interleaved", virtual_stages=2, activation_checkpointing="full")
    raw = {
        "workload": {"model": "llama2-7b", "seq_len": 1024, "global_batch_size": 8, "precision": "bf16"},
        "layout": {"engine": "fsdp", "attention": "sdpa", "rmsnorm": "torch", "micro_batch_size": 1, **layout},
    }
    for r in _traced("fsdp interleaved, one round", [(f"llama2-7b s1024 {layout}", raw)], tracers):
        _assert_planner_within(r, 0.10)
