"""Engine fsdp's expert parallelism (layout.ep), torchtitan's way: the experts shared out over an ep dimension
of the DeviceMesh and reached by all-to-all, FSDP2 over the rest.

Mesh (ExpertParallel): the mesh's dp dimension unflattened into (dp_mod_ep, ep), ep innermost: an ep group is
ep consecutive dp coordinates, as ParallelDims.expert_group_of carves it (checked at build), and the ranks at
the same place in each ep group (dp_mod_ep, torchtitan's "dp_shard_mod_ep") hold the same experts. The
all-to-alls run on a process group of the ep ranks of their own, named "ep" (group_desc): at dp = ep torch's
mesh gives the ep dimension the dp dimension's very group object, and the profiler could not tell them apart.

Layer (ExpertParallelFeedForward): harness.model.moe's MoEFeedForward holding only this ep rank's experts,
keyed by their global index, so parameter names are the reference's. Each rank routes its own tokens (the
reference's router, fp32, top-k; the losses and statistics of its micro-batch, as without ep), sorts the
routed slots by expert, exchanges the per-expert counts (one all_to_all_single of E numbers), sends the rows
to the ranks holding their experts (all_to_all_single, unequal splits: the dispatch), runs each held expert
on the rows it received (an expert with none on an empty batch: a zero gradient, as the reference's), sends
the results back (the combine) and adds them, weighted, into their tokens. The exchange is an autograd
Function whose backward is the reverse all_to_all_single. torchtitan's ExpertParallel (distribute_module,
Shard(0) over ep) stacks the experts' weights into one 3-D tensor; the harness's experts are one module each
(the reference's names), so each rank holds its experts as plain modules, as Megatron and the own engine do.

Sharding (ExpertParallel.shard): one fully_shard of each layer's held experts together (a list of modules: a
ModuleDict has no forward) over the dp_mod_ep mesh, before the block's own fully_shard over dp (which then
leaves them out). Their DTensors are of another mesh than the rest's: the engine's gradient norm and clipping
take the two apart (fsdp/grad_norm.py). An expert's gradient sums every ep rank's tokens' parts,
each already scaled as its rank's loss is (1 / its tokens): FSDP2 must divide by dp, not by the dp_mod_ep
group it reduces over (set_gradient_divide_factor, torchtitan's fsdp_gradient_divide_factor). gloo has no
PREMUL_SUM, the op FSDP2 takes for a factor other than the group's size: there the reduction is a sum and
the division follows (set_force_sum_reduction_for_comms; not on a one-rank dp_mod_ep, dp = ep, where FSDP2
divides its copy by the factor and would, forced, divide again: torch 2.13's foreach_reduce), and gloo's
all-gather has no float8 dtype, which the experts' group gathers in under fp8_all_gather (_byte_all_gather).

FP8 (precision fp8): the held experts' linears are converted as every other (harness.model.float8, before the
sharding); an expert's GEMM takes the rows of every ep rank routed to it, so its dynamic scales are amaxes over
the ep group's micro-batches, not one's (tests/test_engine_moe.py says what that moves); an expert with no rows
runs unconverted (float8._EmptySafe). Under fp8_all_gather the experts' scales are precomputed over their own
mesh (float8.precompute_fsdp_scales: one all-reduce per mesh).

Counted communication (ExpertComm): every all_to_all_single of the layer, forward, backward and a
checkpoint's recomputation, as the comm census's axis "ep", op all_to_all, with what this rank sends (the
own engine's Axis.all_to_all_v counts the same calls the same way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.engine.comm import CommStats, StepClock
from harness.engine.experts import run_held_experts, sort_by_expert, splits
from harness.model.moe import MoEFeedForward, RouterInputs, moe_layers

EP_AXIS = "ep"
DESCRIBE = (
    "expert parallelism over the mesh's ep dimension (dp unflattened into dp_mod_ep x ep): each rank holds "
    "E/ep experts, tokens dispatched and combined by all_to_all_single (counted as comm axis ep); experts "
    "FSDP2-sharded over dp_mod_ep with gradients divided by dp, the rest over dp; the reference's router losses"
)


class ExpertComm:
    """The layer's all-to-alls since the last take(), in the comm census's shape."""

    def __init__(self):
        self.stats = CommStats(StepClock(torch.device("cpu")))  # counts only: no clock is read

    def record(self, t: torch.Tensor) -> None:
        self.stats.record(EP_AXIS, "all_to_all", t)

    def take(self) -> dict:
        out = self.stats.as_dict()
        self.stats.reset()
        return out


def _all_to_all(t: torch.Tensor, send: list[int], recv: list[int], group, comm: ExpertComm) -> torch.Tensor:
    """send[r] rows of t (in rank order) to rank r; recv[r] rows from rank r."""
    out = t.new_empty((sum(recv), *t.shape[1:]))
    comm.record(t)
    dist.all_to_all_single(out, t.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """The rows of x to the ep ranks; backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group, comm: ExpertComm):
        ctx.send, ctx.recv, ctx.group, ctx.comm = send, recv, group, comm
        return _all_to_all(x, send, recv, group, comm)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.recv, ctx.send, ctx.group, ctx.comm), None, None, None, None


