"""The comparison report's view of precision groups (harness.compare.groups): a comparison whose runs hold
several precision policies checks each run against its own group's single-device reference at its group's
tolerance, and sets runs side by side (parity, step times, memory, routing) only within a group: a difference
between precisions is neither a parity failure nor a fair ranking of engines. A summary of one group (every
summary before groups existed) has no `precision_groups`: every function here then sees one group, None.
"""

from __future__ import annotations

from harness.report.policy import check_texts, sci, steps_text

GROUPS_TEXT = (
    "The runs hold {n} precision policies, each a precision group checked on its own: each run's per-step "
    "losses over {steps} (warm-up included), each step's global gradient norm before clipping and its final "
    "weights where the engine gives them are compared with its own group's anchor at its group's tolerance. "
    "Runs of different groups are not compared with each other, here or in any ranking of step times or "
    "memory: a difference between precisions is not a parity failure, and engines compare only under one "
    "precision policy."
)


OWN = " (the workload's)"


def group_of(run: dict) -> str | None:
    """The run's precision group's name (None: the comparison has one group)."""
    return run.get("precision_group")


def several(summary: dict) -> bool:
    return len(summary.get("precision_groups") or []) > 1


def partitions(summary: dict) -> list[tuple[str | None, dict]]:
    """(group name, the summary with that group's runs only) per precision group, in the runs' order;
    [(None, summary)] where the comparison has one group."""
    if not several(summary):
        return [(None, summary)]
    by: dict = {}
    for r in summary["runs"]:
        by.setdefault(group_of(r), []).append(r)
    return [(name, {**summary, "runs": runs}) for name, runs in by.items()]


def group_reference(run: dict, summary: dict, finished: bool = False) -> dict | None:
    """The single-device reference of the run's precision group (finished: only one that finished)."""
    return next(
        (
            r
            for r in summary.get("runs") or []
            if r.get("is_reference") and group_of(r) == group_of(run) and (not finished or r.get("status") == "ok")
        ),
        None,
    )


def policy_of(run: dict, summary: dict) -> str | None:
    """The precision policy (PrecisionPolicy.describe()) the run was asked to hold: its group's."""
    for g in summary.get("precision_groups") or []:
        if g["name"] == group_of(run):
            return g.get("policy")
    return summary.get("precision_policy")


def titled(name: str | None, text: str) -> str:
    """A partition's text with its group named ('' prefix for one group)."""
    return text if name is None else f"Precision group **{name}**: {text}"


def group_parity_texts(summary: dict) -> list[str]:
    """The parity section's lead for several groups: how they are checked, then per group its runs, anchor,
    tolerance, largest difference between two of its finished runs and its gradient-norm and weights checks."""
    par = summary["parity"]
    out = [GROUPS_TEXT.format(n=len(par["groups"]), steps=steps_text(par))]
    for g in par["groups"]:
        spread = g["max_pairwise_rel_diff"]
        agree = (
            "fewer than two of its runs finished: no difference between runs to give"
            if spread is None
            else f"largest difference between two of its finished runs {sci(spread)} "
            f"({'within' if g['cross_engine_ok'] else 'OUTSIDE'} tolerance)"
        )
        anchor = f"the {g['anchor_kind']} (`{g['anchor']}`)" if g["anchor"] else "no anchor: none of its runs finished"
        lead = (
            f"Precision group **{g['group']}**{OWN if g.get('workload_group') else ''}: "
            f"{', '.join(g['labels'])} against {anchor}, tolerance "
            f"**{g['tolerance']:g}** ({g['tolerance_source']}); {agree}."
        )
        out += [lead, *check_texts(g)]
    return out
