"""What `harness plan` writes besides its table: a calibrated profile, a sweep spec, an export.

Kept apart from harness/commands/plan.py, which parses the flags and prints the table.
"""

from __future__ import annotations

import json
import sys

from harness.errors import SpecError


def calibrate_profile(args, profile) -> int:
    from harness.model.presets import PRESETS
    from harness.planner import calibrate, paper, published
    from harness.planner.hardware import save_profile

    samples, sources = [], []
    if args.calibrate:
        recs = calibrate.read_store(args.calibrate)
        samples += [s for s in map(calibrate.sample_from_record, recs) if s is not None]
        sources.append(args.calibrate)
    for path in args.calibrate_csv or []:
        if published.is_published_format(path):  # published GPU runs: the rows of this profile's device
            rows = [r for r in published.load(path) if not r.why_not and r.profile.name == profile.name]
            if not rows:
                raise SpecError("--calibrate-csv", f"{path}: no row the planner can express runs on {profile.name}")
            samples += [
                calibrate.Sample(r.shape, r.layout, r.workload, r.step_time_s, r.label, profile=r.profile) for r in rows
            ]
            sources.append(f"{path} ({len(rows)} rows on {profile.name})")
            continue
        runs = paper.load_sweep(path)
        samples += [
            calibrate.Sample(PRESETS[r.model], r.layout, r.workload, r.step_time_s, r.sweep)
            for r in runs
            if r.status == "ok"
        ]
        sources.append(path)
    prof, report = calibrate.fit(samples, profile, label=", ".join(sources))
    out = args.calibrate_out or f"{profile.name}-calibrated.yaml"
    save_profile(
        prof,
        out,
        header=f"# Calibrated by `harness plan` from {', '.join(sources)}\n"
        f"# fit: median |error| {report['median_abs_error_pct']:.1f}% over "
        f"{report['samples']} runs",
    )
    if args.format == "json":
        print(json.dumps({**report, "profile": out}))
    else:
        print(f"calibrated {profile.name} on {report['samples']} runs; fitted: {', '.join(report['fitted']) or 'none'}")
        print(
            f"step-time error: median {report['median_abs_error_pct']:.1f}%, mean "
            f"{report['mean_abs_error_pct']:.1f}%, max {report['max_abs_error_pct']:.1f}%"
        )
        for k, v in report["efficiency"].items():
            print(f"  {k:16s} {v:.4g}")
        print(f"saved calibrated profile to {out} (use it with --hardware {out})")
    return 0


def emit_sweep(args, fitting, profile, gpus_per_node) -> None:
    """A sweep spec of the top distinct layouts predicted to fit (harness/planner/output.py)."""
    from harness.planner.output import group, sweep_spec

    top = args.top or 20
    text, n, _ = sweep_spec(
        group(fitting, 5 * top),
        model=args.model,
        seq_len=args.seq_len,
        global_batch_size=args.global_batch_size,
        gpus=args.gpus,
        gpus_per_node=gpus_per_node,
        profile=profile,
        top=top,
    )
    from harness.files.atomic import Together

    with Together("--emit-sweep") as files:  # whole or not at all
        files.write(args.emit_sweep, text)
    if n == 0:
        print(
            f"warning: {args.emit_sweep} has no point: no layout predicted to fit uses a kernel this harness runs",
            file=sys.stderr,
        )


def export(args, shape, wl, fitting) -> int:
    """The best layout predicted to fit that the target expresses, in the target's format."""
    from harness.interop.exports import EXPORTERS, VERSIONS, exportable
    from harness.planner.schedules import schedule_label

    if not fitting:
        raise SpecError("--export", "no layout is predicted to fit")
    chosen = next((p for p in fitting if not exportable(p.layout, args.export, shape)), None)
    if chosen is None:
        raise SpecError(
            "--export",
            f"no layout predicted to fit can be expressed for {VERSIONS[args.export]}: "
            f"{exportable(fitting[0].layout, args.export, shape)}",
        )
    text, notes = EXPORTERS[args.export](shape, chosen.layout, wl)
    print(text)
    lay = chosen.layout
    cp = f"cp {lay.cp} {lay.cp_impl} " if lay.cp > 1 else ""
    print(
        f"# {args.export}: tp {lay.tp} {cp}pp {lay.pp} {schedule_label(lay)} dp {lay.dp}"
        f"{f' ep {lay.ep}' if lay.ep > 1 else ''} micro-batch "
        f"{lay.micro_batch_size} checkpointing {lay.activation_checkpointing} {lay.precision}, predicted "
        f"{chosen.memory_gib:.1f} GiB, "
        f"{chosen.step_time_s:.3g} s/step, MFU {chosen.mfu:.3f}",
        file=sys.stderr,
    )
    if chosen is not fitting[0]:
        print(
            f"# the fastest predicted layout cannot be expressed: {exportable(fitting[0].layout, args.export, shape)}",
            file=sys.stderr,
        )
    for note in notes:
        print(f"# note: {note}", file=sys.stderr)
    return 0
