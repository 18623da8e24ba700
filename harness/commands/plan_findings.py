"""`harness plan --findings`: the reference study's findings as the plan predicts them on each
--hardware profile (harness/planner/findings.py), so that one sees which move with the hardware.

The table has one row per finding and one column per profile (the verdict and the compared layouts'
distinguishing values with their MFUs), and a last column saying whether the judged profiles agree;
the compared layouts follow in full. --format json prints the same as one JSON object.
"""

from __future__ import annotations

import json

from harness.planner.findings import QUESTIONS, Finding, judge, label, same_everywhere


def _across(same: bool | None) -> str:
    return "-" if same is None else "same" if same else "moves"


def _calibration(profile_names: list[str], profiles: dict) -> dict:
    """Each profile's calibration error (the median step-time error of its fit), or None: literature constants."""
    return {name: profiles[name].calibrated.get("median_abs_error_pct") for name in profile_names}


def show_findings(args, plans: dict, profiles: dict) -> int:
    """plans: profile name -> that profile's ranked predictions (commands/plan.py's plan_of);
    profiles: profile name -> Profile."""
    names = list(plans)
    judged = {name: judge(preds) for name, preds in plans.items()}
    rows = {key: [next(f for f in judged[name] if f.key == key) for name in names] for key in QUESTIONS}
    calibration = _calibration(names, profiles)
    if args.format == "json":
        print(
            json.dumps(
                {
                    "model": args.model,
                    "seq_len": args.seq_len,
                    "global_batch_size": args.global_batch_size,
                    "gpus": args.gpus,
                    "profiles": names,
                    "calibration_error_pct": calibration,
                    "findings": [
                        {
                            "finding": key,
                            "question": QUESTIONS[key],
                            "profiles": {name: f.to_dict() for name, f in zip(names, cells, strict=True)},
                            "same_on_every_profile": same_everywhere(cells),
                        }
                        for key, cells in rows.items()
                    ],
                }
            )
        )
        return 0
    print(
        f"{args.model} seq {args.seq_len} batch {args.global_batch_size} on {args.gpus} GPUs: the study's findings "
        "as the plan predicts them (best layout predicted to fit with the property vs without, MFU)"
    )
    table = [["finding", *names, "across profiles"]]
    table += [
        [QUESTIONS[key], *(f.cell() for f in cells), _across(same_everywhere(cells))] for key, cells in rows.items()
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    print("compared layouts (MFU, layout):")
    for key, cells in rows.items():
        print(f"  {QUESTIONS[key]}")
        for name, f in zip(names, cells, strict=True):
            print(f"    {name}: {_layouts(f)}")
    for name, err in calibration.items():
        checked = profiles[name].calibrated.get("checked_on")  # another device's fitted constants, checked here
        if err and checked:
            cal = profiles[name].calibrated
            print(
                f"{name}: {cal.get('constants_of', 'another profile')}'s fitted constants, checked on "
                f"{cal.get('samples')} published {name} runs: median step-time error {err:.1f}%"
            )
        elif err:
            print(f"{name}: calibrated, median step-time error {err:.1f}% (MFU differences within it are not resolved)")
        else:
            print(f"{name}: not calibrated (literature constants, error unknown)")
    return 0


def _layouts(f: Finding) -> str:
    if not f.judged:
        return f"not judged: {f.why}"
    text = f"{f.with_.mfu:.3f} {label(f.with_.layout)}"
    if f.key == "best_mfu":
        return text
    other = f"{f.without.mfu:.3f} {label(f.without.layout)}" if f.without else "nothing fits with sp off"
    return f"{text} | vs {other}"
