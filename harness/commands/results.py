"""`harness results export`: the results store as JSONL (whole records) or CSV (flat rows)."""

from __future__ import annotations

import os
import sys

from harness.errors import SpecError
from harness.store import STATUSES


def add_arguments(p):
    sub = p.add_subparsers(dest="action", required=True)
    e = sub.add_parser("export", help="write every record as JSONL or CSV")
    e.add_argument("--store", default="results.sqlite")
    e.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    e.add_argument("--sweep")
    e.add_argument("--status", choices=STATUSES)
    e.add_argument("--out", help="file to write (default: stdout)")


def main(args) -> int:
    from harness.store import ResultsStore, export

    if not os.path.isfile(args.store):
        raise SpecError("--store", f"{args.store!r} does not exist")
    text = export(ResultsStore(args.store).records(sweep=args.sweep, status=args.status), args.format)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
