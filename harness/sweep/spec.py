"""The sweep spec: its format, its dataclass and its checks (a mistake is a SpecError, nothing runs).

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
    slurm: {partition: gpu, time: "00:30:00", account: x, setup: ["module load cuda"],
            exclusive: true, cpus_per_task: 8}  # also qos, constraint, max_parallel, python, extra

dp is derived as gpus / (tp x pp) unless set. Points that fail harness.spec validation,
whose tp x pp x dp != gpus, or that duplicate an earlier point are dropped with the reason
(harness/sweep/expand.py).
"""

from __future__ import annotations

import os
import string
from dataclasses import dataclass, field

from harness.errors import SpecError
from harness.launch import LOCAL_LAUNCHERS
from harness.spec import Layout, Workload, check_file_name, check_positive, read_yaml

SWEEP_KEYS = ("name", "gpus", "nodes", "launcher", "timeout_s", "store", "env", "workload", "layout",
              "grid", "include", "exclude", "points", "slurm", "description")
# How a sweep's points may start: any local launcher, or a Slurm job array (harness/sweep/slurm.py).
SWEEP_LAUNCHERS = LOCAL_LAUNCHERS + ("slurm",)
# The `slurm:` mapping (harness/sweep/slurm.py writes them into the job script).
SLURM_KEYS = ("partition", "account", "qos", "constraint", "time", "max_parallel", "exclusive",
              "cpus_per_task", "python", "setup", "extra")
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


def _require(cond: bool, fld: str, reason: str) -> None:
    if not cond:
        raise SpecError(fld, reason)


def parse_sweep(raw, default_name: str = "sweep") -> SweepSpec:
    _require(isinstance(raw, dict), "sweep", "top level must be a mapping")
    for key in raw:
        _require(key in SWEEP_KEYS, f"sweep.{key}", f"unknown key; allowed: {', '.join(SWEEP_KEYS)}")
    _require("gpus" in raw, "sweep.gpus", "required: the world size of every point")
    s = SweepSpec(name=check_sweep_name(raw.get("name"), default_name), gpus=raw["gpus"])
    for key in SWEEP_KEYS[1:]:
        if key in raw and raw[key] is not None:
            setattr(s, key, raw[key])
    _require(isinstance(s.store, str) and bool(s.store.strip()), "sweep.store",
             f"must be a file path, got {s.store!r}")
    for key in ("gpus", "nodes"):
        v = getattr(s, key)
        _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"sweep.{key}",
                 f"must be a positive integer, got {v!r}")
    _require(s.gpus % s.nodes == 0, "sweep.gpus", f"{s.gpus} GPUs do not split over {s.nodes} nodes")
    _require(s.launcher in SWEEP_LAUNCHERS, "sweep.launcher",
             f"{s.launcher!r} is not one of {', '.join(SWEEP_LAUNCHERS)}")
    check_positive(s.timeout_s, "sweep.timeout_s")
    for key in ("env", "workload", "layout", "grid", "slurm"):
        _require(isinstance(getattr(s, key), dict), f"sweep.{key}", "must be a mapping")
    check_slurm(s.slurm)
    for key in ("include", "exclude", "points"):
        v = getattr(s, key)
        _require(isinstance(v, list) and all(isinstance(e, dict) for e in v), f"sweep.{key}",
                 "must be a list of mappings")
    for i, point in enumerate(s.points):  # a point's own limits are checked now, not when it is reached
        if point.get("timeout_s") is not None:
            check_positive(point["timeout_s"], f"sweep.points[{i}].timeout_s")
        _require(isinstance(point.get("env") or {}, dict), f"sweep.points[{i}].env", "must be a mapping")
    for axis, values in s.grid.items():
        _require(isinstance(values, list) and values, f"sweep.grid.{axis}", "must be a non-empty list")
        if not all(isinstance(v, dict) for v in values):
            check_axis_name(axis, f"sweep.grid.{axis}")
    return s


NAME_CHARS = frozenset(string.ascii_letters + string.digits + "-_.")


def check_sweep_name(name, default_name: str) -> str:
    """The sweep's name (else the spec file's name): it names the log and job folders, the Slurm
    job, the records' group and the report's headings, so letters, digits, '-', '_' and '.' only."""
    given = name is not None and name != ""
    text = str(name) if given else default_name
    check_file_name(text, "sweep.name")
    bad = "".join(sorted({c for c in text if c not in NAME_CHARS}))
    if bad:
        raise SpecError("sweep.name", f"{text!r}: letters, digits, '-', '_' and '.' only (it names folders, the "
                                      f"Slurm job and the report), not {bad!r}"
                        + ("" if given else "; it comes from the file name: set `name:` in the spec"))
    return text


def check_slurm(cfg: dict) -> None:
    """The `slurm:` mapping: known keys of the right types (a typo is refused, not ignored)."""
    for key, v in cfg.items():
        where = f"sweep.slurm.{key}"
        _require(key in SLURM_KEYS, where, f"unknown key; allowed: {', '.join(SLURM_KEYS)}")
        if v is None:
            continue
        if key == "exclusive":
            _require(isinstance(v, bool), where, f"must be true or false, got {v!r}")
        elif key in ("cpus_per_task", "max_parallel"):
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0, where,
                     f"must be a positive integer, got {v!r}")
        elif key in ("setup", "extra"):
            _require(isinstance(v, list) and all(isinstance(x, str) for x in v), where, "must be a list of strings")
        else:
            _require(isinstance(v, str) and "\n" not in v, where, f"must be a string (one line), got {v!r}")


def check_axis_name(axis: str, where: str) -> None:
    """A grid axis or point key names a Layout field, `layout.<field>` or `workload.<field>`."""
    if axis.startswith("workload."):
        _require(axis.split(".", 1)[1] in WORKLOAD_FIELDS, where, "unknown workload field")
    else:
        name = axis.split(".", 1)[1] if axis.startswith("layout.") else axis
        _require(name in LAYOUT_FIELDS, where,
                 "not a Layout field (use workload.<field> for the workload, or mapping values)")


def load_sweep(path: str) -> SweepSpec:
    raw = read_yaml(path, field="sweep")
    return parse_sweep(raw, os.path.splitext(os.path.basename(path))[0])
