"""The SQLite file of records, one row per run (COLUMNS: what a query selects by, the record as JSON).

Records are written in one transaction each, so an interrupted sweep loses nothing that
completed and never leaves half a record. A record that belongs to a sweep point is unique
per (sweep, point_key): writing it again replaces the earlier attempt instead of duplicating it.

The store is checked before anything launches (check_store): a file that is not a results store,
a directory, a read-only folder or a store of a newer schema (PRAGMA user_version, unknown
columns) is one StoreError line. A record the store cannot take (a full disk, a lock, a newer
schema) is appended to a fallback file next to it (`<store>.fallback.jsonl`, else in the temp
directory) and a StoreWriteError says where; every command that opens the store (ResultsStore) merges
those files back first. Records of another schema_version are left out on read (records() counts them).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import sys
import tempfile
import urllib.parse

from harness.errors import StoreError, StoreWriteError
from harness.store.failures import merge_failures
from harness.store.record import SCHEMA_VERSION, STATUSES, now_iso

COLUMNS = (
    "run_id",
    "schema_version",
    "sweep",
    "point_key",
    "status",
    "engine",
    "model",
    "started_at",
    "ended_at",
    "record_json",
)
FALLBACK_SUFFIX = ".fallback.jsonl"


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


def fallback_paths(path: str) -> list[str]:
    """Where records go that the store at `path` cannot take: next to it, else the temp directory."""
    full = os.path.abspath(path)
    tag = hashlib.sha256(full.encode()).hexdigest()[:12]
    return [
        full + FALLBACK_SUFFIX,
        os.path.join(tempfile.gettempdir(), f"harness-{tag}-{os.path.basename(full)[:100]}{FALLBACK_SUFFIX}"),
    ]


def _schema(db: sqlite3.Connection) -> tuple[int, set[str], list[str]]:
    """(user_version, table names, columns of `runs`) of an open store."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return version, tables, [r[1] for r in db.execute("PRAGMA table_info(runs)")]


def _refuse_foreign(path: str, version: int, tables: set[str], columns: list[str]) -> None:
    """A store this harness must not write: not a results store, or one of a newer schema."""
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path} was written by a newer harness (store schema {version}, this harness knows "
            f"{SCHEMA_VERSION}): use another store or upgrade"
        )
    if tables and "runs" not in tables:
        raise StoreError(f"{path} is a SQLite file without a runs table, not a results store")
    extra = [c for c in columns if c not in COLUMNS]
    if extra:
        raise StoreError(
            f"{path} has columns this harness does not know ({', '.join(extra)}): written by a newer "
            "harness; use another store or upgrade"
        )
    missing = [c for c in COLUMNS if columns and c not in columns]
    if missing:
        raise StoreError(f"{path} lacks the columns {', '.join(missing)}: not a results store of this harness")


BUSY_TIMEOUT_S = 60.0  # how long a command waits for another process's lock on the store (sqlite's busy timeout)
_BUSY = (
    "{path} is busy: another process holds a lock on it and did not let go within {wait:g} s; "
    "try again when that process finishes"
)


def _busy(e: Exception) -> bool:
    return isinstance(e, sqlite3.OperationalError) and "locked" in str(e)


def _refuse_special(path: str) -> None:
    """A device, pipe or socket is no results store: sqlite would block on a FIFO for ever and leave
    `<path>-journal` beside /dev/null."""
    if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
        raise StoreError(f"{path} is not a regular file (a device, pipe or socket); give a file path")


