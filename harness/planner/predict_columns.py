"""A plan's predictions as columns: predict_many's predictions of every candidate of a candidate_table.Table,
computed over numpy arrays and ranked (fitting first, fastest first), with a Prediction built only for the
rows a caller reads (Ranked), so that `harness plan` over 100,000 layouts builds twenty.

The terms are predict_many's: a layout's memory from memory_batch (the stage terms once per distinct stage,
the layer terms once per distinct layer, combined per row over arrays; the layouts it does not hold from
_memory), its step time from timing_batch (the split's terms once per split, the layer's once per
distinct layer, combined per row), each kernel predicted as its rate class's representative
(_same_rate_classes), availability by kernel_available; here the distinct keys are found over the
rows' integer codes (np.unique) rather than by a Python loop over layouts. tests/test_predict_columns.py and
benchmarks/plan_speed.py --check hold every candidate's prediction equal to predict_many's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from harness.errors import SpecError
from harness.planner import feedforward, memory_batch, timing, timing_batch
from harness.planner.candidate_table import OPTIONS, Table
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PRECISIONS
from harness.planner.memory import GIB
from harness.planner.predict import (
    ALLOCATOR_MARGIN,
    CLASS_REPRESENTATIVE,
    Prediction,
    _memory,
    _palm_flops_per_token,
    _same_rate_classes,
    kernel_available,
    memory_key,
    validate,
)
from harness.planner.timing import theta_from_profile
from harness.spec import RMSNORM_KERNELS

# The fields a row sets (the rest are its split's).
ROW_FIELDS = frozenset(
    "micro_batch_size pipeline_schedule virtual_stages activation_checkpointing sequence_parallel attention "
    "rmsnorm cp_impl precision dp_shard ep".split()
)


def groups(*cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's group, each group's first row) of the distinct combinations of the rows' codes (each >= -1),
    the groups numbered in the order of their first row."""
    n = len(cols[0])
    if not n:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    key, span = np.zeros(n, dtype=np.int64), 1
    for c in cols:
        c = np.asarray(c, dtype=np.int64) + 1
        size = int(c.max()) + 1
        if span * size >= 2**62:  # too many combinations for one integer: by rows
            _, first, inverse = np.unique(np.stack(cols, axis=1), axis=0, return_index=True, return_inverse=True)
            break
        key, span = key * size + c, span * size
    else:
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse.reshape(-1)], first[order]


