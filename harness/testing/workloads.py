"""The workload the distributed tests share: the tiny model on this CPU in fp32 (exact equivalence),
32 tokens, 8 sequences. Each test file states only what it changes."""

from __future__ import annotations

TINY = dict(model="tiny", seq_len=32, global_batch_size=8, steps=2, warmup_steps=1, device="cpu", precision="fp32")


def tiny_workload(**fields) -> dict:
    """TINY with `fields` changed or added (a fresh dict each call)."""
    return {**TINY, **fields}


def example_over(path: str, steps: int):
    """The compare example at `path` (its runs, reference, tolerance and workload) trained for `steps`
    measured steps instead of its own count: the tests' launch of an example whose assertions hold
    on any number of steps, at a fraction of its cost (a comparison's parity bound is a maximum over
    the steps compared, so it holds on fewer)."""
    from harness.compare.spec import parse_compare_spec
    from harness.spec import read_yaml

    raw = read_yaml(path)
    raw["workload"] = {**raw["workload"], "steps": steps}
    return parse_compare_spec(raw)
