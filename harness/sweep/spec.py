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
      cp: [1, 2]                 #   (context parallelism: cp, and cp_impl: [ring, allgather, ulysses])
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

dp is derived as gpus / (tp x cp x pp) unless set. Points that fail harness.spec validation,
whose tp x cp x pp x dp != gpus, or that duplicate an earlier point are dropped with the reason
(harness/sweep/expand.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import string
import typing
from dataclasses import dataclass

from harness.errors import SpecError, shown
from harness.launch import LOCAL_LAUNCHERS
from harness.spec import (
    Layout,
    Workload,
    build_spec,
    check_device_count,
    check_name,
    check_path,
    check_positive,
    check_positive_int,
    read_yaml,
    spec_field,
)

# How a sweep's points may start: any local launcher, or a Slurm job array (harness/sweep/slurm.py).
SWEEP_LAUNCHERS = LOCAL_LAUNCHERS + ("slurm",)
LAYOUT_FIELDS = set(Layout.__dataclass_fields__)
WORKLOAD_FIELDS = set(Workload.__dataclass_fields__)


def _one_line(value, field: str) -> str:
    if not isinstance(value, str) or "\n" in value:
        raise SpecError(field, f"must be a string (one line), got {shown(value)}")
    return value


# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (or no limit)
_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|infinite|unlimited", re.IGNORECASE)
_SLURM_NAME = frozenset(string.ascii_letters + string.digits + "-_.,+@:")  # partitions, accounts, qos (lists)
_SLURM_CONSTRAINT = _SLURM_NAME | frozenset("&|[]*")  # node features: AND, OR, counts


def _slurm_time(value, field: str) -> str:
    """A time limit as sbatch reads it; an unquoted 00:30:00 is a number to YAML 1.1 (1800), so numbers are refused."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise SpecError(
            field,
            f'give it quoted, e.g. "00:30:00" or "90" (minutes): YAML reads an unquoted '
            f"00:30:00 as the number 1800, got {shown(value)}",
        )
    if not _SLURM_TIME.fullmatch(_one_line(value, field).strip()):
        raise SpecError(
            field, f"{shown(value)} is not a Slurm time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
        )
    return value.strip()


def _chars(allowed: frozenset, what: str):
    def check(value, field: str) -> str:
        bad = "".join(sorted({c for c in _one_line(value, field) if c not in allowed}))
        if bad or not value:
            raise SpecError(
                field,
                f"{shown(value)}: {what} only (it is written into an #SBATCH line)" + (f", not {bad!r}" if bad else ""),
            )
        return value

    return check


_slurm_name = _chars(_SLURM_NAME, "letters, digits and '-_.,+@:'")
_slurm_constraint = _chars(_SLURM_CONSTRAINT, "letters, digits, '-_.,+@:' and the operators '&|[]*'")


def _sbatch_options(value, field: str) -> list:
    """Extra #SBATCH lines: each one option (`--mem=0`), one line."""
    if not isinstance(value, list):
        raise SpecError(field, "must be a list of sbatch options, e.g. [--mem=0]")
    for i, option in enumerate(value):
        if not _one_line(option, f"{field}[{i}]").startswith("-"):
            raise SpecError(f"{field}[{i}]", f"{shown(option)} is not an sbatch option (--name=value)")
    return value


@dataclass
class Slurm:
    """The `slurm:` mapping; harness/sweep/slurm.py writes them into the job script."""

    NULL_IS_DEFAULT: typing.ClassVar[bool] = True
    partition: str | None = spec_field(None, check=_slurm_name)
    account: str | None = spec_field(None, check=_slurm_name)
    qos: str | None = spec_field(None, check=_slurm_name)
    constraint: str | None = spec_field(None, check=_slurm_constraint)
    time: str | None = spec_field(None, check=_slurm_time)  # the array task's limit, HH:MM:SS
    max_parallel: int | None = spec_field(None, check=check_positive_int)  # array tasks at once
    exclusive: bool | None = None
    cpus_per_task: int | None = spec_field(None, check=check_positive_int)
    python: str | None = spec_field(None, check=_one_line)  # the interpreter on the nodes
    setup: list[str] | None = None  # shell lines before the run (module load ...)
    extra: list[str] | None = spec_field(None, check=_sbatch_options)  # more #SBATCH lines


SLURM_KEYS = tuple(f.name for f in dataclasses.fields(Slurm))


def check_slurm(cfg: dict, field: str = "sweep.slurm") -> dict:
    """The `slurm:` mapping: known keys of the right types (a typo is refused, not ignored); kept a mapping."""
    if not isinstance(cfg, dict):
        raise SpecError(field, "must be a mapping")
    built = build_spec(Slurm, cfg, field)
    return {k: getattr(built, k) for k in cfg}


def check_points(points, field: str) -> list:
    """Extra points: mappings of axes, each with its own env and timeout_s checked now, not when it is reached."""
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise SpecError(field, "must be a list of mappings")
    for i, point in enumerate(points):
        if point.get("timeout_s") is not None:
            check_positive(point["timeout_s"], f"{field}[{i}].timeout_s")
        if not isinstance(point.get("env") or {}, dict):
            raise SpecError(f"{field}[{i}].env", "must be a mapping")
    return points


def check_grid(grid, field: str) -> dict:
    """Axes: each a non-empty list of values, named by check_axis_name unless its values are mappings."""
    if not isinstance(grid, dict):
        raise SpecError(field, "must be a mapping")
    for axis, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"{field}.{axis}", "must be a non-empty list")
        if not all(isinstance(v, dict) for v in values):
            check_axis_name(axis, f"{field}.{axis}")
    return grid


