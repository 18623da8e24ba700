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


def harness_version() -> dict:
    """The harness's git commit (read from its checkout's .git, no process started), so a report says
    which code measured it; {} where the package is not a git checkout (an installed wheel)."""
    import os

    from harness.resources import source_root

    root = source_root()
    if root is None:
        return {}
    git = os.path.join(root, ".git")
    try:
        if os.path.isfile(git):  # a worktree: "gitdir: <its folder in the main checkout>"
            with open(git) as f:
                git = os.path.join(root, f.read().split("gitdir:", 1)[1].strip())
        with open(os.path.join(git, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref: "):
            return {"harness_commit": head}
        ref = head[5:]
        common = git
        if os.path.isfile(os.path.join(git, "commondir")):  # a worktree's refs live in the main checkout's
            with open(os.path.join(git, "commondir")) as f:
                common = os.path.join(git, f.read().strip())
        for folder in (git, common):
            if os.path.isfile(os.path.join(folder, ref)):
                with open(os.path.join(folder, ref)) as f:
                    return {"harness_commit": f.read().strip(), "harness_ref": ref}
        with open(os.path.join(common, "packed-refs")) as f:
            for line in f:
                if line.rstrip().endswith(" " + ref):
                    return {"harness_commit": line.split()[0], "harness_ref": ref}
    except (OSError, IndexError):
        pass
    return {}
