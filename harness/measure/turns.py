"""Turns: a run's ranks wait at step boundaries until the comparison grants them steps, so that runs kept
alive side by side take turns of a few steps each (`harness compare --interleave K`, compare.interleave)
and every run's steps are measured within a fraction of a second of the others' (measure.blocks: the turn
is the unit the ratio interval replicates, and a load that both runs met cancels in their ratio).

The protocol is files in one folder (no collective outside the engine's, no socket): the coordinator
writes `<name>.grant` (how many steps the run may have started); before each step, each rank whose grant
is used up writes `<name>.<rank>.done` (the steps it has finished: the turn is over for it) and sleeps in
short polls until the grant grows. After its last step a rank waits once more (grant = steps + 1), so that
what follows (weights' gather, profiled steps, the record) runs while no other run measures. Only a rank
blocked here sleeps; nothing it does is timed (the step clock starts after the gate)."""

from __future__ import annotations

import os
import time

DIR_ENV = "HARNESS_TURNS_DIR"  # the folder of the grant and done files; unset: no turns (every run alone)
NAME_ENV = "HARNESS_TURNS_NAME"  # this run's name in that folder
POLL_S = 0.002  # a waiting rank reads its grant this often: a turn change costs about this much idle time


def write_int(path: str, value: int) -> None:
    """value into path, atomically (a reader sees the old number or the new one, never a partial write)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(value))
    os.replace(tmp, path)


def read_int(path: str, default: int = -1) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip() or default)
    except (OSError, ValueError):
        return default


class Turns:
    """One rank's side of the protocol (module docstring)."""

    def __init__(self, folder: str, name: str, rank: int):
        self.grant_path = os.path.join(folder, f"{name}.grant")
        self.done_path = os.path.join(folder, f"{name}.{rank}.done")
        self.granted = 0

    @classmethod
    def from_env(cls, rank: int) -> Turns | None:
        folder, name = os.environ.get(DIR_ENV), os.environ.get(NAME_ENV)
        return cls(folder, name, rank) if folder and name else None

    def before(self, step: int) -> None:
        """Called before step `step` (0-based, warm-up included) and with the step count after the last:
        returns at once inside a granted turn; else says the turn is over and waits for the next grant."""
        if step < self.granted:
            return
        write_int(self.done_path, step)
        while True:
            self.granted = read_int(self.grant_path, 0)
            if step < self.granted:
                return
            time.sleep(POLL_S)
