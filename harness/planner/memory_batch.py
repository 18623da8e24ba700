"""The memory of many layouts at once (predict_many): memory_engines.engine_stage_memory's arithmetic of a
layout's stage over numpy arrays, one row per stage of every layout, so that a plan of 100,000 layouts does
not run the memory model once per layout in Python.

engine_stage_memory's terms fall in two kinds. A stage's (its model states, weights, fp8 copies, the
loss, FSDP2's buffers, the micro-batches in flight) read no checkpointing, sequence parallelism, attention
kernel or norm (LAYER_ONLY): they are taken once per stage of each distinct rest of the layout, from
engine_stage_memory and memory_engines' functions themselves. A layer's (engine_layer_bytes, the hidden
state, the head's norm) read no pipeline, data-parallel or sharding degree (SPLIT_ONLY): once per distinct
rest. What combines them per layout and stage (from `micro` to `total` in engine_stage_memory) is written
here again over arrays, operation for operation, so that every float is the one the scalar code gives
(tests/test_memory_batch.py compares every candidate of plans of each engine with worst_stage_memory).
A change to that part of engine_stage_memory goes here too; layouts of the terms not combined here
(batched) take the scalar path.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from harness.model.presets import Shape
from harness.planner import memory_engines as me
from harness.planner import memory_recipes as recipes
from harness.planner import memory_reserve as reserve
from harness.planner import memory_terms as terms
from harness.planner.hardware import Profile
from harness.planner.layout import ATTENTION_CLASS, MATERIALISED, PAPER, PlannerLayout, Workload
from harness.planner.memory_fsdp import fsdp_step_bytes, one_round_chunks

# Fields a stage's terms do not read, and fields a layer's terms do not read.
LAYER_ONLY = ("activation_checkpointing", "sequence_parallel", "attention", "rmsnorm")
SPLIT_ONLY = ("pp", "dp", "pipeline_schedule", "virtual_stages", "dp_shard", "zero_stage")
_FIELDS = tuple(f.name for f in dataclasses.fields(PlannerLayout))
_STAGE_KEY = operator.attrgetter(*(f for f in _FIELDS if f not in LAYER_ONLY))
_LAYER_KEY = operator.attrgetter(*(f for f in _FIELDS if f not in SPLIT_ONLY and f != "attention"))
# A stage's columns (_stage), in this order.
STAGE_COLUMNS = (
    "stage emb layers head piped k n9 lookup ce_kept ce_extra eg_base eg_whole gpipe weights gradients optimizer "
    "fp8 has_fp8 frag fsdp fsdp_bws kept_blocks all_blocks fsdp_dynamic params kept_outputs logits_block merged"
).split()
LAYER_COLUMNS = "layer full_layer working hidden head_norm keeps_input full".split()


def batched(shape: Shape, lay: PlannerLayout, wl: Workload) -> bool:
    """Whether the arrays here hold the layout's memory: engine_stage_memory's terms under AdamW but the
    recipes' per-layer recomputation, offload, per-op checkpointing and bf16 main gradients, and engine fsdp's
    one-round interleaved order (memory_fsdp.one_round_chunks: its in-flight count depends on a layer's bytes)."""
    return (
        lay.engine != PAPER
        and wl.optimizer != "muon"
        and not me._per_op(lay)
        and not lay.recompute_layers
        and not lay.offload_layers
        and not recipes.bf16_main_grads(lay)
        and one_round_chunks(shape, lay, wl, 0) is None
    )


def _stages(shape: Shape, lay: PlannerLayout, wl: Workload) -> list[int]:
    """The stages memory.worst_stage_memory compares: the first of each kind."""
    items, seen, out = me.engine_stage_items(shape, lay, wl.seq_len), set(), []
    for i in range(lay.pp):
        if (items[i], i == lay.pp - 1) not in seen:
            seen.add((items[i], i == lay.pp - 1))
            out.append(i)
    return out


def _stage(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int) -> tuple[tuple, dict]:
    """STAGE_COLUMNS of one stage: what engine_stage_memory holds of it whatever the LAYER_ONLY fields; and
    engine_stage_memory of the layout's stage itself."""
    has_emb, layers, has_head = me.engine_stage_items(shape, lay, wl.seq_len)[stage]
    parts = me.engine_stage_memory(shape, lay, wl, stage)  # its model states, weights and fp8 terms
    states = me.memory_model(lay.engine).states
    fsdp_states = states == "fsdp" or (lay.fsdp and states == "megatron")
    B, t, h, V = wl.dtype_bytes, lay.tp, shape.hidden, shape.vocab
    n = lay.micro_batch_size * wl.local(lay).seq_len
    m = wl.micro_batches(lay)
    ce_kept, ce_extra = me.loss_bytes(shape, lay, wl) if has_head else (0.0, 0.0)
    fs = None
    shards = lay.tp if me._loss_parallel(lay) else 1
    if fsdp_states:
        fs = fsdp_step_bytes(shape, lay, wl, has_emb, layers, has_head, shards)
    kept = recipes.kept_outputs_bytes(lay, n, V, B, m, shards) if has_head else 0.0
    return (
        stage,
        has_emb,
        layers,
        has_head,
        lay.pp > 1,
        terms.in_flight(lay, stage, m),
        9 * n,
        has_emb and t > 1,
        ce_kept,
        ce_extra,
        shape.vocab * h / t * B,
        V * h * B,
        lay.pipeline_schedule == "gpipe",
        parts["weights"],
        parts["gradients"],
        parts["optimizer"],
        parts.get("fp8_weights_and_scales", 0.0),
        "fp8_weights_and_scales" in parts,
        terms.FRAGMENTATION_PIPELINED if lay.pp > 1 and m > 1 else terms.FRAGMENTATION,
        fs is not None,
        fs["backward_blocks"] + fs["after_loss"] - (ce_kept if has_head else 0.0) if fs else 0.0,
        fs["kept_blocks"] if fs else 0.0,
        fs["all_blocks"] if fs else 0.0,
        fs["gathered"] + parts["gradients"] if fs else 0.0,
        parts["params"],
        kept,
        reserve.logits_block(shape, lay, wl, has_head, shards),
        reserve.merged_outputs_block(shape, lay, wl, has_emb, has_head, kept, shards),
    ), parts


def _layer(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple:
    """LAYER_COLUMNS of a layout: what engine_stage_memory holds of a layer whatever the SPLIT_ONLY fields."""
    act = me.engine_layer_bytes(shape, lay, wl)
    B, t, h = wl.dtype_bytes, lay.tp, shape.hidden
    sp = lay.sequence_parallel and t > 1
    n = lay.micro_batch_size * wl.local(lay).seq_len
    return (
        act["layer"],
        act["full_layer"],
        act["working"],
        n * h * B / (t if sp else 1),
        me._norm_bytes(lay, n, h, B, sp),
        lay.activation_checkpointing == "full" or lay.norm_kernel == "fused" or B == 4,
        lay.activation_checkpointing == "full",
    )


def _columns(rows: list[tuple], names: list[str], codes: np.ndarray) -> dict[str, np.ndarray]:
    table = list(zip(*rows, strict=True))
    return {name: np.asarray(col)[codes] for name, col in zip(names, table, strict=True)}


def memories(shape: Shape, lays: list[PlannerLayout], wl: Workload, profile: Profile, margin: float) -> list[tuple]:
    """predict._memory of each layout (batched): (worst stage, its total bytes, its breakdown in GiB, fits,
    within `margin` of the device: predict.tight_fit with its ALLOCATOR_MARGIN)."""
    if not lays:
        return []
    stage_codes: dict[tuple, int] = {}
    stage_reps: list[PlannerLayout] = []
    layer_codes: dict[tuple, int] = {}
    layer_reps: list[PlannerLayout] = []
    stage_of, layer_of = [], []
    for lay in lays:
        key = _STAGE_KEY(lay)
        code = stage_codes.get(key)
        if code is None:
            code = stage_codes[key] = len(stage_reps)
            stage_reps.append(lay)
        stage_of.append(code)
        att = lay.attention if ATTENTION_CLASS[lay.attention] in MATERIALISED else "flash"
        lkey = (att, _LAYER_KEY(lay))
        code = layer_codes.get(lkey)
        if code is None:
            code = layer_codes[lkey] = len(layer_reps)
            layer_reps.append(lay)
        layer_of.append(code)
    cols = columns(shape, wl, stage_reps, np.asarray(stage_of), layer_reps, np.asarray(layer_of))
    return _breakdowns(cols, profile, margin)


class Columns:
    """The memory of every row (a layout) of a plan: `parts` and `s` (the stage rows' terms) and `best` (each
    row's worst stage among them); `total` (bytes), `stage` (worst_stage) per row."""

    def __init__(self, parts: dict, s: dict, best: np.ndarray) -> None:
        self.parts, self.s, self.best = parts, s, best
        self.total = parts["total"][best]
        self.stage = s["stage"][best]

    def breakdown(self, i: int) -> dict:
        """predict._memory's breakdown in GiB of row i."""
        gib, r, parts = terms.GIB, self.best[i], self.parts
        d = {k: (parts[k][r] / gib).item() for k in BASE}
        if self.s["has_fp8"][r]:
            d["fp8_weights_and_scales"] = (parts["fp8_weights_and_scales"][r] / gib).item()
        if parts["has_step"][r]:
            d["optimizer_step"] = (parts["optimizer_step"][r] / gib).item()
        d["overhead"] = (parts["overhead"][r] / gib).item()
        if parts["has_reserve"][r]:
            d["allocator_reserve"] = (parts["allocator_reserve"][r] / gib).item()
        d["total"] = (parts["total"][r] / gib).item()
        return d


def columns(
    shape: Shape, wl: Workload, stage_reps: list, stage_of: np.ndarray, layer_reps: list, layer_of: np.ndarray
) -> Columns:
    """The memory of rows whose stage terms are those of stage_reps[stage_of[row]] (layouts equal to the row's
    but in LAYER_ONLY fields) and whose layer terms are those of layer_reps[layer_of[row]] (equal but in
    SPLIT_ONLY fields, the attention kernel of the same memory class), all of them batched."""
    stage_rows: list[tuple] = []
    scalar: list[tuple[int, int, dict]] = []  # (group, its j-th stage, engine_stage_memory) of each stage row
    starts_g, counts_g = [], []
    for g, lay in enumerate(stage_reps):
        starts_g.append(len(stage_rows))
        stages = _stages(shape, lay, wl)
        counts_g.append(len(stages))
        for j, stage in enumerate(stages):
            row, parts = _stage(shape, lay, wl, stage)
            stage_rows.append(row)
            scalar.append((g, j, parts))
    layer_rows = [_layer(shape, lay, wl) for lay in layer_reps]
    n = len(stage_of)
    counts = np.asarray(counts_g, dtype=np.int64)[stage_of]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))  # each row's first flat row
    slot = np.arange(int(counts.sum())) - np.repeat(starts, counts)  # its stage's place among the row's
    rows_stage = np.repeat(np.asarray(starts_g, dtype=np.int64)[stage_of], counts) + slot
    rows_layer = np.repeat(layer_of, counts)
    s = _columns(stage_rows, STAGE_COLUMNS, rows_stage)
    x = _columns(layer_rows, LAYER_COLUMNS, rows_layer)
    parts = _combine(s, x)
    # the worst stage of each row: the first of its largest total (worst_stage_memory's order)
    totals = np.full((n, int(counts.max())), -np.inf)
    totals[np.repeat(np.arange(n), counts), slot] = parts["total"]
    best = starts + np.argmax(totals, axis=1)
    first_row = dict(zip(*(a.tolist() for a in np.unique(stage_of, return_index=True)), strict=True))
    _check(parts, s, [(starts[first_row[g]] + j, want) for g, j, want in scalar])
    return Columns(parts, s, best)


