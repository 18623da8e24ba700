"""The precision policy every run of a comparison really held, read from its memory census.

A config can change a framework's dtypes behind the workload's back (DeepSpeed's
bf16_master_weights_and_grads kept bf16 masters while the report asserted fp32 ones), so the
report's policy sentence is derived from what each run held at its first optimizer step, never
from the spec alone, and a run that held another policy than the workload's fails the comparison.

From a census (bytes per category and dtype, harness.measure.census.tensor_census) four facts:
  master weights   the widest dtype of master_parameters; where an engine keeps none of its own
                   (fp32 runs, FSDP2's sharded parameters) the widest of its parameters: the
                   weights the optimizer updates (a narrower gathered copy is not them)
  gradients        the widest dtype of the gradients held: fp32 where any gradient is accumulated or
                   stepped in fp32 (torch's optimizers step fp32 masters with fp32 gradients); a
                   narrower one alone means none was
  optimizer states every dtype holding at least 10% of the states' bytes (Adam's fp32 step
                   counters beside bf16 moments are not a policy)
  compute          every dtype holding at least 10% of the parameters' bytes, for runs that keep
                   separate masters (the parameters are then the compute copy); absent otherwise
Which dtypes gradients are accumulated and reduced in no census shows: the report says so.
"""

from __future__ import annotations

WIDTH = {"fp32": 4, "float32": 4, "bf16": 2, "fp16": 2}  # wider first where two dtypes compare
MAIN_SHARE = 0.1
FACTS = ("compute", "masters", "gradients", "optimizer_states")


def _widest(by_dtype: dict) -> str | None:
    held = [d for d, n in by_dtype.items() if n]
    return max(held, key=lambda d: (WIDTH.get(d, 1), d)) if held else None


def _main(by_dtype: dict) -> str | None:
    total = sum(by_dtype.values())
    held = sorted(d for d, n in by_dtype.items() if total and n >= MAIN_SHARE * total)
    return "+".join(held) or None


def run_facts(census: dict) -> dict[str, str | None]:
    """The four facts of one run's census (None where the census holds nothing to tell it)."""
    masters = census.get("master_parameters") or {}
    params = census.get("parameters") or {}
    return {
        "compute": _main(params) if any(masters.values()) else None,
        "masters": _widest(masters) if any(masters.values()) else _widest(params),
        "gradients": _widest(census.get("gradients") or {}),
        "optimizer_states": _main(census.get("optimizer_states") or {}),
    }


def expected_facts(precision: str) -> dict[str, str]:
    """What the workload's policy (harness.model.training.PrecisionPolicy) holds: parameters in its
    precision (bf16 under fp8: the FP8 casts are transient), fp32 master weights, their fp32 gradients
    and fp32 Adam states."""
    compute = "bf16" if precision == "fp8" else precision
    return {"compute": compute, "masters": "fp32", "gradients": "fp32", "optimizer_states": "fp32"}


def census_policy(runs: list[dict], precision: str) -> dict:
    """runs: [{label, status, metrics: {memory_census}}] -> the policy each finished run held:
    facts (fact -> dtype -> labels), the runs that held another policy than the workload's (label ->
    [(fact, dtype held)]), the runs without a census, and `same`: every census agrees with the
    workload's policy (true, and said so, when no run has a census: then nothing was checked)."""
    expected = expected_facts(precision)
    facts: dict[str, dict[str, list[str]]] = {k: {} for k in FACTS}
    differ: dict[str, list[tuple[str, str]]] = {}
    without, own_masters = [], []
    for r in runs:
        census = (r.get("metrics") or {}).get("memory_census")
        if r.get("status") != "ok" or not census:
            without.append(r["label"])
            continue
        held = run_facts(census)
        if held["compute"] is None:
            own_masters.append(r["label"])
        for fact, dtype in held.items():
            if dtype is None:
                continue
            facts[fact].setdefault(dtype, []).append(r["label"])
            if dtype != expected[fact]:
                differ.setdefault(r["label"], []).append((fact, dtype))
    return {
        "expected": expected,
        "facts": facts,
        "differ": differ,
        "without_census": without,
        "parameters_are_masters": own_masters,
        "checked": len(runs) - len(without),
        "same": not differ,
    }
