"""Loss parity and fingerprint agreement of the runs of one comparison.

Parity: the per-step losses of the first N steps (by default every step a run trains, warm-up
included) of every run must agree with the reference's - the single-device engine when it ran,
else the first successful run - within a relative tolerance, and with each other (the largest
pairwise difference is reported). A run without losses (failed, oom, timeout) cannot prove
parity: its verdict is `no data`, its note "run failed: <cause>", and the comparison fails; the
pairwise difference needs two finished runs (None otherwise).

Gradient norms: each step's global norm of the full gradient before clipping (the engine's own,
TrainingEngine.grad_norm) is compared the same way, at the same relative tolerance: with
clipping on, every update is the gradient times clip / norm, so a norm off by r moves every
weight by r relatively, the bound the loss tolerance already sets on training alike; and the norm
is a reduction over the same tokens in the same precision as the loss. A run whose engine gave
no norm (FSDP2 without clipping, DeepSpeed ZeRO-0 in fp32) is listed with that reason, its loss
verdict standing; a norm outside the tolerance fails the run.

Final weights: each run's fingerprint of its weights after the trained steps (harness.measure.weights,
gathered on rank 0 by the engine's full_state_dict) against the anchor's, at the same tolerance relative
to each parameter's norm; a run without one is listed with the reason its record gives.

Muon with Newton-Schulz in bf16 (harness.compare.muon_tolerance): a Muon matrix's final weights are compared
at the tolerance plus B / ||W||, the bound on two runs' difference relative to the anchor's norm of it, and
not compared where that is 1 or more (the bound is then the weights' own scale: said in the weights' note).

Fingerprints: hosts, devices and library versions must be the same for every run; a
difference is flagged (world size and environment variables are expected to differ).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.compare.muon_tolerance import relative_bounds
from harness.measure.weights import fingerprint_rel_diff
from harness.store import FAIL, NO_DATA, PASS, failure  # noqa: F401 - the verdicts, recorded with each run

FINGERPRINT_GROUPS = {
    "hosts": ("hosts",),
    "devices": ("device_type", "device_name", "device_count", "cpu_model", "cpu_cores", "driver"),
    "library versions": ("torch", "cuda", "nccl", "deepspeed", "transformers", "flash_attn", "python"),
}
FINGERPRINT_IGNORED = ("world_size", "env")


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def max_rel_diff(xs: list[float], ys: list[float], n: int) -> tuple[float, int]:
    """(largest relative difference over the first n steps, the step where it occurs)."""
    worst, at = 0.0, 0
    for i, (a, b) in enumerate(zip(xs[:n], ys[:n], strict=False)):
        d = rel_diff(a, b)
        if d != d:  # NaN
            return float("inf"), i
        if d > worst:
            worst, at = d, i
    return worst, at


@dataclass
class RunParity:
    label: str
    verdict: str
    max_rel_diff: float | None
    worst_step: int | None
    note: str = ""
    grad_norm_rel_diff: float | None = None  # None: not compared (grad_norm_note says why)
    grad_norm_worst_step: int | None = None
    grad_norm_note: str = ""
    weights_rel_diff: float | None = None  # None: not compared (weights_note says why)
    weights_note: str = ""


NO_NORM = (
    "no gradient norm recorded: {engine} computed none in this run (FSDP2 without clipping, DeepSpeed ZeRO-0 in fp32)"
)


def grad_norms(run: dict, n: int) -> list[float] | None:
    """The run's first n gradient norms, None where it has fewer or any is missing."""
    norms = run.get("grad_norms") or (run.get("metrics") or {}).get("grad_norms") or []
    norms = norms[:n]
    return norms if len(norms) == n and all(g is not None for g in norms) else None


