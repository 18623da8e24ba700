"""The candidate layouts of a plan as columns: per split (tp, cp, pp and dp, with the fields every layout of it
shares) the product of the per-layout options, kept as integer codes in numpy arrays rather than as a
PlannerLayout each, so that the plan's per-layout terms are gathered over arrays (predict_columns.py) and
layouts are built only for the rows a user sees (Table.layout).

candidates.layouts enumerates the splits and their options; the rows here are its layouts, in its order:
the product over micro-batch, pipeline, checkpointing, sequence parallelism, kernel, norm, cp implementation,
precision, sharding group and expert-parallel degree, less those its rules leave out (sequence parallelism
where tp is 1 or does not divide the rank's tokens, a micro-batch not dividing the replica's batch, the
interleaved schedules' micro-batches not divisible by pp). candidates.layouts yields Table.layout of each
row, so both are one enumeration.
"""

from __future__ import annotations

import numpy as np

from harness.planner import schedules
from harness.planner.layout import PlannerLayout

# The per-layout options, in the order of the product (and of the columns' codes).
OPTIONS = ("mb", "pipe", "ck", "sp", "att", "rms", "impl", "prec", "shard", "ep")
_new = object.__new__


class Table:
    """Every candidate of a plan: `splits` (each split's PlannerLayout fields, in the dataclass's order),
    `values` (per option, the values its codes index: pipe a (schedule, virtual stages) pair) and `codes`
    (per option and "split", one int64 array over the rows)."""

    def __init__(self) -> None:
        self.splits: list[dict] = []
        self.values: dict[str, list] = {name: [] for name in OPTIONS}
        self._index: dict[str, dict] = {name: {} for name in OPTIONS}
        self._parts: list[tuple[int, np.ndarray]] = []
        self.codes: dict[str, np.ndarray] = {}
        self._rows: list | None = None

    def code(self, option: str, value) -> int:
        index = self._index[option]
        c = index.get(value)
        if c is None:
            c = index[value] = len(self.values[option])
            self.values[option].append(value)
        return c

    def add_split(self, split: dict, options: dict[str, list], keep) -> None:
        """The product of `options` (name -> values, OPTIONS' order) for one split, less the rows `keep`
        (a function of the per-option index arrays, returning a bool mask or None for all) leaves out."""
        sizes = tuple(len(options[name]) for name in OPTIONS)
        if 0 in sizes:
            return
        grid = _grid(sizes)
        mask = keep(dict(zip(OPTIONS, grid, strict=True)))
        if mask is not None:
            grid = grid[:, mask]
        if not grid.shape[1]:
            return
        cols = np.empty((len(OPTIONS), grid.shape[1]), dtype=np.int64)
        for i, name in enumerate(OPTIONS):
            lookup = np.fromiter((self.code(name, v) for v in options[name]), np.int64, len(options[name]))
            cols[i] = lookup[grid[i]]
        self._parts.append((len(self.splits), cols))
        self.splits.append(split)

    def close(self) -> Table:
        """The columns, once every split is added."""
        parts = self._parts
        if parts:
            cols = np.concatenate([c for _, c in parts], axis=1)
            split = np.repeat(np.arange(len(parts), dtype=np.int64), [c.shape[1] for _, c in parts])
        else:
            cols, split = np.zeros((len(OPTIONS), 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
        self.codes = {name: cols[i] for i, name in enumerate(OPTIONS)}
        self.codes["split"] = split
        self._parts = []
        return self

    def __len__(self) -> int:
        return len(self.codes["split"])

    def __iter__(self):
        """The layouts, in order (built one by one)."""
        return (self.layout(i) for i in range(len(self)))

    def field(self, option: str) -> list:
        """The values of an option's codes, by code (for gathering: np.asarray(...)[codes])."""
        return self.values[option]

    def split_field(self, name: str) -> np.ndarray:
        """A split field's value per row."""
        return np.asarray([s[name] for s in self.splits])[self.codes["split"]]

    def rows(self) -> list[tuple]:
        """Each row's codes as Python ints (split first, then OPTIONS')."""
        if self._rows is None:
            self._rows = list(
                zip(self.codes["split"].tolist(), *(self.codes[n].tolist() for n in OPTIONS), strict=True)
            )
        return self._rows

    def layout(self, i: int, attention: str | None = None) -> PlannerLayout:
        """Row i's layout, built as candidates.layouts builds each (its split's fields, then the options'); with
        `attention`, that kernel instead of the row's."""
        s, mb, pipe, ck, sp, att, rms, impl, prec, shard, ep = self.rows()[i]
        v = self.values
        lay = _new(PlannerLayout)
        values = lay.__dict__
        values.update(self.splits[s])
        values["micro_batch_size"] = v["mb"][mb]
        values["activation_checkpointing"] = v["ck"][ck]
        values["sequence_parallel"] = v["sp"][sp]
        values["attention"] = v["att"][att] if attention is None else attention
        values["rmsnorm"] = v["rms"][rms]
        values["cp_impl"] = v["impl"][impl]
        values["pipeline_schedule"], values["virtual_stages"] = v["pipe"][pipe]
        values["precision"] = v["prec"][prec]
        values["dp_shard"] = v["shard"][shard]
        values["ep"] = v["ep"][ep]
        return lay


_GRIDS: dict[tuple, np.ndarray] = {}


def _grid(sizes: tuple) -> np.ndarray:
    """The index of each option in itertools.product's order (the last option fastest), one row per option."""
    grid = _GRIDS.get(sizes)
    if grid is None:
        if len(_GRIDS) >= 256:
            _GRIDS.clear()
        grid = _GRIDS[sizes] = np.indices(sizes, dtype=np.int64).reshape(len(sizes), -1)
    return grid


def split_rules(wl, tp: int, cp: int, dp: int, pp: int, options: dict):
    """candidates.layouts' rules over one split's rows (`options` its OPTIONS' values), as a `keep` of add_split."""
    no_sp = tp == 1 or (wl.seq_len // cp) % tp
    per_replica = wl.global_batch_size // dp
    mbs = options["mb"]
    mb_ok = np.array([per_replica % mb == 0 for mb in mbs])
    inter = np.array([sched in schedules.INTERLEAVED for sched, _ in options["pipe"]])
    inter_ok = np.array([per_replica % mb != 0 or (per_replica // mb) % pp == 0 for mb in mbs])
    sp_on = np.array([bool(sp) for sp in options["sp"]])
    # ep is carved from the sharding group (memory_states.expert_shard_group): it divides dp_shard where set
    shard_ok = np.array([[not shard or shard % ep == 0 for ep in options["ep"]] for shard in options["shard"]])

    def keep(ix: dict):
        mask = mb_ok[ix["mb"]] & (~inter[ix["pipe"]] | inter_ok[ix["mb"]]) & shard_ok[ix["shard"], ix["ep"]]
        if no_sp:
            mask &= ~sp_on[ix["sp"]]
        return mask

    return keep
