"""Data parallelism: flat bucketed gradients reduced while backward runs, and ZeRO-1.

Parameters and their gradients live as views in a few flat buffers (buckets, filled in
reverse registration order, roughly the order backward produces gradients). A
post-accumulate hook counts each parameter's gradients; when every parameter of a bucket has
received its last micro-batch's gradient, the bucket's collective starts asynchronously while
backward continues. `finish` waits for what is still in flight (the exposed DP time).

The "dp" axis here is every rank holding the same parameters: the data-parallel group, or under
context parallelism the replica group dp x cp (the cp ranks' gradients are partial sums over other
tokens of the same sequences: reduced like data parallelism, Megatron's data-parallel-with-cp
group); "dp" below is that axis's size.

ZeRO-1: each bucket is padded to a multiple of dp and split into dp contiguous shards; the
reduction is a reduce-scatter in place, into this rank's shard of the very tensor reduced (its
view of grad_flat, as Megatron's distributed optimizer does), the optimizer (its fp32 weights
shard and Adam moments) holds only that shard, and an all-gather of the updated shards, in place
too (from this rank's shard of param_flat into param_flat), refreshes the full parameters. NCCL
and gloo both take such aliased buffers; tests/test_census_own.py checks gloo's results against
out-of-place collectives. Without ZeRO the reduction is an all-reduce and the optimizer works on
every parameter.

The precision policy (harness.model.training.PrecisionPolicy), Megatron's way. Per bucket:
  param_flat   the parameters computed with (policy.compute: fp32, or bf16)
  grad_flat    the main gradients, summed over micro-batches in policy.grad_accum. When that
               is the parameters' dtype, each .grad is a view into it and autograd accumulates
               there; otherwise (bf16 parameters, fp32 main gradients) each fresh bf16 .grad is
               added into its slice by the post-accumulate hook and freed.
  reduction    in policy.grad_reduce: grad_flat itself when the dtypes agree, else a copy in
               the reduction dtype made when the bucket is ready and dropped once reduced (a
               bf16-reduced sum goes back into an fp32 grad_flat; an fp32-reduced sum of bf16
               gradients is kept as the optimizer's gradient: the whole copy, or under ZeRO-1 a
               clone of this rank's shard of it, P/dp).
  reduced      this rank's reduced gradient: grad_flat (or, ZeRO-1, its shard view) wherever the
               sum ends in grad_flat, so no gradient buffer exists beside the main gradients.
  master       bf16 only: the fp32 master parameters the optimizer updates (its shard under
               ZeRO-1); the optimizer's gradients are fp32 (a copy at the step where the
               reduced gradient is bf16). After the step the bf16 parameters are refreshed from
               the masters (ZeRO-1: this rank's shard, then the all-gather moves bf16 shards).
Under fp32 the parameters are their own masters and every buffer is fp32, as before.

Under sequence parallelism the norm weights are replicated across TP but each rank saw only
its part of the sequence, so their gradients are partial: they get a bucket of their own that
is summed over TP before the DP reduction (once per step, as Megatron does). The per-head q/k norms
and a MoE's router (ParamSpec.tp_partial: each TP rank's gradient a partial sum, its own heads' or its
share of the experts' outputs) join that bucket with or without SP.

Mixture-of-experts (harness.engine.experts): a routed expert's parameters are held by the ranks of
its expert-data-parallel group only (ParallelDims.expert_data_group_of: the replicas over ep), so they
are a second ModelStates over that group (StateGroups), its own buckets and ZeRO-1 shards. Their
divisor is the dense gradients' one: none. Every loss is scaled by 1 / the global batch's tokens
before backward, and each rank's expert gradient sums the contributions of the tokens its ep group
dispatched to it (the combine's backward brings them back); the ep groups of one edp group's members
partition the replica group, so the sum over the edp group holds every token of the global batch
once: the reference's mean, as the dense sum over dp x cp is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.engine.comm import Axis
from harness.engine.partition import ParamSpec
from harness.model.training import PrecisionPolicy


def padded(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def plan_buckets(specs: list[ParamSpec], bucket_elems: int, dp: int, sp: bool) -> list[dict]:
    """Greedy buckets over parameters in reverse order: [{indices, numel, padded, sp}].

    With sp, TP-replicated parameters (norm weights) go to one separate bucket, reduced last; so do
    the parameters whose gradient is a partial sum over TP whatever sp is (ParamSpec.tp_partial).
    """

    def numel(s):
        n = 1
        for d in s.local:
            n *= d
        return n

    buckets, cur, size = [], [], 0
    sp_bucket = []
    for i in reversed(range(len(specs))):
        if (sp and specs[i].shard_dim is None) or specs[i].tp_partial:
            sp_bucket.append(i)
            continue
        n = numel(specs[i])
        if cur and size + n > bucket_elems:
            buckets.append((cur, False))
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        buckets.append((cur, False))
    if sp_bucket:
        buckets.append((sp_bucket, True))
    out = []
    for idx, is_sp in buckets:
        n = sum(numel(specs[i]) for i in idx)
        out.append({"indices": idx, "numel": n, "padded": padded(n, dp), "sp": is_sp})
    return out


class Bucket:
    def __init__(
        self,
        params: list[torch.nn.Parameter],
        specs: list[ParamSpec],
        plan: dict,
        dp: Axis,
        device,
        policy: PrecisionPolicy,
        zero: bool,
    ):
        self.params, self.specs, self.sp = params, specs, plan["sp"]
        self.numel, self.padded = plan["numel"], plan["padded"]
        self.param_flat = torch.zeros(self.padded, dtype=policy.compute, device=device)
        self.grad_flat = torch.zeros(self.padded, dtype=policy.grad_accum, device=device)
        self.grads_in_place = policy.grad_accum == policy.compute  # .grad are views of grad_flat
        self.ranges = []
        off = 0
        for p in params:
            n = p.numel()
            with torch.no_grad():
                self.param_flat[off : off + n].copy_(p.detach().reshape(-1))
            p.data = self.param_flat[off : off + n].view_as(p)
            p.grad = self.grad_flat[off : off + n].view_as(p) if self.grads_in_place else None
            if policy.fuses_weight_gradient:  # the FP8 linears add their weight gradients here themselves
                p.main_grad = self.grad_flat[off : off + n].view_as(p)
            self.ranges.append((off, off + n))
            off += n
        self.range_of = {p: r for p, r in zip(params, self.ranges, strict=True)}
        per = self.padded // dp.size
        self.shard = (dp.index * per, (dp.index + 1) * per)
        self.mine = self.shard if zero else (0, self.padded)  # what this rank's optimizer updates
        lo, hi = self.mine
        self.master = self.param_flat[lo:hi].to(policy.master, copy=True) if policy.master is not None else None
        self.ready = 0
        self.work = None
        self.reducing = None  # the tensor in flight, when it is a copy of grad_flat in the reduction dtype
        self.reduced = None  # this rank's reduced gradient (full bucket, or its ZeRO-1 shard)
        self.main32 = None  # the same in fp32: what the optimizer's gradients are views of

    def main_grad(self) -> torch.Tensor:
        """This rank's part of grad_flat: all of it, or under ZeRO-1 its shard (a view)."""
        lo, hi = self.mine
        return self.grad_flat[lo:hi]