class Diverged(AssertionError):
    """The arrays' memory of a layout is not engine_stage_memory's: a term changed there, not here."""


def _check(parts: dict, s: dict, rows: list[tuple[int, dict]]) -> None:
    """Each stage row of its first layout (`rows`: flat row, engine_stage_memory's parts) against the scalar
    model's, which _stage computed anyway: a term added to engine_stage_memory and not here raises Diverged
    (predict_many then takes the scalar path), before any prediction uses the arrays."""
    at = np.asarray([r for r, _ in rows], dtype=np.int64)
    keys = (*BASE, "fp8_weights_and_scales", "optimizer_step", "overhead", "allocator_reserve", "total")
    cols = {k: parts[k][at].tolist() for k in keys}
    has_reserve = parts["has_reserve"][at].tolist()
    has_fp8, has_step, params = s["has_fp8"][at].tolist(), parts["has_step"][at].tolist(), s["params"][at].tolist()
    for i, (r, want) in enumerate(rows):
        got = _row_parts(cols, i, has_fp8[i], has_step[i], has_reserve[i])
        got.update(total=cols["total"][i], params=params[i])
        if list(got.items()) != list(want.items()):
            raise Diverged(f"stage {s['stage'][r]}: {got} against engine_stage_memory's {want}")


def _combine(s: dict, x: dict) -> dict[str, np.ndarray]:
    """engine_stage_memory from its `micro` on, per row (a layout's stage): the parts in bytes, and
    `has_fp8`, `has_step` (whether the part is in the breakdown)."""
    w = np.where
    layers, emb, head, piped = s["layers"], s["emb"], s["head"], s["piped"]
    rec = w(x["full"], layers, 0)  # recipes.recomputed_layers (every layer under full checkpointing)
    micro = w(rec != 0, rec * x["layer"] + (layers - rec) * x["full_layer"], layers * x["layer"])
    micro = micro - 0 * micro / np.maximum(layers, 1)  # recipes.offloaded_layers: none (batched)
    hidden = x["hidden"]
    micro = w(piped, micro + hidden * ((~emb).astype(np.int64) + (~head).astype(np.int64)), micro)
    micro = w(x["keeps_input"] & piped & ~emb & (layers != 0), micro - hidden, micro)
    micro = w(s["lookup"], micro + s["n9"], micro)
    head_b = w(head, x["head_norm"] + s["ce_kept"], 0.0)
    micro = micro + head_b
    k = s["k"]
    held = k * micro
    held = w(head, held + s["kept_outputs"], held)  # every micro-batch's logits kept (pp_outputs_kept)
    held = w((head_b != 0) & (k > 1) & ~s["gpipe"], held - (k - 1) * head_b, held)
    working = w(rec != 0, x["full_layer"] - x["layer"], 0.0) + x["working"]
    fsdp = s["fsdp"]
    bws = w(layers != 0, working, 0.0)
    bws = w(fsdp & (layers != 0), bws + s["fsdp_bws"], bws)
    loss = w(head, s["ce_extra"], -np.inf)
    loss = w(fsdp & head, loss + s["kept_blocks"], loss)
    emb_grad = w(emb, s["eg_base"] - micro, -np.inf)
    emb_grad = w(fsdp & emb, emb_grad + s["kept_blocks"], emb_grad)
    emb_grad = w(fsdp & s["lookup"], s["eg_whole"] - micro, emb_grad)
    gathered = w(fsdp & piped & (layers != 0), s["all_blocks"] - micro, -np.inf)
    name = np.argmax(np.stack((bws, loss, emb_grad, gathered)), axis=0)  # the first of the largest
    chosen = np.choose(name, (bws, loss, emb_grad, gathered))
    extra = w(chosen > 0.0, chosen, 0.0)
    logits = s["logits_block"]  # memory_reserve.reserve
    stranded = w(logits != 0, np.maximum(0.0, loss + logits - extra), 0.0) + s["merged"]
    dynamic = held + extra
    dynamic = w(fsdp, dynamic + s["fsdp_dynamic"], dynamic)
    out = {
        "weights": s["weights"],
        "gradients": s["gradients"],
        "optimizer": s["optimizer"],
        "activations": held,
        "backward_working_set": w(name != 1, extra, 0.0),
        "logits_and_loss": w(name == 1, extra, 0.0),
        "fp8_weights_and_scales": s["fp8"],
        "optimizer_step": 0.0 - dynamic,  # no step_grads (batched)
        "overhead": terms.CONTEXT_GIB * terms.GIB + s["frag"] * dynamic,
    }
    has_step = 0.0 > dynamic
    total = out["weights"] + out["gradients"] + out["optimizer"] + held  # sum(parts.values()), in order
    total = total + out["backward_working_set"] + out["logits_and_loss"]
    total = w(s["has_fp8"], total + s["fp8"], total)
    total = w(has_step, total + out["optimizer_step"], total)
    total = total + out["overhead"]
    has_reserve = stranded != 0
    out["allocator_reserve"] = stranded
    out["total"] = w(has_reserve, total + stranded, total)
    out["has_step"], out["has_reserve"] = has_step, has_reserve
    return out


