"""A block's feed-forward in the planner: one model (FeedForward) with two implementations, the dense SwiGLU
(Dense) and a mixture of experts (MoE), so that memory (memory_terms, memory_engines), features and timing
ask `of(shape)` for its parameters, activations, work and collectives and none of them branches on the kind.

Dense: SwiGLU's three h x ffn matrices split over tp, its two GEMMs on every token of the layer and its
elementwise passes (SWIGLU_BYTES_PER_B) at the layer's rate, four ffn / t tensors kept for backward.

MoE: the terms a MoE layer (harness/model/moe.py: a router, E SwiGLU experts of width moe_ffn, each token
routed to k of them) adds to memory and time, and expert parallelism's (PlannerLayout.ep: the experts
shared out over groups of ep consecutive dp x cp ranks, harness.parallel_dims.ParallelDims.ep, as Megatron
carves them). Modelled as Megatron-core's alltoall token dispatcher runs it, with the experts
tensor-parallel over the layout's tp (its default expert_tensor_parallel_size = tp) and, under tp > 1,
sequence parallelism's local tokens dispatched.

Per layer and micro-batch of n tokens on a tensor-parallel group (n / tp per rank under sequence
parallelism), with k = experts_per_token, f = moe_ffn, E = experts, t = tp:
  parameters   experts (E / ep) x 3 h f / t per rank, the router h x E (replicated); their gradients and
               optimizer states under each engine's closed form, the experts' ZeRO-1 / distributed
               optimizer shard over the expert-data-parallel group (dp x cp / ep), the rest over dp x cp
  compute      the experts' GEMMs on n k tokens (the busiest rank's: x IMBALANCE when ep > 1), each
               expert's GEMM M dimension ep n k / E tokens on average, at the hardware model's GEMM
               efficiency for that size (rates.GEMM_HALF_DIM: the grouped GEMM's small-expert
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
from typing import Protocol

from harness.model.presets import Shape, expert_params
from harness.planner.layout import PlannerLayout
from harness.planner.rates import gemm_eff, group_link, link_bandwidth, link_of, replica_groups

SWIGLU_BYTES_PER_B = 13  # silu(gate) * up: fwd ~5 f-sized passes, bwd ~8
IMBALANCE = 1.1  # the busiest expert-parallel rank's tokens over the mean (see the docstring)
# HBM bytes per element of the n k h dispatched tokens, forward + backward: the permute and unpermute
# (read + write, forward and backward: 8) and the routing weights' multiply (forward 3, backward 3).
DISPATCH_BYTES_PER_B = 14
ROUTER_BYTES_PER_SCORE = 24  # fp32 logits, softmax, top-k: forward read/write ~3 passes, backward ~3
KERNELS_PER_MOE_LAYER = 30  # router GEMM, softmax, top-k, permute, all-to-all, unpermute: forward, ~2x backward
ALL_TO_ALLS = 4  # dispatch and combine forward, their gradients backward


class FeedForward(Protocol):
    """What the planner asks of one layer's feed-forward. n: the tokens of the layer's tensor-parallel group
    for one micro-batch, B: the dtype's bytes, t: tp."""

    shape: Shape

    def tp_params(self) -> int:
        """Parameters of one layer split over tp (beside the attention's)."""

    def replicated_params(self) -> int:
        """Parameters of one layer replicated over tp."""

    def expert_params(self, layers: int, tp: int, ep: int) -> float:
        """Parameters a rank of a stage of `layers` holds sharded over the expert-data-parallel group."""

    def kept_bytes(self, lay: PlannerLayout, n: float, B: int) -> float:
        """What one layer's feed-forward keeps for backward per micro-batch on one rank."""

    def working_bytes(self, lay: PlannerLayout, n: float, B: int) -> float:
        """Above what is kept, while the feed-forward runs backward."""

    def token_shape(self, lay: PlannerLayout) -> Shape:
        """The dense stand-in terms proportional to tokens x ffn (fp8 activation casts) read."""

    def weight_shape(self, ep: int) -> Shape:
        """The dense stand-in terms proportional to the linear weights (fp8 weight copies and casts) read."""

    def gemms(self, t: int) -> list[tuple[float, float]]:
        """(N, K) of its GEMMs on every token of the layer (M = n, at the layer's GEMM rate)."""

    def width(self) -> int:
        """The width of its elementwise passes over every token of the layer (SWIGLU_BYTES_PER_B each)."""

    def routed_features(self, lay: PlannerLayout, n: float, B: int, prof, gemm_key: str, gemm_peak: float) -> dict:
        """Ideal seconds of its work beyond gemms() and width(), by kind (features.layer_features adds them)."""

    def reduction_terms(self, lay: PlannerLayout, wl, prof, phi_experts: float, dpx: dict) -> None:
        """Add the expert_params' gradient reduction to `dpx` (ideal seconds by link)."""

    def all_to_all_breakdown(self, lay: PlannerLayout, wl, prof, theta: dict, layer_passes: int) -> dict:
        """Its exposed collectives over a step, for the time breakdown."""

    def ep_degrees(self, replicas: int, asked=None) -> list[int]:
        """The ep of a layout's candidates."""


