"""One comparison at a time writes a given report: a second `harness compare` of the same name into
the same --out would overwrite the first one's report, its runs timed against the first one's, so
it is refused before it launches anything, naming the first one's pid. An advisory lock (flock),
which the kernel releases when its holder dies, even by SIGKILL: a killed comparison never leaves
it held (harness.files.lock, the same as a sweep's per store)."""

from __future__ import annotations

import os

from harness.files.lock import pid_lock


def report_lock(out: str, name: str):
    """Held while comparison `name` runs and writes compare-<name>.* in the folder `out`."""
    return pid_lock(
        os.path.join(out, f"compare-{name}.lock"),
        "--out",
        lambda pid: (
            f"comparison {name} is already running into {out} (pid {pid}); wait for it to end, or give another --out"
        ),
    )