class ExpertParallelFeedForward(MoEFeedForward):
    """harness.model.moe's MoE feed-forward holding experts [index·E/ep, (index+1)·E/ep) of ep rank `index`,
    exchanging over `group` (the ep group).
    forward: x [..., hidden] (this rank's tokens) -> [..., hidden].

    `routing` (BuildOptions.routing), when given, says how many routed slots each expert gets, (slots, experts)
    -> counts, in place of the data's: every rank is taken to route as this one (no exchange of counts), and no
    statistics or losses are attached. harness memory's trace on fake tensors, which have no data, routes so
    (evenly), as it does the own engine's layer (harness.engine.experts)."""

    def __init__(self, shape, ep: int, index: int, group, comm: ExpertComm, routing=None):
        self.ep, self.index = ep, index
        held = shape.experts // self.ep
        super().__init__(shape, range(self.index * held, (self.index + 1) * held))
        self.group, self.comm, self.routing = group, comm, routing

    def _counts(self, experts: torch.Tensor) -> tuple:
        """(order, token, counts [E], recv_counts [ep][held]) of the routed slots: the data's, with the
        counts exchanged, or routing's (every rank routing as this one)."""
        held = self.n_experts // self.ep
        if self.routing is not None:
            order = torch.arange(experts.numel(), device=experts.device)
            counts = self.routing(experts.numel(), self.n_experts)
            return order, order // self.k, counts, [counts[self.index * held : (self.index + 1) * held]] * self.ep
        order, token, counts_t = sort_by_expert(experts, self.n_experts)
        # each source rank's slots for my experts: one all_to_all_single of the E counts
        recv_t = torch.empty_like(counts_t)
        self.comm.record(counts_t)
        dist.all_to_all_single(recv_t, counts_t, group=self.group)
        return order, token, counts_t.tolist(), recv_t.view(self.ep, held).tolist()

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        weights, experts, probs, logits = self.gate(x2)
        order, token, counts, recv_counts = self._counts(experts)
        send, recv = splits(counts, self.ep), [sum(r) for r in recv_counts]
        received = _Exchange.apply(x2[token], send, recv, self.group, self.comm)  # the dispatch
        y = run_held_experts(self.experts.values(), received, recv_counts)
        y = _Exchange.apply(y, recv, send, self.group, self.comm)  # the combine
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x2).index_add(0, token, y)
        if self.routing is not None:  # the statistics are the data's: none with given counts
            return out.view_as(x)
        return self.attach_losses(out, RouterInputs.of(logits, experts, probs)).view_as(x)


