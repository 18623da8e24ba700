"""Mixture of experts in the planner: the terms a MoE layer (harness/model/moe.py: a router, E SwiGLU
experts of width moe_ffn, each token routed to k of them) adds to memory and time, and expert
parallelism's (PlannerLayout.ep: the experts shared out over groups of ep consecutive dp x cp ranks,
harness.parallel_dims.ParallelDims.ep, as Megatron carves them). Modelled as Megatron-core's alltoall
token dispatcher runs it, with the experts tensor-parallel over the layout's tp (its default
expert_tensor_parallel_size = tp) and, under tp > 1, sequence parallelism's local tokens dispatched.

Per layer and micro-batch of n tokens on a tensor-parallel group (n / tp per rank under sequence
parallelism), with k = experts_per_token, f = moe_ffn, E = experts, t = tp:
  parameters   experts (E / ep) x 3 h f / t per rank, the router h x E (replicated); their gradients and
               optimizer states under each engine's closed form, the experts' ZeRO-1 / distributed
               optimizer shard over the expert-data-parallel group (dp x cp / ep), the rest over dp x cp
  compute      the experts' GEMMs on n k tokens (the busiest rank's: x IMBALANCE when ep > 1), each
               expert's GEMM M dimension ep n k / E tokens on average, at the hardware model's GEMM
               efficiency for that size (features.GEMM_HALF_DIM: the grouped GEMM's small-expert
               penalty), and the router's h x E GEMM (2 h E FLOPs per token forward)
  all-to-all   dispatch and combine, forward and backward: 4 per layer (6 under full recomputation)
               of (n / t) k h bytes x (ep - 1) / ep per rank, the members of the group in the rank's
               node over NVLink, the others over the network (ParallelDims.expert_geometry); exposed,
               not overlapped (Megatron's overlap of the all-to-all with another micro-batch's compute,
               --overlap-moe-expert-parallel-comm, is off by default); under tp > 1 the dispatched
               tokens all-gathered over tp and the expert output reduce-scattered (4 more collectives
               of n k h on the tp link)
  activations  per layer kept for backward: the dispatch buffers (the permuted tokens, the received
               tokens the experts' GEMMs keep, the combined output the routing weights multiply), the
               experts' SwiGLU (4 n k f / t), the router's fp32 logits and probabilities (n E), its
               routing map and top-k weights
IMBALANCE is a stated assumption, not fitted: the auxiliary load-balancing loss keeps the busiest
expert's share within ~10% of the mean in published Mixtral/DeepSeek/Qwen-MoE training (Megatron's
moe_router_load_balancing_type aux_loss). With ep = 1 every rank holds every expert, so its work is
n k whatever the routing and no imbalance is charged.
"""

from __future__ import annotations

import dataclasses
import functools

from harness.model.presets import Shape, expert_params
from harness.planner.layout import PlannerLayout

IMBALANCE = 1.1  # the busiest expert-parallel rank's tokens over the mean (see the docstring)
# HBM bytes per element of the n k h dispatched tokens, forward + backward: the permute and unpermute
# (read + write, forward and backward: 8) and the routing weights' multiply (forward 3, backward 3).
DISPATCH_BYTES_PER_B = 14
ROUTER_BYTES_PER_SCORE = 24  # fp32 logits, softmax, top-k: forward read/write ~3 passes, backward ~3
KERNELS_PER_MOE_LAYER = 30  # router GEMM, softmax, top-k, permute, all-to-all, unpermute: forward, ~2x backward
ALL_TO_ALLS = 4  # dispatch and combine forward, their gradients backward


@functools.lru_cache(maxsize=4096)  # a plan asks them of thousands of layouts sharing a few meshes
def expert_geometry(dims, gpus_per_node: int) -> tuple[int, int, int]:
    """dims.expert_geometry(gpus_per_node), remembered."""
    return dims.expert_geometry(gpus_per_node)


@functools.lru_cache(maxsize=4096)
def expert_data_parallel(dims) -> int:
    """dims.expert_data_parallel(), remembered (checked: ep divides dp x cp)."""
    dims.check_ep()
    return dims.expert_data_parallel()


def busiest(lay: PlannerLayout) -> float:
    """The factor on the tokens of the slowest expert-parallel rank (1 without expert parallelism)."""
    return IMBALANCE if lay.ep > 1 else 1.0


