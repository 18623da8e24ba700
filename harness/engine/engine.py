"""The own 3D engine behind the frameworks interface: build, train_step, state, details.

One step: every rank takes the same global batch, keeps its DP slice (and under context
parallelism its CP chunks of every sequence: cp_token_index), runs its pipeline program over the
micro-batches (TP/SP and CP collectives inside each forward/backward, DP reductions starting from
gradient hooks), waits for the DP reductions, then one world all-reduce of two numbers (loss
contribution, squared gradient norm contribution) gives the global loss and the global norm for
clipping, and AdamW steps on this rank's parameters (or its ZeRO-1 shard of them, followed by an
all-gather).

Context parallelism (layout.cp, cp_impl): the cp ranks of a sequence hold the same parameters, so
to the gradients they are data parallelism: the "dp" axis here is the replica group (dp x cp,
Megatron's data-parallel-with-cp group), reduced over and ZeRO-1-sharded over, counted as "dp".
Each cp rank's loss share is its tokens' summed losses over the global batch's token count, and
every one counts in the world all-reduce; a gradient shard counts once in the norm.

A mixture of experts (harness/engine/experts.py): each block's experts shared out over the ep ranks
(carved from dp x cp, ParallelDims.expert_groups) and reached by all-to-all inside the block's TP
region; their gradients reduced (and ZeRO-1-sharded) over the expert-data-parallel group, the dense
ones over dp x cp as before (data_parallel.StateGroups); the router's losses enter the gradient as
harness.model.moe attaches them, scaled per micro-batch of the whole global batch.

Built as a real run builds it unless `options` (harness.model.training.BuildOptions) says
otherwise: the optimizer factory, how pipeline transfer groups are posted, a MoE's routing counts
(harness memory's even routing on fake tensors), and the hooks the step tells its phases to (harness
memory's labels). The rank's axes are one ParallelContext (parallel.py), built from the mesh and handed
to the chunks; the parameter list is read from the built chunks.

Precision follows the workload's policy (harness.model.training.PrecisionPolicy) Megatron's
way, not under autocast: under bf16 the model's parameters are bf16 (so are the activations,
the pipeline transfers and the TP collectives), the main gradients and the DP reduction are in
grad_accum_dtype and grad_reduce_dtype, and AdamW updates fp32 masters (data_parallel.py).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from harness.data.source import dp_slice, micro_batches
from harness.engine.comm import CommStats, StepClock, opaque_to_compile
from harness.engine.data_parallel import ModelStates, StateGroups
from harness.engine.model import ChunkOptions, build_chunks, use_fp8
from harness.engine.parallel import ParallelContext
from harness.engine.partition import rank_chunks
from harness.engine.pipeline import PipelineExecutor
from harness.engine.schedules import Placement, all_programs
from harness.engine.topology import Mesh, format_rank_map
from harness.measure.census import CensusAtStep, optimizer_state_tensors
from harness.model.compiled import compile_blocks
from harness.model.llama import cp_token_index, reference_tensor, shape_rotary
from harness.model.moe import set_router_losses, take_router_stats
from harness.model.training import BuildOptions, precision_policy
from harness.parallel_dims import AXES, ParallelDims
from harness.spec import micro_batches_per_step, model_chunks


def _ranks_per_node(ctx) -> int:
    """torchrun and deepspeed set LOCAL_WORLD_SIZE; srun says SLURM_NTASKS_PER_NODE (e.g. '8(x2)')."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(var, "").split("(")[0].split(",")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    if ctx.device.type == "cuda":
        return max(1, torch.cuda.device_count())
    return ctx.world_size


class Engine3D:
    name = "own"
    times_own_communication = True  # its breakdown_s: compute apart from tp/cp/ep/dp communication and the bubble

    def __init__(self, spec, shape, ctx, *, options: BuildOptions | None = None):
        w, lay = spec.workload, spec.layout
        options = options or BuildOptions()
        self.spec, self.shape, self.device = spec, shape, ctx.device
        self._grad_norm = None  # the last step's
        self.hooks = options.hooks
        self.policy = precision_policy(w)
        distributed = ctx.backend is not None
        self.mesh = Mesh.get(ParallelDims.of(lay), ctx.rank, distributed)
        c = self.mesh.coord
        self.clock = StepClock(ctx.device)
        self.stats = CommStats(self.clock)
        self.parallel = ParallelContext.of(self.mesh, self.stats, lay.sequence_parallel)
        self.chunks_per_rank = model_chunks(lay.pipeline_schedule, lay.virtual_stages)
        self.micro = micro_batches_per_step(spec)
        schedule = lay.pipeline_schedule if lay.pp > 1 or self.chunks_per_rank > 1 else "1f1b"
        self.placement = Placement.of(schedule, lay.pp, self.chunks_per_rank)  # which stage each chunk holds
        plans = rank_chunks(shape, self.placement, c.pp, w.seq_len)
        self.plans = plans
        chunk_options = ChunkOptions(
            options.kernels_for(lay), lay.activation_checkpointing, lay.cp_impl, options.routing
        )
        self.chunks = build_chunks(
            shape, plans, self.parallel, chunk_options, lambda name: reference_tensor(shape, w.seed, name), ctx.device
        )
        self.param_specs = [s for ch in self.chunks for s in ch.param_specs()]
        # the aux losses' gradient: 1 / the reference's micro-batches per step (the DP sum adds the dp
        # ranks' micro-batches; cp ranks share theirs), and 1/tp of it on each tp rank (harness.engine.experts)
        for ch in self.chunks:
            set_router_losses(
                ch, w.moe_aux_loss_coeff, w.moe_z_loss_coeff, self.micro * self.mesh.dims.product("dp", "tp")
            )
        use_fp8(self.chunks, self.policy, ctx.device.type)
        named = {}
        for ch in self.chunks:
            named.update(dict(ch.named_parameters()))
        self.params = [named[s.name] for s in self.param_specs]
        # dense parameters over dp x cp, a MoE's experts over their expert-data-parallel group
        groups = []
        for expert, axis in ((False, self.parallel.dp), (True, self.parallel.edp)):
            specs = [s for s in self.param_specs if s.expert == expert]
            if specs or not expert:
                params = [named[s.name] for s in specs]
                groups.append(
                    ModelStates(
                        params,
                        specs,
                        axis,
                        self.parallel.region.sp,
                        lay.zero_stage == 1,
                        lay.dp_bucket_mb,
                        ctx.device,
                        self.policy,
                        tp=self.parallel.tp,
                    )
                )
        self.model_states = StateGroups(groups)
        self.optimizer = options.make_optimizer(
            self.model_states.optimizer_tensors(), w, fused=ctx.device.type == "cuda"
        )
        self.census = CensusAtStep(self.optimizer, self._census_tensors)
        # each block compiled around its explicit TP regions: a collective in one breaks the graph there
        if lay.compile != "none":
            opaque_to_compile()
        compile_blocks((block for ch in self.chunks for block in ch.layers.values()), lay.compile)
        self.programs = all_programs(schedule, lay.pp, self.micro, self.chunks_per_rank)
        self.schedule = schedule if lay.pp > 1 or self.chunks_per_rank > 1 else "none (no pipeline)"
        seq_cp = w.seq_len // lay.cp  # the tokens of each sequence this rank holds
        seq_local = seq_cp // lay.tp if self.parallel.sp else seq_cp
        p2p_mode = lay.pipeline_p2p if lay.pipeline_p2p != "auto" else ("grouped" if ctx.backend == "nccl" else "async")
        self.executor = PipelineExecutor(
            self.chunks,
            self.programs,
            self.parallel.pp,
            self.clock,
            (seq_local, lay.micro_batch_size, shape.hidden),
            ctx.device,
            self.policy.compute,
            p2p_mode,
            self.hooks,
            options.batch_isend_irecv or dist.batch_isend_irecv,
            self.placement,
        )
        cos, sin = shape_rotary(shape, w.seq_len, ctx.device, lay.cp, c.cp)  # this rank's positions
        self.cos, self.sin = cos, sin
        self.positions = cp_token_index(w.seq_len, lay.cp, c.cp, ctx.device) if lay.cp > 1 else None
        self.rank_map = self.mesh.dims.rank_table(_ranks_per_node(ctx))
        if ctx.rank == 0 and ctx.world_size > 1:
            print("own engine rank map (tp innermost):\n" + format_rank_map(self.rank_map), file=sys.stderr, flush=True)
        self._details: dict = {}

    # ---------------------------------------------------------------- step

    def train_step(self, global_batch: torch.Tensor) -> torch.Tensor:
        w, lay = self.spec.workload, self.spec.layout
        clock = self.clock
        clock.reset()
        self.stats.reset()
        t_start = clock.mark()
        local = dp_slice(global_batch, self.mesh.coord.dp, lay.dp).to(self.device, non_blocking=True)
        micro = micro_batches(local, lay.micro_batch_size, self.positions)
        states = self.model_states
        states.begin_step(len(micro))
        tokens = global_batch.shape[0] * w.seq_len  # the reference's mean over the global batch (every cp share)
        loss = self.executor.run(micro, self.cos, self.sin, 1.0 / tokens)
        self.hooks.optimizer("optimizer step (reductions, AdamW, parameter refresh)")
        states.finish()

        t0 = clock.mark()
        states.grads_to_masters()
        c = self.mesh.coord
        count_loss = c.tp == 0 and any(p.last for p in self.plans)  # the last stage: rank 0 in a V
        # without ZeRO every replica (dp x cp; edp for experts) holds the same reduced gradients: one counts
        sq = states.grad_sq_sum(c.tp == 0, self.device)
        pair = torch.stack([loss if count_loss else torch.zeros_like(loss), sq]).float()
        ta = clock.mark()
        self.parallel.world.all_reduce(pair)  # its wait is the slowest stage's lag: charged to bubble
        t1 = clock.mark()
        norm = pair[1].sqrt()
        self._grad_norm = norm.detach()  # read after the step: no device sync inside it
        if w.grad_clip > 0:
            coef = torch.clamp(w.grad_clip / (norm + 1e-6), max=1.0)
            states.scale_grads(coef)
        self.optimizer.step()
        t2 = clock.mark()
        states.refresh_params()  # masters -> bf16 parameters; ZeRO-1 all-gather (dp_comm)
        t3 = clock.mark()
        states.zero_grads()
        t_end = clock.mark()

        clock.add("optimizer", t0, ta)
        clock.add("optimizer", t1, t2)
        clock.add("optimizer", t3, t_end)
        clock.finish()
        s = clock.seconds
        self._details = {
            "breakdown_s": {
                # they run inside forward/backward
                "compute": max(0.0, s["fb"] - s["tp_comm"] - s["cp_comm"] - s["ep_comm"]),
                "tp_comm": s["tp_comm"],
                **({"cp_comm": s["cp_comm"]} if self.parallel.cp.size > 1 else {}),
                **({"ep_comm": s["ep_comm"]} if self.mesh.size("ep") > 1 else {}),
                "bubble": s["bubble"],  # p2p sends and receive waits, send drains, waiting for the slowest stage
                "dp_comm": s["dp_comm"],
                "optimizer": s["optimizer"],
                "total": clock.elapsed(t_start, t_end),
            },
            "comm": self.stats.as_dict(),
            "pipeline_timeline": [dict(e, rank=self.mesh.rank) for e in self.executor.resolve_timeline()],
        }
        return pair[0]

    # ---------------------------------------------------------------- reporting

    def last_step_details(self) -> dict:
        return self._details

    def grad_norm(self) -> float | None:
        """The global norm the clipping used: every rank's squared sum, each gradient counted once."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def full_state_dict(self):
        """Gather every parameter (TP shards concatenated, pipeline stages collected from dp and cp
        index 0, since the other replicas hold the same; a MoE's experts from each ep share) on rank 0:
        the fp32 masters under bf16 (as the reference's), the parameters themselves under fp32.

        Collective: every rank must call it; rank 0 gets the dict, the others None.
        """
        c = self.mesh.coord
        tp = self.parallel.tp
        masters = self.model_states.full_masters()
        mine = {}
        for spec, p in zip(self.param_specs, self.params, strict=True):
            t = (masters[p] if masters is not None else p).detach().float()
            if spec.shard_dim is not None and tp.size > 1:
                parts = [torch.empty_like(t) for _ in range(tp.size)]
                dist.all_gather(parts, t.contiguous(), group=tp.group)
                t = torch.cat(parts, dim=spec.shard_dim)
            mine[spec.name] = t.cpu().clone()
        if self.mesh.size("all") == 1:
            return mine
        gathered = [None] * self.mesh.size("all") if self.mesh.rank == 0 else None
        # the dense parameters from the first replica, a MoE's experts from the first member of each
        # expert-data-parallel group (every ep share once)
        first = {False: self.parallel.dp.index == 0, True: self.parallel.edp.index == 0}
        experts = {s.name: s.expert for s in self.param_specs}
        payload = {k: v for k, v in mine.items() if first[experts[k]]} if c.tp == 0 else {}
        dist.gather_object(payload, gathered, dst=0)
        if self.mesh.rank != 0:
            return None
        out = {}
        for part in gathered:
            out.update(part)
        return out

    def router_stats(self) -> dict:
        """Each MoE layer's routing statistics over the last step, this rank's tokens; {} on tp ranks
        other than 0 (they route the same tokens) and cp ranks other than 0 (their statistics are the
        micro-batch's, summed over cp), so that the sum over ranks counts every token once."""
        out = {}
        for ch in self.chunks:
            out.update(take_router_stats(ch))
        return out if self.mesh.coord.tp == 0 and self.mesh.coord.cp == 0 else {}

    def _census_tensors(self) -> dict:
        return {**self.model_states.census_tensors(), "optimizer_states": optimizer_state_tensors(self.optimizer)}

    def memory_census(self) -> dict | None:
        return self.census.result

    def activation_exclusions(self) -> list:
        return list(self.params)

    def process_groups(self) -> dict:
        return {}  # every group of the Mesh names its axis (group_desc)

    def describe(self) -> dict:
        lay = self.spec.layout
        return {
            "engine": "own 3D (Megatron-style TP/SP, instruction-list pipeline, bucketed DP, ZeRO-1)",
            "mesh": {**self.mesh.dims.sizes(), "order": f"{', '.join(AXES)} ({AXES[-1]} innermost)"},
            **({"ep": lay.ep, "expert_data_parallel": self.mesh.size("edp")} if self.shape.moe else {}),
            "cp": lay.cp,
            "cp_impl": lay.cp_impl if lay.cp > 1 else None,
            "coord": self.mesh.coord._asdict(),
            "schedule": self.schedule,
            "backward": "split: B input gradient, W weight gradients"
            if any(a.kind == "W" for a in self.executor.program)
            else "whole",
            "chunks_per_rank": self.chunks_per_rank,
            "p2p_mode": self.executor.mode,
            "micro_batches": self.micro,
            "sequence_parallel": self.parallel.sp,
            "zero_stage": lay.zero_stage,
            "dp_buckets": [b.padded for b in self.model_states.buckets],
            "precision_policy": self.policy.describe(),
            **({"fp8_backend": self.policy.fp8_backend(self.device.type)} if self.policy.fp8 else {}),
            "compile": lay.compile,
            "stages": [{"stage": p.stage, "layers": [p.layers.start, p.layers.stop]} for p in self.plans],
            "rank_map": self.rank_map[:64],
        }
