"""Seconds per optimizer step, as a sum of kinds of work, each at its own efficiency.

Every term is "ideal seconds" (work at the datasheet peak of the resource it uses) divided by an
efficiency from the hardware profile: GEMMs and flash attention by tensor-core FLOPs; the score
matrix of materialised attention, norms, rotary, SwiGLU, residual adds, loss and optimizer by
HBM bytes; tensor-parallel collectives, pipeline sends and data-parallel reduction by link bytes
(NVLink inside a node, InfiniBand across); a launch cost per kernel; and a cost per step for the
caching allocator's flushes when the device is nearly full (ALLOC_PRESSURE_S). Because the step
time is linear in the inverse efficiencies and that cost, calibration is a least-squares fit
(calibrate.py).

Schedule: 1F1B over m micro-batches with per-stage times t_i takes sum(t_i) + (m-1) max(t_i)
(fill and drain pass every stage once; the steady state runs at the slowest stage), i.e. the
bubble (p-1)/m of Narayanan et al. 2021 when stages are equal; the other schedules take a share
of the fill/drain part (interleaving with v chunks 1/v; the zero-bubble schedules less:
harness/planner/schedules.py). Data-parallel reduction runs after the last backward (after
the flush), in fp32, not overlapped, as in the study's framework (see step_features). The LM
head's output is all-gathered over tp and the loss runs over the full vocabulary on every rank.
Context parallelism (harness/planner/context.py): every term on the rank's seq / cp tokens, the
attention against every key, the cp exchange on its link (the ring's hidden behind each block's
attention up to that block's compute), and the data-parallel reduction over dp x cp. FSDP (and
hybrid sharding, PlannerLayout.dp_shard): its all-gathers and reduce-scatters within the sharding
group, the all-reduce across the replicate groups, each on the link its group spans. Mixture of
experts (harness/planner/feedforward.py): the experts' GEMMs, the router and the exposed expert all-to-all in
each layer, the experts' gradients reduced over the expert-data-parallel group.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

from harness.model.presets import Shape
from harness.planner import feedforward, fp8, schedules
from harness.planner.context import exchange_bytes
from harness.planner.features import (
    ADAM_BYTES_PER_PARAM,
    ALLOC_PRESSURE_FROM,
    ALLOC_PRESSURE_S,
    attention_features,
    cp_exchange,
    dot,
    layer_features,
    stage_extras,
    stage_features,
    theta_from_profile,
    zero_features,
)
from harness.planner.hardware import Profile
from harness.planner.layout import ATTENTION_CLASS, PlannerLayout, Workload, item_split
from harness.planner.memory import GIB, stage_params, worst_stage_memory
from harness.planner.rates import group_geometry, group_link, replica_groups


@functools.lru_cache(maxsize=4096)
def _stage_params(shape: Shape, items: tuple, tp: int, ep: int = 1) -> float:
    return stage_params(shape, *items, tp, ep)


@functools.lru_cache(maxsize=4096)
def _stage_kinds(n_layers: int, pp: int) -> tuple:
    """Stages that cost the same (same items, same neighbours: first, last): (key, first stage,
    how many), in stage order. A uniform split has a few kinds however many stages."""
    items = item_split(n_layers, pp)
    kinds: dict = {}
    for i in range(pp):
        key = (items[i], i == 0, i == pp - 1)
        if key in kinds:
            kinds[key][1] += 1
        else:
            kinds[key] = [i, 1]
    return tuple((key, first, count) for key, (first, count) in kinds.items())


def alloc_pressure(
    shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, memory_bytes: float | None = None
) -> float:
    """How far the predicted peak of the fullest stage (memory.py; `memory_bytes` when the caller has
    it) lies above ALLOC_PRESSURE_FROM of the device's memory, as a fraction of it (capped at a full
    device): the feature of 'alloc_pressure_s'."""
    if memory_bytes is None:
        memory_bytes = worst_stage_memory(shape, lay, wl)[1]["total"]
    return max(0.0, min(1.0, memory_bytes / (prof.memory_gib * GIB)) - ALLOC_PRESSURE_FROM)


def _per_layer(
    shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, theta: dict, layer_cache: dict | None
) -> tuple[dict, float]:
    """layer_features and their time under theta, from `layer_cache` when the caller keeps one
    (a dict across layouts of one shape, workload, profile and theta: predict_many)."""
    if layer_cache is None:
        per_layer = layer_features(shape, lay, wl, prof, theta)
        return per_layer, dot(theta, per_layer)
    key = layer_key(lay, wl, prof) + layer_own(lay)
    hit = layer_cache.get(key)
    if hit is None:
        per_layer = layer_features(shape, lay, wl, prof, theta)
        hit = layer_cache[key] = (per_layer, dot(theta, per_layer))
    return hit


def layer_key(lay: PlannerLayout, wl: Workload, prof: Profile) -> tuple:
    """What _per_layer's cache key holds beyond layer_own's fields (which the data-parallel terms do
    not read: timing_batch takes this once per the rest of the layout)."""
    key = (
        lay.tp,
        lay.micro_batch_size,
        lay.cp,
        lay.cp_impl if lay.cp > 1 else "",
        group_geometry(lay.dims, "span", "cp") > prof.gpus_per_node,
        lay.ep,  # with tp, the expert group's geometry (ParallelDims.expert_geometry: its span is ep x tp)
        lay.moe_balanced,  # the busiest expert-parallel rank's tokens (feedforward.busiest)
        lay.selective_policy,  # what is recomputed (memory_recipes: per-op checkpointing, recompute_layers)
        lay.recompute_layers,
    )
    if lay.recompute_layers:  # the recomputed layers' share of a rank's: of layers / pp, per chunk (memory_recipes)
        key += (lay.pp, lay.virtual_stages)
    if lay.precision != "bf16":  # the weight casts depend on the engine, the shard and the micro-batches (fp8.py)
        key += (lay.precision, lay.engine, lay.fsdp, lay.reshard_after_forward, lay.replicas, wl.micro_batches(lay))
    return key


def layer_own(lay: PlannerLayout) -> tuple:
    """The rest of _per_layer's cache key: the fields _NOT_DATA_PARALLEL names (the kernel as its cost class)."""
    return (
        lay.activation_checkpointing,
        lay.sequence_parallel,
        ATTENTION_CLASS[lay.attention],
        lay.rmsnorm,
        lay.compile,
    )


