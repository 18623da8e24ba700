"""Precision groups: the runs of one comparison that share a precision policy, each checked against a
single-device reference of that policy at that policy's tolerance.

A run's `workload` override may change the policy (the Workload fields PrecisionPolicy reads:
precision, fp8_recipe under fp8, grad_accum_dtype and grad_reduce_dtype under bf16 and fp8); the
runs of one policy are one group. The workload's own group keeps the reference's usual label;
another gets its own reference, "reference <policy> (single device)", the compare's workload with the
override's policy fields. Runs of different groups are never compared with each other: not in
parity (a difference between precisions is not a failure), not in the census's policy check (each
run against its own group's policy), not in a ranking of step times or memory (the project's rule:
engines are compared only under one precision policy). A comparison of one group is planned,
checked and summarised exactly as before groups existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.compare.muon_tolerance import matrix_bounds
from harness.compare.parity import PASS, check_parity
from harness.compare.policy import census_policy

POLICY_FIELDS = ("precision", "fp8_recipe", "grad_accum_dtype", "grad_reduce_dtype")
REFERENCE = "reference (single device)"
# fp8: bf16's x sqrt(2^5), e4m3's amplification of bf16's rounding differences (tests/test_fp8.py derives it);
# fp8 with fp8_recipe mxfp8: fp8's x sqrt(1 + 2^-4), its power-of-two block scales (harness.testing.equivalence)
DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3, "fp8": 5.7e-3, "mxfp8": 5.9e-3}
MUON_SOURCE = "; Muon matrices' final weights: plus their bf16 Newton-Schulz bound (compare/muon_tolerance.py)"


def policy_key(workload) -> tuple:
    """What makes two checked workloads (harness.spec Workload) one precision policy (model.training's
    precision_policy reads these fields, and under fp32 none but the precision)."""
    if workload.precision == "fp32":
        return ("fp32",)
    recipe = workload.fp8_recipe if workload.precision == "fp8" else None
    return (workload.precision, recipe, workload.grad_accum_dtype, workload.grad_reduce_dtype)


def policy_name(workload) -> str:
    """The policy in a few words: 'fp32', 'fp8 rowwise_with_gw_hp', 'bf16 grad reduce bf16'."""
    key = policy_key(workload)
    words = [key[0]] + ([key[1]] if key[1:2] and key[1] else [])
    if len(key) > 1:
        words += [f"grad accum {key[2]}"] * (key[2] != "fp32") + [f"grad reduce {key[3]}"] * (key[3] != "fp32")
    return " ".join(words)


def default_tolerance(workload) -> tuple[float, str]:
    """(DEFAULT_TOLERANCE of the workload's precision, mxfp8's for fp8 with fp8_recipe mxfp8; its source)."""
    precision = workload.precision
    key = "mxfp8" if precision == "fp8" and workload.fp8_recipe == "mxfp8" else precision
    return DEFAULT_TOLERANCE[key], f"default for {key}"


def reference_label(name: str, own: bool) -> str:
    return REFERENCE if own else f"reference {name} (single device)"


@dataclass
class PrecisionGroup:
    """One precision policy of a comparison: its reference's label (None without references), tolerance
    and Muon bounds, and the labels of its runs (its reference first)."""

    name: str
    reference: str | None
    tolerance: float
    tolerance_source: str
    muon_bounds: dict = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)
    workload_group: bool = True  # the compare's workload's own policy
    precision: str = "fp32"  # the workload's precision field (the census's expected policy follows it)

    def info(self, policy: str, workload) -> dict:
        """The summary's entry: what the report says of the group (policy: PrecisionPolicy.describe();
        workload: its checked Workload, whose policy fields the report's gradient sentence reads)."""
        return {
            "name": self.name,
            "reference": self.reference,
            "tolerance": self.tolerance,
            "tolerance_source": self.tolerance_source,
            "labels": list(self.labels),
            "workload_group": self.workload_group,
            "policy": policy,
            "fields": {k: getattr(workload, k) for k in POLICY_FIELDS},
        }


def new_group(spec, own: bool, given_tolerance: float | None, reference: bool) -> PrecisionGroup:
    """The group of a checked RunSpec's workload policy; given_tolerance: the compare spec's (one group only)."""
    w = spec.workload
    tolerance, source = (
        default_tolerance(w) if given_tolerance is None else (given_tolerance, "set in the compare spec")
    )
    muon = matrix_bounds(spec.shape(), w)  # Muon with a bf16 Newton-Schulz: its matrices' bounds
    name = policy_name(w)
    return PrecisionGroup(
        name,
        reference_label(name, own) if reference else None,
        tolerance,
        source + (MUON_SOURCE if muon else ""),
        muon,
        workload_group=own,
        precision=w.precision,
    )


