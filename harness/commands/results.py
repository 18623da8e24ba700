"""`harness results export`: the results store as JSONL (whole records) or CSV (flat rows)."""

from __future__ import annotations

import sys

from harness.errors import SpecError
from harness.store import STATUSES

DESCRIPTION = "Export the results store (SQLite) as JSONL (whole records) or CSV (flat rows)."

EXAMPLES = """\
examples:
  harness results export > records.jsonl
  harness results export --format csv --sweep cpu-demo --status ok --out cpu-demo.csv"""


def add_arguments(p):
    sub = p.add_subparsers(dest="action", required=True)
    e = sub.add_parser(
        "export",
        help="write every record as JSONL or CSV",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=p.formatter_class,
    )
    e.add_argument("--store", default="results.sqlite")
    e.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    e.add_argument("--sweep")
    e.add_argument("--status", choices=STATUSES)
    e.add_argument("--out", help="file to write (default: stdout)")


def main(args) -> int:
    from harness.commands.outputs import check_output_path
    from harness.store import ResultsStore, check_store, export

    check_store(args.store, write=False)
    if args.out:
        check_output_path(args.out, "--out", directory=False)
    store = ResultsStore(args.store)
    records = store.records(sweep=args.sweep, status=args.status)
    if args.sweep is not None and not records:
        check_sweeps(store, [args.sweep], "--sweep")  # a sweep the store holds may have no record of --status
    text = export(records, args.format)
    if store.skipped_note():
        print(store.skipped_note(), file=sys.stderr)
    if args.out:
        from harness.files.atomic import Together

        with Together("--out") as files:  # whole or not at all
            files.write(args.out, text)
    else:
        sys.stdout.write(text)
    return 0


def check_sweeps(store, names: list[str], field: str) -> None:
    """Every sweep named is in the store: a misspelt name would select nothing, silently."""
    missing = [n for n in names if not store.records(sweep=n)]
    if missing:
        known = sorted({str(r.get("sweep")) for r in store.records() if r.get("sweep") is not None})
        shown = ", ".join(known[:8]) + (f" and {len(known) - 8} more" if len(known) > 8 else "")
        raise SpecError(
            field,
            f"no sweep {missing[0]!r} in {store.path}; " + (f"it holds {shown}" if known else "it holds no sweep"),
        )