# Fields of a layout the data-parallel reduction and the optimizer step do not read: layouts
# differing only in them share those terms (_dp_terms).
_NOT_DATA_PARALLEL = frozenset(("activation_checkpointing", "sequence_parallel", "attention", "rmsnorm", "compile"))


# The other fields' values as a tuple, at C speed: the key of _dp_terms' cache.
_DATA_PARALLEL_FIELDS = operator.attrgetter(
    *(f.name for f in dataclasses.fields(PlannerLayout) if f.name not in _NOT_DATA_PARALLEL)
)


def _dp_terms(shape, lay, wl, prof, kinds, cache) -> tuple[dict, float]:
    """_data_parallel's terms, from `cache` (the caller's layer_cache) when it has them: a plan asks
    them of every kernel, checkpointing and sequence-parallel variant of one split."""
    if cache is None:
        return _data_parallel(shape, lay, wl, prof, kinds)
    key = ("data_parallel", *_DATA_PARALLEL_FIELDS(lay))
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _data_parallel(shape, lay, wl, prof, kinds)
    return hit


def _data_parallel(shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, kinds) -> tuple[dict, float]:
    """Ideal seconds of the data-parallel reduction (by link) and of the optimizer step (HBM), once
    per step, for the stage with the most parameters.

    Data-parallel gradient reduction, as the study's framework does it (Aleph Alpha scaling,
    optimizer.py/allreduce.py): after the last backward (after the pipeline flush), never
    overlapped with compute, the bf16 gradients are flattened into buckets, upcast to fp32 and
    all-reduced (ring: 2 (n-1)/n x 4 bytes per parameter), then each rank updates its ZeRO-1
    shard and the updated bf16 weights are all-gathered ((n-1)/n x 2 bytes per parameter).
    Bus bandwidth: NVLink when the group lies in one node; otherwise NCCL runs one ring per NIC
    and a node offers one NIC per group member it holds (ranks are ordered pp, dp, tp: a node
    holds gpus_per_node / tp members of each data-parallel group). Engine fsdp's collectives, full
    or hybrid sharding: _fsdp_reduction; its optimizer steps on its sharding group's shard."""
    dpx: dict[str, float] = {}
    phi = max(_stage_params(shape, key[0], lay.tp, lay.ep) for key, _, _ in kinds)
    # MoE: the experts' gradients are reduced over the expert-data-parallel group instead (feedforward.py)
    ffn = feedforward.of(shape)
    phi_e = ffn.expert_params(max(kind[0][1] for kind, _, _ in kinds), lay.tp, lay.ep)
    if phi_e:
        phi -= phi_e
        ffn.reduction_terms(lay, wl, prof, phi_e, dpx)
    zero = lay.sharding_stage
    r = lay.replicas  # the gradients are reduced over dp x cp (harness.parallel_dims.REPLICA_AXES)
    grad_bytes = 4 if wl.dtype_bytes == 2 else wl.dtype_bytes  # fp32 reduction of bf16 grads
    if r > 1 and lay.fsdp:
        gathered = phi * wl.dtype_bytes  # bytes of the weights one all-gather of the whole stage moves
        if lay.precision == "fp8":  # FSDP2's fp8 all-gather: the blocks' linear weights in fp8
            layers = max(kind[0][1] for kind, _, _ in kinds)
            gathered -= layers * fp8.gathered_block_saving(shape, lay, wl.dtype_bytes)
        _fsdp_reduction(lay, wl, prof, phi, gathered, grad_bytes, dpx)
    elif r > 1:
        m = wl.micro_batches(lay)
        key, bw = group_link(lay, prof, replica_groups(lay.dims, r, prof.gpus_per_node)[0])
        frac = (r - 1) / r
        dpx[key] = dpx.get(key, 0.0) + (2 * frac * grad_bytes + (frac * wl.dtype_bytes if zero >= 1 else 0)) * phi / bw
        if zero >= 3:  # weights gathered for forward and backward of every micro-batch
            dpx[key] += 2 * m * frac * phi * wl.dtype_bytes / bw
    # Optimizer step on this rank's shard of the master weights, Adam (memory bound).
    opt_params = phi / (lay.shard_group if zero >= 1 else 1)
    opt_params += phi_e / (feedforward.expert_data_parallel(lay.dims) if zero >= 1 else 1)
    return dpx, opt_params * ADAM_BYTES_PER_PARAM / (prof.hbm_gbps * 1e9)


