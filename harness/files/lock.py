"""An advisory lock (flock) held while one process writes what a second must not write at the same
time (a comparison's report, a sweep's points): the kernel releases it when its holder dies, even by
SIGKILL, so a killed run never leaves it held; the holder's pid is in the file for the refusal."""

from __future__ import annotations

import contextlib
import fcntl
import os
import typing

from harness.errors import SpecError


@contextlib.contextmanager
def pid_lock(path: str, field: str, busy: typing.Callable[[str], str], create_field: str | None = None):
    """Hold the lock on `path` (its folder made if missing) while the block runs; when another process
    holds it, SpecError(field, busy(its pid)). The file is removed on release; one removed while it was
    being opened is opened again. `create_field` names a lock file that cannot be made (default `field`)."""
    while True:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise SpecError(create_field or field, f"cannot create the lock file {path}: {e.strerror}") from None
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
