"""The data files the package ships (ds_configs/, baselines/): one place that finds them.

Each file lives once in git, at the top of the repository (where the design wants people to
see and edit it). A wheel carries a copy under `harness/_data/`, made by the build
(setup.py copies the folders named in SHIPPED into the package while building it); installed,
they are read through importlib.resources. In a source checkout, an editable install included,
the repository's own folders are used, so an edit takes effect without a rebuild.

    resources.path("ds_configs/zero1.json")   # a pathlib.Path to the file, wherever harness runs

Standard library only: this module sits at the bottom layer, beside harness.errors.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

SHIPPED = ("ds_configs", "baselines")  # top-level folders of the repository the wheel carries
PACKAGED = "_data"  # where the wheel has them: harness/_data/<folder>

_SOURCE_ROOT = Path(__file__).resolve().parent.parent


def source_root() -> Path | None:
    """The repository root when harness runs from a source checkout (editable install or
    PYTHONPATH), else None."""
    if (_SOURCE_ROOT / "pyproject.toml").is_file() and all((_SOURCE_ROOT / d).is_dir() for d in SHIPPED):
        return _SOURCE_ROOT
    return None


def root() -> Path:
    """The folder that holds ds_configs/ and baselines/: the repository root in a source
    checkout, the package's own copy (harness/_data) once installed from a wheel."""
    src = source_root()
    if src is not None:
        return src
    # A wheel installs into a plain folder: files() is a pathlib.Path there.
    return Path(str(importlib.resources.files("harness").joinpath(PACKAGED)))


def path(relative: str) -> Path:
    """The shipped file or folder `relative`, e.g. "ds_configs/zero1.json" or "baselines".

    Whether it exists is the caller's question (it names the path in its own error)."""
    top = Path(relative).parts[0] if relative else ""
    if top not in SHIPPED:
        raise ValueError(f"{relative!r} is not under a shipped folder {SHIPPED}")
    return root() / relative
