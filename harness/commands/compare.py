"""`harness compare [SPEC.yaml]`: one workload under several engines, parity-checked, reported.

Without a SPEC it runs the built-in default on this machine: a tiny LLaMA with 2 processes
under the own engine (dp2, tp2, pp2, where that engine is present), DeepSpeed ZeRO-1/2/3 and
FSDP2 (both reshard modes), plus the single-device reference. Exit code 0 when every run
finished and the losses agree, 1 otherwise, 2 for a mistake in the spec (nothing launched).
With --baseline OLD.json (an earlier compare's JSON report) it also exits 1 when a run drifted from it.
"""

from __future__ import annotations

import os
import sys

from harness.commands import add_profile_steps_argument, add_set_argument, add_tensorboard_argument, tensorboard_dir

DESCRIPTION = __doc__.split(":", 1)[1].strip()

EXAMPLES = """\
examples:
  harness compare                                  # the built-in CPU default, a few minutes, into harness-out/
  harness compare --set workload.steps=3 --set parity_steps=2 --out /tmp/cmp
  harness compare examples/compare-cpu-bf16.yaml --store cmp.sqlite --timeout 300
  harness compare examples/ci/tiny-compare.yaml --baseline examples/ci/baseline.json   # a CI check
  harness compare examples/compare-cpu-decide.yaml --rounds 3 --profile-steps 0   # runs alternated, 3 rounds
  harness compare examples/compare-cpu-decide.yaml --interleave 1   # runs side by side, one step per turn"""


# Where a comparison writes by default: a folder of the working directory that git ignores, so a
# default run never overwrites the committed example reports under reports/.
DEFAULT_OUT = "harness-out"


def default_log_dir(store: str, name: str) -> str:
    """The runs' logs by default: next to the store, as given (a relative store keeps them relative)."""
    return os.path.join(os.path.dirname(store), "harness-logs", f"compare-{name}")


def add_arguments(p):
    p.add_argument(
        "spec", nargs="?", help="compare spec YAML (see harness/compare/spec.py); without it: the built-in CPU default"
    )
    add_set_argument(p, "compare spec")
    p.add_argument("--store", help="results SQLite file (default: the spec's `store`, else results.sqlite)")
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"directory for the report files compare-<name>.md/.html/.json (default: {DEFAULT_OUT}/)",
    )
    p.add_argument(
        "--logs", help="directory for the runs' logs (default: harness-logs/compare-<name>/ next to the store)"
    )
    p.add_argument("--timeout", type=float, help="per-run timeout in seconds (overrides the spec)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tensorboard_argument(p, "every run")
    add_profile_steps_argument(p, "every run")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="launch every run N times in alternating order and compare runs round by round (the round is "
        "the unit: a launch's steps share its load), so that load that changes during the comparison cancels "
        "(default 1: one launch each, then the first run again as a load-drift check)",
    )
    p.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="K",
        help="keep every run alive side by side and measure them in turns of K steps each, compared turn by "
        "turn, so that load both runs met within a turn cancels: for a machine other work loads (default 0: "
        "runs one after another)",
    )
    p.add_argument(
        "--baseline",
        metavar="OLD.json",
        help="an earlier compare's JSON report: exit 1 with one line per drift (a loss beyond the parity "
        "tolerance, a census byte count, a step-time ratio to the reference beyond --time-tolerance)",
    )
    p.add_argument(
        "--time-tolerance",
        type=float,
        metavar="FRACTION",
        help="with --baseline: how far a run's step time / the reference's may move (default 0.1: 10%%; inf: "
        "step times not compared)",
    )