def _weights_parity(p: RunParity, run: dict, anchor: dict, tolerance: float, muon: dict) -> bool:
    """Compare the run's final-weights fingerprint with the anchor's into p (a difference fails the run);
    muon: {Muon matrix: B / ||W||}, added to its tolerance below 1, the matrix left out at 1 or more.
    Whether every compared tensor is within its tolerance (True where none was compared)."""
    mine, ref = (((r.get("metrics") or {}).get("weights_fingerprint")) for r in (run, anchor))
    if not isinstance(ref, dict):
        p.weights_note = f"not compared: the anchor ({anchor['label']}) has no weights fingerprint"
        return True
    if not isinstance(mine, dict):
        p.weights_note = mine if isinstance(mine, str) else "no weights fingerprint in its record (none gathered)"
        return True
    left_out = [n for n, r in muon.items() if r >= 1]  # said once, in the summary's weights (check_parity)
    ref = {n: v for n, v in ref.items() if n not in left_out}
    mine = {n: v for n, v in mine.items() if n not in left_out}
    if set(mine) != set(ref):
        p.weights_rel_diff, at = fingerprint_rel_diff(mine, ref)  # inf: a tensor one of them lacks
        failed, d = True, p.weights_rel_diff
    else:  # each tensor against its own tolerance (a Muon matrix's widened by its bound)
        diffs = {n: fingerprint_rel_diff({n: mine[n]}, {n: ref[n]})[0] for n in ref}
        p.weights_rel_diff = max(diffs.values(), default=0.0)
        at = max(diffs, key=lambda n: diffs[n] / (tolerance + muon.get(n, 0.0)), default=None)
        d = diffs[at] if at is not None else 0.0
        failed = d > tolerance + muon.get(at, 0.0)
    if failed:
        p.verdict = FAIL
        p.note = "; ".join(x for x in (p.note, f"final weights: {at} differs by {d:.1e}") if x)
    return not failed


MUON_LEFT_OUT = (
    "the final weights of {n} Muon matrices are not compared: under bf16 Newton-Schulz two runs' difference in "
    "each is bounded only by {low:.2g} of its norm or more (harness/compare/muon_tolerance.py)"
)


def _grad_parity(p: RunParity, run: dict, anchor: dict, n: int, tolerance: float) -> None:
    """Compare the run's gradient norms with the anchor's into p (a norm off fails the run)."""
    mine, ref = grad_norms(run, n), grad_norms(anchor, n)
    if ref is None:
        p.grad_norm_note = f"not compared: the anchor ({anchor['label']}) has no gradient norms"
        return
    if mine is None:
        p.grad_norm_note = NO_NORM.format(engine=run.get("engine") or "its engine")
        return
    p.grad_norm_rel_diff, p.grad_norm_worst_step = max_rel_diff(mine, ref, n)
    if p.grad_norm_rel_diff > tolerance:
        at = p.grad_norm_worst_step
        p.verdict = FAIL
        p.note = "; ".join(x for x in (p.note, f"gradient norm at step {at}: {mine[at]:.7g} vs {ref[at]:.7g}") if x)


