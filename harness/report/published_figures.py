"""Published figures (baselines/*.csv) and which measured runs they can stand beside. Not
harness/report/drift.py (a comparison against an earlier comparison's report, `--baseline`)."""

from __future__ import annotations

import csv
import os

from harness import resources

DEFAULT_DIR = str(resources.path("baselines"))  # the repository's, or the installed package's copy


def load(directory: str | None = None) -> dict[str, list[dict]]:
    """{'study': rows of hagemann2023_best.csv, 'frameworks': rows of published_mfu.csv}."""
    directory = directory or DEFAULT_DIR
    out: dict[str, list[dict]] = {"study": [], "frameworks": []}
    for key, name in (("study", "hagemann2023_best.csv"), ("frameworks", "published_mfu.csv")):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, newline="") as f:
                out[key] = list(csv.DictReader(f))
    return out