def check_store(path, *, write: bool = True) -> None:
    """Before anything launches: the store at `path` can be read (and, with `write`, written or
    created), else a StoreError that says why. Reads only: a missing store is not created here."""
    if not isinstance(path, str) or not path.strip():
        raise StoreError(f"must be a file path, got {path!r}")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise StoreError(f"{path} is a directory, not a results file")
    _refuse_special(path)
    if not os.path.exists(full):
        if not write:
            raise StoreError(f"{path} does not exist")
        folder = os.path.dirname(full)
        while not os.path.exists(folder):
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise StoreError(f"cannot create {path}: {folder} is not a directory")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StoreError(f"cannot create {path}: the folder {folder} is read-only")
        return
    try:
        db = sqlite3.connect(f"file:{urllib.parse.quote(full)}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S)
        try:
            _refuse_foreign(path, *_schema(db))
        finally:
            db.close()
    except sqlite3.Error as e:
        if _busy(e):
            raise StoreError(_BUSY.format(path=path, wait=BUSY_TIMEOUT_S)) from None
        raise StoreError(f"{path} is not a readable results store ({e})") from None
    if write and not (os.access(full, os.W_OK) and os.access(os.path.dirname(full), os.W_OK | os.X_OK)):
        raise StoreError(f"{path} is read-only (the file or its folder cannot be written)")


class ResultsStore:
    def __init__(self, path: str, *, announce: bool = True):
        self.path = path
        self.skipped: dict[str, int] = {}  # what records() left out: schema_version (or 'unreadable') -> count
        _refuse_special(path)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            db = self._connect()
            try:
                version, tables, columns = _schema(db)
                _refuse_foreign(path, version, tables, columns)
                if "runs" not in tables:
                    db.executescript(_DDL)
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            finally:
                db.close()
        except (sqlite3.Error, OSError) as e:
            if _busy(e):
                raise StoreError(_BUSY.format(path=path, wait=BUSY_TIMEOUT_S)) from None
            raise StoreError(f"cannot open {path} ({e})") from None
        self.merged = self._merge_fallback(announce)

    def _merge_fallback(self, announce: bool) -> int:
        """Records an earlier command could not write (a full disk), moved into the store now; they stay
        in their file, still found by get(), while the store cannot take them. Returns how many moved."""
        if not any(os.path.exists(p) for p in fallback_paths(self.path)):
            return 0
        try:
            merged = self.recover_fallback()
        except StoreError:
            return 0
        if merged and announce:
            print(
                f"store: merged {merged} records that an earlier command could not write into {self.path}",
                file=sys.stderr,
            )
        return merged

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
        db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        return db

    def write(self, record: dict, *, keep_earlier_failure: bool = False) -> None:
        """Insert or replace. `keep_earlier_failure`: a failing rank's record is merged with a
        failure another rank of the same run already wrote (merge_failures). A record the store
        cannot take goes to a fallback file (fallback_paths) and a StoreError says where."""
        if record.get("status") not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {record.get('status')!r}")
        record.setdefault("ended_at", now_iso())
        try:
            self._insert(record, keep_earlier_failure)
        except (sqlite3.Error, OSError, StoreError) as e:
            why = e.reason if isinstance(e, StoreError) else str(e)
            saved = self._save_fallback(record, keep_earlier_failure)
            raise StoreWriteError(
                f"cannot write run {record.get('run_id')} to {self.path} ({why}); "
                + (
                    f"the record is saved in {saved}, and the next harness command that opens this store merges it in"
                    if saved
                    else "no fallback file could be written either"
                )
            ) from None

    def _insert(self, record: dict, keep_earlier_failure: bool) -> None:
        version = record.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"record {record.get('run_id')} has schema_version {version!r}; this harness writes {SCHEMA_VERSION}"
            )
        db = self._connect()
        try:
            _refuse_foreign(self.path, *_schema(db))
            with db:  # one transaction: the old attempt of this point goes, the new one comes
                db.execute("BEGIN IMMEDIATE")  # before the read: two failing ranks merge, not overwrite
                if keep_earlier_failure:
                    row = db.execute("SELECT record_json FROM runs WHERE run_id = ?", (record["run_id"],)).fetchone()
                    record = merge_failures(json.loads(row[0]) if row else None, record)
                spec = record.get("spec") or {}
                values = (
                    record["run_id"],
                    version,
                    record.get("sweep"),
                    record.get("point_key"),
                    record["status"],
                    (spec.get("layout") or {}).get("engine"),
                    (spec.get("workload") or {}).get("model"),
                    record.get("started_at"),
                    record.get("ended_at"),
                    json.dumps(record, sort_keys=True),
                )
                if record.get("sweep") is not None and record.get("point_key") is not None:
                    db.execute(
                        "DELETE FROM runs WHERE sweep = ? AND point_key = ?", (record["sweep"], record["point_key"])
                    )
                db.execute(
                    f"INSERT OR REPLACE INTO runs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                    values,
                )
        finally:
            db.close()

    def _save_fallback(self, record: dict, keep_earlier_failure: bool) -> str | None:
        line = (
            json.dumps(
                {**record, "fallback": {"keep_earlier_failure": keep_earlier_failure, "at": now_iso()}}, sort_keys=True
            )
            + "\n"
        )
        for path in fallback_paths(self.path):
            try:
                with open(path, "a") as f:
                    f.write(line)
                return path
            except OSError:
                continue
        return None

    def fallback_records(self) -> dict[str, dict]:
        """run_id -> record, from the fallback files (a later line replaces an earlier one, as in write)."""
        out: dict[str, dict] = {}
        for path in fallback_paths(self.path):
            try:
                with open(path) as f:
                    lines = f.read().splitlines()
            except OSError:
                continue
            for line in lines:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut short by the full disk that sent it here
                    continue
                if not isinstance(rec, dict) or "run_id" not in rec:
                    continue
                keep = (rec.pop("fallback", None) or {}).get("keep_earlier_failure")
                out[rec["run_id"]] = merge_failures(out.get(rec["run_id"]), rec) if keep else rec
        return out

    def recover_fallback(self) -> int:
        """Move the records of the fallback files into the store (then remove the files); returns
        how many. If the store still cannot take them, the files stay and a StoreError says so."""
        records = self.fallback_records()
        for rec in records.values():
            try:
                self._insert(rec, False)
            except (sqlite3.Error, OSError, StoreError) as e:
                raise StoreError(
                    f"cannot move the records of {' or '.join(fallback_paths(self.path))} into "
                    f"{self.path} ({getattr(e, 'reason', e)}); they stay there"
                ) from None
        for path in fallback_paths(self.path):
            try:
                os.remove(path)
            except FileNotFoundError:  # none, or another rank of the same launch merged it first
                pass
        return len(records)

    def records(self, *, sweep: str | None = None, status: str | None = None) -> list[dict]:
        """The records, oldest first; those of another schema_version are left out and counted
        in self.skipped (skipped_note says so)."""
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
            rows = db.execute(query, args).fetchall()
        finally:
            db.close()
        out = []
        for (text,) in rows:
            try:
                rec = json.loads(text)
                version = rec.get("schema_version")
            except (ValueError, AttributeError):
                rec, version = None, "unreadable"
            if rec is None or version != SCHEMA_VERSION:
                key = version if version == "unreadable" else f"schema_version {version!r}"
                self.skipped[key] = self.skipped.get(key, 0) + 1
                continue
            out.append(rec)
        return out

    def skipped_note(self) -> str | None:
        """One line on the records records() left out, or None."""
        if not self.skipped:
            return None
        what = ", ".join(f"{n} with {k}" for k, n in sorted(self.skipped.items()))
        return (
            f"warning: store: left out {sum(self.skipped.values())} records this harness cannot read ({what}; "
            f"it reads schema_version {SCHEMA_VERSION})"
        )

    def get(self, run_id: str) -> dict | None:
        """The record of `run_id`, from the store or, if the store could not take it, its fallback file."""
        db = self._connect()
        try:
            row = db.execute("SELECT record_json FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        finally:
            db.close()
        if row:
            return json.loads(row[0])
        if any(os.path.exists(p) for p in fallback_paths(self.path)):
            return self.fallback_records().get(run_id)
        return None

    def completed_points(self, sweep: str) -> dict[str, str]:
        """point_key -> status for every point of a sweep that has a record."""
        db = self._connect()
        try:
            rows = db.execute(
                "SELECT point_key, status FROM runs WHERE sweep = ? AND point_key IS NOT NULL", (sweep,)
            ).fetchall()
        finally:
            db.close()
        return dict(rows)
