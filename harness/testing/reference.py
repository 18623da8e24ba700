"""The single-device reference run and the one comparison every equivalence test makes with it."""

from __future__ import annotations

import json

import torch

_RUNS: dict[str, tuple[list[float], dict]] = {}  # reference_run's, by its arguments (a session repeats many)
_KEEP = 64  # runs kept at most (tiny models: well under 1 MB of weights each)


def _key(workload: dict, steps: int, layout: dict) -> str | None:
    """The arguments as one string, with this process's thread count (a CPU reduction's order follows it);
    None for a model that is not a preset (a config.json or a hub id) or tokens from a file: what those name
    may change under the same string."""
    from harness.model.presets import PRESETS

    if workload.get("model", "tiny") not in PRESETS or (workload.get("data") or {}).get("kind") == "file":
        return None
    return json.dumps([workload, steps, layout, torch.get_num_threads()], sort_keys=True, default=repr)


def reference_run(workload: dict, steps: int, **layout) -> tuple[list[float], dict]:
    """The single-device engine in this process on `workload`: (losses, final fp32 weights). The same
    arguments again get a copy of the first run's result (the run is deterministic): many tests of a
    session compare their layouts with one reference."""
    key = _key(workload, steps, layout)
    if key is None:
        return _reference_run(workload, steps, **layout)
    if key not in _RUNS:
        if len(_RUNS) >= _KEEP:
            _RUNS.pop(next(iter(_RUNS)))
        _RUNS[key] = _reference_run(workload, steps, **layout)
    losses, state = _RUNS[key]
    return list(losses), {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in state.items()}


def _reference_run(workload: dict, steps: int, **layout) -> tuple[list[float], dict]:
    from harness.data.source import token_source
    from harness.frameworks.single.engine import SingleDeviceEngine
    from harness.spec import parse_spec

    spec = parse_spec({"workload": dict(workload), "layout": {"engine": "single", **layout}})
    shape = spec.shape()
    engine = SingleDeviceEngine(spec, shape, torch.device("cpu"))
    source = token_source(spec.workload, shape.vocab)
    losses = [float(engine.train_step(source.global_batch_at(step))) for step in range(steps)]
    return losses, engine.full_state_dict()


def mismatches(result: dict, ref_losses: list[float], ref_state: dict | None, rtol: float = 1e-5) -> list[str]:
    """What differs from the reference (empty when equal within rtol): the loss of every step
    (relative), and every final parameter (max abs difference relative to the tensor's scale)."""
    losses = result["losses"]
    bad = []
    if len(losses) != len(ref_losses):
        bad.append(f"{len(losses)} losses vs {len(ref_losses)} in the reference")
    for i, (a, b) in enumerate(zip(losses, ref_losses, strict=False)):
        if abs(a - b) > rtol * abs(b):
            bad.append(f"step {i}: loss {a!r} vs reference {b!r} (rel {abs(a - b) / abs(b):.2e} > {rtol:g})")
    if ref_state is None:
        return bad
    state = result["state"]
    if set(state) != set(ref_state):
        bad.append(f"parameter names differ: {sorted(set(state) ^ set(ref_state))[:5]}")
    for name, ref in ref_state.items():
        if name in state:
            got = state[name]
            if got.shape != ref.shape:
                bad.append(f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
                continue
            err = (got - ref).abs().max().item()
            scale = ref.abs().max().item()
            if err > rtol * max(scale, 1e-12):
                bad.append(f"{name}: max abs diff {err:.3g} (scale {scale:.3g})")
    return bad


def assert_grad_norms_match(norms: list, ref_norms: list, label: str, rtol: float = 1e-5) -> None:
    """Every step's global gradient norm (TrainingEngine.grad_norm) is the reference's within rtol, the
    comparison's rule (harness.compare.parity)."""
    from harness.compare.parity import max_rel_diff

    assert len(norms) == len(ref_norms) and None not in norms, (label, norms)
    worst, at = max_rel_diff(norms, ref_norms, len(norms))
    assert worst <= rtol, f"{label}: gradient norm at step {at}: {norms[at]!r} vs {ref_norms[at]!r} ({worst:.2e})"


def assert_matches_reference(
    result: dict, ref_losses: list[float], ref_state: dict | None, label: str, rtol: float = 1e-5
) -> None:
    bad = mismatches(result, ref_losses, ref_state, rtol)
    if bad:
        raise AssertionError(f"{label}:\n  " + "\n  ".join(bad))
