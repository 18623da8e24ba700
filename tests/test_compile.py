"""layout.compile (torch.compile per transformer block): the spec's refusals, what CompileWatch counts,
and compiled runs against the eager single-device reference.

Tolerance (fp32, 1e-5 relative on every step's loss and on the final weights, the equivalence tests'
own): inductor on CPU calls the same aten/mkldnn GEMMs for fp32 matmuls as eager (extern kernels,
max-autotune off), so a compiled block differs from eager only where it fuses an elementwise chain
or a reduction and so rounds in another order. The widest such reduction in a block is RMSNorm's mean
over hidden = 64 terms; a sum of n fp32 terms in any order is within gamma_n = n*u/(1 - n*u) of the
exact one (u = 2^-24), 3.8e-6 relative for n = 64, below 1e-5 (attention's softmax reduces 16 terms,
the SwiGLU MLP reduces nothing outside its GEMMs). Measured here: at most 1.7e-7 on a loss.
"""

from __future__ import annotations

import pytest

from harness.errors import SpecError
from harness.spec import layout_label, parse_spec

TINY = {"model": "tiny", "seq_len": 16, "global_batch_size": 8, "steps": 2, "warmup_steps": 1, "device": "cpu"}
HF = {"engine": "deepspeed", "model_impl": "hf", "zero_stage": 1}


def spec(layout: dict, **workload):
    return parse_spec({"workload": {**TINY, **workload}, "layout": layout})


@pytest.mark.parametrize(
    "layout, workload, field, says",
    [
        ({"compile": "blocks"}, {"warmup_steps": 0}, "layout.compile", "needs workload.warmup_steps >= 1"),
        ({"compile": "all"}, {}, "layout.compile", "none, blocks"),
        ({"engine": "megatron", "compile": "blocks"}, {}, "layout.compile", "engine megatron runs Megatron-core"),
        ({"engine": "deepspeed", "pp": 2, "compile": "blocks"}, {}, "layout.compile", "needs pp=1"),
        ({**HF, "compile": "blocks"}, {}, "layout.compile", "model_impl own"),
        ({"engine": "deepspeed", "tp": 2, "zero_stage": 1, "compile": "blocks"}, {}, "layout.compile", "tp=1"),
        ({"engine": "fsdp", "tp": 2, "compile": "blocks"}, {}, "layout.compile", "does not reproduce the reference"),
    ],
)
def test_a_compile_the_engine_or_workload_cannot_take_is_one_line(layout, workload, field, says):
    with pytest.raises(SpecError) as e:
        spec(layout, **workload)
    assert e.value.field == field and says in e.value.reason and "\n" not in str(e.value)


@pytest.mark.parametrize("engine", ["single", "own", "fsdp", "deepspeed"])
def test_engines_that_compile_take_it_and_the_label_says_so(engine):
    base = {"engine": engine, **({"zero_stage": 1} if engine == "deepspeed" else {})}
    lay = spec({**base, "compile": "blocks"}).layout
    assert lay.compile == "blocks"
    assert layout_label(lay).endswith("compiled") and layout_label(lay, short=True).endswith("compiled")
    assert "compiled" not in layout_label(spec(base).layout)


def test_compile_watch_counts_breaks_and_fails_a_recompile_after_warmup():
    """In process, dynamo's eager backend (no inductor, no process): a graph break is counted, the
    compiled frame's graphs and frames before arm() are the warm-up's, and a new input shape after
    arm() raises dynamo's RecompileError instead of compiling in a measured step."""
    import torch
    from torch._dynamo.exc import RecompileError

    from harness.model.compiled import CompileWatch

    torch._dynamo.reset()

    def block(x):
        y = x * 2
        torch._dynamo.graph_break()
        return y + 1

    compiled = torch.compile(block, backend="eager")
    watch = CompileWatch("blocks")
    compiled(torch.ones(4))  # warm-up
    compiled(torch.ones(4))
    watch.arm()
    compiled(torch.ones(4))  # cached: fine
    try:
        with pytest.raises(RecompileError):
            compiled(torch.ones(5, 3))
    finally:
        watch.close()
    assert not torch._dynamo.config.error_on_recompile  # restored
    got = watch.metrics()["compile"]
    assert got["graph_breaks"] == 1 and got["graphs"] == 2 and got["recompiles_after_warmup"] == 1  # the attempt
    assert got["frames_compiled"] >= 1 and got["compile_s"] >= 0
    assert CompileWatch("none").metrics() == {}


