"""A run's `note:` lines, passed from its log to the console of the command that launched it.

A run's output goes to its log, so what a rank says for the user while it runs (DeepSpeed compiling
an op for minutes, harness/frameworks/deepspeed/extensions.py) would reach nobody while the command
seems to hang. Its `note: ` lines are echoed as they are written; every other line stays in the log."""

from __future__ import annotations

import re
import sys

PREFIX = "note: "
# torchrun and srun prefix a rank's lines ("[rank0]: ", "0: "); the note is what follows
NOTE = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s*|\d+:\s*)?(note: .*\S)\s*$")


def _echo(line: str) -> None:
    """On stderr, above the launching command's progress bar (tqdm's write clears and redraws it)."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


class LogRelay:
    """Echoes the `note: ` lines written to `path` since the last poll (whole lines only)."""

    def __init__(self, path: str, offset: int = 0, echo=None):
        self.path, self.offset, self.partial = path, offset, b""
        self.echo = echo or _echo

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for raw in lines:
            found = NOTE.match(raw.decode(errors="replace"))
            if found:
                self.echo(found.group(1))
