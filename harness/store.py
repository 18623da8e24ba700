"""The results store: one versioned record per run in a SQLite file.

Records are written in one transaction each, so an interrupted sweep loses nothing that
completed and never leaves half a record. A record that belongs to a sweep point is unique
per (sweep, point_key): writing it again replaces the earlier attempt instead of duplicating it.

Record (JSON, `schema_version` 1):
  run_id, status (ok|oom|failed|timeout), error (excerpt or null), started_at, ended_at,
  sweep, point_key, spec {workload, layout, ...}, metrics {...}, fingerprint {...}
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import uuid
from datetime import datetime, timezone

SCHEMA_VERSION = 1
STATUSES = ("ok", "oom", "failed", "timeout")
# A comparison's loss-parity verdict, per run and overall (the record's `comparison` section).
PASS, FAIL, NO_DATA = "pass", "FAIL", "no data"
# What an out-of-memory failure says, in an exception or in a run's output: PyTorch's CUDA
# allocator ("CUDA out of memory"), the CUDA runtime ("CUDA error: out of memory") and the
# exception's class name.
OOM_MARKERS = ("out of memory", "OutOfMemoryError")


def mentions_oom(text: str) -> bool:
    return any(m in text for m in OOM_MARKERS)

_DDL = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    schema_version INTEGER NOT NULL,
    sweep TEXT,
    point_key TEXT,
    status TEXT NOT NULL,
    engine TEXT,
    model TEXT,
    started_at TEXT,
    ended_at TEXT,
    record_json TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS runs_sweep_point ON runs(sweep, point_key)
    WHERE sweep IS NOT NULL AND point_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS runs_status ON runs(status);
"""


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


class ResultsStore:
    def __init__(self, path: str):
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        with self._connect() as db:
            db.executescript(_DDL)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=60)
        db.execute("PRAGMA busy_timeout = 60000")
        return db

    def write(self, record: dict, *, keep_earlier_failure: bool = False) -> None:
        """Insert or replace. `keep_earlier_failure`: a failing rank's record does not replace
        a failure another rank of the same run already wrote (see _keeps_earlier_failure)."""
        if record.get("status") not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {record.get('status')!r}")
        record.setdefault("ended_at", now_iso())
        spec = record.get("spec") or {}
        row = (
            record["run_id"], record.get("schema_version", SCHEMA_VERSION), record.get("sweep"),
            record.get("point_key"), record["status"], (spec.get("layout") or {}).get("engine"),
            (spec.get("workload") or {}).get("model"), record.get("started_at"), record.get("ended_at"),
            json.dumps(record, sort_keys=True),
        )
        db = self._connect()
        try:
            with db:  # one transaction: the old attempt of this point goes, the new one comes
                if keep_earlier_failure and self._keeps_earlier_failure(db, record):
                    return
                if record.get("sweep") is not None and record.get("point_key") is not None:
                    db.execute("DELETE FROM runs WHERE sweep = ? AND point_key = ?",
                               (record["sweep"], record["point_key"]))
                db.execute("INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?,?,?)", row)
        finally:
            db.close()

    @staticmethod
    def _keeps_earlier_failure(db, record: dict) -> bool:
        """Several ranks of one run may fail: the first failure is the cause, the others its
        echo (a peer's lost connection). An out-of-memory error is never overwritten by a
        plain failure, whichever rank wrote first."""
        row = db.execute("SELECT status FROM runs WHERE run_id = ?", (record["run_id"],)).fetchone()
        if row is None or row[0] == "ok":
            return False
        return not (row[0] == "failed" and record["status"] == "oom")

    def records(self, *, sweep: str | None = None, status: str | None = None) -> list[dict]:
        query, args = "SELECT record_json FROM runs WHERE 1=1", []
        if sweep is not None:
            query += " AND sweep = ?"
            args.append(sweep)
        if status is not None:
            query += " AND status = ?"
            args.append(status)
        query += " ORDER BY started_at, run_id"
        db = self._connect()
        try:
            return [json.loads(r[0]) for r in db.execute(query, args)]
        finally:
            db.close()

    def get(self, run_id: str) -> dict | None:
        db = self._connect()
        try:
            row = db.execute("SELECT record_json FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        finally:
            db.close()
        return json.loads(row[0]) if row else None

    def completed_points(self, sweep: str) -> dict[str, str]:
        """point_key -> status for every point of a sweep that has a record."""
        db = self._connect()
        try:
            rows = db.execute("SELECT point_key, status FROM runs WHERE sweep = ? AND point_key IS NOT NULL",
                              (sweep,)).fetchall()
        finally:
            db.close()
        return dict(rows)


# ---------------------------------------------------------------- export

def flat_row(record: dict) -> dict:
    """One flat row per record for CSV: the columns people sort and plot by."""
    spec, m = record.get("spec") or {}, record.get("metrics") or {}
    w, lay = spec.get("workload") or {}, spec.get("layout") or {}
    st = m.get("step_time_s") or {}
    mfu = m.get("mfu") or {}
    return {
        "run_id": record.get("run_id"), "sweep": record.get("sweep"), "status": record.get("status"),
        "engine": lay.get("engine"), "model": w.get("model"), "seq_len": w.get("seq_len"),
        "global_batch_size": w.get("global_batch_size"), "precision": w.get("precision"),
        "tp": lay.get("tp"), "pp": lay.get("pp"), "dp": lay.get("dp"),
        "micro_batch_size": lay.get("micro_batch_size"),
        "activation_checkpointing": lay.get("activation_checkpointing"),
        "sequence_parallel": lay.get("sequence_parallel"), "attention": lay.get("attention"),
        "rmsnorm": lay.get("rmsnorm"), "zero_stage": lay.get("zero_stage"),
        "step_time_median_s": st.get("median"), "step_time_ci95_low_s": st.get("ci95_low"),
        "step_time_ci95_high_s": st.get("ci95_high"), "steps_measured": st.get("n"),
        "tokens_per_s": m.get("tokens_per_s"), "mfu_palm": mfu.get("palm"),
        "mfu_megatron": mfu.get("megatron"), "hfu": mfu.get("hardware"),
        "peak_memory_bytes": m.get("peak_memory_bytes"),
        "final_loss": (m.get("losses") or [None])[-1],
        "error": (record.get("error") or "")[:200] or None,
        "started_at": record.get("started_at"), "ended_at": record.get("ended_at"),
    }


def export(records: list[dict], fmt: str) -> str:
    if fmt == "jsonl":
        return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    if fmt == "csv":
        rows = [flat_row(r) for r in records]
        buf = io.StringIO()
        fields = list(rows[0]) if rows else list(flat_row({}))
        writer = csv.DictWriter(buf, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue()
    raise ValueError(fmt)