def policy_override(override: dict) -> dict:
    """The precision-policy fields of a run's workload override: what its group's reference takes."""
    return {k: v for k, v in override.items() if k in POLICY_FIELDS}


def _by_group(runs: list[dict], cs) -> list[tuple[PrecisionGroup, list[dict]]]:
    """Each group with its runs (a group none of whose runs was planned, the workload's without a reference
    and every run overriding its precision, left out: it has nothing to check)."""
    return [(g, [r for r in runs if r["label"] in g.labels]) for g in cs.groups if g.labels]


def check_groups(runs: list[dict], cs) -> dict:
    """check_parity per group, each against its own anchor at its own tolerance. One group: check_parity's
    summary as it is. Several: the same keys over every group (each run's entry naming its group, anchor and
    tolerance; the pairwise matrix within groups only; the largest pairwise differences the largest within a
    group; no one tolerance or anchor: None), and `groups`, each group's own summary with its name."""
    if len(cs.groups) == 1:
        return check_parity(runs, cs.parity_steps, cs.tolerance, cs.muon_bounds)
    parts = []
    for g, members in _by_group(runs, cs):
        par = check_parity(members, cs.parity_steps, g.tolerance, g.muon_bounds)
        par.update(group=g.name, tolerance_source=g.tolerance_source, workload_group=g.workload_group)
        for p in par["runs"]:
            p.update(group=g.name, anchor=par["anchor"], tolerance=g.tolerance)
        parts.append(par)

    def most(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    weights = [p["weights"] for p in parts]
    return {
        "steps": cs.parity_steps,
        "trained_steps": min((p["trained_steps"] for p in parts if p["trained_steps"] is not None), default=None),
        "grad_norms": {
            "compared": [x for p in parts for x in p["grad_norms"]["compared"]],
            "not_compared": {k: v for p in parts for k, v in p["grad_norms"]["not_compared"].items()},
            "max_pairwise_rel_diff": most(p["grad_norms"]["max_pairwise_rel_diff"] for p in parts),
        },
        "weights": {
            "compared": [x for w in weights for x in w["compared"]],
            "not_compared": {k: v for w in weights for k, v in w["not_compared"].items()},
            "max_rel_diff": most(w["max_rel_diff"] for w in weights),
            "within": all(w["within"] for w in weights),
            "muon_bounds": {k: v for w in weights for k, v in w["muon_bounds"].items()},
            "muon_left_out": "; ".join(w["muon_left_out"] for w in weights if w["muon_left_out"]),
        },
        "tolerance": None,  # each group's: its runs' entries and `groups`
        "anchor": None,
        "anchor_kind": "per precision group: each run against its own group's anchor",
        "runs": [r for p in parts for r in p["runs"]],
        "pairwise_max_rel_diff": {a: row for p in parts for a, row in p["pairwise_max_rel_diff"].items()},
        "labels": [x for p in parts for x in p["labels"]],
        "max_pairwise_rel_diff": most(p["max_pairwise_rel_diff"] for p in parts),
        "cross_engine_ok": all(p["cross_engine_ok"] for p in parts),
        "verdict": PASS if all(p["verdict"] == PASS for p in parts) else "FAIL",
        "groups": parts,
    }


def check_policies(runs: list[dict], cs, precision: str) -> dict:
    """census_policy per group, each run against its own group's policy (precision: the workload's). One
    group: census_policy's summary as it is; several: the runs' facts and differences together, `same` over
    every group, and `groups`, each group's own summary with its name."""
    if len(cs.groups) == 1:
        return census_policy(runs, precision)
    parts = []
    for g, members in _by_group(runs, cs):
        part = census_policy(members, g.precision)
        part["group"] = g.name
        parts.append(part)
    facts: dict = {}
    for p in parts:
        for fact, by in p["facts"].items():
            for dtype, labels in by.items():
                facts.setdefault(fact, {}).setdefault(dtype, []).extend(labels)
    return {
        "expected": None,  # each group's: `groups`
        "facts": facts,
        "differ": {k: v for p in parts for k, v in p["differ"].items()},
        "without_census": [x for p in parts for x in p["without_census"]],
        "parameters_are_masters": [x for p in parts for x in p["parameters_are_masters"]],
        "checked": sum(p["checked"] for p in parts),
        "same": all(p["same"] for p in parts),
        "groups": parts,
    }