class Plan:
    """Every candidate's prediction as columns (rows in the table's order), and one row's Prediction."""

    def __init__(self, shape, table: Table, wl, profile, theta: dict | None = None) -> None:
        self.shape, self.table, self.wl, self.profile = shape, table, wl, profile
        self._built: dict[int, Prediction] = {}
        self.theta = theta = theta or theta_from_profile(profile)
        same = _same_rate_classes(theta)
        t, c = table, table.codes
        self.split = split = c["split"]
        per_split = {name: np.asarray([s[name] for s in t.splits], dtype=np.int64) for name in ("tp", "cp", "pp")}
        self.cp = per_split["cp"][split]
        self.gpus = np.asarray([_gpus(s) for s in t.splits], dtype=np.int64)[split]
        classes = [ATTENTION_CLASS.get(a, a) for a in t.values["att"]]
        merged = [same.get(cls, cls) for cls in classes]
        self.rep = [CLASS_REPRESENTATIVE.get(cls, att) for cls, att in zip(merged, t.values["att"], strict=True)]
        self.rate = np.asarray([merged.index(m) for m in merged], dtype=np.int64)[c["att"]]  # a code per rate class
        memclass = np.asarray([i if cls in MATERIALISED else -1 for i, cls in enumerate(classes)], dtype=np.int64)
        self.memclass = memclass[c["att"]]
        stage_cols = (split, c["mb"], c["pipe"], c["impl"], c["prec"], c["shard"], c["ep"])
        self.stage_of, self.stage_first = groups(*stage_cols)  # also timing's splits: _DATA_PARALLEL_FIELDS
        self._validate()
        self._memory(per_split)
        self._time()
        self._kernels(per_split["tp"])
        tokens = wl.global_batch_size * wl.seq_len
        flops = tokens * _palm_flops_per_token(shape, wl.seq_len)
        peak = profile.peak_flops(wl.dtype_bytes)
        self.mfu = flops / (self.seconds * self.gpus * peak)
        self.tokens_per_s = tokens / self.seconds
        self.memory_gib = self.total / GIB
        ok = self.fits & self.available
        self.order = np.lexsort((-self.mfu, ~ok))  # stable: predict_many's list sorted by (not fits, -mfu)
        self.n_fitting = int(ok.sum())

    def stand_in(self, r: int):
        """Row r's layout with its kernel replaced by its rate class's representative (predict_many's)."""
        return self.table.layout(r, self.rep[self.table.codes["att"][r]])

    def _validate(self) -> None:
        """validate of every row (of its stand-in, as predict_many): the fields it reads are the split's, cp
        implementation, sharding group and ep (one check per distinct combination), the micro-batch (over the
        arrays: at least 1, dp x micro-batch dividing the batch) and kernel, norm and precision (by value); a
        failure is raised as predict_many raises it: the first row's."""
        c, t = self.table.codes, self.table.values
        _, firsts = groups(self.split, c["impl"], c["shard"], c["ep"])
        ok = all(a in ATTENTION_CLASS for a in self.rep) and all(r in RMSNORM_KERNELS for r in t["rms"])
        ok = ok and all(p in PRECISIONS for p in t["prec"]) and all(type(m) is int for m in t["mb"])
        if ok:
            mb = np.asarray(t["mb"], dtype=np.int64)[c["mb"]]
            dp = np.asarray([s["dp"] for s in self.table.splits], dtype=np.int64)[self.split]
            ok = bool(np.all(mb >= 1) and np.all(dp >= 1)) and bool(np.all(self.wl.global_batch_size % (dp * mb) == 0))
        try:
            for r in firsts.tolist():
                validate(self.shape, self.stand_in(r), self.wl)
        except SpecError:
            ok = False
        if not ok:
            for r in range(len(self.table)):
                validate(self.shape, self.stand_in(r), self.wl)

    def _memory(self, per_split: dict) -> None:
        """Each row's memory: worst stage, total bytes, fits, tight; breakdown() reads the rest."""
        shape, wl, t, c = self.shape, self.wl, self.table, self.table.codes
        skip = ROW_FIELDS.union(memory_batch.SPLIT_ONLY)
        lsplit = _as_codes([tuple(v for k, v in s.items() if k not in skip) for s in t.splits])[0]
        n = len(t)
        held = np.ones(n, dtype=bool)
        ck_groups, ck_first = groups(self.stage_of, c["ck"])
        batched = np.asarray([memory_batch.batched(shape, t.layout(r), wl) for r in ck_first.tolist()], dtype=bool)
        held = batched[ck_groups] if len(batched) else held
        self._scalar: dict[int, tuple] = {}  # row -> _memory, for the rows the arrays do not hold
        rows = np.flatnonzero(held)
        cols = None
        if len(rows):
            try:
                stage_of, stage_first = groups(self.stage_of[rows])
                layer_of, layer_first = groups(
                    lsplit[self.split[rows]],
                    *(c[k][rows] for k in ("mb", "ck", "sp", "rms", "impl", "prec", "ep")),
                    self.memclass[rows],
                )
                pair_of, pair_first = groups(stage_of, layer_of)  # rows of one memory (kernels of a class)
                cols = memory_batch.columns(
                    shape,
                    wl,
                    [t.layout(r) for r in rows[stage_first].tolist()],
                    stage_of[pair_first],
                    [t.layout(r) for r in rows[layer_first].tolist()],
                    layer_of[pair_first],
                )
            except memory_batch.Diverged:  # engine_stage_memory has a term the arrays lack: the scalar path
                held[:] = False
                rows = rows[:0]
        self._cols, self._col_of = cols, np.full(n, -1, dtype=np.int64)
        total = np.zeros(n)
        stage = np.zeros(n, dtype=np.int64)
        if cols is not None:
            self._col_of[rows] = pair_of
            total[rows], stage[rows] = cols.total[pair_of], cols.stage[pair_of]
        cache: dict = {}
        for r in np.flatnonzero(~held).tolist():
            lay = self.stand_in(r)
            key = memory_key(lay)
            memory = cache.get(key)
            if memory is None:
                memory = cache[key] = _memory(shape, lay, wl, self.profile)
            self._scalar[r] = memory
            stage[r], total[r] = memory[0], memory[1]
        device = self.profile.memory_gib * GIB
        self.total, self.stage = total, stage
        self.fits = total <= device
        self.tight = ((1 - ALLOCATOR_MARGIN) * device < total) & (total <= device)

    def memory_breakdown(self, r: int) -> dict:
        if r in self._scalar:
            return self._scalar[r][2]
        return self._cols.breakdown(int(self._col_of[r]))

    def _time(self) -> None:
        """Each row's step time and the columns of its breakdown (timing_batch's), the cp and all-to-all terms by
        the fields they read; or, where the arrays diverge from step_time, step_time of each distinct stand-in."""
        shape, wl, prof, theta, c = self.shape, self.wl, self.profile, self.theta, self.table.codes
        cache: dict = {}
        reps = [self.stand_in(r) for r in self.stage_first.tolist()]
        keys = [timing.layer_key(lay, wl, prof) for lay in reps]
        lk = groups(*_as_codes(keys))[0][self.stage_of]
        layer_of, layer_first = groups(lk, c["ck"], c["sp"], self.rate, c["rms"])
        bubbles: dict = {}
        tl = np.zeros(len(layer_first))
        bubble = np.zeros(len(self.split))
        per_layer = []
        for g, r in enumerate(layer_first.tolist()):
            lay = self.stand_in(r)
            hit = timing._per_layer(shape, lay, wl, prof, theta, cache)
            per_layer.append(hit[0])
            tl[g] = hit[1]
        pp_of = np.asarray([s["pp"] for s in self.table.splits], dtype=np.int64)[self.split]
        b_of, b_first = groups(c["pipe"], pp_of)
        reads = np.asarray([timing.bubble_reads_layer(self.table.layout(r)) for r in b_first.tolist()], dtype=bool)
        b_of, b_first = groups(b_of, np.where(reads[b_of], layer_of, -1) if len(reads) else b_of)
        values = []
        for r in b_first.tolist():
            lay = self.stand_in(r)
            pl = per_layer[layer_of[r]]
            bkey = (lay.pipeline_schedule, lay.virtual_stages, lay.pp, timing.bubble_reads_layer(lay) and id(pl))
            f = bubbles.get(bkey)
            if f is None:
                f = bubbles[bkey] = timing._bubble_factor(lay, theta, pl)
            values.append(f)
        bubble = np.asarray(values)[b_of]
        cols = timing_batch.columns(shape, wl, prof, theta, cache, reps, self.stage_of, tl[layer_of], bubble)
        self._t = cols = timing_batch.finish(cols, prof, theta, self.total)
        self.seconds = cols["total"]
        self._cache = cache  # the cp exchange's, read again by time_breakdown
        firsts = self.stage_first[: timing_batch.CHECKED].tolist()
        try:
            timing_batch._check(
                shape,
                [self.stand_in(r) for r in firsts],
                wl,
                prof,
                theta,
                [self.total[r].item() for r in firsts],
                [self.seconds[r].item() for r in firsts],
                [self.time_breakdown(r) for r in firsts],
                range(len(firsts)),
            )
        except timing_batch.Diverged:  # step_time's arithmetic changed, not the arrays': test_timing_batch fails
            self._scalar_time()

    def _scalar_time(self) -> None:
        c = self.table.codes
        of, first = groups(self.stage_of, c["ck"], c["sp"], self.rate, c["rms"], self.memclass)
        cache: dict = {}
        timed = [
            timing.step_time(
                self.shape, self.stand_in(r), self.wl, self.profile, self.theta, cache, self.total[r].item()
            )
            for r in first.tolist()
        ]
        self.seconds = np.asarray([s for s, _ in timed])[of]
        self._timed, self._timed_of = [b for _, b in timed], of

    def time_breakdown(self, r: int) -> dict:
        if hasattr(self, "_timed"):
            return self._timed[self._timed_of[r]]
        b = {k: self._t[k][r].item() for k in timing_batch.BREAKDOWN}
        p = self._t["passes"][r].item()  # step_time's cp and expert all-to-all terms, of the slowest stage's passes
        if self.cp[r] > 1:
            b.update(
                timing.cp_breakdown(self.shape, self.stand_in(r), self.wl, self.profile, self.theta, p, self._cache)
            )
        if self.shape.moe:
            lay = self.stand_in(r)
            b.update(feedforward.of(self.shape).all_to_all_breakdown(lay, self.wl, self.profile, self.theta, p))
        return b

    def _kernels(self, tp: np.ndarray) -> None:
        """Whether each row's kernel runs (kernel_available, by the fields it reads) and why not."""
        c = self.table.codes
        of, first = groups(c["att"], c["mb"], tp[self.split], c["prec"])
        self.why = [kernel_available(self.shape, self.table.layout(r), self.wl, self.profile) for r in first.tolist()]
        self.why_of = of
        self.available = np.asarray([not w for w in self.why], dtype=bool)[of]

    def prediction(self, r: int) -> Prediction:
        """Row r's Prediction, as predict_many's (one object per row: a caller may compare them by identity)."""
        p = self._built.get(r)
        if p is not None:
            return p
        p = self._built[r] = object.__new__(Prediction)
        why = self.why[self.why_of[r]]
        p.__dict__.update(
            layout=self.table.layout(r),
            fits=self.fits[r].item(),
            available=not why,
            memory_gib=self.memory_gib[r].item(),
            step_time_s=self.seconds[r].item(),
            mfu=self.mfu[r].item(),
            tokens_per_s=self.tokens_per_s[r].item(),
            worst_stage=self.stage[r].item(),
            memory_breakdown_gib=self.memory_breakdown(r),
            time_breakdown_s=self.time_breakdown(r),
            why_unavailable=why,
            tight=self.tight[r].item(),
        )
        return p


