"""The comparison's verdict and its precision-policy sentence, in words, from the summary.

The policy sentence says what every run held at its first optimizer step (the summary's `policy`,
harness/compare/policy.py: derived from each run's memory census), not what the spec asked for;
the verdict names every reason it is not PASS: a run that failed (with its cause, never a parity
figure), runs that held another precision policy, loss parity among the finished runs, and
fingerprints.
"""

from __future__ import annotations

from harness.spec.schema import BF16_PRECISIONS
from harness.store import PASS, failure

FACT_NAMES = {
    "compute": "parameters for compute",
    "masters": "master weights",
    "gradients": "gradients held at the optimizer step",
    "optimizer_states": "optimizer states",
}


def sci(x) -> str:
    """A relative difference as the report prints it ('-' for none)."""
    return "-" if x is None else "0" if x == 0 else f"{x:.1e}"


def configured_text(workload: dict) -> str:
    """What the workload asks of gradients, which no census shows."""
    bf16 = workload.get("precision") in BF16_PRECISIONS
    accum = (workload.get("grad_accum_dtype") or "fp32") if bf16 else "fp32"
    reduce = (workload.get("grad_reduce_dtype") or "fp32") if bf16 else "fp32"
    if accum == reduce:
        return f"gradients accumulated over micro-batches and reduced across data-parallel ranks in {accum}"
    return f"gradients accumulated over micro-batches in {accum} and reduced across data-parallel ranks in {reduce}"


def held_text(items: list) -> str:
    """[(fact, dtype)] of one run, in words: 'master weights bf16, optimizer states bf16'."""
    return ", ".join(f"{FACT_NAMES[fact]} {dtype}" for fact, dtype in items)


def _held(one: dict[str, str]) -> str:
    compute, masters = one.get("compute"), one.get("masters")
    parts = []
    if compute and compute != masters:
        parts += [f"{compute} {FACT_NAMES['compute']}", f"{masters} {FACT_NAMES['masters']}"]
    elif masters:
        parts.append(f"{masters} parameters")
    parts += [f"{one[k]} {FACT_NAMES[k]}" for k in ("gradients", "optimizer_states") if one.get(k)]
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] if parts else "nothing"


def policy_sentence(summary: dict, runs: str = "every run") -> str:
    """The workload section's policy sentence: from every run's census (summary['policy']); runs: whose."""
    pol, configured = summary.get("policy"), summary.get("precision_policy") or "not recorded"
    if pol and pol.get("groups"):
        return _groups_sentence(summary)
    if not pol:
        return f"Precision policy, as configured (this summary predates the census check): {configured}."
    if not pol["checked"]:
        return f"Precision policy: not checked, no run recorded a memory census; configured: {configured}."
    gradients = configured_text(summary.get("workload") or {})
    if not pol["same"]:
        runs = "; ".join(f"{label}: {held_text(items)}" for label, items in pol["differ"].items())
        return (
            f"Precision policy: the runs DIFFER. The workload's: {configured}; read from each run's memory census "
            f"at its first optimizer step, these runs held another: {runs}."
        )
    one = {fact: next(iter(by), None) for fact, by in pol["facts"].items()}
    without = pol["without_census"]
    every = f"{runs} with a census (none for {', '.join(without)})" if without else runs
    out = (
        f"Precision policy, the same for {every} (read from each run's memory census at its first optimizer "
        f"step): {_held(one)}"
    )
    compute, masters = one.get("compute"), one.get("masters")
    if compute and compute != masters and pol["parameters_are_masters"]:
        out += (
            f"; {', '.join(pol['parameters_are_masters'])} held no separate {compute} copy at that step (their "
            f"parameters are the {masters} masters)"
        )
    return f"{out}. Configured, which no census shows: {gradients}.{fp8_text(summary)}"


def _groups_sentence(summary: dict) -> str:
    """Several precision groups (harness.compare.groups): each group's sentence, its runs' censuses against
    its own policy."""
    infos = {g["name"]: g for g in summary.get("precision_groups") or []}
    texts = []
    for part in summary["policy"]["groups"]:
        g = infos.get(part["group"]) or {}
        workload = {**(summary.get("workload") or {}), **(g.get("fields") or {})}
        one = {**summary, "policy": part, "precision_policy": g.get("policy"), "workload": workload}
        texts.append(f"**{part['group']}**: {policy_sentence({**one, 'fp8_vs_bf16': None}, 'every run of the group')}")
    return (
        "Precision policy, by precision group (each run's census against its own group's policy): "
        + " ".join(texts)
        + fp8_text(summary)
    )


def fp8_text(summary: dict) -> str:
    """The measured cost of FP8: the fp8 reference's losses against the bf16 reference's ('' without)."""
    d = summary.get("fp8_vs_bf16")
    if not d:
        return ""
    return (
        f" FP8 against bf16, measured (single-device references, the same weights and batches): max relative loss "
        f"difference {sci(d['max_rel_diff'])} over the first {d['steps']} steps (step {d['worst_step']})."
    )


