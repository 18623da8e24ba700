"""Runs under layout.compile in one launch: each case through the runner's Trainer (so CompileWatch
arms after warm-up and the record's compile fields are filled), one after another in the same ranks.

Dynamo's in-memory caches are cleared before each case (torch._dynamo.reset()): every block's
nn.Module.compile() compiles the same code object (Module._call_impl), whose cache holds at most
torch._dynamo.config.recompile_limit entries before dynamo silently runs it eagerly, and a case
must count its own graphs. Inductor's on-disk cache stays: a graph an earlier case (or launch)
compiled is loaded, not compiled again."""

from __future__ import annotations


def train_cases(ctx, raws: list[dict]) -> list[dict]:
    """On one rank: each spec dict's run (warm-up and measured steps), its losses, compile fields and
    final fp32 weights (rank 0's gathered state; None elsewhere)."""
    import torch

    from harness.run import Trainer
    from harness.spec import parse_spec

    out = []
    for raw in raws:
        torch._dynamo.reset()
        spec = parse_spec(raw)
        trainer = Trainer(spec, ctx, spec.shape(), progress=False)
        try:
            for step in range(trainer.total):
                trainer.step(step)
        finally:
            trainer.close_stream()
        metrics = trainer.metrics(measure_matmul=False)
        out.append(
            {
                "losses": metrics["losses"],
                "compile": metrics.get("compile"),
                "step_times_s": metrics["step_times_s"],
                "state": trainer.engine.full_state_dict(),
                "describe": metrics["engine"],
            }
        )
        del trainer
    return out
