"""What tests of an optimizer read of a run (tests/test_muon.py): every engine built by harness.frameworks from
a spec dict, trained a few steps on one rank of a shared launch; its losses, final weights, memory census, last
step's details and its optimizer's state bytes by kind (Muon's momentum, AdamW's moments and step counters)."""

from __future__ import annotations


def state_bytes(optimizer) -> dict[str, int]:
    """Bytes of the optimizer's state tensors by state name (momentum_buffer, exp_avg, exp_avg_sq, step)."""
    from harness.measure.census import local_tensor

    out: dict[str, int] = {}
    for state in optimizer.state.values():
        for name, t in state.items():
            t = local_tensor(t)
            out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out


def run_optimizer_cases(ctx, runs: list[dict], steps: int) -> list[dict]:
    """On one rank: each spec dict's engine built in turn and trained `steps` steps."""
    from harness.data.source import token_source
    from harness.frameworks import build_engine
    from harness.spec import parse_spec

    out = []
    for raw in runs:
        spec = parse_spec(raw)
        shape = spec.shape()
        engine = build_engine(spec, shape, ctx)
        source = token_source(spec.workload, shape.vocab)
        losses = [float(engine.train_step(source.global_batch_at(step))) for step in range(steps)]
        out.append(
            {
                "losses": losses,
                "state": engine.full_state_dict(),
                "census": engine.memory_census(),
                "details": engine.last_step_details(),
                "optimizer_state_bytes": state_bytes(engine.optimizer),
            }
        )
        del engine
    return out
