"""What a failed run's record says: the words that name an out-of-memory error or a peer's failure, the
line that says why a run failed, and which of several failing ranks' records to keep."""

from __future__ import annotations

_CAUSES = {"oom": "out of memory", "timeout": "timed out"}


def failure(run: dict) -> str:
    """'run failed: <cause>' for a run (record or comparison entry) that did not finish: its error
    line (the exception, or the `error:` line it printed), else what its status says."""
    cause = run.get("error_line") or _CAUSES.get(run.get("status"), "") or str(run.get("status"))
    return f"run failed: {cause}"


# What an out-of-memory failure says, in an exception or in a run's output: PyTorch's CUDA
# allocator ("CUDA out of memory"), the CUDA runtime ("CUDA error: out of memory") and the
# exception's class name.
OOM_MARKERS = ("out of memory", "OutOfMemoryError")


# What a rank sees when a peer died or hung first (gloo, NCCL, sockets): its failure is an echo.
PEER_FAILURE_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "remote process exited",
    "NCCL communicator was aborted",
    "Timed out waiting",
    "collective operation timeout",
)


def mentions_oom(text: str) -> bool:
    return any(m in text for m in OOM_MARKERS)


def mentions_peer_failure(text: str) -> bool:
    return any(m in text for m in PEER_FAILURE_MARKERS)


def _is_echo(record: dict) -> bool:
    """Every failure this record holds is a rank's echo of a peer's (a lost connection)."""
    failures = record.get("rank_failures") or []
    return bool(failures) and all(f.get("echo") for f in failures)


def merge_failures(earlier: dict | None, record: dict) -> dict:
    """The record to keep when a rank of a run that already has one fails. Several ranks may
    fail: the first failure is the cause, the others its echo (a peer's lost connection). An
    echo never hides a rank's own failure, and an out-of-memory error is never overwritten by a
    plain failure, whichever rank wrote first; every rank's failure stays in rank_failures."""
    if earlier is None or earlier.get("status") == "ok":
        return record
    keep = earlier
    if (_is_echo(earlier) and not _is_echo(record)) or (earlier.get("status"), record["status"]) == ("failed", "oom"):
        keep = record
    failures = (earlier.get("rank_failures") or []) + (record.get("rank_failures") or [])
    return {**keep, "rank_failures": failures} if failures else keep
