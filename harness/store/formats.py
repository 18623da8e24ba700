"""The export: records as JSON lines, or as CSV rows of the exported fields (harness.store.fields)."""

from __future__ import annotations

import csv
import io
import json

from harness.store import fields


def flat_row(record: dict) -> dict:
    """One flat row per record for CSV: the exported fields (harness.store.fields)."""
    return {f.name: f.read(record) for f in fields.exported()}


def export(records: list[dict], fmt: str) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    if fmt == "csv":
        rows = [flat_row(r) for r in records]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=[f.name for f in fields.exported()])
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()
    raise ValueError(fmt)