class ModelStates:
    """One rank's model states in flat buckets: the parameters, their main gradients, the fp32
    masters (bf16), the views the optimizer updates, and the gradient hooks and DP (and SP)
    reductions that fill the gradients."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        specs: list[ParamSpec],
        dp: Axis,
        sp: Axis | None,
        zero: bool,
        bucket_mb: float,
        device,
        policy: PrecisionPolicy,
        tp: Axis | None = None,
    ):
        self.dp, self.sp, self.zero = dp, sp, zero and dp.size > 1
        self.tp_sum = sp or tp  # what the partial bucket is summed over: SP's group, else TP's
        self.policy, self.mixed = policy, policy.master is not None
        self.params = params
        elems = max(1, int(bucket_mb * 2**20 / 4))  # elements: the same buckets under every policy
        plans = plan_buckets(specs, elems, dp.size, sp is not None)
        self.buckets = [
            Bucket(
                [params[i] for i in pl["indices"]], [specs[i] for i in pl["indices"]], pl, dp, device, policy, self.zero
            )
            for pl in plans
        ]
        self.owner = {}
        for b in self.buckets:
            for p in b.params:
                self.owner[p] = b
        self.counts: dict = {}
        self.expected = 1
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        # what the optimizer updates: one 1-D view per parameter (its part of this rank's shard
        # under ZeRO-1) of the parameters (fp32) or of the masters (bf16), as (bucket, lo, hi, view).
        # Per-parameter views rather than one tensor per bucket: AdamW's elementwise passes then
        # run over cache-sized pieces (on CPU a 13 MB flat buffer made the step twice as slow),
        # and padding is never touched. The values are the same either way.
        self.views = []
        for b in self.buckets:
            lo, hi = b.mine
            for a, e in b.ranges:
                a2, e2 = max(a, lo), min(e, hi)
                if a2 < e2:
                    t = b.master[a2 - lo : e2 - lo] if self.mixed else b.param_flat[a2:e2]
                    self.views.append((b, a2 - lo, e2 - lo, t))
        self._attach_grads()

    # ---------------------------------------------------------------- reduction

    def begin_step(self, backwards_per_param: int) -> None:
        self.expected = backwards_per_param
        self.counts = {}
        for b in self.buckets:
            b.ready, b.work = 0, None

    def _on_grad(self, p) -> None:
        b = self.owner[p]
        if not b.grads_in_place:  # Megatron: the fresh .grad goes into the main gradient and is freed
            if not getattr(p, "grad_added_to_main_grad", False):  # (fused: harness.model.float8 added it)
                a, e = b.range_of[p]
                b.grad_flat[a:e].add_(p.grad.reshape(-1))
            p.grad, p.grad_added_to_main_grad = None, False
        c = self.counts.get(p, 0) + 1
        self.counts[p] = c
        if c == self.expected:
            b.ready += 1
            if b.ready == len(b.params):
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        if b.sp and self.tp_sum is not None:
            self.tp_sum.all_reduce(b.grad_flat)  # blocking: partial gradients (norms' over the sequence, router's)
        if self.dp.size == 1:
            return
        reduce_dtype = self.policy.grad_reduce
        t = b.grad_flat if b.grad_flat.dtype == reduce_dtype else b.grad_flat.to(reduce_dtype)
        b.reducing = None if t is b.grad_flat else t
        if self.zero:  # in place: the output is this rank's shard of t itself
            lo, hi = b.shard
            b.work = self.dp.reduce_scatter(t, out=t[lo:hi], async_op=True)
        else:
            b.work = self.dp.all_reduce(t, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket's reduction (charged to dp_comm)."""
        clock = self.dp.stats.clock
        t0 = clock.mark()
        for b in self.buckets:
            if b.ready != len(b.params):
                missing = [
                    s.name for p, s in zip(b.params, b.specs, strict=True) if self.counts.get(p, 0) != self.expected
                ]
                raise AssertionError(f"gradients never arrived for {missing[:4]}")
            if b.work is not None:
                b.work.wait()
                b.work = None
            b.reduced = b.main_grad()
            if b.reducing is not None:
                lo, hi = b.mine
                summed = b.reducing[lo:hi]
                if b.grad_flat.dtype == torch.float32:  # a bf16-reduced sum back into the fp32 main gradient
                    b.reduced.copy_(summed)
                else:  # the fp32-reduced sum of bf16 gradients: kept (ZeRO-1: only this rank's shard of it)
                    b.reduced = summed.clone() if self.zero else summed
                b.reducing = None
        clock.add("dp_comm", t0, clock.mark())

    # ---------------------------------------------------------------- optimizer view

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """What the optimizer updates (the parameters, or the fp32 masters; their ZeRO-1 shard),
        one 1-D view per parameter; grads_to_masters() attaches the matching gradient views."""
        return [t for _, _, _, t in self.views]

    def _attach_grads(self) -> None:
        for b, lo, hi, t in self.views:
            g = b.main32 if b.main32 is not None else b.main_grad()
            t.grad = g[lo:hi] if g.dtype == t.dtype else None

    def grads_to_masters(self) -> None:
        """After finish(): the reduced gradients in fp32 (a copy only where they are bf16) become
        the optimizer's gradients."""
        for b in self.buckets:
            b.main32 = b.reduced if b.reduced.dtype == torch.float32 else b.reduced.float()
        self._attach_grads()

    def grad_sq_sum(self, count_replicated: bool) -> torch.Tensor:
        """Sum of squared gradients this rank is responsible for in the global norm.

        Without ZeRO every DP rank holds the same reduced gradients, so the caller counts only
        one of them; with ZeRO each rank counts its shard. TP-replicated parameters count on
        one TP rank only (count_replicated).
        """
        total = torch.zeros((), device=self.buckets[0].grad_flat.device if self.buckets else "cpu")
        for b in self.buckets:
            lo, hi = b.mine
            g = b.main32
            for (a, e), spec in zip(b.ranges, b.specs, strict=True):
                if spec.shard_dim is None and not count_replicated:
                    continue
                a2, e2 = max(a, lo), min(e, hi)
                if a2 < e2:
                    seg = g[a2 - lo : e2 - lo]
                    total += torch.dot(seg, seg)
        return total

    def scale_grads(self, coef: torch.Tensor) -> None:
        for b in self.buckets:
            b.main32.mul_(coef)

    def refresh_params(self) -> None:
        """After the step: the parameters from the updated masters (bf16), and under ZeRO-1 every
        rank's updated shard back into the full flat parameters (an all-gather in their dtype)."""
        for b in self.buckets:
            lo, hi = b.mine
            if self.mixed:
                with torch.no_grad():
                    b.param_flat[lo:hi].copy_(b.master)
            if self.zero:  # in place, as the reduce-scatter: the input is this rank's shard of the output
                self.dp.all_gather(b.param_flat[lo:hi], out=b.param_flat)

    def zero_grads(self) -> None:
        for b in self.buckets:
            b.grad_flat.zero_()
            b.reducing = b.reduced = b.main32 = None  # the step's copies go
        self._attach_grads()

    # ---------------------------------------------------------------- state and census

    def full_masters(self) -> dict | None:
        """bf16: each parameter's fp32 master, whole (ZeRO-1 shards gathered over dp; not counted:
        a check, not the step); None under fp32, where the parameters are the masters.
        Collective under ZeRO-1: every DP rank must call it."""
        if not self.mixed:
            return None
        out = {}
        for b in self.buckets:
            full = b.master
            if self.zero:
                parts = [torch.empty_like(b.master) for _ in range(self.dp.size)]
                dist.all_gather(parts, b.master, group=self.dp.group)
                full = torch.cat(parts)
            for p, (a, e) in zip(b.params, b.ranges, strict=True):
                out[p] = full[a:e].view_as(p)
        return out

    def census_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, by memory-census category (harness.measure.census.tensor_census):
        flat parameters; main gradients and any reduction or fp32 copies alive (ZeRO-1's reduced
        shard is a view of grad_flat, counted with it, unless it is such a copy); fp32 masters
        (bf16 only)."""
        out = {
            "parameters": [b.param_flat for b in self.buckets],
            "gradients": [t for b in self.buckets for t in (b.grad_flat, b.reducing, b.reduced, b.main32)]
            + [p.grad for p in self.params],
        }
        if self.mixed:
            out["master_parameters"] = [b.master for b in self.buckets]
        return out


class StateGroups:
    """The model states of parameters replicated over different groups: the dense ones over dp x cp, a
    MoE's experts over their expert-data-parallel group (each a ModelStates); the step calls each."""

    def __init__(self, groups: list[ModelStates]):
        self.groups = groups
        self.buckets = [b for g in groups for b in g.buckets]

    def begin_step(self, backwards_per_param: int) -> None:
        for g in self.groups:
            g.begin_step(backwards_per_param)

    def finish(self) -> None:
        for g in self.groups:
            g.finish()

    def optimizer_tensors(self) -> list[torch.Tensor]:
        return [t for g in self.groups for t in g.optimizer_tensors()]

    def grads_to_masters(self) -> None:
        for g in self.groups:
            g.grads_to_masters()

    def grad_sq_sum(self, count_replicated: bool, device) -> torch.Tensor:
        """This rank's part of the global squared norm: under ZeRO-1 each group's shard, else only the
        first member of each group counts its (reduced, identical) gradients."""
        total = torch.zeros((), device=device)
        for g in self.groups:
            if g.zero or g.dp.index == 0:
                total = total + g.grad_sq_sum(count_replicated)
        return total

    def scale_grads(self, coef: torch.Tensor) -> None:
        for g in self.groups:
            g.scale_grads(coef)

    def refresh_params(self) -> None:
        for g in self.groups:
            g.refresh_params()

    def zero_grads(self) -> None:
        for g in self.groups:
            g.zero_grads()

    def full_masters(self) -> dict | None:
        """Every group's (collective over each group's dp axis under ZeRO-1); None under fp32."""
        parts = [g.full_masters() for g in self.groups]
        return None if parts[0] is None else {k: v for p in parts for k, v in p.items()}

    def census_tensors(self) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for g in self.groups:
            for k, v in g.census_tensors().items():
                out.setdefault(k, []).extend(v)
        return out