def reasons(summary: dict) -> list[str]:
    """Every reason the verdict gives, in order: failed runs with their cause, runs that held another
    precision policy, loss parity among the finished runs, fingerprints."""
    par, runs = summary["parity"], summary.get("runs") or []
    out = [f"{r['label']}: {failure(r)}" for r in runs if r["status"] != "ok"]
    pol = summary.get("policy")
    if pol and not pol["same"]:
        out.append("runs differ in precision policy (" + ", ".join(pol["differ"]) + ")")
    status = {r["label"]: r["status"] for r in runs}
    out += [
        f"{p['label']}: no loss parity ({p['note']})"
        for p in par["runs"]
        if p.get("max_rel_diff") is None and status.get(p["label"]) == "ok"
    ]
    for part in par.get("groups") or [par]:  # each precision group on its own (harness.compare.groups)
        out += _parity_reasons(part, f" of precision group {part['group']}" if "group" in part else "")
    fp = summary["fingerprints"]
    out.append(
        "fingerprints " + ("identical" if fp["same"] else "DIFFER (" + ", ".join(fp.get("flagged_groups", [])) + ")")
    )
    return out


def _parity_reasons(par: dict, of: str) -> list[str]:
    """Loss parity, gradient norms and final weights among the finished runs of one parity check (of: which
    runs, '' for every run of a one-group comparison)."""
    finished = [p for p in par["runs"] if p.get("max_rel_diff") is not None]
    if par.get("max_pairwise_rel_diff") is None:
        return [f"loss parity{of} not checked: {len(finished)} run(s) finished, two are needed"]
    tol = par["tolerance"]
    holds = all(p["max_rel_diff"] <= tol for p in finished) and par["max_pairwise_rel_diff"] <= tol
    out = [
        f"loss parity {'holds' if holds else 'FAILS'} across the {len(finished)} finished runs{of} "
        f"(max pairwise relative difference {sci(par['max_pairwise_rel_diff'])}"
        + (f" over {steps_text(par)}, " if par.get("steps") else ", ")
        + f"tolerance {par['tolerance']:g})"
    ]
    grads = par.get("grad_norms")
    if grads is not None:
        out.append(grad_norm_text(grads, par["tolerance"]))
    if par.get("weights") is not None:
        out.append(weights_text(par["weights"], par["tolerance"]))
    return out


def steps_text(par: dict) -> str:
    """'10 steps', or '5 of the 10 steps' where a spec compared fewer than the runs trained."""
    n, trained = par["steps"], par.get("trained_steps")
    return f"{n} of the {trained} trained steps" if trained and trained > n else f"{n} steps"


def grad_norm_text(grads: dict, tolerance: float) -> str:
    """What the gradient-norm check covered: how many runs, their largest difference, who gave none."""
    done, spread = grads["compared"], grads.get("max_pairwise_rel_diff")
    agree = "agree" if spread is None or spread <= tolerance else "DIFFER"
    text = (
        f"gradient norms {agree} across {len(done)} run(s)"
        + (f" (max pairwise relative difference {sci(spread)}, tolerance {tolerance:g})" if spread is not None else "")
        if done
        else "gradient norms not compared"
    )
    missing = grads.get("not_compared") or {}
    return text + (f"; none from {', '.join(missing)}" if missing else "")


def weights_text(weights: dict, tolerance: float) -> str:
    """What the final-weights check covered: how many runs, the largest difference, who has none and why."""
    done, worst = weights["compared"], weights.get("max_rel_diff")
    agree = "agree" if weights.get("within", worst is None or worst <= tolerance) else "DIFFER"
    text = (
        f"final weights {agree} for {len(done)} run(s) (max relative difference {sci(worst)} of a parameter's norm "
        "or random projection, to its norm)"
        if done
        else "final weights not compared"
    )
    missing = weights.get("not_compared") or {}
    left_out = f"; {weights['muon_left_out']}" if weights.get("muon_left_out") else ""  # harness.compare.parity
    return text + left_out + "".join(f"; {label}: {why}" for label, why in missing.items())


def check_texts(par: dict) -> list[str]:
    """The gradient-norm and final-weights checks as sentences (none where the summary predates them)."""
    texts = [grad_norm_text(par["grad_norms"], par["tolerance"])] if par.get("grad_norms") is not None else []
    texts += [weights_text(par["weights"], par["tolerance"])] if par.get("weights") is not None else []
    return [t[0].upper() + t[1:] + "." for t in texts]


def verdict_text(summary: dict) -> str:
    """'PASS' or 'FAIL', then every reason (reasons())."""
    return f"{'PASS' if summary['verdict'] == PASS else 'FAIL'} - " + "; ".join(reasons(summary))


def parity_cell(run: dict, parity: dict) -> str:
    """The results table's loss-parity cell: the verdict, or 'run failed: <cause>' (no figure)."""
    return failure(run) if run["status"] != "ok" else parity.get("verdict", "-")