def main(args) -> int:
    import copy
    import shlex

    from harness.commands.outputs import check_output_path
    from harness.commands.overrides import parse_with_overrides
    from harness.compare.orchestrate import check_before_launch, run_comparison
    from harness.compare.report_lock import report_lock
    from harness.compare.spec import DEFAULT, parse_compare_spec
    from harness.errors import SpecError
    from harness.report.compare import write_report
    from harness.report.policy import verdict_text
    from harness.spec import check_positive, check_positive_int, process_counts, read_yaml
    from harness.store import check_store

    raw = copy.deepcopy(DEFAULT) if args.spec is None else read_yaml(args.spec)
    cs = parse_with_overrides(raw, args.overrides, parse_compare_spec)  # every run is checked here: nothing launched
    if args.timeout is not None:
        cs.timeout_s = check_positive(args.timeout, "--timeout")
    rounds = check_positive_int(args.rounds, "--rounds")
    interleave = check_positive_int(args.interleave, "--interleave") if args.interleave else 0
    if interleave and rounds > 1:
        raise SpecError("--interleave", "takes no --rounds: the turns control the load drift")
    store = args.store or cs.store or "results.sqlite"
    check_store(store)
    check_output_path(args.out, "--out", directory=True)
    tensorboard = tensorboard_dir(args)  # checked before anything launches
    if tensorboard:  # every run this command launches inherits it (harness train reads it)
        from harness.measure.stream import TENSORBOARD_ENV

        os.environ[TENSORBOARD_ENV] = tensorboard
    if args.logs:
        check_output_path(args.logs, "--logs", directory=True)
    baseline, time_tolerance = _baseline(args, cs)  # read, checked and matched before anything launches
    check_before_launch(cs)  # kernels, launchers, something to compare: still nothing launched
    with report_lock(args.out, cs.name):  # refused here, before any launch, while another one writes this report
        print(
            f"compare {cs.name}: {process_counts([p.nproc for p in cs.runs])}; parity over the first "
            f"{cs.parity_steps} steps, tolerance {cs.tolerance:g} ({cs.tolerance_source})",
            file=sys.stderr,
        )
        _say_oversubscribed(cs)
        summary = run_comparison(
            cs,
            store_path=store,
            log_dir=args.logs or default_log_dir(store, cs.name),
            progress=not args.no_progress,
            profile_steps=args.profile_steps,
            rounds=rounds,
            interleave=interleave,
            drift_check=rounds == 1 and not interleave,  # with rounds or turns, those control the drift
        )
        summary["invocation"] = {  # what a reader runs to repeat it (the report's Engines section)
            "command": shlex.join(["harness", *sys.argv[1:]]),  # as typed: spec, --set overrides, options
            "spec": args.spec,
        }
        if baseline is not None:
            from harness.report.drift import compare_with_baseline

            summary["baseline"] = compare_with_baseline(baseline, summary, time_tolerance, args.baseline)
        paths = write_report(summary, args.out)
    print(f"verdict: {verdict_text(summary)}")  # failed runs with their cause, policy, parity, fingerprints
    from harness.report.compare_steps import console_lines

    for line in console_lines(summary):  # the fastest run and Why's pairs, as the report says them
        print(line)
    for p in summary["parity"]["runs"]:
        if p["verdict"] == "FAIL":
            print(f"  parity FAIL: {p['label']} {p['note']}")
    drifts = (summary.get("baseline") or {}).get("drifts") or []
    if baseline is not None:
        print(f"baseline {args.baseline}: {len(drifts)} drift(s)")
        for line in drifts:
            print(f"  drift: {line}")
    print(f"report: {paths['markdown']} {paths['html']}")
    return 0 if summary["verdict"] == "pass" and not drifts else 1


def _baseline(args, cs) -> tuple[dict | None, float | None]:
    """(the --baseline report, the time tolerance): a one-line error (exit 2) for an unreadable or
    malformed file, a report of another comparison (name, workload, no label in common: check_matches),
    or a tolerance without a baseline."""
    from harness.errors import SpecError
    from harness.report.drift import DEFAULT_TIME_TOLERANCE, check_matches, check_time_tolerance, load_baseline

    if args.baseline is None:
        if args.time_tolerance is not None:
            raise SpecError("--time-tolerance", "only with --baseline (the step times it compares)")
        return None, None
    given = DEFAULT_TIME_TOLERANCE if args.time_tolerance is None else args.time_tolerance
    tolerance = check_time_tolerance(given)
    baseline = load_baseline(args.baseline)
    check_matches(baseline, cs.name, cs.workload, [p.label for p in cs.runs], args.baseline)
    return baseline, tolerance


def _say_oversubscribed(cs) -> None:
    """A note before launch where a CPU run's processes x threads exceed this machine's cores: the report
    will mark it oversubscribed and leave its step times out of ranking and Why (parity still holds)."""
    from harness.compare.orchestrate import comparison_threads
    from harness.launch import cpu_cores
    from harness.launch.environment import _has_cuda

    device = cs.workload.get("device") or "auto"
    if device == "cuda" or (device == "auto" and _has_cuda()):
        return
    threads, cores = comparison_threads(cs), cpu_cores()
    over = sorted({p.nproc for p in cs.runs if p.nproc * threads > cores})
    if over:
        print(
            f"note: runs of {' or '.join(map(str, over))} processes x {threads} thread(s) each exceed this "
            f"machine's {cores} cores: oversubscribed; the report checks their parity but neither ranks nor "
            "explains their step times",
            file=sys.stderr,
        )