def _fsdp_reduction(
    lay: PlannerLayout, wl: Workload, prof: Profile, phi: float, gathered: float, grad_bytes: int, dpx: dict
) -> None:
    """Add FSDP2's collectives for one step to `dpx` (ideal seconds by link), under full or hybrid
    sharding (PlannerLayout.shard_group: s ranks; R = dp x cp / s replicate groups). Within the
    sharding group, on the link it spans: every block's weights all-gathered for the forward and
    again for the backward of every micro-batch ((s-1)/s x `gathered`, the stage's bytes in the
    compute dtype, fp8 for the linear weights under fp8 all-gather), and its gradients
    reduce-scattered ((s-1)/s x 4 bytes, the fp32 reduction); across the replicate groups, on
    theirs: the reduced 1/s shard all-reduced (2 (R-1)/R x 4 / s, FSDP2's foreach_reduce after each
    reduce-scatter). A reduction after every micro-batch's backward (FSDP2's default accumulation,
    engine fsdp's in fp32), under pp once after the last (pipelining defers it:
    harness/frameworks/fsdp/engine.py). Not overlapped, as the rest of this model."""
    s = lay.shard_group
    m = wl.micro_batches(lay)
    reductions = m if lay.pp == 1 else 1
    shard_geo, replicate_geo = replica_groups(lay.dims, s, prof.gpus_per_node)
    if s > 1:
        key, bw = group_link(lay, prof, shard_geo)
        frac = (s - 1) / s
        dpx[key] = dpx.get(key, 0.0) + (2 * m * gathered + reductions * grad_bytes * phi) * frac / bw
    n_rep = lay.replicas // s
    if n_rep > 1:
        key, bw = group_link(lay, prof, replicate_geo)
        dpx[key] = dpx.get(key, 0.0) + reductions * 2 * (n_rep - 1) / n_rep * grad_bytes * phi / s / bw