CASES = [
    {"engine": "fsdp", "dp": 2, "compile": "blocks"},
    {"engine": "own", "pp": 2, "compile": "blocks"},
    {"engine": "own", "tp": 2, "compile": "blocks"},
]


@pytest.mark.slow
def test_compiled_blocks_match_the_eager_reference_in_one_launch():
    """One 2-rank launch runs every case through the runner's Trainer, one after another: identical
    blocks share a graph and inductor's on-disk cache (one per user, shared by every case and every
    launch) means a case compiles only the graphs no earlier one did. Losses and final weights against
    the eager single-device reference at 1e-5 (the module docstring derives it); no recompilation
    after warm-up; the own engine's TP regions break its blocks' graphs (its collectives are opaque
    to dynamo), pipeline stages and FSDP2's hooks do not."""
    import torch

    from harness.runtime import RunContext
    from harness.testing.compiled import train_cases
    from harness.testing.equivalence import BASE
    from harness.testing.reference import assert_matches_reference, reference_run
    from harness.testing.spawn import spawn

    workload = {**BASE["workload"], "steps": 3, "warmup_steps": 1}
    ref_losses, ref_state = reference_run(workload, 4)
    single = {"engine": "single", "compile": "blocks"}  # in this process, first: its graph is FSDP2's block's
    results = train_cases(RunContext(0, 1, 0, torch.device("cpu"), None), [{"workload": workload, "layout": single}])
    results += spawn(train_cases, 2, [{"workload": workload, "layout": c} for c in CASES], timeout_s=600)
    for case, got in zip([single, *CASES], results, strict=True):
        label = layout_label(spec(case), short=True)
        assert_matches_reference(got, ref_losses, ref_state, label)
        c = got["compile"]
        assert c["recompiles_after_warmup"] == 0 and c["graphs"] >= 1 and c["compile_s"] > 0, (label, c)
        if case.get("tp", 1) > 1:
            assert c["graph_breaks"] > 0, (label, c)
        else:
            assert c["graph_breaks"] == 0, (label, c)


@pytest.mark.slow
def test_a_recompile_in_a_measured_step_fails_the_run_and_is_recorded(tmp_path, monkeypatch):
    """In this process (engine single, no launcher): after the warm-up step a block's Python attribute
    that its compiled graph was guarded on changes (selective recomputation switched on), so the next
    step would recompile. The run stops there and the store holds it failed with dynamo's
    RecompileError naming the guard, not a measurement that timed the compiler."""
    import torch

    from harness.run import Trainer, run
    from harness.runtime import RunContext
    from harness.store import ResultsStore

    original = Trainer.step

    def step(self, i):
        if i == self.spec.workload.warmup_steps:
            self.engine.model.layers["0"].attention.recompute_core = True
        return original(self, i)

    monkeypatch.setattr(Trainer, "step", step)
    torch._dynamo.reset()
    store = str(tmp_path / "r.sqlite")
    with pytest.raises(Exception, match="RecompileError|Recompiling"):
        run(
            spec({"compile": "blocks"}),
            RunContext(0, 1, 0, torch.device("cpu"), None),
            store_path=store,
            profile_steps=0,
        )
    (record,) = ResultsStore(store).records()
    assert record["status"] == "failed" and "RecompileError" in record["error"], record.get("error")
    assert not torch._dynamo.config.error_on_recompile  # restored for whatever runs next in this process
