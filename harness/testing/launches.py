"""Launches shared by a whole test session: one set of processes per (pool, world size), not one per file.

A test module declares what its ranks run as a fixture, `results = shared_launch("deepspeed", 2, fn, *args)`;
the first test that asks for any job of a pool at a world size starts one launch (harness.testing.spawn's
spawn_jobs) that runs every job of that pool and world the session's selected tests need, each module's
in turn, so process start-up, group creation and an engine's import (DeepSpeed's, Megatron's: seconds a
rank) are paid once. A job's failure fails its own tests only (its exception again for each): the launch's
later jobs run in a fresh one. The pools: "torch" (the own engine and FSDP2, built on torch.distributed
alone), "megatron", "deepspeed", and "deepspeed-mp" for DeepSpeed's tensor and pipeline parallel jobs:
DeepSpeed keeps their groups process-wide, and a data-parallel engine built after them fails in its
initialize. "megatron" and "deepspeed-mp" jobs run in the "torch" pool's launch (LAUNCH_OF): Megatron's shim
patches torch only while its engine runs and each Megatron engine rebuilds its parallel state, and what
DeepSpeed's tp and pp leave behind concerns DeepSpeed's data-parallel engines alone (the "deepspeed" pool,
never in that launch), so a launch of 8 processes (and of 4, of 2) starts once for all three.
tests/conftest.py marks, after collection,
the jobs a selected test uses (`select`), so `-k` or one file runs only what it needs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from harness.testing.spawn import NOT_RUN, Job, spawn_jobs

RELEASED = object()  # its module is done with the result
LAUNCH_OF = {"megatron": "torch", "deepspeed-mp": "torch"}  # a pool whose jobs run in another pool's launch


@dataclass(eq=False)
class Shared:
    """One job in its pool's launch: its outcome once the launch ran it (a result or the exception)."""

    pool: str
    world: int
    threads: int
    job: Job
    prepare: Callable | None = None  # folder -> the job's args, made when its launch starts
    wanted: bool = False  # until a selected test is seen to use it (select)
    outcome: object = field(default=NOT_RUN)

    def result(self):
        while self.outcome is NOT_RUN:
            group = [s for s in _POOLS[self.key] if s.outcome is NOT_RUN and (s.wanted or s is self)]
            for s in group:
                if s.prepare is not None:
                    s.job.args, s.prepare = tuple(s.prepare(_folder())), None
            for s, out in zip(group, spawn_jobs([s.job for s in group], self.world, self.threads), strict=True):
                s.outcome = out
        if self.outcome is RELEASED:
            raise RuntimeError(f"{self.job.fn.__name__}'s result was released with its module")
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    @property
    def key(self) -> tuple:
        return LAUNCH_OF.get(self.pool, self.pool), self.world, self.threads


_POOLS: dict[tuple, list[Shared]] = {}


def _folder() -> str:
    """A fresh folder for a job's files (its configs), removed when the session's interpreter exits."""
    path = tempfile.mkdtemp(prefix="shared-launch-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _add(pool: str, world: int, fn, args, every_rank: bool, timeout_s: float, threads: int | None, prepare=None):
    threads = threads or max(1, (os.cpu_count() or 1) // world)  # spawn's default, so that equal ones share
    s = Shared(pool, world, threads, Job(fn, tuple(args), every_rank, timeout_s), prepare)
    _POOLS.setdefault(s.key, []).append(s)
    return s


def _fixture(shared: list[Shared], value):
    import pytest

    def fixture():
        yield value()
        for s in shared:  # a session's results would otherwise all stay in memory to its end
            s.outcome = RELEASED

    made = pytest.fixture(scope="module")(fixture)
    made.shared_launch = shared
    return made


def shared_launch(
    pool: str,
    world: int,
    fn,
    *args,
    keys=None,
    prepare: Callable | None = None,
    every_rank: bool = False,
    timeout_s: float = 300.0,
    threads: int | None = None,
):
    """A module fixture whose value is fn(ctx, *args)'s result (rank 0's, or every rank's), run in the
    session's launch of `pool` at `world` ranks; with `keys`, a dict of them to the result's items (one per
    run, in order); with `prepare`, the args are prepare(folder)'s, made in a fresh folder when the launch
    starts (files a run reads: a DeepSpeed config, a config.json). Jobs sharing a launch must leave the
    processes as they found them (an engine's global state torn down), as one engine after another in
    harness.testing.spawn's processes already must."""
    s = _add(pool, world, fn, args, every_rank, timeout_s, threads, prepare)
    if keys is None:
        return _fixture([s], s.result)
    return _fixture([s], lambda: dict(zip(keys, s.result(), strict=True)))


def shared_launches(
    pool: str, by_world: dict, fn, *, every_rank: bool = False, timeout_s: float = 300.0, threads: int | None = None
):
    """A module fixture whose value is get(world) -> fn(ctx, *by_world[world])'s result, each world's job
    in the session's launch of `pool` at that world size (world 1 included: its own launch of one rank)."""
    jobs = {w: _add(pool, w, fn, args, every_rank, timeout_s, threads) for w, args in by_world.items()}
    return _fixture(list(jobs.values()), lambda: lambda world: jobs[world].result())


def select(items) -> None:
    """Mark the jobs the collected `items` use (a test's fixture, and its `world` parameter where it has
    one); the others run only if a test asks for them anyway (each then in a launch of its own). Marks
    only add: an inner session (pytester's) leaves the outer one's marks."""
    for item in items:
        module = getattr(item, "module", None)
        world = getattr(getattr(item, "callspec", None), "params", {}).get("world")
        for name in getattr(item, "fixturenames", ()):
            for s in getattr(getattr(module, name, None), "shared_launch", ()):
                if world is None or s.world == world:
                    s.wanted = True