def step_features(
    shape: Shape,
    lay: PlannerLayout,
    wl: Workload,
    prof: Profile,
    theta: dict | None = None,
    layer_cache: dict | None = None,
    memory_bytes: float | None = None,
) -> tuple[dict, dict]:
    """Ideal seconds per kind of work for one optimizer step, and a breakdown in real seconds.

    The step time is sum(theta[k] * features[k]) (what calibration fits); theta decides only
    which stage is slowest. step_time() is the same sum, computed without the features.
    """
    theta = theta or theta_from_profile(prof)
    m = wl.micro_batches(lay)
    per_layer, _ = _per_layer(shape, lay, wl, prof, theta, layer_cache)
    # Stages with the same items and neighbours cost the same: each kind is computed once and
    # counted (a uniform split has at most a few kinds, however many stages).
    kinds = _stage_kinds(shape.layers, lay.pp)
    xs = {key: stage_features(shape, lay, wl, prof, first, per_layer) for key, first, _ in kinds}
    times = {key: dot(theta, xs[key]) for key, _, _ in kinds}
    slow_key, slow, _ = max(kinds, key=lambda kind: (times[kind[0]], -kind[1]))  # the first of the slowest
    x_slow = xs[slow_key]
    f = _bubble_factor(lay, theta, per_layer)
    feats = zero_features()
    for k in feats:  # m x slowest + fill/drain through the other stages (the schedule's share of it)
        total = sum(count * xs[key][k] for key, _, count in kinds)
        feats[k] = m * x_slow[k] + (total - x_slow[k]) * f
    compute_s = dot(theta, feats)
    dpx, opt_x = _data_parallel(shape, lay, wl, prof, kinds)
    window = _overlap_window(lay, compute_s, times[slow_key])
    if dot(theta, dpx) > window:  # exposed: what outlasts the compute it overlaps (all of it without overlap)
        hidden = dict(feats if lay.fsdp else x_slow) if window else {}
        for k, value in dpx.items():
            feats[k] += value
        for k, value in hidden.items():
            feats[k] -= value
    feats["hbm"] += opt_x
    pressure = alloc_pressure(shape, lay, wl, prof, memory_bytes)
    feats["alloc_pressure_s"] += pressure
    times_sum = sum(count * times[key] for key, _, count in kinds)
    return feats, _breakdown(lay, m, f, compute_s, times_sum, times[slow_key], slow, dpx, opt_x, theta, pressure)


def _bubble_factor(lay: PlannerLayout, theta: dict, per_layer: dict) -> float:
    """The schedule's bubble as a fraction of 1F1B's (harness/planner/schedules.py), the GEMMs'
    share taken from a layer's time."""
    if lay.pp == 1 or lay.pipeline_schedule in ("1f1b", "gpipe"):
        return 1.0
    share = 0.0
    if bubble_reads_layer(lay):
        total = dot(theta, per_layer)
        share = theta["gemm"] * per_layer.get("gemm", 0.0) / total if total else 0.0
    return schedules.bubble_factor(lay.pipeline_schedule, lay.virtual_stages, lay.pp, share)


def bubble_reads_layer(lay: PlannerLayout) -> bool:
    """Whether _bubble_factor reads the layer's features: under the zero-bubble schedules only."""
    return lay.pp > 1 and lay.pipeline_schedule not in ("1f1b", "gpipe", "interleaved")


def _overlap_window(lay: PlannerLayout, compute_s: float, t_slow: float) -> float:
    """Seconds of compute the data-parallel collectives overlap (PlannerLayout.dp_overlap): FSDP2
    prefetches every block's all-gather and reduce-scatters in its own stream while the other blocks
    compute, so the step's compute; Megatron's overlapped reduction runs in the last micro-batch's
    backward and its parameter gather in the next step's first forward, so one micro-batch's forward
    and backward on the slowest stage. None without overlap (the study's framework, the own engine)."""
    if not lay.overlaps_dp:
        return 0.0
    return compute_s if lay.fsdp else t_slow


def _breakdown(lay, m, f, compute_s, times_sum, t_slow, slow, dpx, opt_x, theta, pressure) -> dict:
    return {
        "compute_and_tp_s": compute_s,
        "bubble_s": (times_sum - t_slow) * f if lay.pp > 1 else 0.0,
        "dp_reduction_exposed_s": max(0.0, dot(theta, dpx) - _overlap_window(lay, compute_s, t_slow)),
        "optimizer_s": theta["hbm"] * opt_x,
        "allocator_pressure_s": theta.get("alloc_pressure_s", ALLOC_PRESSURE_S) * pressure,
        "per_microbatch_slowest_stage_s": t_slow,
        "micro_batches": m,
        "slowest_stage": slow,
    }