def check_parity(runs: list[dict], n: int, tolerance: float, muon_bounds: dict | None = None) -> dict:
    """runs: [{label, status, losses, is_reference}] -> verdict per run, pairwise matrix, overall.
    muon_bounds: {Muon matrix: B, the bound on two runs' final difference} (muon_tolerance.matrix_bounds)."""
    usable = [r for r in runs if r["status"] == "ok" and len(r.get("losses") or []) >= n]
    anchor = next((r for r in usable if r.get("is_reference")), None)
    anchor_kind = "single-device reference"
    if anchor is None and usable:
        anchor, anchor_kind = usable[0], f"first successful run ({usable[0]['label']}); the reference did not run"
    muon = relative_bounds(muon_bounds or {}, ((anchor or {}).get("metrics") or {}).get("weights_fingerprint"))
    per_run, weights_within, out = [], True, [k for k, r in muon.items() if r >= 1]
    for r in runs:
        if r not in usable:
            why = failure(r) if r["status"] != "ok" else f"fewer than {n} losses"
            per_run.append(RunParity(r["label"], NO_DATA, None, None, why))
            continue
        d, at = max_rel_diff(r["losses"], anchor["losses"], n)
        verdict = PASS if d <= tolerance else FAIL
        note = "" if verdict == PASS else (f"step {at}: {r['losses'][at]:.7g} vs {anchor['losses'][at]:.7g}")
        p = RunParity(r["label"], verdict, d, at, note)
        _grad_parity(p, r, anchor, n, tolerance)
        weights_within &= _weights_parity(p, r, anchor, tolerance, muon)
        per_run.append(p)
    labels = [r["label"] for r in usable]
    matrix = {a["label"]: {b["label"]: max_rel_diff(a["losses"], b["losses"], n)[0] for b in usable} for a in usable}
    # between two finished runs at least: one run alone (the others failed) is no agreement of 0
    spread = max((v for row in matrix.values() for v in row.values()), default=0.0) if len(usable) > 1 else None
    ok = bool(usable) and all(p.verdict == PASS for p in per_run)
    normed = [grad_norms(r, n) for r in usable if grad_norms(r, n) is not None]
    # the largest difference between any two runs that gave norms (None: fewer than two)
    grad_spread = max(max_rel_diff(a, b, n)[0] for a in normed for b in normed) if len(normed) > 1 else None
    within = (spread is None or spread <= tolerance) and (grad_spread is None or grad_spread <= tolerance)
    return {
        "steps": n,
        "trained_steps": min((len(r["losses"]) for r in usable), default=None),
        "grad_norms": {
            "compared": [p.label for p in per_run if p.grad_norm_rel_diff is not None],
            "not_compared": {p.label: p.grad_norm_note for p in per_run if p.grad_norm_note},
            "max_pairwise_rel_diff": grad_spread,
        },
        "weights": {
            "compared": [p.label for p in per_run if p.weights_rel_diff is not None],
            "not_compared": {p.label: p.weights_note for p in per_run if p.weights_note},
            "max_rel_diff": max((p.weights_rel_diff for p in per_run if p.weights_rel_diff is not None), default=None),
            "within": weights_within,  # each tensor within its tolerance (a Muon matrix's: plus its bound)
            # {Muon matrix: B / ||W||}: added to its tolerance below 1, left out at 1 or more
            "muon_bounds": muon,
            "muon_left_out": MUON_LEFT_OUT.format(n=len(out), low=min(muon[k] for k in out)) if out else "",
        },
        "tolerance": tolerance,
        "anchor": anchor["label"] if anchor else None,
        "anchor_kind": anchor_kind if anchor else "none: no run finished",
        "runs": [p.__dict__ for p in per_run],
        "pairwise_max_rel_diff": matrix,
        "labels": labels,
        "max_pairwise_rel_diff": spread,
        "cross_engine_ok": within,
        "verdict": PASS if ok and within else FAIL,
    }


def _flatten(fp: dict) -> dict:
    out = {}
    for k, v in (fp or {}).items():
        if k in FINGERPRINT_IGNORED:
            continue
        out[k] = tuple(v) if isinstance(v, list) else v
    return out


def compare_fingerprints(runs: list[dict]) -> dict:
    """runs: [{label, fingerprint}] -> {same: bool, differences: [{group, key, values{label: v}}]}."""
    flat = {r["label"]: _flatten(r.get("fingerprint") or {}) for r in runs if r.get("fingerprint")}
    keys = sorted({k for fp in flat.values() for k in fp})
    group_of = {k: g for g, ks in FINGERPRINT_GROUPS.items() for k in ks}
    differences = []
    for key in keys:
        values = {label: fp.get(key) for label, fp in flat.items()}
        if len({repr(v) for v in values.values()}) > 1:
            differences.append(
                {
                    "group": group_of.get(key, "other"),
                    "key": key,
                    "values": {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()},
                }
            )
    missing = [r["label"] for r in runs if not r.get("fingerprint")]
    flagged = sorted({d["group"] for d in differences})
    return {
        "same": not differences,
        "differences": differences,
        "flagged_groups": flagged,
        "without_fingerprint": missing,
        "common": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in (next(iter(flat.values()), {}) or {}).items()
            if not any(d["key"] == k for d in differences)
        },
    }
