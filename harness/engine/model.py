"""The sharded LLaMA: one module per model chunk, built from the reference weights.

It is harness/model/llama.py's block in [seq, batch, hidden] order with explicit TP regions
around attention and MLP: the norms and the SwiGLU MLP are the plain model's modules (a rank's
slice of the MLP is the plain FeedForward at width ffn/tp), attention calls the plain model's
attend (rotary, core, selective recomputation), the tie is its tie_embeddings; what is the
engine's own is the head layout, the sharded projections and the communication
(tensor_parallel.py). Under context parallelism (cp > 1) a rank holds its chunks of every
sequence (seq/cp tokens, cp_token_index order) and its attention is the plain model's rotary
followed by context_parallel.attention over the cp axis instead of the core (selective
checkpointing is its recompute: only rank-local math again, no collective repeated). The
kernels are given at build time (harness.model.kernels.Kernels).

Every module takes the rank's ParallelContext (parallel.py: its axes and TP region) and the chunk's
ChunkOptions (how it computes), and marks how each parameter it builds is sharded (partition.Sharding);
the rank's parameter list is read from the built chunks (Chunk.param_specs), not declared beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from harness.engine import context_parallel
from harness.engine.experts import ExpertParallelMoE
from harness.engine.parallel import ParallelContext
from harness.engine.partition import ChunkPlan, ParamSpec, module_params, shard, shard_of, shard_swiglu
from harness.engine.tensor_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding, vocab_range
from harness.model.feed_forward import FeedForward
from harness.model.kernels import Kernels
from harness.model.llama import RMSNorm, apply_rotary, attend, normed, qk_norms, tie_embeddings
from harness.model.op_checkpoint import checkpoint_block
from harness.model.presets import Shape

SPLIT_DIM = {"column": 0, "row": 1}


@dataclass(frozen=True)
class ChunkOptions:
    """How a chunk computes, beside where it runs (ParallelContext): the kernels, activation checkpointing
    (none, selective, full), the context-parallel attention's implementation (cp_impl), and a MoE's tokens
    per expert when the builder gives them instead of the data (harness.model.training.BuildOptions.routing:
    (routed slots, experts) -> slots per expert; None: the data's)."""

    kernels: Kernels
    checkpointing: str = "none"
    cp_impl: str = "ring"
    routing: Callable[[int, int], list[int]] | None = None


class Weight(nn.Module):
    """A bare weight, this rank's shard of it, and optionally a bias of `bias` elements, so parameter names
    match the plain model's. `split` "column": rows split over TP (the weight's dim 0, the bias with it,
    added by forward); "row": columns split (dim 1), the bias replicated and added once after the region's
    reduction by the caller, not here."""

    def __init__(self, *shape, split: str, bias: int = 0):
        super().__init__()
        self.weight = shard(nn.Parameter(torch.empty(*shape)), SPLIT_DIM[split])
        if bias:
            self.bias = shard(nn.Parameter(torch.empty(bias)), 0 if split == "column" else None)
        else:
            self.bias = None
        self.add_bias = split == "column"
        self.matmul = None  # precision fp8: torchao's FP8 matmul (use_fp8); None: F.linear

    def forward(self, x):
        bias = self.bias if self.add_bias else None
        if self.matmul is None:
            return F.linear(x, self.weight, bias)
        out = self.matmul(x, self.weight)
        return out if bias is None else out + bias.to(out.dtype)


class ParallelAttention(nn.Module):
    """q/k/v column-parallel by heads (each rank keeps whole query groups), wo row-parallel.
    With attention_bias or qkv_bias, q/k/v biases are sharded with their heads and added locally;
    wo's bias (attention_bias only) is replicated and added by the block after the region's
    reduction (once, not tp times). With qk_norm, the plain model's per-head q/k RMSNorms run on the
    rank's own heads (weights replicated, gradients partial over TP: Sharding.tp_partial).
    Under cp > 1 its core meets the other chunks over the context's cp axis (options.cp_impl)."""

    def __init__(self, shape: Shape, parallel: ParallelContext, options: ChunkOptions):
        super().__init__()
        tp = parallel.tp.size
        self.head_dim = shape.head_dim
        hq, hkv = shape.heads // tp * self.head_dim, shape.kv_heads // tp * self.head_dim
        b = shape.has_qkv_bias
        self.wq = Weight(hq, shape.hidden, split="column", bias=hq if b else 0)
        self.wk = Weight(hkv, shape.hidden, split="column", bias=hkv if b else 0)
        self.wv = Weight(hkv, shape.hidden, split="column", bias=hkv if b else 0)
        self.wo = Weight(shape.hidden, hq, split="row", bias=shape.hidden if shape.attention_bias else 0)
        self.q_norm, self.k_norm = qk_norms(shape, options.kernels.rmsnorm)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                shard(norm.weight, tp_partial=tp > 1)
        self.kernel = options.kernels.attention
        self.recompute_core = options.checkpointing == "selective"
        self.cp = parallel.cp if parallel.cp.size > 1 else None
        self.cp_impl = options.cp_impl

    def _attend(self, q, k, v, cos, sin):
        if self.cp is None:
            return attend(q, k, v, cos, sin, self.kernel, self.recompute_core)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return context_parallel.attention(q, k, v, self.cp, self.cp_impl, self.kernel, self.recompute_core)

    def forward(self, x, cos, sin):
        """x: [seq, batch, hidden] (the full sequence, or this cp rank's chunks of it) -> partial
        sums of wo, [seq, batch, hidden]."""
        s, b, _ = x.shape
        q = normed(self.q_norm, self.wq(x).view(s, b, -1, self.head_dim)).permute(1, 2, 0, 3)
        k = normed(self.k_norm, self.wk(x).view(s, b, -1, self.head_dim)).permute(1, 2, 0, 3)
        v = self.wv(x).view(s, b, -1, self.head_dim).permute(1, 2, 0, 3)
        out = self._attend(q, k, v, cos, sin)
        return self.wo(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class ParallelBlock(nn.Module):
    """The plain Block with its attention and MLP inside TP regions. The MLP is the plain
    FeedForward at width ffn/tp: w1/w3 column-parallel, w2 row-parallel, no communication inside; a MoE's
    is harness.engine.experts' (this ep rank's experts, all-to-all inside the same region)."""

    def __init__(self, shape: Shape, parallel: ParallelContext, options: ChunkOptions):
        super().__init__()
        rmsnorm = options.kernels.rmsnorm
        self.attention_norm = RMSNorm(shape.hidden, shape.norm_eps, rmsnorm)
        self.attention = ParallelAttention(shape, parallel, options)
        self.ffn_norm = RMSNorm(shape.hidden, shape.norm_eps, rmsnorm)
        if shape.moe:
            self.feed_forward = ExpertParallelMoE(shape, parallel, options.routing)
        else:
            self.feed_forward = FeedForward(shape.hidden, shape.ffn // parallel.tp.size)
            shard_swiglu(self.feed_forward)
        self.region = parallel.region

    def forward(self, x, cos, sin):
        r = self.region
        a = r.leave(self.attention(r.enter(self.attention_norm(x)), cos, sin))
        if self.attention.wo.bias is not None:  # after the reduction: added once
            a = a + self.attention.wo.bias
        h = x + a
        return h + r.leave(self.feed_forward(r.enter(self.ffn_norm(h))))


class Chunk(nn.Module):
    """A contiguous run of layers; the first stage adds the embedding, the last the norm and head.

    With tied embeddings (only when one chunk is both first and last: the spec refuses the rest)
    the head is the embedding's Parameter: both are this TP rank's vocabulary rows
    [vocab_start, vocab_start + vocab/tp), so one shard serves the lookup and the logits, and its
    gradient is the sum of both uses, as in the plain model.

    forward(x) takes tokens [batch, seq(/cp)] on the first stage, else hidden [seq(/cp)(/tp), batch, h];
    returns hidden, or on the last stage the summed per-token loss (the executor scales it).
    """

    def __init__(self, shape: Shape, plan: ChunkPlan, parallel: ParallelContext, options: ChunkOptions):
        super().__init__()
        self.shape, self.plan, self.region, self.checkpointing = shape, plan, parallel.region, options.checkpointing
        tp = parallel.tp
        self.vocab_start = vocab_range(shape.vocab, tp.size, tp.index)[0]
        self.tok_embeddings = Weight(shape.vocab // tp.size, shape.hidden, split="column") if plan.first else None
        self.layers = nn.ModuleDict({str(i): ParallelBlock(shape, parallel, options) for i in plan.layers})
        self.norm = RMSNorm(shape.hidden, shape.norm_eps, options.kernels.rmsnorm) if plan.last else None
        self.output = Weight(shape.vocab // tp.size, shape.hidden, split="column") if plan.last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        tie_embeddings(self.shape, self.tok_embeddings, self.output)

    def param_specs(self) -> list[ParamSpec]:
        """This chunk's parameters, in the plain model's order, with their shards (partition.module_params)."""
        return module_params(self, self.plan.chunk, self.region.tp.size)

    def allocate(self, device) -> Chunk:
        """Built on the meta device, allocated on `device` (Module.to_empty makes new Parameters: the tie
        is made again and each keeps its sharding)."""
        marks = {name: p.sharding for name, p in self.named_parameters() if hasattr(p, "sharding")}
        self.to_empty(device=device)
        self.tie_weights()
        for name, p in self.named_parameters():
            if name in marks:
                p.sharding = marks[name]
        return self

    def forward(self, x, cos, sin, targets=None):
        if self.plan.first:
            x = vocab_parallel_embedding(x.t(), self.tok_embeddings.weight, self.region, self.vocab_start)
        for layer in self.layers.values():
            if self.checkpointing == "full" and torch.is_grad_enabled():
                # Early stop (torch's default, pinned here): recomputation ends once the saved
                # tensors backward needs exist again, so the block's last leave() collective is
                # not repeated. comm_model counts on exactly this.
                with set_checkpoint_early_stop(True):
                    x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            elif self.checkpointing == "selective_op" and torch.is_grad_enabled():
                x = checkpoint_block(layer, x, cos, sin)  # tp = cp = 1 (the facts): no collective inside
            else:
                x = layer(x, cos, sin)
        if not self.plan.last:
            return x
        logits = self.output(self.region.enter(self.norm(x)))  # [seq, batch, vocab/tp]
        per_token = vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.t().reshape(-1), self.region.tp, self.vocab_start
        )
        return per_token.sum()


def use_fp8(chunks: list[Chunk], policy, device_type: str) -> None:
    """Precision fp8: each rank's column- and row-parallel GEMMs run torchao's FP8 matmul on the rank's
    shard, the TP regions' collectives around them unchanged (explicit, counted, in bf16: Megatron's
    TP with FP8 GEMMs moves bf16 activations too). The MLP's shards are plain nn.Linear modules:
    torchao's convert_to_float8_training swaps them (PrecisionPolicy.convert_fp8); the attention
    projections are this module's Weight, whose forward takes torchao's matmul_with_hp_or_float8_args
    under the configs torchao builds for the recipe (harness.model.float8.matmul). The LM head stays bf16.

    Scales are dynamic over what the rank holds: a column-parallel GEMM's input is the whole
    activation (the same amax as the reference's), its weight and output gradient the rank's shard;
    a row-parallel GEMM's input is the rank's shard. A shard's amax is at most the full tensor's, so
    each shard's FP8 values are as fine or finer than the reference's: under tp > 1 the casts differ
    from the reference's by at most e4m3's rounding (2^-4 relative per element); at tp=1 they are
    the reference's."""
    from harness.model import float8

    if not policy.fp8:
        return
    matmul = float8.matmul(policy.fp8, device_type)
    for chunk in chunks:
        policy.convert_fp8(chunk, device_type)
        for layer in chunk.layers.values():
            a = layer.attention
            for w in (a.wq, a.wk, a.wv, a.wo):
                if all(d % float8.align(policy.fp8) == 0 for d in w.weight.shape):
                    w.matmul = matmul


def build_chunks(
    shape: Shape, plans: list[ChunkPlan], parallel: ParallelContext, options: ChunkOptions, reference, device
) -> list[Chunk]:
    """The rank's chunks (one per plan) with their shards of the reference weights.

    `reference(name)` gives one full initial tensor; it is sharded and dropped before the
    next is made, so a rank never holds more than one unsharded weight.
    """
    chunks = []
    tp = parallel.tp
    for plan in plans:
        with torch.device("meta"):
            chunk = Chunk(shape, plan, parallel, options)
        chunk = chunk.allocate(device)
        named = dict(chunk.named_parameters())
        with torch.no_grad():
            for spec in chunk.param_specs():
                named[spec.name].copy_(shard_of(reference(spec.name), spec, tp.index, tp.size))
        chunks.append(chunk)
    return chunks


def rank_params(shape: Shape, plans: list[ChunkPlan], parallel: ParallelContext) -> list[ParamSpec]:
    """The parameter list of the chunks `plans` on `parallel`'s rank without weights or processes: the
    chunks built on the meta device (the closed-form comm model's gradient buckets)."""
    out = []
    for plan in plans:
        with torch.device("meta"):
            out += Chunk(shape, plan, parallel, ChunkOptions(Kernels.of("naive", "torch"))).param_specs()
    return out