def _gpus(split: dict) -> int:
    from harness.parallel_dims import AXES, ParallelDims

    return ParallelDims(**{d: split[d] for d in AXES}).world


def _as_codes(keys: list[tuple]) -> tuple[np.ndarray]:
    """One code per distinct key (hashable), in the order of first sight."""
    index: dict = {}
    return (np.fromiter((index.setdefault(k, len(index)) for k in keys), np.int64, len(keys)),)


class Ranked(Sequence):
    """A plan's predictions ranked as plan_of ranks them (fitting and available first, then by MFU, ties in the
    candidates' order): a Prediction is built when a caller reads it; column() reads a column in this order."""

    def __init__(self, plan: Plan, order: np.ndarray | None = None) -> None:
        self.plan = plan
        self.order = plan.order if order is None else order
        self._rows = self.order.tolist()

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return Ranked(self.plan, self.order[k])
        return self.plan.prediction(self._rows[k])

    def __iter__(self):
        prediction = self.plan.prediction
        return (prediction(r) for r in self._rows)

    def distinct(self, name: str) -> int:
        """How many distinct values a layout field takes over these rows."""
        return len(set(self.column(name).tolist()))

    def column(self, name: str) -> np.ndarray:
        """A prediction's column (fits, available, memory_gib, step_time_s, mfu) or a layout field's, ranked."""
        p = self.plan
        if name in ("fits", "available", "memory_gib", "mfu", "tight"):
            return getattr(p, name)[self.order]
        if name == "step_time_s":
            return p.seconds[self.order]
        t = p.table
        option = {"micro_batch_size": "mb", "attention": "att", "rmsnorm": "rms", "cp_impl": "impl"}.get(name, name)
        option = {"precision": "prec", "dp_shard": "shard", "activation_checkpointing": "ck"}.get(option, option)
        if option in OPTIONS:
            return np.asarray(t.values[option], dtype=object)[t.codes[option][self.order]]
        return np.asarray([s[name] for s in t.splits])[p.split[self.order]]


def plan_predictions(shape, table: Table, wl, profile, theta: dict | None = None) -> Ranked:
    """Every candidate of `table` predicted (predict_many's predictions) and ranked: fitting first, fastest first."""
    return Ranked(Plan(shape, table, wl, profile, theta))
