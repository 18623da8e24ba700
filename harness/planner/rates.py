"""The rates every term of the planner runs at, below the models that use them: a GEMM's efficiency by
its size, the link a group of ranks spans and its bandwidth, the geometry of the replica groups, and a
data-parallel collective's bus bandwidth. features, timing and feedforward (the dense and MoE
feed-forward) all read them; this module imports none of them."""

from __future__ import annotations

import functools

from harness.planner.hardware import Profile
from harness.planner.layout import PlannerLayout

# GEMMs lose efficiency as their smallest dimension shrinks (tile edges and the K-loop's fixed
# prologue/epilogue amortise over it): factor d / (d + GEMM_HALF_DIM). 128 is one CUTLASS tile
# edge on A100/H100; a 5120-wide GEMM runs at 97.6% of the large-GEMM rate, a 640-wide at 83%.
GEMM_HALF_DIM = 128

# Inter-node bandwidth of the data-parallel gradient reduction. A data-parallel group with g
# members in a node can drive g NICs (NCCL runs one ring per rail, each on its own NIC): bus
# bandwidth g x the NIC's. The published sweeps say this happens only in non-pipelined runs whose
# group spans at most `profile.rail_aggregation_max_nodes` nodes; otherwise the reduction runs as
# if each member had only its own NIC. This is what the data say, not a mechanism we have traced.
# Evidence: (1) 13B tp=1 runs with pp=2 cost ~4.5 s per step more than pp=1 on both 32 and 64
# GPUs although each stage reduces half the gradients (candidates: the pipeline's cross-node p2p
# communicators holding NCCL channels/NIC queue pairs, per-stage sequential reduction in the
# study's pipeline engine); (2) 30B runs without a pipeline on 256 GPUs (groups over 32 nodes)
# were 3-11 s slower than an aggregated reduction allows, while the same layouts over 4-8 nodes
# (13B on 32 and 64 GPUs, 30B tp=4 on 64) are fast (candidate: rings leaving one rail-optimised
# leaf group, a 20-node scalable unit of a DGX A100 SuperPOD, and crossing the spine). (1) raises
# leave-one-sweep-out Spearman 0.789 -> 0.855 and lifts the fitted inter-node efficiency from an
# implausible 0.16 to ~0.56; (2) raises it 0.855 -> 0.879 (30B-256 alone 0.77 -> 0.86). The
# sweeps pin the node limit only between 8 and 32. DP_NIC_AGGREGATION_PIPELINED = True restores
# aggregation for pipelined runs.
DP_NIC_AGGREGATION = True
DP_NIC_AGGREGATION_PIPELINED = False


def gemm_eff(*dims: float) -> float:
    """The share of the large-GEMM rate a GEMM of these dimensions reaches: d / (d + GEMM_HALF_DIM), d the smallest."""
    d = min(dims)
    return d / (d + GEMM_HALF_DIM)


def link_of(profile: Profile, group_gpus_span: int) -> str:
    """NVLink when the group fits in a node, else the inter-node network."""
    return "nvlink" if group_gpus_span <= profile.gpus_per_node else "internode"


@functools.lru_cache(maxsize=8192)
def group_geometry(dims, what: str, axis: str, *args) -> int:
    """dims.<what>(axis, *args) (span, stride, per_node, nodes), remembered: a plan asks it of
    thousands of layouts sharing a few meshes."""
    return getattr(dims, what)(axis, *args)


@functools.lru_cache(maxsize=8192)
def replica_groups(dims, shard: int, gpus_per_node: int) -> tuple[tuple[int, int, int, int], ...]:
    """(members, span, members per node, nodes) of the two groups hybrid sharding splits the replica
    ranks into (dp x cp flattened, dp outer: harness.parallel_dims.REPLICA_AXES): the sharding group,
    `shard` consecutive members of it (innermost, as torchtitan's dp_shard inside dp_replicate), then
    the replicate group, one member of each sharding group. shard = dp x cp is the whole replica
    group (its geometry that of group_geometry over the outermost replica axis); span as
    ParallelDims.span, the consecutive ranks one group lies in."""
    inner = dims.stride("cp")  # rank distance between neighbours of the flattened replica group

    def geometry(members: int, stride: int) -> tuple[int, int, int, int]:
        span = members * stride
        return members, span, max(1, min(members, gpus_per_node // stride)), -(-span // gpus_per_node)

    return geometry(shard, inner), geometry(dims.replicas() // shard, shard * inner)


def link_bandwidth(profile: Profile, key: str) -> float:
    return (profile.nvlink_gbps if key == "nvlink" else profile.internode_gbps) * 1e9


def group_link(lay: PlannerLayout, prof: Profile, geometry: tuple[int, int, int, int]) -> tuple[str, float]:
    """The link and bus bandwidth of a collective over a group of replica ranks (replica_groups'
    geometry): NVLink when the group lies in one node; otherwise NCCL runs one ring per NIC and a
    node offers one NIC per group member it holds, aggregated as DP_NIC_AGGREGATION says."""
    members, span, per_node, nodes = geometry
    key = link_of(prof, span)
    if key != "internode":
        per_node = 1
    if lay.pp > 1:
        aggregate = DP_NIC_AGGREGATION_PIPELINED
    else:
        aggregate = DP_NIC_AGGREGATION and nodes <= prof.rail_aggregation_max_nodes
    return key, min(link_bandwidth(prof, key) * (per_node if aggregate else 1), prof.nvlink_gbps * 1e9)
