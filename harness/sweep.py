"""Sweeps: one workload, a grid of layouts, every point run in its own fenced process tree.

Why it is shaped like this: the reference study swept about a thousand layouts and half of
them ran out of memory. So expansion decides up front which points are invalid and says why
(those never launch), each point is identified by a stable key (a hash of its full,
normalised workload + layout) so that a re-run skips what already has a record, and every
record is committed to the store when its run ends, so killing the sweep loses nothing.

Sweep spec (YAML):

    name: 13b-seq2048-64gpu      # default: the file name; records are grouped by it
    gpus: 64                     # world size of every point (nodes x gpus_per_node)
    nodes: 8                     # default 1
    launcher: torchrun           # torchrun | deepspeed | direct | slurm (CLI --launcher wins)
    timeout_s: 1800              # per point
    store: results.sqlite
    env: {NCCL_DEBUG: WARN}      # extra environment for every point
    workload: {...}              # harness.spec.Workload fields, the same for every point
    layout: {...}                # fixed Layout fields
    grid:                        # the cross product of these axes
      tp: [1, 2, 4]              # a Layout field ...
      workload.seq_len: [2048]   # ... or a Workload field ...
      kernel:                    # ... or any name whose values are mappings of Layout fields
        - {attention: sdpa, rmsnorm: torch}
        - {attention: flash2, rmsnorm: fused}
    include: [{tp: [1, 2]}]      # keep only points matching one entry (optional)
    exclude: [{tp: 4, pp: 1}]    # drop points matching any entry (a list value = any of)
    points:                      # extra points beyond the grid; may carry their own env, timeout_s
      - {tp: 8, pp: 1, env: {NCCL_ALGO: Ring}, timeout_s: 600}
    slurm: {partition: gpu, time: "00:30:00", account: x, setup: ["module load cuda"]}

dp is derived as gpus / (tp x pp) unless set. Points that fail harness.spec validation,
whose tp x pp x dp != gpus, or that duplicate an earlier point are dropped with the reason.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field

import yaml

from harness.errors import SpecError
from harness.spec import Layout, Workload, check_world_size, layout_label, parse_spec, read_yaml

SWEEP_KEYS = ("name", "gpus", "nodes", "launcher", "timeout_s", "store", "env", "workload", "layout",
              "grid", "include", "exclude", "points", "slurm", "description")
LAYOUT_FIELDS = set(Layout.__dataclass_fields__)
WORKLOAD_FIELDS = set(Workload.__dataclass_fields__)


@dataclass
class SweepSpec:
    name: str
    gpus: int
    nodes: int = 1
    launcher: str = "torchrun"
    timeout_s: float = 1800.0
    store: str = "results.sqlite"
    env: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)
    grid: dict = field(default_factory=dict)
    include: list = field(default_factory=list)
    exclude: list = field(default_factory=list)
    points: list = field(default_factory=list)
    slurm: dict = field(default_factory=dict)
    description: str = ""

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass
class Point:
    """One layout to run: the full validated spec, its coordinates on the grid and its key."""

    coords: dict
    spec: dict
    key: str
    env: dict = field(default_factory=dict)
    timeout_s: float | None = None  # a point's own limit, else the sweep's

    def label(self) -> str:
        extra = [f"{k}={v}" for k, v in self.coords.items() if k.startswith("workload.")]
        return " ".join([layout_label(self.spec["layout"])] + extra)


@dataclass
class Drop:
    coords: dict
    reason: str


# ---------------------------------------------------------------- loading

def _require(cond: bool, fld: str, reason: str) -> None:
    if not cond:
        raise SpecError(fld, reason)


def parse_sweep(raw, default_name: str = "sweep") -> SweepSpec:
    _require(isinstance(raw, dict), "sweep", "top level must be a mapping")
    for key in raw:
        _require(key in SWEEP_KEYS, f"sweep.{key}", f"unknown key; allowed: {', '.join(SWEEP_KEYS)}")
    _require("gpus" in raw, "sweep.gpus", "required: the world size of every point")
    s = SweepSpec(name=str(raw.get("name") or default_name), gpus=raw["gpus"])
    for key in SWEEP_KEYS[1:]:
        if key in raw and raw[key] is not None:
            setattr(s, key, raw[key])
    for key in ("gpus", "nodes"):
        v = getattr(s, key)
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"sweep.{key}",
                 f"must be a positive integer, got {v!r}")
    _require(s.gpus % s.nodes == 0, "sweep.gpus", f"{s.gpus} GPUs do not split over {s.nodes} nodes")
    _require(s.launcher in ("torchrun", "deepspeed", "direct", "slurm"), "sweep.launcher",
             f"{s.launcher!r} is not one of torchrun, deepspeed, direct, slurm")
    _require(isinstance(s.timeout_s, (int, float)) and s.timeout_s > 0, "sweep.timeout_s", "must be positive")
    for key in ("env", "workload", "layout", "grid", "slurm"):
        _require(isinstance(getattr(s, key), dict), f"sweep.{key}", "must be a mapping")
    for key in ("include", "exclude", "points"):
        v = getattr(s, key)
        _require(isinstance(v, list) and all(isinstance(e, dict) for e in v), f"sweep.{key}",
                 "must be a list of mappings")
    for axis, values in s.grid.items():
        _require(isinstance(values, list) and values, f"sweep.grid.{axis}", "must be a non-empty list")
        if not all(isinstance(v, dict) for v in values):
            _check_axis_name(axis, f"sweep.grid.{axis}")
    return s


def _check_axis_name(axis: str, where: str) -> None:
    if axis.startswith("workload."):
        _require(axis.split(".", 1)[1] in WORKLOAD_FIELDS, where, "unknown workload field")
    else:
        name = axis.split(".", 1)[1] if axis.startswith("layout.") else axis
        _require(name in LAYOUT_FIELDS, where,
                 "not a Layout field (use workload.<field> for the workload, or mapping values)")


def load_sweep(path: str) -> SweepSpec:
    raw = read_yaml(path, field="sweep")
    return parse_sweep(raw, os.path.splitext(os.path.basename(path))[0])


# ---------------------------------------------------------------- expansion

def point_key(spec_dict: dict) -> str:
    """Stable identity of a point: hash of its normalised workload + layout (not its name)."""
    ident = {"workload": spec_dict["workload"], "layout": spec_dict["layout"]}
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=list)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _apply(raw_spec: dict, assignments: dict) -> None:
    for axis, value in assignments.items():
        if isinstance(value, dict):  # a mapping axis sets several layout (or workload.x) fields
            _apply(raw_spec, value)
        elif axis.startswith("workload."):
            raw_spec["workload"][axis.split(".", 1)[1]] = value
        else:
            raw_spec["layout"][axis.split(".", 1)[1] if axis.startswith("layout.") else axis] = value


def _flat(spec_dict: dict, coords: dict) -> dict:
    """Every name a filter may use: layout fields bare, workload fields as workload.x, axes."""
    flat = {k: v for k, v in coords.items() if not isinstance(v, dict)}
    flat.update(spec_dict["layout"])
    flat.update({f"layout.{k}": v for k, v in spec_dict["layout"].items()})
    flat.update({f"workload.{k}": v for k, v in spec_dict["workload"].items()})
    return flat


def matches(flat: dict, rule: dict) -> bool:
    for k, want in rule.items():
        if k == "env":
            continue
        have = flat.get(k)
        options = want if isinstance(want, list) else [want]
        if have not in options:
            return False
    return True


def _fmt(coords: dict) -> str:
    def one(v):
        return ",".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else v
    return " ".join(f"{k}={one(v)}" for k, v in coords.items())


def _defaults() -> dict:
    from harness.spec import RunSpec

    d = RunSpec().to_dict()
    return {"workload": d["workload"], "layout": d["layout"]}


def expand(sweep: SweepSpec) -> tuple[list[Point], list[Drop]]:
    """All valid points of the sweep, in grid order, and every dropped combination with why.

    Filters see each point with the spec defaults filled in (so `exclude: [{attention: sdpa}]`
    also hits points that leave attention at its default) and run before validation, so a
    point the user excluded is reported as excluded rather than as invalid.
    """
    axes = list(sweep.grid)
    combos = [dict(zip(axes, vals)) for vals in itertools.product(*(sweep.grid[a] for a in axes))]
    if not axes and sweep.points:
        combos = []  # only the listed points, not also the bare base layout
    candidates = [(c, {"env": {}, "timeout_s": None}) for c in combos]
    for i, extra in enumerate(sweep.points):
        coords = {k: v for k, v in extra.items() if k not in ("env", "timeout_s")}
        for k in coords:
            if not isinstance(coords[k], dict):
                _check_axis_name(k, f"sweep.points[{i}].{k}")
        candidates.append((coords, {"env": dict(extra.get("env") or {}), "timeout_s": extra.get("timeout_s")}))
    defaults = _defaults()
    points, drops, seen = [], [], {}
    for coords, extra in candidates:
        raw = {"name": sweep.name, "store": sweep.store,
               "workload": copy.deepcopy(sweep.workload), "layout": copy.deepcopy(sweep.layout)}
        _apply(raw, coords)
        lay = raw["layout"]
        filled = {"workload": {**defaults["workload"], **raw["workload"]},
                  "layout": {**defaults["layout"], **lay}}
        if "dp" not in lay:
            tp, pp = filled["layout"]["tp"], filled["layout"]["pp"]
            if isinstance(tp, int) and isinstance(pp, int) and tp > 0 and pp > 0 and sweep.gpus % (tp * pp) == 0:
                lay["dp"] = filled["layout"]["dp"] = sweep.gpus // (tp * pp)
        flat = _flat(filled, coords)
        if sweep.include and not any(matches(flat, r) for r in sweep.include):
            drops.append(Drop(coords, "not matched by any include filter"))
            continue
        hit = next((i for i, r in enumerate(sweep.exclude) if matches(flat, r)), None)
        if hit is not None:
            drops.append(Drop(coords, f"excluded by exclude[{hit}] {sweep.exclude[hit]}"))
            continue
        if "dp" not in lay:
            drops.append(Drop(coords, f"layout: {sweep.gpus} GPUs are not divisible by tp x pp = "
                                      f"{filled['layout']['tp']} x {filled['layout']['pp']}"))
            continue
        try:
            spec = parse_spec(raw)
            check_world_size(spec, sweep.gpus)
        except SpecError as e:
            drops.append(Drop(coords, str(e)))
            continue
        spec_dict = spec.to_dict()
        spec_dict["workload"]["optimizer"]["betas"] = list(spec_dict["workload"]["optimizer"]["betas"])
        key = point_key(spec_dict)
        if key in seen:
            drops.append(Drop(coords, f"duplicate of point {seen[key]} ({key})"))
            continue
        seen[key] = len(points)
        points.append(Point(coords=coords, spec=spec_dict, key=key, env={**sweep.env, **extra["env"]},
                            timeout_s=extra["timeout_s"]))
    return points, drops


def describe(points: list[Point], drops: list[Drop], done: dict[str, str] | None = None) -> str:
    """The dry-run listing: points (with status if already recorded) and drops with reasons."""
    done = done or {}
    lines = [f"{len(points)} points, {len(drops)} dropped"]
    for i, p in enumerate(points):
        state = f"  [{done[p.key]}, skipped]" if p.key in done else ""
        lines.append(f"  {i:4d}  {p.key}  {p.label()}{state}")
    if drops:
        lines.append("dropped:")
        for d in drops:
            lines.append(f"  - {_fmt(d.coords) or '(base)'}: {d.reason}")
    return "\n".join(lines)


# ---------------------------------------------------------------- execution

def sweep_id(sweep: SweepSpec, store_path: str) -> str:
    """Names the runs of this sweep on this store, to find orphans of a killed sweep process."""
    return hashlib.sha256(f"{sweep.name}\0{os.path.abspath(store_path)}".encode()).hexdigest()[:16]


def pending(points: list[Point], done: dict[str, str], retry: tuple[str, ...] = ()) -> list[Point]:
    """Points without a record (or whose recorded status is one the user asked to retry)."""
    return [p for p in points if p.key not in done or done[p.key] in retry]


def run_sweep(sweep: SweepSpec, *, launcher: str, store_path: str, timeout_s: float,
              retry: tuple[str, ...] = (), log_dir: str | None = None, progress: bool = True,
              echo=print) -> dict[str, int]:
    """Run every pending point, one after another; returns counts per status.

    Each point's record is committed by the time its run_spec returns. A failure, OOM or
    timeout is recorded and the sweep goes on. Orphans of an earlier, killed sweep process
    of the same sweep and store are killed first, so they cannot write a second attempt.
    """
    from harness import launch
    from harness.store import ResultsStore

    if launcher not in ("torchrun", "deepspeed", "direct"):
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
    counts = {s: 0 for s in ("ok", "oom", "failed", "timeout")}
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


# ---------------------------------------------------------------- slurm

def _hhmmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def write_slurm(sweep: SweepSpec, points: list[Point], job_dir: str, *, timeout_s: float,
                python: str | None = None) -> str:
    """Write the job array (one task per point) and its inputs; returns the sbatch script path.

    Each task writes its record into a store of its own (task-N.sqlite) so that hundreds of
    tasks never contend for one SQLite file on a shared file system; `harness sweep collect`
    merges them and classifies tasks that wrote nothing from their Slurm logs.
    """
    import sys

    if not points:
        raise SpecError("sweep", "no pending points: nothing to submit")
    job_dir = os.path.abspath(job_dir)
    for sub in ("points", "stores", "logs"):
        os.makedirs(os.path.join(job_dir, sub), exist_ok=True)
    rows = []
    for i, p in enumerate(points):
        path = os.path.join(job_dir, "points", f"{i:05d}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(p.spec, f, sort_keys=False)
        extra = {k: v for k, v in p.env.items() if k not in sweep.env or sweep.env[k] != v}
        with open(path[:-5] + ".env", "w") as f:  # the point's own environment, sourced by its task
            f.writelines(f"export {k}={json.dumps(str(v))}\n" for k, v in extra.items())
        rows.append(f"{i}\t{p.key}\t{path}\t{int(p.timeout_s or timeout_s)}")
    with open(os.path.join(job_dir, "points.tsv"), "w") as f:
        f.write("\n".join(rows) + "\n")
    cfg = dict(sweep.slurm)
    python = python or cfg.get("python") or sys.executable
    gpn = sweep.gpus_per_node
    lines = ["#!/bin/bash", f"#SBATCH --job-name=harness-{sweep.name}",
             f"#SBATCH --array=0-{len(points) - 1}" + (f"%{cfg['max_parallel']}" if cfg.get("max_parallel") else ""),
             f"#SBATCH --nodes={sweep.nodes}", f"#SBATCH --ntasks-per-node={gpn}",
             f"#SBATCH --gpus-per-node={gpn}",
             f"#SBATCH --time={cfg.get('time') or _hhmmss(max(p.timeout_s or timeout_s for p in points) + 300)}",
             f"#SBATCH --output={job_dir}/logs/%A_%a.log"]
    for key in ("partition", "account", "qos", "constraint"):
        if cfg.get(key):
            lines.append(f"#SBATCH --{key}={cfg[key]}")
    lines += [f"#SBATCH {x}" for x in cfg.get("extra", [])]
    lines += ["", "# generated by `harness sweep --launcher slurm`; gather with `harness sweep collect`",
              "set -u", *cfg.get("setup", [])]
    lines += [f"export {k}={json.dumps(str(v))}" for k, v in sweep.env.items()]
    lines += [
        f'LINE=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" {job_dir}/points.tsv)',
        'KEY=$(printf "%s" "$LINE" | cut -f2)',
        'SPEC=$(printf "%s" "$LINE" | cut -f3)',
        'LIMIT=$(printf "%s" "$LINE" | cut -f4)',
        '. "${SPEC%.yaml}.env"',
        'RUN_ID="${KEY}-slurm-${SLURM_ARRAY_JOB_ID}-${SLURM_ARRAY_TASK_ID}"',
        f'STORE="{job_dir}/stores/task-${{SLURM_ARRAY_TASK_ID}}.sqlite"',
        'echo "harness-point $KEY $RUN_ID"',
        'timeout --signal=TERM --kill-after=60 "$LIMIT" '
        f"srun --kill-on-bad-exit=1 --ntasks-per-node={gpn} {python} -m harness.cli train \"$SPEC\" "
        f"--store \"$STORE\" --run-id \"$RUN_ID\" --sweep {json.dumps(sweep.name)} --point-key \"$KEY\"",
        "RC=$?",
        'echo "harness-exit $RC"',
        "exit 0  # the outcome is in the record or the log; collect classifies it",
    ]
    script = os.path.join(job_dir, "sweep.sbatch")
    with open(script, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(script, 0o755)
    return script


def submit_slurm(script: str) -> str:
    """sbatch the script; a missing sbatch is a clear user error, not a traceback."""
    import shutil
    import subprocess

    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SpecError("--launcher slurm", f"sbatch not found on PATH; the job script is written to "
                                            f"{script}: submit it with `sbatch {script}` on a Slurm "
                                            "login node, then run `harness sweep collect`")
    out = subprocess.run([sbatch, script], capture_output=True, text=True)
    if out.returncode != 0:
        raise SpecError("--launcher slurm", f"sbatch failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


def collect(sweep: SweepSpec, job_dir: str, store_path: str) -> dict[str, int]:
    """Merge the per-task stores of a Slurm job array into the sweep's store.

    A task that wrote no record gets one classified from its log (timeout when `timeout`
    or Slurm's time limit ended it, oom when the log shows CUDA out-of-memory, else failed);
    a task with neither record nor log is still pending and is left alone.
    """
    import glob

    from harness import launch
    from harness.store import ResultsStore, new_record, now_iso

    job_dir = os.path.abspath(job_dir)
    table = os.path.join(job_dir, "points.tsv")
    if not os.path.isfile(table):
        raise SpecError("collect", f"{table} does not exist: no Slurm job was generated there")
    main_store = ResultsStore(store_path)
    counts = {"merged": 0, "classified": 0, "pending": 0}
    with open(table) as f:
        rows = [ln.rstrip("\n").split("\t") for ln in f if ln.strip()]
    for idx, key, spec_path, *_ in rows:
        task_store = os.path.join(job_dir, "stores", f"task-{idx}.sqlite")
        recs = ResultsStore(task_store).records(sweep=sweep.name) if os.path.isfile(task_store) else []
        recs = [r for r in recs if r.get("point_key") == key]
        if recs:
            main_store.write(recs[-1])
            counts["merged"] += 1
            continue
        logs = sorted(glob.glob(os.path.join(job_dir, "logs", f"*_{idx}.log")), key=os.path.getmtime)
        if not logs:
            counts["pending"] += 1
            continue
        text = launch.tail(logs[-1], 400)
        if "harness-exit" not in text and "DUE TO TIME LIMIT" not in text:
            counts["pending"] += 1  # still running
            continue
        timed_out = "harness-exit 124" in text or "harness-exit 137" in text or "DUE TO TIME LIMIT" in text
        with open(spec_path) as f:
            spec = yaml.safe_load(f)
        rec = new_record(spec, sweep=sweep.name, point_key=key)
        rec["status"] = launch.classify_output(text, timed_out)
        rec["error"] = launch.error_excerpt(text)
        rec["ended_at"] = now_iso()
        rec["launch"] = {"launcher": "slurm", "log": logs[-1], "timed_out": timed_out}
        main_store.write(rec)
        counts["classified"] += 1
    return counts
