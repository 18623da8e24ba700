"""Muon (`workload.optimizer.name: muon`): torch.optim.Muon's update on the transformer blocks' 2-D
weights, torch.optim.AdamW on the embedding, the LM head, the norms, biases and anything not 2-D (a MoE's
stacked experts), with the workload's hyperparameters, the same split under every engine that runs it.

Why not torch.optim.Muon itself: it needs each parameter as a whole 2-D matrix, and under ZeRO-1 (the own
engine) or FSDP2 a rank holds a shard. MuonWithAdamW runs torch's algorithm step for step (the momentum
lerp, the Nesterov blend, torch.optim._muon's Newton-Schulz iteration and learning-rate adjustment, the
decoupled weight decay) on what the rank holds, and asks the engine's `Whole` for what Newton-Schulz needs:
each matrix's whole update (a gather over the shard group, counted as communication by the engine) and
the part of the orthogonalised result the rank holds. On whole matrices (the reference, the own engine
without ZeRO) that is a view, and the result is torch.optim.Muon's to the bit (tests/test_muon.py). The
momentum stays sharded as the Adam moments are: one fp32 buffer per element held, half of AdamW's two.
"""

from __future__ import annotations

import torch
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from harness.model.training import dtype_name, make_adamw

NESTEROV = True  # torch.optim.Muon's default, as its ns_coefficients, eps and ns_steps
COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def newton_schulz(update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of a whole 2-D update, in `dtype`: bf16 is torch's own function
    (it always casts to bf16); fp32 runs the same quintic iteration (its coefficients, steps, norm and
    transposition) in fp32, as the fp32 policy keeps every optimizer computation in fp32. Why not bf16
    there: the iteration raises small singular values towards one (by up to a^5, about 480, over five
    steps), so a gradient summed in another order (1e-7 apart in fp32) that flips one bf16 rounding moves
    the update by far more than the engines' fp32 parity allows; in fp32 it moves it by 1e-7 times that."""
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(update, COEFFICIENTS, DEFAULT_NS_STEPS, EPS)
    a, b, c = COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=EPS)
    for _ in range(DEFAULT_NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_matrix(name: str, shape) -> bool:
    """Whether the parameter `name` (the plain model's state-dict name) of `shape` (its whole shape) takes
    Muon: a 2-D weight inside a transformer block (attention and MLP projections, a MoE router); the
    embedding, the LM head, norms and biases take AdamW, as Muon's authors and torchtitan split them."""
    return name.startswith("layers.") and len(shape) == 2


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard (a view: in-place updates reach the DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


class Whole:
    """Whole matrices (the reference; an engine whose ranks hold each matrix whole): no gather."""

    what = "each matrix held whole, no gather"

    def __init__(self, shapes: list[tuple[int, int]]):
        self.shapes = shapes

    def batches(self) -> list[tuple]:
        """(key, the matrices' indices) by gather, in an order every rank of a gather follows (the indices may
        be none where this rank takes part in a gather without holding a Muon matrix of it)."""
        return [(None, [i]) for i in range(len(self.shapes))]

    def full(self, key, batch: list[int], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each batch matrix's whole update, 2-D, from what this rank holds of it (collective where sharded)."""
        return [updates[k].reshape(self.shapes[i]) for k, i in enumerate(batch)]

    def mine(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        """The part of matrix `index`'s whole orthogonalised update this rank holds."""
        return whole


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer (one state, one step and its hooks: the census and the profiler see one) over Muon's
    matrices (param group 0) and AdamW's other parameters (the next group, an inner torch.optim.AdamW
    sharing this state). `matrices` are the tensors the rank updates (whole, flat views of them, shards or
    DTensors); `shapes` their whole 2-D shapes; `whole` the engine's gather (Whole: none)."""

    def __init__(self, matrices, others, workload, shapes, whole=None, fused: bool = False):
        o = workload.optimizer
        # Newton-Schulz's dtype: fp32 under the fp32 policy, torch's bf16 under bf16 and fp8 (newton_schulz)
        self.ns_dtype = torch.float32 if workload.precision == "fp32" else torch.bfloat16
        super().__init__(
            list(matrices),
            dict(lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum, adjust_lr_fn=o.muon_adjust_lr),
        )
        self.shapes = [tuple(s) for s in shapes]
        if any(len(s) != 2 for s in self.shapes):
            raise ValueError("Muon takes 2-D matrices only")
        self.whole = whole or Whole(self.shapes)
        self.adamw = None
        if others:
            self.adamw = torch.optim.AdamW(
                list(others), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=fused
            )
            self.adamw.state = self.state
            self.param_groups.extend(self.adamw.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        params = group["params"]
        # a batch at a time (the whole matrices of one gather), so that no more than one batch is whole at once
        for key, batch in self.whole.batches():
            updates = []
            for i in batch:
                held = local(params[i])
                g = local(params[i].grad) if params[i].grad is not None else torch.zeros_like(held)
                state = self.state[params[i]]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                updates.append(g.lerp(buf, mu) if NESTEROV else buf)
            for i, whole in zip(batch, self.whole.full(key, batch, updates), strict=True):
                ortho = newton_schulz(whole, self.ns_dtype)
                adjusted = _adjust_lr(lr, group["adjust_lr_fn"], self.shapes[i])
                held = local(params[i])
                held.mul_(1 - lr * wd)
                held.add_(self.whole.mine(i, ortho).reshape(held.shape), alpha=-adjusted)
        if self.adamw is not None:
            self.adamw.step()
        return None

    def describe(self) -> str:
        """The optimizer in words, as a report says it."""
        g = self.param_groups[0]
        others = sum(len(group["params"]) for group in self.param_groups[1:])
        return (
            f"Muon on the blocks' {len(g['params'])} 2-D weights held here (torch.optim.Muon's step: momentum "
            f"{g['momentum']}, Nesterov, {DEFAULT_NS_STEPS} Newton-Schulz steps in {dtype_name(self.ns_dtype)}, "
            f"adjust_lr_fn {g['adjust_lr_fn']}; {self.whole.what}), torch.optim.AdamW on the other "
            f"{others} tensors"
        )


def describe(optimizer, device_type: str) -> str:
    """What a report says of the optimizer an engine built: MuonWithAdamW's words, or AdamW's implementation."""
    if isinstance(optimizer, MuonWithAdamW):
        return optimizer.describe()
    return "torch.optim.AdamW" + (" (fused)" if device_type == "cuda" else " (foreach)")


def split(named, shape_of=lambda name, t: tuple(t.shape)) -> tuple[list, list, list]:
    """(matrices, their whole shapes, the others) of (name, tensor) pairs by muon_matrix."""
    matrices, shapes, others = [], [], []
    for name, t in named:
        full = shape_of(name, t)
        if muon_matrix(name, full):
            matrices.append(t)
            shapes.append(full)
        else:
            others.append(t)
    return matrices, shapes, others


def make_optimizer(named, workload, fused: bool = False, shape_of=None, whole=None):
    """The workload's optimizer over (name, tensor) pairs: torch.optim.AdamW, or MuonWithAdamW with the split
    (`shape_of(name, tensor)`: its whole shape where the tensor is a shard; `whole`: the engine's gather, built
    from the matrices' list by whole(matrices, shapes))."""
    named = list(named)
    o = workload.optimizer
    if o.name != "muon":
        return make_adamw([t for _, t in named], workload, fused=fused)
    matrices, shapes, others = split(named, shape_of or (lambda name, t: tuple(t.shape)))
    return MuonWithAdamW(
        matrices, others, workload, shapes, whole(matrices, shapes) if whole is not None else None, fused=fused
    )