BASE = ("weights", "gradients", "optimizer", "activations", "backward_working_set", "logits_and_loss")


def _row_parts(col: dict, i: int, has_fp8: bool, has_step: bool, has_reserve: bool) -> dict:
    """Row i's parts (col: part -> list) in engine_stage_memory's order, the terms a stage lacks left out,
    the total not yet added: the one place the order lives for the check and the breakdowns."""
    d = {k: col[k][i] for k in BASE}
    if has_fp8:
        d["fp8_weights_and_scales"] = col["fp8_weights_and_scales"][i]
    if has_step:
        d["optimizer_step"] = col["optimizer_step"][i]
    d["overhead"] = col["overhead"][i]
    if has_reserve:
        d["allocator_reserve"] = col["allocator_reserve"][i]
    return d


def _breakdowns(cols: Columns, profile: Profile, margin: float) -> list[tuple]:
    """predict._memory's tuple of each layout from its worst stage's row."""
    parts, s, best = cols.parts, cols.s, cols.best
    gib = terms.GIB
    keys = (*BASE, "fp8_weights_and_scales", "optimizer_step", "overhead", "allocator_reserve")
    col = {k: (parts[k][best] / gib).tolist() for k in keys}
    total = cols.total
    device = profile.memory_gib * gib
    fit = (total <= device).tolist()
    tight = (((1 - margin) * device < total) & (total <= device)).tolist()
    total_gib = (total / gib).tolist()
    total = total.tolist()
    has_fp8 = s["has_fp8"][best].tolist()
    has_step = parts["has_step"][best].tolist()
    has_reserve = parts["has_reserve"][best].tolist()
    stage = cols.stage.tolist()
    out = []
    for i in range(len(stage)):
        d = _row_parts(col, i, has_fp8[i], has_step[i], has_reserve[i])
        d["total"] = total_gib[i]
        out.append((stage[i], total[i], d, fit[i], tight[i]))
    return out