class ExpertParallel:
    """What engine fsdp does for layout.ep > 1: the meshes, the layers' swap and sharding, the comm count."""

    describe = DESCRIBE

    def __init__(self, mesh, dims, shape, routing=None):
        self.dims, self.shape, self.comm, self.routing = dims, shape, ExpertComm(), routing
        split = mesh._unflatten("dp", (dims.dp // dims.ep, dims.ep), ("dp_mod_ep", "ep"))
        self.mesh, self.dp_mod_ep = split["ep"], split["dp_mod_ep"]
        self.group = _named_group(dims.expert_groups(), "ep")
        rank = dist.get_rank()
        for got, want in ((self.mesh, dims.expert_group_of(rank)), (self.dp_mod_ep, dims.expert_data_group_of(rank))):
            if sorted(got.mesh.reshape(-1).tolist()) != want:  # ParallelDims' groups: the own engine's, the planner's
                raise RuntimeError(f"{got.mesh_dim_names} mesh {got.mesh.tolist()} is not ParallelDims' {want}")

    def swap_in(self, part) -> None:
        """Each block's MoEFeedForward of `part` (on the meta device) replaced by this ep rank's share."""
        for block in part.layers.children():
            if type(block.feed_forward) is MoEFeedForward:
                block.feed_forward = ExpertParallelFeedForward(
                    self.shape, self.mesh.size(), self.mesh.get_local_rank(), self.group, self.comm, self.routing
                )

    def shard(self, part, reshard_after_forward: bool, mp_policy, device_type: str) -> None:
        """fully_shard on each layer's experts over dp_mod_ep, their gradients divided by dp (module docstring)."""
        from torch.distributed.fsdp import fully_shard

        for layer in moe_layers(part).values():
            held = list(layer.experts.values())  # one FSDP2 group of the layer's experts (a ModuleDict has no forward)
            fully_shard(held, mesh=self.dp_mod_ep, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
            held[0].set_gradient_divide_factor(float(self.dims.dp))  # the group's, shared by its modules
            if device_type != "cuda" and self.dp_mod_ep.size() > 1:  # gloo: no PREMUL_SUM (one rank: no reduction)
                held[0].set_force_sum_reduction_for_comms(True)
                held[0].set_custom_all_gather(_byte_all_gather())

    def process_groups(self) -> dict:
        """The profiler's axis names of groups their ranks alone do not name: the ep group (named by its
        group_desc too) and dp_mod_ep, the experts' reduction (as Megatron's EXPERT_DATA_PARALLEL_GROUP: dp),
        where it holds more than this rank (a one-rank group object may be another axis's too)."""
        return {"ep": [self.group], "dp": [self.dp_mod_ep.get_group()] if self.dp_mod_ep.size() > 1 else []}

    def take_comm(self) -> dict:
        """The all-to-alls since the last call, {"ep": {"all_to_all": {count, bytes, bytes_by_dtype}}}."""
        return self.comm.take()

    def gather(self, mine: dict, keep: bool) -> dict:
        """Every ep rank's experts (whole tensors in `mine`) merged into the dict of the ep group's first rank
        (`keep`: the rank whose state is returned), by gather_object over the ep group."""
        dst = dist.get_global_rank(self.group, 0)
        got = [None] * self.mesh.size() if dist.get_rank() == dst else None
        dist.gather_object({k: v for k, v in mine.items() if is_expert(k)}, got, dst=dst, group=self.group)
        if keep and got is not None:
            for d in got:
                mine.update(d)
        return mine


def _byte_all_gather():
    """FSDP2's all-gather with float8 buffers sent as their bytes. gloo's all_gather has no float8 dtype ("Invalid
    scalar type"), and under fp8_all_gather an experts' group holds FP8 weights only, so FSDP2 gathers them in
    float8_e4m3fn (a block's group mixes in its bf16 norms and goes through uint8, _fsdp_collectives.py,
    _get_all_gather_input_metadatas); the flat buffers' bytes are the same either way. Other dtypes as FSDP2's own."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    class ByteAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if output_tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    return ByteAllGather()


def _named_group(groups: list[list[int]], desc: str):
    """This rank's group among `groups` (every rank creates all of them, in order: torch's new_group contract),
    a process group of its own with `group_desc`: at dp = ep the mesh's ep group is the very dp group object, and
    the profiler (harness.profiling.annotate) would name the all-to-alls and FSDP2's collectives alike."""
    rank, mine = dist.get_rank(), None
    for ranks in groups:
        group = dist.new_group(ranks, group_desc=desc)
        if rank in ranks:
            mine = group
    return mine


def is_expert(name: str) -> bool:
    return ".feed_forward.experts." in name
