"""`harness report [--sweep NAME] [--store PATH] --out DIR`: argument handling only."""

from __future__ import annotations

import sys

from harness.errors import SpecError

DESCRIPTION = """\
Write a Markdown report and a single-file HTML report (plots, ablations, time breakdown,
failures, quoted published baselines, recommendations) from the records in a results store."""

EXAMPLES = """\
examples:
  harness report --out reports/all                 # every record in results.sqlite
  harness report --sweep cpu-demo --store results.sqlite --out harness-out/cpu-demo
  harness report --sweep a --sweep b --title "a against b" --out reports/ab"""


def add_arguments(p) -> None:
    p.add_argument("--sweep", action="append", help="only this sweep (repeatable; default: every record)")
    p.add_argument("--store", default="results.sqlite", help="results store (default: results.sqlite)")
    p.add_argument("--out", required=True, help="directory for report.md, report.html and img/")
    p.add_argument("--title", help="report title")
    p.add_argument(
        "--timeline-run",
        metavar="RUN_ID",
        help="draw this run's pipeline schedule (id or prefix; default: the best pipelined run)",
    )
    p.add_argument("--baselines", help="directory of published figures (default: the baselines/ harness ships)")


def main(args) -> int:
    from harness.commands.outputs import check_output_path
    from harness.report.build import build_report
    from harness.store import ResultsStore, check_store

    check_store(args.store, write=False)
    check_output_path(args.out, "--out", directory=True)
    if args.baselines is not None:
        _check_baselines(args.baselines)
    store = ResultsStore(args.store)
    records = []
    for name in args.sweep or [None]:
        records += store.records(sweep=name)
    if store.skipped_note():
        print(store.skipped_note(), file=sys.stderr)
    if not records:
        raise SpecError("--sweep" if args.sweep else "--store", "no records to report on")
    if args.sweep and len(args.sweep) > 1:  # one misspelt name among several would be left out silently
        from harness.commands.results import check_sweeps

        check_sweeps(store, args.sweep, "--sweep")
    if args.timeline_run:
        chosen = {r["run_id"] for r in records if str(r.get("run_id")).startswith(args.timeline_run)}
        if len(chosen) != 1:
            raise SpecError(
                "--timeline-run",
                f"{args.timeline_run!r} is the start of "
                f"{'no' if not chosen else len(chosen)} run ids of these records"
                + ("" if not chosen else ": give more of it"),
            )
    title = args.title or ("Sweep report: " + ", ".join(args.sweep) if args.sweep else "Layout sweep report")
    paths = build_report(records, args.out, title=title, baselines_dir=args.baselines, timeline_run=args.timeline_run)
    print(f"wrote {paths['markdown']} and {paths['html']} from {len(records)} records")
    return 0


def _check_baselines(folder: str) -> None:
    """A --baselines that would be ignored (missing, a file, a folder without published figures) is refused."""
    import os

    from harness.report import published_figures

    if not os.path.isdir(folder):
        raise SpecError(
            "--baselines",
            f"{folder} is {'a file' if os.path.exists(folder) else 'missing'}; give a folder of published figures",
        )
    if not any(published_figures.load(folder).values()):
        raise SpecError(
            "--baselines",
            f"{folder} holds no published figures (hagemann2023_best.csv, "
            "published_mfu.csv, as in the baselines/ folder harness ships)",
        )