def check_axis_name(
    axis: str, where: str, hint: str = " (use workload.<field> for the workload, or mapping values)"
) -> None:
    """A grid axis, point key or filter key names a Layout field, `layout.<field>` or `workload.<field>`."""
    if not isinstance(axis, str):
        raise SpecError(where, "not a Layout field" + hint)
    if axis.startswith("workload."):
        if axis.split(".", 1)[1] not in WORKLOAD_FIELDS:
            raise SpecError(where, "unknown workload field")
    else:
        name = axis.split(".", 1)[1] if axis.startswith("layout.") else axis
        if name not in LAYOUT_FIELDS:
            raise SpecError(where, "not a Layout field" + hint)


def check_filters(rules, field: str) -> list:
    """include/exclude entries: mappings of a field name to a value or a list of values (any of). A
    key that names no field would match nothing: an exclude that drops nothing, an include that drops all."""
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise SpecError(field, "must be a list of mappings")
    for i, rule in enumerate(rules):
        for key in rule:
            check_axis_name(
                key, f"{field}[{i}].{key}", " (a filter names a Layout field, layout.<field> or workload.<field>)"
            )
    return rules


@dataclass
class SweepSpec:
    """A sweep spec as written (the format above), every field checked by harness.spec's builder."""

    NULL_IS_DEFAULT: typing.ClassVar[bool] = True
    name: str  # default: the file name; records are grouped by it (check_sweep_name)
    gpus: int = spec_field(check=check_device_count, required="required: the world size of every point")
    nodes: int = spec_field(1, check=check_device_count)  # gpus split evenly over them
    launcher: str = spec_field("torchrun", choices=SWEEP_LAUNCHERS)  # the CLI's --launcher wins
    timeout_s: float = spec_field(1800.0, check=check_positive)  # per point
    store: str = spec_field("results.sqlite", check=check_path)
    env: dict = spec_field(factory=dict)  # extra environment for every point
    workload: dict = spec_field(factory=dict)  # Workload fields, the same for every point (checked per point)
    layout: dict = spec_field(factory=dict)  # fixed Layout fields
    grid: dict = spec_field(factory=dict, check=check_grid)  # axes: their cross product is the points
    include: list[dict] = spec_field(factory=list, check=check_filters)  # keep only points matching one entry
    exclude: list[dict] = spec_field(factory=list, check=check_filters)  # drop points matching any entry
    points: list[dict] = spec_field(factory=list, check=check_points)  # extra points beyond the grid
    slurm: dict = spec_field(factory=dict, check=check_slurm)  # Slurm fields (class Slurm)
    description: str = ""

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes


SWEEP_KEYS = tuple(f.name for f in dataclasses.fields(SweepSpec))


def parse_sweep(raw, default_name: str = "sweep") -> SweepSpec:
    if not isinstance(raw, dict):
        raise SpecError("sweep", "top level must be a mapping")
    s = build_spec(SweepSpec, {**raw, "name": check_sweep_name(raw.get("name"), default_name)}, "sweep")
    if s.gpus % s.nodes:
        raise SpecError("sweep.gpus", f"{s.gpus} GPUs do not split over {s.nodes} nodes")
    return s


def check_sweep_name(name, default_name: str) -> str:
    """The sweep's name (else the spec file's name): it names the log and job folders, the Slurm
    job, the records' group and the report's headings."""
    given = name is not None and name != ""
    return check_name(
        str(name) if given else default_name,
        "sweep.name",
        "folders, the Slurm job and the report",
        hint="" if given else "; it comes from the file name: set `name:` in the spec",
    )


def load_sweep(path: str) -> SweepSpec:
    raw = read_yaml(path, field="sweep")
    return parse_sweep(raw, os.path.splitext(os.path.basename(path))[0])