def expert_stage_params(shape: Shape, layers: int, tp: int, ep: int) -> float:
    """Expert parameters a rank of a stage holds: (layers) x (E / ep) x expert_params / tp."""
    if not shape.moe:
        return 0.0
    return layers * (shape.experts // ep) * expert_params(shape) / tp


def router_params(shape: Shape) -> int:
    """The router's weight of one layer ([E, h], replicated over tp)."""
    return shape.hidden * shape.experts if shape.moe else 0


@functools.lru_cache(maxsize=256)
def token_shape(shape: Shape, imbalance: float = 1.0) -> Shape:
    """A dense stand-in whose feed-forward width is a token's expert width (k x moe_ffn x imbalance):
    what terms proportional to tokens x ffn (fp8 activation casts) read of a MoE layer."""
    if not shape.moe:
        return shape
    return dataclasses.replace(shape, ffn=shape.experts_per_token * shape.moe_ffn * imbalance, experts=0)


@functools.lru_cache(maxsize=256)
def weight_shape(shape: Shape, ep: int) -> Shape:
    """A dense stand-in whose feed-forward width is a rank's experts' ((E / ep) x moe_ffn): what terms
    proportional to the linear weights (fp8 weight copies and casts) read of a MoE layer."""
    if not shape.moe:
        return shape
    return dataclasses.replace(shape, ffn=(shape.experts // ep) * shape.moe_ffn, experts=0)


def ffn_kept_bytes(shape: Shape, lay: PlannerLayout, n: float, B: int) -> float:
    """What one layer's feed-forward keeps for backward per micro-batch on one rank (n: the tp group's
    tokens): dense, SwiGLU's four ffn / t tensors; MoE, the docstring's activations."""
    t = lay.tp
    if not shape.moe:
        return 4 * n * shape.ffn / t * B
    sp = t if lay.sequence_parallel and t > 1 else 1
    slots = n * shape.experts_per_token * busiest(lay)
    dispatch = slots * shape.hidden * B * (2 / sp + 1)  # permuted (local), received (tp-gathered), combined (local)
    swiglu = 4 * slots * shape.moe_ffn / t * B
    local = n / sp
    router = local * shape.experts * (4 + 4 + 1) + local * shape.experts_per_token * (4 + 8)
    return dispatch + swiglu + router


def ffn_working_bytes(shape: Shape, lay: PlannerLayout, n: float, B: int) -> float:
    """Above what is kept, while the feed-forward runs backward: the incoming gradient, SwiGLU's three
    gradients and the largest weight gradient (dense: h x ffn / t; MoE: one expert's h x moe_ffn / t, on
    the tokens routed to the rank's experts)."""
    t, h = lay.tp, shape.hidden
    if not shape.moe:
        f = shape.ffn
        return (n * h + 3 * n * f / t + h * f / t) * B
    slots = n * shape.experts_per_token * busiest(lay)
    return (slots * h + 3 * slots * shape.moe_ffn / t + h * shape.moe_ffn / t) * B


def all_to_all(shape: Shape, lay: PlannerLayout, n: float, B: int, gpus_per_node: int) -> dict[str, float]:
    """Bytes one rank sends in one layer's all-to-alls for one micro-batch (forward + backward, and the
    recomputed forward's under full checkpointing), by link: 'nvlink' to the members of its expert group
    in its node, 'internode' to the others (ParallelDims.expert_geometry)."""
    if not shape.moe or lay.ep == 1:
        return {}
    t = lay.tp
    sp = t if lay.sequence_parallel and t > 1 else 1
    count = ALL_TO_ALLS + (2 if lay.activation_checkpointing == "full" else 0)
    per = n / sp * shape.experts_per_token * shape.hidden * B * busiest(lay)
    _, per_node, _ = expert_geometry(lay.dims, gpus_per_node)
    out = {"nvlink": count * per * (per_node - 1) / lay.ep}
    if per_node < lay.ep:
        out["internode"] = count * per * (lay.ep - per_node) / lay.ep
    return out


def layer_features(shape: Shape, lay: PlannerLayout, n: float, B: int, prof, gemm_key: str, gemm_peak: float) -> dict:
    """Ideal seconds of one MoE layer's feed-forward for one micro-batch (forward + backward and the
    recomputation), by kind of work: what features.layer_features counts for it in place of the dense
    SwiGLU. n: the tp group's tokens."""
    from harness.planner.features import SWIGLU_BYTES_PER_B, _gemm_eff, link_bandwidth, link_of

    t, h, f, k, E = lay.tp, shape.hidden, shape.moe_ffn, shape.experts_per_token, shape.experts
    ckpt = lay.activation_checkpointing
    passes = 3 + (1 if ckpt == "full" else 0)
    recf = 4 / 3 if ckpt == "full" else 1.0
    sp = t if lay.sequence_parallel and t > 1 else 1
    slots = n * k * busiest(lay)
    per_expert = lay.ep * n * k / E  # an expert's tokens on average: its GEMMs' M
    x: dict[str, float] = {}

    def add(key: str, v: float) -> None:
        x[key] = x.get(key, 0.0) + v

    for N, K in ((2 * f / t, h), (h, f / t)):
        add(gemm_key, passes * 2 * slots * N * K / (gemm_peak * _gemm_eff(per_expert, N, K)))
    local = n / sp
    peak = prof.peak_flops(B)  # the router's GEMM in the compute dtype (Transformer Engine keeps it out of fp8)
    add("gemm", passes * 2 * local * h * E / (peak * _gemm_eff(local, E, h)))
    hbm = SWIGLU_BYTES_PER_B * slots * f / t * B + DISPATCH_BYTES_PER_B * slots / sp * h * B
    hbm += ROUTER_BYTES_PER_SCORE * local * E
    add("hbm", hbm * recf / (prof.hbm_gbps * 1e9))
    for key, sent in all_to_all(shape, lay, n, B, prof.gpus_per_node).items():
        add(key, sent / link_bandwidth(prof, key))
    if t > 1:  # the dispatched tokens gathered over the experts' tp group, their output reduce-scattered
        key = link_of(prof, t)
        add(key, (4 + (2 if ckpt == "full" else 0)) * (t - 1) / t * slots * h * B / link_bandwidth(prof, key))
    add("launch_us", 1e-6 * KERNELS_PER_MOE_LAYER * recf)
    return x


def all_to_all_breakdown(shape: Shape, lay: PlannerLayout, wl, prof, theta: dict, layer_passes: int) -> dict:
    """The expert all-to-all of the slowest stage over a step (`layer_passes`: its layers x micro-batches,
    part of compute_and_tp_s, exposed): its seconds at theta's link efficiencies, the GB one rank sends
    and the link the expert group spans."""
    from harness.planner.features import link_bandwidth

    n, B = lay.micro_batch_size * wl.local(lay).seq_len, wl.dtype_bytes
    sent = all_to_all(shape, lay, n, B, prof.gpus_per_node)
    seconds = sum(theta[key] * v / link_bandwidth(prof, key) for key, v in sent.items())
    _, per_node, nodes = expert_geometry(lay.dims, prof.gpus_per_node)
    return {
        "ep_all_to_all_s": layer_passes * seconds,
        "ep_all_to_all_gb": layer_passes * sum(sent.values()) / 1e9,
        "ep_group_nodes": nodes,
    }


def reduction_terms(lay: PlannerLayout, wl, prof, phi_experts: float, dpx: dict) -> None:
    """Add the expert gradients' reduction over the expert-data-parallel group (dp x cp / ep members, every
    ep-th member of the replica group: features.replica_groups' replicate group of ep-member shards) to
    `dpx` (ideal seconds by link): an fp32 all-reduce (bf16 workloads: fp32 main gradients), the updated
    weights all-gathered under ZeRO-1 (Megatron's distributed optimizer over that group), and under ZeRO-3 /
    FSDP the experts gathered for the forward and backward of every micro-batch, as the dense part's."""
    from harness.planner.features import replica_groups
    from harness.planner.timing import _group_link

    r = expert_data_parallel(lay.dims)
    if r == 1 or not phi_experts:
        return
    B = wl.dtype_bytes
    key, bw = _group_link(lay, prof, replica_groups(lay.dims, lay.ep, prof.gpus_per_node)[1])
    frac = (r - 1) / r
    stage = lay.sharding_stage
    moved = 2 * frac * (4 if B == 2 else B) + (frac * B if stage >= 1 else 0)
    if stage >= 3:
        moved += 2 * wl.micro_batches(lay) * frac * B
    dpx[key] = dpx.get(key, 0.0) + moved * phi_experts / bw


def ep_degrees(shape: Shape, replicas: int, asked=None) -> list[int]:
    """The ep of a layout's candidates: 1 for a dense model; for a MoE every divisor of dp x cp that
    divides the experts (or those of `asked`, --ep)."""
    if not shape.moe:
        return [1]
    return [
        e for e in range(1, replicas + 1) if replicas % e == 0 and shape.experts % e == 0 and (not asked or e in asked)
    ]
