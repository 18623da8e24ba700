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
    e = sub.add_parser("export", help="write every record as JSONL or CSV", description=DESCRIPTION,
                       epilog=EXAMPLES, formatter_class=p.formatter_class)
    e.add_argument("--store", default="results.sqlite")
    e.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    e.add_argument("--sweep")
    e.add_argument("--status", choices=STATUSES)
    e.add_argument("--out", help="file to write (default: stdout)")


def main(args) -> int:
    from harness.spec import check_output_path
    from harness.store import ResultsStore, check_store, export

    check_store(args.store, write=False)
    if args.out:
        check_output_path(args.out, "--out", directory=False)
    store = ResultsStore(args.store)
    text = export(store.records(sweep=args.sweep, status=args.status), args.format)
    if store.skipped_note():
        print(store.skipped_note(), file=sys.stderr)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text)
        except OSError as e:
            raise SpecError("--out", f"cannot write {args.out}: {e}") from None
    else:
        sys.stdout.write(text)
    return 0
