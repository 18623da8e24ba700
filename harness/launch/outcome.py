"""A finished run's outcome from its output: ok, oom, timeout or failed, the first `error:` line, and
which rank failed first and how (first_failure), ahead of its peers' echoes."""

from __future__ import annotations

import os
import re
import signal

from harness.launch.processes import RANK_EXIT
from harness.store import mentions_oom

TAIL_LINES = 30


def tail(path: str, lines: int = TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 200_000))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def classify_output(text: str, timed_out: bool) -> str:
    """Status of a run that wrote no record, from what it printed."""
    if timed_out:
        return "timeout"
    if mentions_oom(text):
        return "oom"
    return "failed"


ERROR_LINE = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*|\d+:\s*)?(error: .*\S)\s*$", re.M)


def first_error_line(text: str | None) -> str:
    """The first `error: <field>: <reason>` line a run printed (a refusal by its preflight, a
    user mistake: harness.cli prints it and exits 2), '' if none; a launcher's rank prefix
    (`[rank0]: `, `0: `) is dropped. This is the cause; the launcher's `exitcode: 2` is not."""
    found = ERROR_LINE.search(text or "")
    return found[1][:500] if found else ""


def lead_with_error_line(record: dict, output: str) -> None:
    """A failed run's record: `error_line` is the first `error:` line of its output, and its
    error starts with that line (every view shows the error's first line)."""
    if record.get("status") == "ok":
        return
    line = first_error_line(output) or first_error_line(record.get("error"))
    if not line:
        return
    record["error_line"] = line
    error = record.get("error") or ""
    if not error.startswith(line):
        record["error"] = line + ("\n---\n" + error if error else "")


def error_excerpt(text: str) -> str:
    """The lines that explain a failure: the last exception line first, then the tail."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.search(r"(Error|Exception|exitcode|Signal|Killed)", ln)]
    head = errs[-1].strip() if errs else ""
    body = "\n".join(lines[-TAIL_LINES:])
    return (head + "\n---\n" + body) if head else body


def _how(code: int) -> str:
    """An exit status in words: 'killed by SIGKILL (exit code -9)', 'exit code 137 (128 + SIGKILL)'."""
    try:
        if code < 0:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        if code > 128:
            return f"exit code {code} (128 + {signal.Signals(code - 128).name})"
    except ValueError:
        pass
    return f"exit code {code}"


def first_failure(record: dict, output: str) -> dict | None:
    """The rank that failed first and how: its own report in the record (an exception or an
    out-of-memory error that is not the echo of a peer's), else what the launcher saw: torchrun's
    root cause, or the first rank exit the fenced deepspeed launcher printed (RANK_EXIT); a rank
    killed by a signal cannot report, its peers' lost connections are only echoes of it."""
    own = [f for f in record.get("rank_failures") or [] if not f.get("echo")]
    if own:
        return {
            "rank": own[0]["rank"],
            "how": "out of memory" if own[0]["status"] == "oom" else own[0]["error"],
            "source": "rank",
        }
    root = output.rsplit("Root Cause (first observed failure):", 1)
    found = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", root[1], re.S) if len(root) == 2 else None
    source = "torchrun"
    if found is None:
        found, source = RANK_EXIT.search(output), "deepspeed launcher"
    if found is None:
        return None
    return {"rank": int(found[1]), "exit_code": int(found[2]), "how": _how(int(found[2])), "source": source}


def first_failure_line(cause: dict) -> str:
    return (
        f"rank {cause['rank']} failed first: {cause['how']}, per {cause['source']}; "
        "the errors of its peers below are echoes of it"
    )
