"""The results store: one versioned record per run in a SQLite file.

record.py says what a record is (statuses, a new one, the comparison's verdicts), failures.py what a
failed one says and which of several failing ranks' records to keep, database.py keeps them (the
SQLite file, its checks, the fallback files), fields.py reads a record as a flat row (for the export
and every report), formats.py exports records as JSON lines or CSV.
"""

from __future__ import annotations

from harness.store.database import COLUMNS, FALLBACK_SUFFIX, ResultsStore, check_store, fallback_paths
from harness.store.failures import (
    OOM_MARKERS,
    PEER_FAILURE_MARKERS,
    failure,
    mentions_oom,
    mentions_peer_failure,
    merge_failures,
)
from harness.store.formats import export, flat_row
from harness.store.record import FAIL, NO_DATA, PASS, SCHEMA_VERSION, STATUSES, new_record, now_iso

__all__ = [
    "COLUMNS",
    "FAIL",
    "FALLBACK_SUFFIX",
    "NO_DATA",
    "OOM_MARKERS",
    "PASS",
    "PEER_FAILURE_MARKERS",
    "SCHEMA_VERSION",
    "STATUSES",
    "ResultsStore",
    "check_store",
    "export",
    "failure",
    "fallback_paths",
    "flat_row",
    "mentions_oom",
    "mentions_peer_failure",
    "merge_failures",
    "new_record",
    "now_iso",
]