def cp_breakdown(
    shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, theta: dict, layer_passes: int, cache=None
) -> dict:
    """The cp exchange of the slowest stage over a step (`layer_passes`: its layers x micro-batches,
    part of compute_and_tp_s): the seconds of all its transfers, those the attention does not hide,
    and the bytes one rank sends. `cache` (step_time's layer_cache): the exchange of one layer and
    micro-batch, by the fields it reads (a plan asks it of every layout with cp > 1)."""
    key = None
    if cache is not None:
        key = (
            "cp",
            lay.micro_batch_size,
            lay.tp,
            lay.cp,
            lay.cp_impl,
            ATTENTION_CLASS[lay.attention],
            lay.activation_checkpointing,
            lay.dims,  # the cp group's span (its link)
        )
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        attention = attention_features(shape, lay, wl, prof)
        link, exposed, total = cp_exchange(shape, lay, wl, prof, theta, attention)
        hit = (link, exposed, total, exchange_bytes(shape, lay, wl.seq_len, wl.dtype_bytes)["total"])
        if cache is not None:
            cache[key] = hit
    link, exposed, total, sent = hit
    return {
        "cp_exchange_s": layer_passes * theta[link] * total,
        "cp_exposed_s": layer_passes * theta[link] * exposed,
        "cp_sent_gb": layer_passes * sent / 1e9,
    }


# Layout fields stage_extras does not read (its cache key leaves them out).
EXTRAS_IGNORE = frozenset(
    {
        "activation_checkpointing",
        "sequence_parallel",
        "attention",
        "rmsnorm",
        "compile",  # the blocks only: embedding, head and loss stay eager (torchtitan compiles the blocks)
        "zero_stage",
        "fsdp",
        "reshard_after_forward",
        "engine",
        "cp_impl",
        "dp_shard",
        "ep",  # the all-to-all is the layers' (feedforward.MoE.routed_features)
    }
)


_EXTRAS_FIELDS = operator.attrgetter(
    *(f.name for f in dataclasses.fields(PlannerLayout) if f.name not in EXTRAS_IGNORE)
)


def _extras(shape: Shape, lay: PlannerLayout, wl: Workload, prof: Profile, theta: dict, kinds, cache) -> tuple:
    """The time of each stage kind's stage_extras under theta, from `cache` (step_time's layer_cache)
    when the caller keeps one: keyed by every layout field but those stage_extras does not read
    (EXTRAS_IGNORE: the checkpointing, kernels, sharding of one mesh share it; a new field is in
    the key until someone adds it there)."""
    key = ("extras", *_EXTRAS_FIELDS(lay))
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        hit = tuple(dot(theta, stage_extras(shape, lay, wl, prof, first)) for _, first, _ in kinds)
        if cache is not None:
            cache[key] = hit
    return hit


def step_time(
    shape: Shape,
    lay: PlannerLayout,
    wl: Workload,
    prof: Profile,
    theta: dict | None = None,
    layer_cache: dict | None = None,
    memory_bytes: float | None = None,
) -> tuple[float, dict]:
    """Seconds per optimizer step and their breakdown: sum(theta[k] * step_features[k]) computed
    per stage kind as layers x (time of a layer) + time of the stage's extras, which a plan over
    thousands of layouts needs (harness plan answers in under a second). `memory_bytes`: the
    predicted peak of the fullest stage, when the caller has it (allocator pressure)."""
    theta = theta or theta_from_profile(prof)
    m = wl.micro_batches(lay)
    per_layer, t_layer = _per_layer(shape, lay, wl, prof, theta, layer_cache)
    kinds = _stage_kinds(shape.layers, lay.pp)
    times = [
        key[0][1] * t_layer + extra
        for (key, _, _), extra in zip(kinds, _extras(shape, lay, wl, prof, theta, kinds, layer_cache), strict=True)
    ]
    dpx, opt_x = _dp_terms(shape, lay, wl, prof, kinds, layer_cache)
    i_slow = max(range(len(kinds)), key=lambda i: (times[i], -kinds[i][1]))
    t_slow, slow = times[i_slow], kinds[i_slow][1]
    f = _bubble_factor(lay, theta, per_layer)
    times_sum = sum(kind[2] * t for kind, t in zip(kinds, times, strict=True))
    compute_s = m * t_slow + (times_sum - t_slow) * f
    pressure = alloc_pressure(shape, lay, wl, prof, memory_bytes)
    breakdown = _breakdown(lay, m, f, compute_s, times_sum, t_slow, slow, dpx, opt_x, theta, pressure)
    if lay.cp > 1:
        breakdown.update(cp_breakdown(shape, lay, wl, prof, theta, m * kinds[i_slow][0][0][1], layer_cache))
    # a MoE's expert all-to-all, exposed: part of compute_and_tp_s (feedforward.py)
    breakdown.update(feedforward.of(shape).all_to_all_breakdown(lay, wl, prof, theta, m * kinds[i_slow][0][0][1]))
    return (
        compute_s + breakdown["dp_reduction_exposed_s"] + breakdown["optimizer_s"] + breakdown["allocator_pressure_s"]
    ), breakdown
