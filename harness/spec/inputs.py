"""Checks of the inputs beyond a run spec's fields: the numbers, names and paths a sweep spec, a
compare spec or a command's flags give (a timeout, a device count, a results store, a name that
becomes file names). Each raises a SpecError naming the field.
"""

from __future__ import annotations

import math
import string

from harness.errors import SpecError, shown
from harness.spec.schema import MAX_DEVICES

NAME_MAX = 255  # bytes in one file name (Linux, macOS)


def check_positive(value, field: str):
    """A positive, finite number (a timeout, a peak), or a SpecError naming `field`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SpecError(field, f"must be a positive number, got {shown(value)}")
    return value


def check_positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(field, f"must be a positive integer, got {shown(value)}")
    return value


def check_device_count(value, field: str) -> int:
    """A number of processes or devices (a comparison's nproc, a sweep's gpus and nodes)."""
    check_positive_int(value, field)
    if value > MAX_DEVICES:
        raise SpecError(
            field, f"must be at most {MAX_DEVICES:,} (more devices than any cluster has), got {shown(value)}"
        )
    return value


def check_path(value, field: str) -> str:
    """A file path the harness will write (a results store)."""
    if not isinstance(value, str) or not value.strip():
        raise SpecError(field, f"must be a file path, got {shown(value)}")
    return value


NAME_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")


def check_name(name, field: str, names: str, reserved: int = 0, hint: str = "") -> str:
    """A spec's name (a sweep's, a comparison's): a file name (check_file_name) of letters, digits,
    '-', '_' and '.' only, since it also names jobs, records and headings (`names` says which)."""
    text = check_file_name(name, field, reserved)
    bad = "".join(sorted({c for c in text if c not in NAME_CHARS}))
    if bad:
        raise SpecError(
            field, f"{shown(text)}: letters, digits, '-', '_' and '.' only (it names {names}), not {bad!r}{hint}"
        )
    return text


def check_file_name(name, field: str, reserved: int = 0) -> str:
    """A name that becomes a file or folder name (logs, reports): no path separator, not '.' or
    '..', and within the file-name limit less `reserved` bytes the harness adds around it."""
    if not isinstance(name, str) or not name.strip():
        raise SpecError(field, f"must be a non-empty string, got {shown(name)}")
    if any(c in name for c in "/\\\0") or name in (".", ".."):
        raise SpecError(field, f"{shown(name)} names files and folders: no '/', '\\' or NUL, not '.' or '..'")
    if len(name.encode()) > NAME_MAX - reserved:
        raise SpecError(
            field, f"is {len(name.encode())} bytes long; it names files, so at most {NAME_MAX - reserved} bytes"
        )
    return name
