"""A record (JSON, `schema_version` 1): its statuses, a new one, its times, a comparison's verdicts.

run_id, status (ok|oom|failed|timeout), error (excerpt or null), started_at, ended_at,
sweep, point_key, spec {workload, layout, ...}, metrics {...}, fingerprint {...}
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "failed", "timeout")
# A comparison's loss-parity verdict, per run and overall (the record's `comparison` section).
PASS, FAIL, NO_DATA = "pass", "FAIL", "no data"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def new_record(spec: dict, *, sweep: str | None = None, point_key: str | None = None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": uuid.uuid4().hex,
        "status": "failed",
        "error": None,
        "started_at": now_iso(),
        "ended_at": None,
        "sweep": sweep,
        "point_key": point_key,
        "spec": spec,
        "metrics": {},
        "fingerprint": {},
    }
