"""Every run of a comparison kept alive side by side and measured in turns of K steps (`harness compare
--interleave K`): the finest grain at which runs can share a machine's load, for a machine other work loads.

Launches in rounds (drift_control.measure_rounds) alternate runs by the launch, tens of seconds apart on a
loaded machine, and the load a launch met is one draw however many steps it measures: the identical pair of
examples/compare-cpu-decide.yaml moved 0.65x to 2.33x from round to round at load 14-21. Here every run is
started, in the plan's order, and waits before its first step (measure.turns) until all are ready; then
turn c grants each run K steps in turn, in an order drawn afresh every turn (seeded) in which no run follows
itself, each run waiting asleep while another measures. Why drawn, and never itself: a run that follows
itself finds its own data still in the caches, one that follows another does not; alternating the plan's
order forward and back made the middle run the only one never to follow itself, and one layout under two
labels read "slower 1.128x [1.066, 1.208]" (load 14-16). Drawn orders give every run every predecessor
and every place in the turn alike, so neither caches nor a load that rises during a turn favour one;
after the last turn each run finishes (weights, profiled steps, record) alone, one after another. Each run's
measured steps are then grouped by turn (`step_time_rounds_s`, one list per turn), and two runs are compared
turn by turn (measure.blocks: the turn is the unit of replication). What this measures is said with it:
the step times of runs interleaved step by step, each step after another run's (caches as the other run
left them), which a run measured alone on an idle machine need not match."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time

from harness.compare.spec import CompareSpec
from harness.measure.turns import DIR_ENV, NAME_ENV, POLL_S, read_int, write_int

SEED = 41  # the turn orders' draw: a comparison repeated measures in the same orders
INTERLEAVE_METHOD = (
    "every run is kept alive side by side and measured in turns of {k} step(s): each turn grants each run "
    "its steps in an order drawn afresh every turn in which no run follows itself (every run after every "
    "other alike, none with its own data still in the caches), the others asleep meanwhile; "
    "two runs are compared turn by turn (each turn's ratio of their steps, the interval across turns), so "
    "that load both met within a turn cancels; step times are those of runs interleaved step by step, "
    "each after another run's, not those of a run alone on an idle machine"
)


def turn_blocks(times: list[float], warmup: int, k: int) -> list[list[float]]:
    """A run's measured step times grouped by the turn each was measured in (step warmup + i in turn
    (warmup + i) // k)."""
    blocks: dict[int, list[float]] = {}
    for i, t in enumerate(times):
        blocks.setdefault((warmup + i) // k, []).append(t)
    return [blocks[c] for c in sorted(blocks)]


def turn_orders(n: int, turns: int, seed: int = SEED) -> list[list[int]]:
    """`turns` orders of n runs, each drawn at random (seeded) until its first run is not the previous
    order's last (no run follows itself; with 2 runs: the same order every turn, they alternate)."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    for _ in range(turns):
        order = list(range(n))
        while True:
            rng.shuffle(order)
            if n < 2 or not out or order[0] != out[-1][-1]:
                break
        out.append(list(order))
    return out


class _Run:
    def __init__(self, folder: str, index: int, plan, launch, kw: dict):
        self.name, self.nproc, self.plan = f"run{index}", plan.nproc, plan
        w = plan.spec.workload
        self.total = w.warmup_steps + w.steps
        self.folder, self.record = folder, None
        spec = plan.spec.to_dict()
        spec["store"] = kw["store_path"]
        env = {DIR_ENV: folder, NAME_ENV: self.name}

        def go():
            try:
                self.record = launch(
                    spec, nproc=plan.nproc, launcher=plan.launcher, point_key=plan.label, turn_env=env, **kw
                )
            except Exception as e:  # the launch itself failed (its record is the run's failure)
                self.record = {"status": "failed", "error": f"{type(e).__name__}: {e}", "spec": spec}

        self.thread = threading.Thread(target=go, name=f"interleave-{plan.label}", daemon=True)

    def done(self) -> int:
        """The steps every rank has finished at its gate (-1 while one has not reached it)."""
        return min(read_int(os.path.join(self.folder, f"{self.name}.{r}.done")) for r in range(self.nproc))

    def wait(self, steps: int) -> bool:
        """Until every rank waits at step `steps`; False where the run ended first (it failed)."""
        while self.done() < steps:
            if not self.thread.is_alive():
                return False
            time.sleep(POLL_S)
        return True

    def grant(self, steps: int) -> None:
        write_int(os.path.join(self.folder, f"{self.name}.grant"), steps)


def run_interleaved(cs: CompareSpec, launch, k: int, **kw) -> tuple[list[dict], dict]:
    """Every planned run's record, measured in turns of k steps (module docstring), and the summary's
    load-drift entry (the method). `launch` is launch.run_spec's signature plus turn_env (the turn
    variables for the run's processes); kw: sweep, store_path, timeout_s (each run's, multiplied by the
    number of runs: a run waits while the others measure), log_dir."""
    folder = tempfile.mkdtemp(prefix="harness-turns-")
    kw = {**kw, "timeout_s": kw["timeout_s"] * len(cs.runs)}
    runs = [_Run(folder, i, p, launch, kw) for i, p in enumerate(cs.runs)]
    try:
        alive = []
        for r in runs:  # one at a time: a run's start-up does not load another's steps (none measures yet)
            r.thread.start()
            if r.wait(0):
                alive.append(r)
        turns = -(-max(r.total for r in runs) // k)
        for turn, order in enumerate(turn_orders(len(runs), turns)):
            for r in (runs[i] for i in order):
                if r in alive and r.thread.is_alive() and r.done() < r.total:
                    step = min((turn + 1) * k, r.total)
                    r.grant(step)
                    r.wait(step)
            alive = [r for r in alive if r.thread.is_alive()]
        for r in runs:  # each finishes alone: its gather, profiled steps and record load no one's measurement
            r.grant(r.total + 1)
            r.thread.join()
    finally:
        for r in runs:  # a run left waiting (an error above) is released, to finish or time out
            r.grant(r.total + 1)
        if not any(r.thread.is_alive() for r in runs):
            shutil.rmtree(folder, ignore_errors=True)
    note = f"Load drift: {INTERLEAVE_METHOD.format(k=k)}."
    return [r.record for r in runs], {"method": INTERLEAVE_METHOD.format(k=k), "interleave": k, "note": note}
