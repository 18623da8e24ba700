"""Local execution: every pending point, one after another, each in its own fenced process tree.

Every record is committed to the store when its run ends, so killing the sweep loses nothing
and running it again resumes where it stopped (and, with retry, runs chosen statuses again).
One sweep runs once per store at a time (sweep_lock); a record the store could not take (a full
disk) is merged back from its fallback file by the next command that opens the store (the sweep run again).
"""

from __future__ import annotations

import contextlib
import hashlib
import os

from harness import launch
from harness.errors import SpecError
from harness.files.lock import pid_lock
from harness.store import STATUSES, ResultsStore
from harness.sweep.expand import expand, pending
from harness.sweep.spec import SweepSpec


def sweep_id(sweep: SweepSpec, store_path: str) -> str:
    """Names the runs of this sweep on this store, to find orphans of a killed sweep process."""
    return hashlib.sha256(f"{sweep.name}\0{os.path.abspath(store_path)}".encode()).hexdigest()[:16]


@contextlib.contextmanager
def sweep_lock(sweep: SweepSpec, store_path: str):
    """Hold an advisory lock (flock) on `<store>.<sweep_id>.lock` while the sweep runs: a second
    instance of the same sweep on the same store is refused, naming the pid that holds it, since
    both would run every point, timed while competing for the machine. The lock file is removed
    when released; one that was removed while being opened is opened again."""
    path = f"{os.path.abspath(store_path)}.{sweep_id(sweep, store_path)}.lock"
    with pid_lock(
        path, "sweep", lambda pid: f"{sweep.name} is already running on {store_path} (pid {pid})", create_field="store"
    ):
        yield path


def run_sweep(
    sweep: SweepSpec,
    *,
    launcher: str,
    store_path: str,
    timeout_s: float,
    retry: tuple[str, ...] = (),
    log_dir: str | None = None,
    progress: bool = True,
    echo=print,
    profile_steps: int | None = None,
) -> dict[str, int]:
    """Run every pending point, one after another; returns counts per status.

    Each point's record is committed by the time its run_spec returns. A failure, OOM or
    timeout is recorded and the sweep goes on; a record the store cannot take (StoreError: a
    full disk) stops it, with that record in its fallback file. Orphans of an earlier, killed
    sweep process of the same sweep and store are killed first, so they cannot write a second
    attempt; a second instance of the sweep on the store is refused (sweep_lock). `profile_steps`:
    each point's profiled steps after its measured ones (None: the runs' default).
    """
    if launcher not in launch.LOCAL_LAUNCHERS:
        raise SpecError("--launcher", f"{launcher!r} cannot run points from here")
    if sweep.nodes > 1:
        raise SpecError("sweep.nodes", "a multi-node sweep runs through --launcher slurm")
    launch.check_launcher(launcher, sweep.gpus_per_node, sweep.nodes, "--launcher")
    points, _ = expand(sweep)
    with sweep_lock(sweep, store_path):
        return _run_points(
            sweep,
            points,
            launcher=launcher,
            store_path=store_path,
            timeout_s=timeout_s,
            retry=retry,
            log_dir=log_dir,
            progress=progress,
            echo=echo,
            profile_steps=profile_steps,
        )


def _run_points(
    sweep: SweepSpec,
    points: list,
    *,
    launcher: str,
    store_path: str,
    timeout_s: float,
    retry: tuple[str, ...],
    log_dir: str | None,
    progress: bool,
    echo,
    profile_steps: int | None = None,
) -> dict[str, int]:
    store = ResultsStore(store_path, announce=False)
    merged = store.merged or store.recover_fallback()  # a store that still cannot take them stops the sweep
    if merged:
        echo(f"merged {merged} records that the store could not take earlier from its fallback file")
    sid = sweep_id(sweep, store_path)
    reaped = launch.reap_orphans_of_dead_sweeps(sid)
    if reaped:
        echo(f"killed {reaped} processes left by an earlier, interrupted run of this sweep")
    done = store.completed_points(sweep.name)
    todo = pending(points, done, retry)
    echo(
        f"sweep {sweep.name}: {len(points)} points, {len(points) - len(todo)} already recorded, "
        f"{len(todo)} to run ({launcher}, {sweep.gpus} processes, timeout {timeout_s:g} s)"
    )
    # next to the store, as given: a relative store keeps its logs' paths relative in the records
    log_dir = log_dir or os.path.join(os.path.dirname(store_path), "harness-logs", sweep.name)
    counts = {s: 0 for s in STATUSES}
    bar = _progress(len(todo), sweep.name, progress)
    try:
        for p in todo:
            env = {**p.env, launch.SWEEP_ID_ENV: sid, launch.SWEEP_PID_ENV: str(os.getpid())}
            if profile_steps is not None:
                from harness.profiling import ENV

                env[ENV] = str(profile_steps)
            rec = launch.run_spec(
                p.spec,
                nproc=sweep.gpus_per_node,
                launcher=launcher,
                store_path=store_path,
                timeout_s=p.timeout_s or timeout_s,
                sweep=sweep.name,
                point_key=p.key,
                extra_env=env,
                log_dir=log_dir,
            )
            counts[rec["status"]] = counts.get(rec["status"], 0) + 1
            first = [rec["error_line"]] if rec.get("error_line") else (rec.get("error") or "").strip().splitlines()
            reason = f" - {first[0][:200]}" if rec["status"] != "ok" and first else ""
            bar.write(f"{rec['status']:>7}  {p.label()}{reason}")
            bar.set_postfix({k: v for k, v in counts.items() if v})
            bar.update(1)
    finally:
        bar.close()
    return counts


def _progress(total: int, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=name,
        unit="run",
        disable=not enabled or total == 0,
        dynamic_ncols=True,
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
    )