# By the shape's id, not its hash: a plan asks it a few times per layout and hashing a Shape costs more than
# the rest of the call. Each entry holds its shape alive, so an id in here is never another shape's.
_OF: dict[int, FeedForward] = {}


def of(shape: Shape) -> FeedForward:
    """The feed-forward of `shape`'s layers: MoE for a mixture of experts, else Dense."""
    ffn = _OF.get(id(shape))
    if ffn is None:
        if len(_OF) >= 256:
            _OF.clear()
        ffn = _OF[id(shape)] = MoE(shape) if shape.moe else Dense(shape)
    return ffn


@dataclasses.dataclass(frozen=True)
class Dense:
    """SwiGLU of width ffn on every token: three h x ffn matrices split over tp."""

    shape: Shape

    def tp_params(self) -> int:
        return 3 * self.shape.hidden * self.shape.ffn

    def replicated_params(self) -> int:
        return 0

    def expert_params(self, layers: int, tp: int, ep: int) -> float:
        return 0.0

    def kept_bytes(self, lay: PlannerLayout, n: float, B: int) -> float:
        """SwiGLU's four ffn / t tensors."""
        return 4 * n * self.shape.ffn / lay.tp * B

    def working_bytes(self, lay: PlannerLayout, n: float, B: int) -> float:
        """The incoming gradient, SwiGLU's three gradients and the largest weight gradient (h x ffn / t)."""
        t, h, f = lay.tp, self.shape.hidden, self.shape.ffn
        return (n * h + 3 * n * f / t + h * f / t) * B

    def token_shape(self, lay: PlannerLayout) -> Shape:
        return self.shape

    def weight_shape(self, ep: int) -> Shape:
        return self.shape

    def gemms(self, t: int) -> list[tuple[float, float]]:
        h, f = self.shape.hidden, self.shape.ffn
        return [(2 * f / t, h), (h, f / t)]

    def width(self) -> int:
        return self.shape.ffn

    def routed_features(self, lay: PlannerLayout, n: float, B: int, prof, gemm_key: str, gemm_peak: float) -> dict:
        return {}

    def reduction_terms(self, lay: PlannerLayout, wl, prof, phi_experts: float, dpx: dict) -> None:
        return None

    def all_to_all_breakdown(self, lay: PlannerLayout, wl, prof, theta: dict, layer_passes: int) -> dict:
        return {}

    def ep_degrees(self, replicas: int, asked=None) -> list[int]:
        return [1]


@functools.lru_cache(maxsize=4096)  # a plan asks them of thousands of layouts sharing a few meshes
def expert_geometry(dims, gpus_per_node: int) -> tuple[int, int, int]:
    """dims.expert_geometry(gpus_per_node), remembered."""
    return dims.expert_geometry(gpus_per_node)


@functools.lru_cache(maxsize=4096)
def expert_data_parallel(dims) -> int:
    """dims.expert_data_parallel(), remembered (checked: ep divides dp x cp)."""
    dims.check_ep()
    return dims.expert_data_parallel()


def folded_share(lay: PlannerLayout) -> float:
    """The share of its tensor-parallel group's dispatched tokens a rank receives: all of them when its experts
    are split over tp (expert_tp 0, Megatron's default), its own 1/tp under parallel folding (expert_tp 1: the
    tp ranks hold different whole experts, Megatron's expert-parallel group ep x tp ranks of tp x dp)."""
    return 1 / lay.tp if lay.expert_tp == 1 and lay.sequence_parallel and lay.tp > 1 else 1.0


