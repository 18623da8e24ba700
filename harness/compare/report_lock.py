"""One comparison at a time writes a given report: a second `harness compare` of the same name into
the same --out would overwrite the first one's report, its runs timed against the first one's, so
it is refused before it launches anything, naming the first one's pid. An advisory lock (flock),
which the kernel releases when its holder dies, even by SIGKILL: a killed comparison never leaves
it held. (harness.sweep.execute.sweep_lock is the same, per sweep and store.)"""

from __future__ import annotations

import contextlib
import fcntl
import os
import typing

from harness.errors import SpecError


def report_lock(out: str, name: str):
    """Held while comparison `name` runs and writes compare-<name>.* in the folder `out`."""
    return pid_lock(os.path.join(out, f"compare-{name}.lock"), "--out",
                    lambda pid: f"comparison {name} is already running into {out} (pid {pid}); wait for it "
                                "to end, or give another --out")


@contextlib.contextmanager
def pid_lock(path: str, field: str, busy: typing.Callable[[str], str]):
    """Hold the lock on `path` (its folder made if missing) while the block runs; when another process
    holds it, SpecError(field, busy(its pid)). The file is removed on release; one removed while it was
    being opened is opened again."""
    while True:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SpecError(field, f"cannot create the lock file {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SpecError(field, busy(holder)) from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the pid is only for the message; the lock holds without it
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
