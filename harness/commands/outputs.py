"""Where a command will write (--out, --logs, --emit-sweep ...), checked before any work, so that a
missing folder or a file where a folder goes is one line and exit code 2, not a late failure.
"""

from __future__ import annotations

import os

from harness.errors import SpecError


def check_output_path(path: str, field: str, directory: bool) -> None:
    """Where a command will write (a report folder, an export file): refused before any work if
    it cannot be written there (a missing folder, a file where a folder goes, or the reverse)."""
    full = os.path.abspath(path)
    if directory and os.path.exists(full) and not os.path.isdir(full):
        raise SpecError(field, f"{path} is a file; give a folder")
    if not directory and os.path.isdir(full):
        raise SpecError(field, f"{path} is a folder; give a file name")
    if os.path.exists(full) and not (os.path.isdir(full) or os.path.isfile(full)):  # /dev/full, a FIFO
        raise SpecError(field, f"{path} is not a regular file (a device, pipe or socket); give a file name")
    folder = full if directory and os.path.isdir(full) else os.path.dirname(full)
    if not os.path.isdir(folder):
        raise SpecError(field, f"folder {os.path.dirname(path) or folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SpecError(field, f"folder {folder} cannot be written")