def busiest(lay: PlannerLayout) -> float:
    """The factor on the tokens of the slowest expert-parallel rank (1 without expert parallelism)."""
    return IMBALANCE if lay.ep > 1 and not lay.moe_balanced else 1.0  # moe_balanced: forced balanced routing


@functools.lru_cache(maxsize=256)
def _token_shape(shape: Shape, imbalance: float) -> Shape:
    return dataclasses.replace(shape, ffn=shape.experts_per_token * shape.moe_ffn * imbalance, experts=0)


@functools.lru_cache(maxsize=256)
def _weight_shape(shape: Shape, ep: int) -> Shape:
    return dataclasses.replace(shape, ffn=(shape.experts // ep) * shape.moe_ffn, experts=0)


@dataclasses.dataclass(frozen=True)
class MoE:
    """A router and E SwiGLU experts of width moe_ffn, each token routed to k of them (the docstring)."""

    shape: Shape

    def tp_params(self) -> int:
        return 0

    def replicated_params(self) -> int:
        """The router's weight ([E, h])."""
        return self.shape.hidden * self.shape.experts

    def expert_params(self, layers: int, tp: int, ep: int) -> float:
        """(layers) x (E / ep) x expert_params / tp."""
        return layers * (self.shape.experts // ep) * expert_params(self.shape) / tp

    def kept_bytes(self, lay: PlannerLayout, n: float, B: int) -> float:
        """The docstring's activations."""
        shape, t = self.shape, lay.tp
        sp = t if lay.sequence_parallel and t > 1 else 1
        slots = n * shape.experts_per_token * busiest(lay)
        # permuted (local), received (tp-gathered; folded, expert_tp 1: the rank's own share), combined (local)
        # Megatron-core's permute is an index_select, which keeps its indices, not the permuted tokens
        permuted = 0.0 if lay.engine == "megatron" else 1 / sp
        # Transformer Engine's GroupedLinear (v2.9, grouped_linear.py) saves the experts' fc1 input, the received
        # tokens, in fp8 (its columnwise copy only); fp8.saved_input_saving counts a dense FC1's normalised input
        # instead, which a MoE layer's router keeps in B: that saving is given back here
        te_fp8 = lay.engine == "megatron" and lay.precision == "fp8"
        received = (1 if te_fp8 else B) * folded_share(lay)
        given_back = te_fp8 * (B - 1) * n * shape.hidden / sp
        dispatch = slots * shape.hidden * (B * (permuted + 1 / sp) + received) + given_back
        swiglu = 4 * slots * shape.moe_ffn / t * B
        local = n / sp
        router = local * shape.experts * (4 + 4 + 1) + local * shape.experts_per_token * (4 + 8)
        return dispatch + swiglu + router

    def working_bytes(self, lay: PlannerLayout, n: float, B: int) -> float:
        """Dense's, on the tokens routed to the rank's experts, with one expert's h x moe_ffn / t weight gradient."""
        shape, t, h = self.shape, lay.tp, self.shape.hidden
        slots = n * shape.experts_per_token * busiest(lay)
        return (slots * h * folded_share(lay) + 3 * slots * shape.moe_ffn / t + h * shape.moe_ffn / t) * B

    def token_shape(self, lay: PlannerLayout) -> Shape:
        """Feed-forward width a token's expert width (k x moe_ffn x the busiest rank's imbalance)."""
        return _token_shape(self.shape, busiest(lay))

    def weight_shape(self, ep: int) -> Shape:
        """Feed-forward width a rank's experts' ((E / ep) x moe_ffn)."""
        return _weight_shape(self.shape, ep)

    def gemms(self, t: int) -> list[tuple[float, float]]:
        return []  # the experts' run on routed tokens (routed_features)

    def width(self) -> int:
        return 0

    def all_to_all(self, lay: PlannerLayout, n: float, B: int, gpus_per_node: int) -> dict[str, float]:
        """Bytes one rank sends in one layer's all-to-alls for one micro-batch (forward + backward, and the
        recomputed forward's under full checkpointing), by link: 'nvlink' to the members of its expert group
        in its node, 'internode' to the others (ParallelDims.expert_geometry)."""
        if lay.ep == 1:
            return {}
        shape, t = self.shape, lay.tp
        sp = t if lay.sequence_parallel and t > 1 else 1
        count = ALL_TO_ALLS + (2 if lay.activation_checkpointing == "full" else 0)
        per = n / sp * shape.experts_per_token * shape.hidden * B * busiest(lay)
        _, per_node, _ = expert_geometry(lay.dims, gpus_per_node)
        out = {"nvlink": count * per * (per_node - 1) / lay.ep}
        if per_node < lay.ep:
            out["internode"] = count * per * (lay.ep - per_node) / lay.ep
        return out

    def routed_features(self, lay: PlannerLayout, n: float, B: int, prof, gemm_key: str, gemm_peak: float) -> dict:
        """Ideal seconds of one MoE layer's feed-forward for one micro-batch (forward + backward and the
        recomputation), by kind of work: the router, the experts and the all-to-all."""
        shape = self.shape
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
            add(gemm_key, passes * 2 * slots * N * K / (gemm_peak * gemm_eff(per_expert, N, K)))
        local = n / sp
        peak = prof.peak_flops(B)  # the router's GEMM in the compute dtype (Transformer Engine keeps it out of fp8)
        add("gemm", passes * 2 * local * h * E / (peak * gemm_eff(local, E, h)))
        hbm = SWIGLU_BYTES_PER_B * slots * f / t * B + DISPATCH_BYTES_PER_B * slots / sp * h * B
        hbm += ROUTER_BYTES_PER_SCORE * local * E
        add("hbm", hbm * recf / (prof.hbm_gbps * 1e9))
        for key, sent in self.all_to_all(lay, n, B, prof.gpus_per_node).items():
            add(key, sent / link_bandwidth(prof, key))
        if t > 1 and lay.expert_tp != 1:  # the dispatched tokens gathered over the experts' tp group, their
            # output reduce-scattered (none when folded: each tp rank dispatches its own tokens to whole experts)
            key = link_of(prof, t)
            add(key, (4 + (2 if ckpt == "full" else 0)) * (t - 1) / t * slots * h * B / link_bandwidth(prof, key))
        add("launch_us", 1e-6 * KERNELS_PER_MOE_LAYER * recf)
        return x

    def all_to_all_breakdown(self, lay: PlannerLayout, wl, prof, theta: dict, layer_passes: int) -> dict:
        """The expert all-to-all of the slowest stage over a step (`layer_passes`: its layers x micro-batches,
        part of compute_and_tp_s, exposed): its seconds at theta's link efficiencies, the GB one rank sends
        and the link the expert group spans; nothing without expert parallelism."""
        if lay.ep == 1:
            return {}
        n, B = lay.micro_batch_size * wl.local(lay).seq_len, wl.dtype_bytes
        sent = self.all_to_all(lay, n, B, prof.gpus_per_node)
        seconds = sum(theta[key] * v / link_bandwidth(prof, key) for key, v in sent.items())
        _, per_node, nodes = expert_geometry(lay.dims, prof.gpus_per_node)
        return {
            "ep_all_to_all_s": layer_passes * seconds,
            "ep_all_to_all_gb": layer_passes * sum(sent.values()) / 1e9,
            "ep_group_nodes": nodes,
        }

    def reduction_terms(self, lay: PlannerLayout, wl, prof, phi_experts: float, dpx: dict) -> None:
        """The expert gradients' reduction over the expert-data-parallel group (dp x cp / ep members, every
        ep-th member of the replica group: rates.replica_groups' replicate group of ep-member shards): an
        fp32 all-reduce (bf16 workloads: fp32 main gradients), the updated weights all-gathered under ZeRO-1
        (Megatron's distributed optimizer over that group), and under ZeRO-3 / FSDP the experts gathered for
        the forward and backward of every micro-batch, as the dense part's."""
        r = expert_data_parallel(lay.dims)
        if r == 1 or not phi_experts:
            return
        B = wl.dtype_bytes
        key, bw = group_link(lay, prof, replica_groups(lay.dims, lay.ep, prof.gpus_per_node)[1])
        frac = (r - 1) / r
        stage = lay.sharding_stage
        moved = 2 * frac * (4 if B == 2 else B) + (frac * B if stage >= 1 else 0)
        if stage >= 3:
            moved += 2 * wl.micro_batches(lay) * frac * B
        dpx[key] = dpx.get(key, 0.0) + moved * phi_experts / bw

    def ep_degrees(self, replicas: int, asked=None) -> list[int]:
        """Every divisor of dp x cp that divides the experts (or those of `asked`, --ep)."""
        E = self.shape.experts
        return [e for e in range(1, replicas + 1) if replicas % e == 0 and E % e == 0 and (not asked or e in asked)]
