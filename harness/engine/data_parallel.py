"""Data parallelism: flat bucketed gradients reduced while backward runs, and ZeRO-1.

Parameters and their gradients live as views in a few flat buffers (buckets, filled in
reverse registration order, roughly the order backward produces gradients). A
post-accumulate hook counts each parameter's gradients; when every parameter of a bucket has
received its last micro-batch's gradient, the bucket's collective starts asynchronously while
backward continues. `finish` waits for what is still in flight (the exposed DP time).

ZeRO-1: each bucket is padded to a multiple of dp and split into dp contiguous shards; the
reduction is a reduce-scatter into this rank's shard, the optimizer (its fp32 weights shard
and Adam moments) holds only that shard, and an all-gather of the updated shards refreshes
the full parameters. Without ZeRO the reduction is an all-reduce and the optimizer works on
every parameter.

Under sequence parallelism the norm weights are replicated across TP but each rank saw only
its part of the sequence, so their gradients are partial: they get a bucket of their own that
is summed over TP before the DP reduction (once per step, as Megatron does).
"""

from __future__ import annotations

import torch

from harness.engine.comm import Axis
from harness.engine.partition import ParamSpec


def padded(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def plan_buckets(specs: list[ParamSpec], bucket_elems: int, dp: int, sp: bool) -> list[dict]:
    """Greedy buckets over parameters in reverse order: [{indices, numel, padded, sp}].

    With sp, TP-replicated parameters (norm weights) go to one separate bucket, reduced last.
    """
    def numel(s):
        n = 1
        for d in s.local:
            n *= d
        return n

    buckets, cur, size = [], [], 0
    sp_bucket = []
    for i in reversed(range(len(specs))):
        if sp and specs[i].shard_dim is None:
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
    def __init__(self, params: list[torch.nn.Parameter], specs: list[ParamSpec], plan: dict, dp: Axis, device):
        self.params, self.specs, self.sp = params, specs, plan["sp"]
        self.numel, self.padded = plan["numel"], plan["padded"]
        self.param_flat = torch.zeros(self.padded, device=device)
        self.grad_flat = torch.zeros(self.padded, device=device)
        self.ranges = []
        off = 0
        for p in params:
            n = p.numel()
            with torch.no_grad():
                self.param_flat[off:off + n].copy_(p.detach().reshape(-1))
            p.data = self.param_flat[off:off + n].view_as(p)
            p.grad = self.grad_flat[off:off + n].view_as(p)
            self.ranges.append((off, off + n))
            off += n
        per = self.padded // dp.size
        self.shard = (dp.index * per, (dp.index + 1) * per)
        self.shard_grad = torch.zeros(per, device=device) if dp.size > 1 else None
        self.ready = 0
        self.work = None


class GradSync:
    """Owns the flat buffers, the hooks and the DP (and SP) reductions of one rank."""

    def __init__(self, params: list[torch.nn.Parameter], specs: list[ParamSpec], dp: Axis, sp: Axis | None,
                 zero: bool, bucket_mb: float, device):
        self.dp, self.sp, self.zero = dp, sp, zero and dp.size > 1
        elems = max(1, int(bucket_mb * 2 ** 20 / 4))
        plans = plan_buckets(specs, elems, dp.size, sp is not None)
        self.buckets = [Bucket([params[i] for i in pl["indices"]], [specs[i] for i in pl["indices"]], pl, dp, device)
                        for pl in plans]
        self.owner = {}
        for b in self.buckets:
            for p in b.params:
                self.owner[p] = b
        self.counts: dict = {}
        self.expected = 1
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    # ---------------------------------------------------------------- reduction

    def begin_step(self, backwards_per_param: int) -> None:
        self.expected = backwards_per_param
        self.counts = {}
        for b in self.buckets:
            b.ready, b.work = 0, None

    def _on_grad(self, p) -> None:
        c = self.counts.get(p, 0) + 1
        self.counts[p] = c
        if c == self.expected:
            b = self.owner[p]
            b.ready += 1
            if b.ready == len(b.params):
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        if b.sp:
            self.sp.all_reduce(b.grad_flat)   # blocking: partial norm gradients over the sequence
        if self.dp.size == 1:
            return
        if self.zero:
            b.work = self.dp.reduce_scatter(b.grad_flat, out=b.shard_grad, async_op=True)
        else:
            b.work = self.dp.all_reduce(b.grad_flat, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket's reduction (charged to dp_comm)."""
        clock = self.dp.stats.clock
        t0 = clock.mark()
        for b in self.buckets:
            if b.ready != len(b.params):
                missing = [s.name for p, s in zip(b.params, b.specs) if self.counts.get(p, 0) != self.expected]
                raise AssertionError(f"gradients never arrived for {missing[:4]}")
            if b.work is not None:
                b.work.wait()
                b.work = None
        clock.add("dp_comm", t0, clock.mark())

    # ---------------------------------------------------------------- optimizer view

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """What the optimizer updates: one 1-D view per parameter (its part of this rank's shard
        under ZeRO-1), with the matching gradient view attached.

        Per-parameter views rather than one tensor per bucket: AdamW's elementwise passes then
        run over cache-sized pieces (on CPU a 13 MB flat buffer made the step twice as slow),
        and padding is never touched. The values are the same either way.
        """
        out = []
        for b in self.buckets:
            lo, hi = b.shard if self.zero else (0, b.padded)
            grads = b.shard_grad if self.zero else b.grad_flat
            for a, e in b.ranges:
                a2, e2 = max(a, lo), min(e, hi)
                if a2 < e2:
                    t = b.param_flat[a2:e2]
                    t.grad = grads[a2 - lo:e2 - lo]
                    out.append(t)
        return out

    def grad_sq_sum(self, count_replicated: bool) -> torch.Tensor:
        """Sum of squared gradients this rank is responsible for in the global norm.

        Without ZeRO every DP rank holds the same reduced gradients, so the caller counts only
        one of them; with ZeRO each rank counts its shard. TP-replicated parameters count on
        one TP rank only (count_replicated).
        """
        total = torch.zeros((), device=self.buckets[0].grad_flat.device if self.buckets else "cpu")
        for b in self.buckets:
            lo, hi = b.shard if self.zero else (0, b.padded)
            g = b.shard_grad if self.zero else b.grad_flat
            for (a, e), spec in zip(b.ranges, b.specs):
                if spec.shard_dim is None and not count_replicated:
                    continue
                a2, e2 = max(a, lo), min(e, hi)
                if a2 < e2:
                    seg = g[a2 - lo:e2 - lo]
                    total += torch.dot(seg, seg)
        return total

    def scale_grads(self, coef: torch.Tensor) -> None:
        for b in self.buckets:
            (b.shard_grad if self.zero else b.grad_flat).mul_(coef)

    def gather_params(self) -> None:
        """ZeRO-1: every rank's updated shard back into the full flat parameters."""
        if not self.zero:
            return
        for b in self.buckets:
            self.dp.all_gather(b.param_flat[b.shard[0]:b.shard[1]].clone(), out=b.param_flat)

    def zero_grads(self) -> None:
        for b in self.buckets:
            b.grad_flat.zero_()
            if b.shard_grad is not None:
                b.shard_grad.zero_()
