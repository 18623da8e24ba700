"""Local execution: every pending point, one after another, each in its own fenced process tree.

Every record is committed to the store when its run ends, so killing the sweep loses nothing
and running it again resumes where it stopped (and, with retry, runs chosen statuses again).
"""

from __future__ import annotations

import hashlib
import os

from harness import launch
from harness.errors import SpecError
from harness.store import STATUSES, ResultsStore
from harness.sweep.expand import expand, pending
from harness.sweep.spec import SweepSpec


def sweep_id(sweep: SweepSpec, store_path: str) -> str:
    """Names the runs of this sweep on this store, to find orphans of a killed sweep process."""
    return hashlib.sha256(f"{sweep.name}\0{os.path.abspath(store_path)}".encode()).hexdigest()[:16]


def run_sweep(sweep: SweepSpec, *, launcher: str, store_path: str, timeout_s: float,
              retry: tuple[str, ...] = (), log_dir: str | None = None, progress: bool = True,
              echo=print) -> dict[str, int]:
    """Run every pending point, one after another; returns counts per status.

    Each point's record is committed by the time its run_spec returns. A failure, OOM or
    timeout is recorded and the sweep goes on. Orphans of an earlier, killed sweep process
    of the same sweep and store are killed first, so they cannot write a second attempt.
    """
    if launcher not in launch.LOCAL_LAUNCHERS:
        raise SpecError("--launcher", f"{launcher!r} cannot run points from here")
    if sweep.nodes > 1:
        raise SpecError("sweep.nodes", "a multi-node sweep runs through --launcher slurm")
    if launcher == "direct" and sweep.gpus != 1:
        raise SpecError("--launcher", "direct runs one process; this sweep needs "
                                      f"{sweep.gpus}: use torchrun or deepspeed")
    points, _ = expand(sweep)
    store = ResultsStore(store_path)
    sid = sweep_id(sweep, store_path)
    reaped = launch.reap_orphans_of_dead_sweeps(sid)
    if reaped:
        echo(f"killed {reaped} processes left by an earlier, interrupted run of this sweep")
    done = store.completed_points(sweep.name)
    todo = pending(points, done, retry)
    echo(f"sweep {sweep.name}: {len(points)} points, {len(points) - len(todo)} already recorded, "
         f"{len(todo)} to run ({launcher}, {sweep.gpus} processes, timeout {timeout_s:g} s)")
    log_dir = log_dir or os.path.join(os.path.dirname(os.path.abspath(store_path)), "harness-logs", sweep.name)
    counts = {s: 0 for s in STATUSES}
    bar = _progress(len(todo), sweep.name, progress)
    try:
        for p in todo:
            env = {**p.env, launch.SWEEP_ID_ENV: sid, launch.SWEEP_PID_ENV: str(os.getpid())}
            rec = launch.run_spec(p.spec, nproc=sweep.gpus_per_node, launcher=launcher,
                                  store_path=store_path, timeout_s=p.timeout_s or timeout_s, sweep=sweep.name,
                                  point_key=p.key, extra_env=env, log_dir=log_dir)
            counts[rec["status"]] = counts.get(rec["status"], 0) + 1
            first = (rec.get("error") or "").strip().splitlines()
            reason = f" - {first[0][:120]}" if rec["status"] != "ok" and first else ""
            bar.write(f"{rec['status']:>7}  {p.label()}{reason}")
            bar.set_postfix({k: v for k, v in counts.items() if v})
            bar.update(1)
    finally:
        bar.close()
    return counts


def _progress(total: int, name: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="run", disable=not enabled or total == 0,
                dynamic_ncols=True, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
                                               "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
