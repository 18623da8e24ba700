"""Output files written whole or not at all, and never over something that is not a file.

A command's outputs (a token file and its metadata, a report's pages and figures) are written to
temporaries beside their targets and renamed into place together once every one is complete: a
full disk or a failed step leaves the earlier outputs as they were and no partial file. A target
that exists and is not a regular file (a device node, a FIFO, a folder, a link to one) is refused
before anything is written: renamed over, /dev/null would become a file for the whole machine.
A link to a regular file stays a link: the file it names is replaced.
"""

from __future__ import annotations

import os
import stat
import tempfile

from harness.errors import SpecError


def check_target(path: str, field: str) -> str:
    """The real path an output goes to; SpecError if something there is not a regular file."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return real
    except OSError as e:
        raise SpecError(field, f"cannot check {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        what = (
            "a folder"
            if stat.S_ISDIR(mode)
            else "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "not a regular file"
        )
        named = f" (a link to {real})" if real != os.path.abspath(path) else ""
        raise SpecError(field, f"{path}{named} is {what}, not a file: nothing is written over it")
    return real


def check_writable(path: str, field: str) -> None:
    """Before any work: `path` can be written (its folder exists and takes a new file, also for root
    on a read-only file system, where permission bits say nothing) and is not a special file."""
    files = Together(field)
    files.path(path)  # creates its temporary beside it, or says why not
    files.discard()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Together:
    """Targets that appear together or not at all: `path(target)` gives the temporary to fill,
    leaving the `with` block renames every one into place; an exception removes them all.
    An OSError (a full disk, a read-only folder) becomes one SpecError line naming `field`."""

    def __init__(self, field: str):
        self.field = field
        self.temps: dict[str, str] = {}  # real target -> its temporary
        self.named: list[str] = []  # the targets as given, for the message

    def path(self, target: str) -> str:
        real = check_target(target, self.field)
        if real not in self.temps:
            self.named.append(target)
            folder, name = os.path.split(real)
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
            except OSError as e:
                self.discard()
                raise SpecError(self.field, f"cannot write {target}: {e.strerror or e}") from None
            os.close(fd)
            self.temps[real] = tmp
        return self.temps[real]

    def write(self, target: str, data: str | bytes) -> None:
        with open(self.path(target), "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)

    def __enter__(self) -> Together:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        try:
            if kind is None:
                self._commit()
                return False
            if isinstance(exc, OSError):
                raise exc
            return False
        except OSError as e:  # named after the first target: the rest go with it
            raise SpecError(
                self.field, f"cannot write {self.named[0] if self.named else 'its files'}: {e.strerror or e}"
            ) from None
        finally:
            self.discard()

    def _commit(self) -> None:
        mode = 0o666 & ~_umask()  # mkstemp makes them private: give them the mode a plain open would
        for real, tmp in self.temps.items():
            check_target(real, self.field)  # nothing replaced it with a special file meanwhile
            os.chmod(tmp, mode)
        for real, tmp in list(self.temps.items()):
            os.replace(tmp, real)
            del self.temps[real]

    def discard(self) -> None:
        for tmp in self.temps.values():
            try:
                os.unlink(tmp)
            except OSError:
                pass
        self.temps.clear()
