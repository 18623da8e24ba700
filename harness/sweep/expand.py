"""The grid into points: every valid point with its stable key, every dropped combination with why.

Invalid points are decided here, before anything launches, so a sweep never spends a run on
a layout that cannot start; the key lets a re-run skip what the store already holds.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
from dataclasses import dataclass, field

from harness.errors import SpecError
from harness.parallel_dims import ParallelDims
from harness.spec import RunSpec, check_world_size, layout_label, parse_spec
from harness.sweep.spec import SweepSpec, check_axis_name


@dataclass
class Point:
    """One layout to run: the full validated spec, its coordinates on the grid and its key."""

    coords: dict
    spec: dict
    key: str
    env: dict = field(default_factory=dict)
    timeout_s: float | None = None  # a point's own limit, else the sweep's
    grid: bool = True  # a combination of the grid's values, not one of the spec's listed points

    def label(self) -> str:
        extra = [f"{k}={v}" for k, v in self.coords.items() if k.startswith("workload.")]
        return " ".join([layout_label(self.spec["layout"])] + extra)


@dataclass
class Drop:
    coords: dict
    reason: str
    kind: str = "invalid"  # or "filter" (include/exclude) or "duplicate" (of a point kept)
    grid: bool = True


# Layout fields that mean nothing without context parallelism: left out of a cp1 point's key, so a
# cp1 point keeps the key it had before the fields existed (a resumed sweep skips what it ran) and
# points differing only in cp_impl at cp 1 are one point (a duplicate, dropped).
CP_FIELDS = ("cp", "cp_impl")
# Layout and workload fields added later, left out of a point's key at their default for the same reason
LATER_DEFAULTS = {"compile": "none", "fp8_all_gather": False, "ep": 1, "ds_moe": "layer"}
LATER_WORKLOAD_DEFAULTS = {"fp8_recipe": "tensorwise", "moe_aux_loss_coeff": 0.0, "moe_z_loss_coeff": 0.0}
LATER_OPTIMIZER_DEFAULTS = {"name": "adamw", "muon_momentum": 0.95, "muon_adjust_lr": "original"}


def point_key(spec_dict: dict) -> str:
    """Stable identity of a point: hash of its normalised workload + layout (not its name)."""
    layout = spec_dict["layout"]
    if ParallelDims.of(layout).cp == 1:
        layout = {k: v for k, v in layout.items() if k not in CP_FIELDS}
    layout = {k: v for k, v in layout.items() if k not in LATER_DEFAULTS or v != LATER_DEFAULTS[k]}
    workload = {
        k: v
        for k, v in spec_dict["workload"].items()
        if k not in LATER_WORKLOAD_DEFAULTS or v != LATER_WORKLOAD_DEFAULTS[k]
    }
    if isinstance(workload.get("optimizer"), dict):  # its fields added later (Muon's), dropped at their defaults
        later = LATER_OPTIMIZER_DEFAULTS
        workload["optimizer"] = {k: v for k, v in workload["optimizer"].items() if k not in later or v != later[k]}
    ident = {"workload": workload, "layout": layout}
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


def _fixed(layout: dict) -> str:
    """The degrees dp is derived from, as a drop names them: 'tp x pp = 3 x 1' ('tp x cp x pp' with cp)."""
    axes = ("tp", "cp", "pp") if layout.get("cp", 1) != 1 else ("tp", "pp")
    return f"{' x '.join(axes)} = {' x '.join(str(layout.get(a, 1)) for a in axes)}"


def _defaults() -> dict:
    d = RunSpec().to_dict()
    return {"workload": d["workload"], "layout": d["layout"]}


def expand(sweep: SweepSpec) -> tuple[list[Point], list[Drop]]:
    """All valid points of the sweep, in grid order, and every dropped combination with why.

    Filters see each point with the spec defaults filled in (so `exclude: [{attention: sdpa}]`
    also hits points that leave attention at its default) and run before validation, so a
    point the user excluded is reported as excluded rather than as invalid.
    """
    axes = list(sweep.grid)
    combos = [dict(zip(axes, vals, strict=True)) for vals in itertools.product(*(sweep.grid[a] for a in axes))]
    if not axes and sweep.points:
        combos = []  # only the listed points, not also the bare base layout
    candidates = [(c, {"env": {}, "timeout_s": None, "grid": True}) for c in combos]
    for i, extra in enumerate(sweep.points):
        coords = {k: v for k, v in extra.items() if k not in ("env", "timeout_s")}
        for k in coords:
            if not isinstance(coords[k], dict):
                check_axis_name(k, f"sweep.points[{i}].{k}")
        extra = {"env": dict(extra.get("env") or {}), "timeout_s": extra.get("timeout_s"), "grid": False}
        candidates.append((coords, extra))
    defaults = _defaults()
    points, drops, seen = [], [], {}
    for coords, extra in candidates:
        raw = {
            "name": sweep.name,
            "store": sweep.store,
            "workload": copy.deepcopy(sweep.workload),
            "layout": copy.deepcopy(sweep.layout),
        }
        _apply(raw, coords)
        lay = raw["layout"]
        filled = {"workload": {**defaults["workload"], **raw["workload"]}, "layout": {**defaults["layout"], **lay}}
        if "dp" not in lay:
            try:
                tp, pp, cp = filled["layout"]["tp"], filled["layout"]["pp"], filled["layout"].get("cp", 1)
                lay["dp"] = filled["layout"]["dp"] = ParallelDims.derive(
                    sweep.gpus, "sweep.gpus", tp=tp, pp=pp, cp=cp
                ).dp
            except SpecError:
                pass  # dropped below, once the filters have seen the point
        flat = _flat(filled, coords)
        if sweep.include and not any(matches(flat, r) for r in sweep.include):
            drops.append(Drop(coords, "not matched by any include filter", "filter", extra["grid"]))
            continue
        hit = next((i for i, r in enumerate(sweep.exclude) if matches(flat, r)), None)
        if hit is not None:
            drops.append(Drop(coords, f"excluded by exclude[{hit}] {sweep.exclude[hit]}", "filter", extra["grid"]))
            continue
        if "dp" not in lay:
            why = f"layout: {sweep.gpus} GPUs are not divisible by {_fixed(filled['layout'])}"
            drops.append(Drop(coords, why, grid=extra["grid"]))
            continue
        try:
            spec = parse_spec(raw)
            check_world_size(spec, sweep.gpus)
        except SpecError as e:
            drops.append(Drop(coords, str(e), grid=extra["grid"]))
            continue
        spec_dict = spec.to_dict()
        spec_dict["workload"]["optimizer"]["betas"] = list(spec_dict["workload"]["optimizer"]["betas"])
        key = point_key(spec_dict)
        if key in seen:
            drops.append(Drop(coords, f"duplicate of point {seen[key]} ({key})", "duplicate", extra["grid"]))
            continue
        seen[key] = len(points)
        points.append(
            Point(
                coords=coords,
                spec=spec_dict,
                key=key,
                env={**sweep.env, **extra["env"]},
                timeout_s=extra["timeout_s"],
                grid=extra["grid"],
            )
        )
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


def check_some_point(points: list[Point], drops: list[Drop]) -> None:
    """A sweep that would run nothing is a mistake, not a success: refused by a dry run and a run alike."""
    if not points:
        raise SpecError(
            "sweep", f"all {len(drops)} points were dropped (first: {drops[0].reason if drops else '-'}); see --dry-run"
        )


def check_grid_values(sweep: SweepSpec, points: list[Point], drops: list[Drop]) -> None:
    """A value of a grid axis that is invalid in every combination it is part of (attention: flash
    where no kernel of that name exists, tp 3 on 2 GPUs) is a mistake in the spec, not a smaller
    sweep: refused, naming the axis and the first reason, before anything launches. A value whose
    combinations were all filtered out (include, exclude) is the user's choice and passes. Where
    one bad value leaves every combination invalid (and so every other value with it), the value
    blamed is one whose reasons name its own field, else one beside a valid value of its axis."""
    bad = []  # (axis, index, value, its invalid drops, how many of its points were filtered out)
    for axis, values in sweep.grid.items():
        for i, value in enumerate(values):
            mine = [x for x in (*points, *drops) if x.grid and x.coords.get(axis) == value]
            invalid = [d for d in mine if isinstance(d, Drop) and d.kind == "invalid"]
            if invalid and not any(isinstance(x, Point) or x.kind == "duplicate" for x in mine):
                bad.append((axis, i, value, invalid, len(mine) - len(invalid)))
    if not bad:
        return

    def names_itself(b) -> bool:
        fields = {k.split(".")[-1] for k in (b[2] if isinstance(b[2], dict) else {b[0]: b[2]})}
        return all(d.reason.split(":", 1)[0].split(".")[-1] in fields for d in b[3])

    def beside_a_valid_value(b) -> bool:
        return sum(1 for x in bad if x[0] == b[0]) < len(sweep.grid[b[0]])

    axis, i, value, invalid, filtered = next(
        (b for b in bad if names_itself(b)), next((b for b in bad if beside_a_valid_value(b)), bad[0])
    )
    raise SpecError(
        f"sweep.grid.{axis}" + (f"[{i}]" if isinstance(value, dict) else ""),
        f"{_fmt({axis: value}).split('=', 1)[1]} is invalid in every point it is part of "
        f"({len(invalid)}; first: {invalid[0].reason})"
        + (f", the other {filtered} filtered out" if filtered else "")
        + "; remove it from the grid",
    )


def drop_summary(points: list[Point], drops: list[Drop]) -> list[str]:
    """What a partly dropped sweep says before it starts: one line per kind of reason (the field a
    check named, an exclude or include rule, a duplicate) with how many and the first of them."""
    kinds: dict[str, list[str]] = {}
    for d in drops:
        head = d.reason.split(":", 1)[0]
        kinds.setdefault(head if " " not in head else " ".join(d.reason.split()[:3]), []).append(d.reason)
    total = len(points) + len(drops)
    return [
        f"note: sweep: {len(reasons)} of {total} points dropped: {reasons[0]}"
        + (f" (and {len(reasons) - 1} more like it)" if len(reasons) > 1 else "")
        + "; see --dry-run"
        for reasons in kinds.values()
    ]


def pending(points: list[Point], done: dict[str, str], retry: tuple[str, ...] = ()) -> list[Point]:
    """Points without a record (or whose recorded status is one the user asked to retry)."""
    return [p for p in points if p.key not in done or done[p.key] in retry]
