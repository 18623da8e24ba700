"""The plain single-device LLaMA: readable, no parallel code in it.

RMSNorm, rotary embeddings (transformers' rotate-half convention, so HF weights load as is;
Llama 3.1 rope scaling), SwiGLU MLP (or a mixture of SwiGLU experts, harness/model/moe.py),
grouped-query attention with optional q/k/v/o biases (or q/k/v only, Qwen2) and per-head q/k norms (Qwen3),
embedding and LM head untied or tied (the Shape says which, as config.json does). FSDP2 and DeepSpeed shard
this very module from outside (harness/frameworks), and a pipeline stage is this model holding only
some of its pieces (Llama's layers/first/last, torchtitan's way). The own engine's Megatron-layout
blocks (harness/engine/model.py) reuse its modules and functions (RMSNorm, FeedForward: feed_forward.py, attend,
lm_loss, tie_embeddings, the rotary tables) under the same parameter names, so every engine starts
from the same reference weights (reference_tensor) and computes the same math.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from harness.model.feed_forward import FeedForward
from harness.model.kernels import Kernels, rmsnorm_torch
from harness.model.moe import MoEFeedForward
from harness.model.op_checkpoint import checkpoint_block
from harness.model.presets import Shape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, kernel=rmsnorm_torch):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernel

    def forward(self, x):
        return self.kernel(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, device, scaling: tuple | None = None):
    """The rotary inverse frequencies (fp32), with Llama 3.1's scaling when `scaling` is
    (factor, low_freq_factor, high_freq_factor, original_max_positions): transformers'
    _compute_llama3_parameters step for step (long wavelengths divided by factor, short ones
    kept, the band between interpolated smoothly)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def cp_token_index(seq_len: int, cp: int = 1, index: int = 0, device=None) -> torch.Tensor:
    """Which of a sequence's token positions context-parallel rank `index` of `cp` holds, in the order
    it holds them (int64): the sequence cut into 2·cp equal chunks, the rank keeping chunks index and
    2·cp-1-index (causal load balancing: every rank gets one early and one late chunk, so the same
    share of the causal mask's work). The whole sequence when cp is 1. Every engine's CP sharding of
    tokens, targets and rotary positions comes from here."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // (2 * cp)
    return torch.cat(
        [
            torch.arange(index * chunk, (index + 1) * chunk, device=device),
            torch.arange((2 * cp - 1 - index) * chunk, (2 * cp - index) * chunk, device=device),
        ]
    )


def token_positions(seq_len: int, device, cp: int = 1, index: int = 0) -> torch.Tensor:
    """The positions (fp32) of the tokens a rank computes attention over: the whole sequence,
    0 .. seq_len-1, or under context parallelism the rank's chunks (cp_token_index). Every engine's
    rotary tables come from here."""
    return cp_token_index(seq_len, cp, index, device).to(torch.float32)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, scaling: tuple | None = None):
    """cos and sin, [len(positions), head_dim] (fp32)."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device, scaling)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def shape_rotary(shape: Shape, seq_len: int, device, cp: int = 1, index: int = 0):
    """The model's rotary tables (theta and rope scaling from the shape): what every engine uses;
    under context parallelism those of rank `index`'s positions."""
    positions = token_positions(seq_len, device, cp, index)
    return rotary_tables(positions, shape.head_dim, shape.rope_theta, shape.rope_scaling)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin):
    """x: [batch, heads, seq, head_dim]."""
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def attention_core(q, k, v, kernel):
    """softmax(QKᵀ)V on [batch, heads, seq, head_dim], K/V heads repeated for grouped-query
    attention: the part selective checkpointing recomputes (Korthikanti et al. 2022)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return kernel(q, k, v)


def attend(q, k, v, cos, sin, kernel, recompute: bool = False):
    """Rotary on q and k, then the attention core, [batch, heads, seq, head_dim] in and out, whatever
    the caller's activation layout. recompute: selective checkpointing (the core runs again in
    backward instead of keeping its intermediates)."""
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    if recompute and torch.is_grad_enabled():
        return checkpoint(attention_core, q, k, v, kernel, use_reentrant=False)
    return attention_core(q, k, v, kernel)


def qk_norms(shape: Shape, rmsnorm) -> tuple[nn.Module | None, nn.Module | None]:
    """Qwen3's per-head RMSNorms of queries and keys (width head_dim), or (None, None)."""
    if not shape.qk_norm:
        return None, None
    return RMSNorm(shape.head_dim, shape.norm_eps, rmsnorm), RMSNorm(shape.head_dim, shape.norm_eps, rmsnorm)


def normed(norm: nn.Module | None, x):
    """x [..., head_dim] through a per-head norm, if there is one (before rotary, as Qwen3)."""
    return x if norm is None else norm(x)


class Attention(nn.Module):
    """Grouped-query attention, q/k/v/o widths from shape.head_dim (which may differ from
    hidden/heads); biases on q/k/v with attention_bias or qkv_bias, on o with attention_bias only;
    with qk_norm a per-head RMSNorm of q and k (q_norm, k_norm) before rotary."""

    def __init__(self, shape: Shape, kernel, rmsnorm=rmsnorm_torch):
        super().__init__()
        self.head_dim = shape.head_dim
        bias = shape.has_qkv_bias
        self.wq = nn.Linear(shape.hidden, shape.heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(shape.hidden, shape.kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(shape.hidden, shape.kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(shape.heads * self.head_dim, shape.hidden, bias=shape.attention_bias)
        self.q_norm, self.k_norm = qk_norms(shape, rmsnorm)
        self.kernel = kernel
        self.recompute_core = False  # selective activation checkpointing

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = normed(self.q_norm, self.wq(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = normed(self.k_norm, self.wk(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        out = attend(q, k, v, cos, sin, self.kernel, self.recompute_core)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, shape: Shape, kernels: Kernels):
        super().__init__()
        self.attention_norm = RMSNorm(shape.hidden, shape.norm_eps, kernels.rmsnorm)
        self.attention = Attention(shape, kernels.attention, kernels.rmsnorm)
        self.ffn_norm = RMSNorm(shape.hidden, shape.norm_eps, kernels.rmsnorm)
        # a MoE's routed experts (harness/model/moe.py), else the dense SwiGLU
        self.feed_forward = MoEFeedForward(shape) if shape.moe else FeedForward(shape.hidden, shape.ffn)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def tie_embeddings(shape: Shape, embedding: nn.Module | None, head: nn.Module | None) -> None:
    """Where every engine ties the LM head to the embedding (config.json's tie_word_embeddings):
    the head's weight becomes the embedding's Parameter, one tensor under one name
    (tok_embeddings.weight) whose gradient is the sum of both uses. Call it again after anything
    that gives modules new Parameters (to_empty, a DTensor plan)."""
    if not shape.tie_embeddings:
        return
    if embedding is None or head is None:
        raise ValueError(
            "tied embeddings need the embedding and the LM head in one module "
            "(one pipeline stage or model chunk: pp=1, virtual_stages=1)"
        )
    head.weight = embedding.weight


def _checkpoint(function, *args):
    return checkpoint(function, *args, use_reentrant=False)


class Llama(nn.Module):
    """The model, or one pipeline stage of it (torchtitan's way): the blocks of `layers` (global
    indices; all by default) in a ModuleDict keyed by index, so names stay layers.<i>...; the
    embedding only when `first`, the final norm and LM head only when `last`, else None, and
    forward skips what is None. forward takes tokens [batch, seq] (hidden [batch, seq, hidden]
    without the embedding) and returns logits (hidden without the head).

    kernels: the attention and RMSNorm functions (default: those `attention` and `rmsnorm_kind`
    name). seq_len: the sequence the attention runs over when the input holds only part of it
    (a pipeline stage's input under sequence parallelism holds seq/tp positions); None: the input's.
    cp, cp_index: a context-parallel rank's model, whose input holds that rank's chunks of each
    sequence (cp_token_index): its rotary positions are theirs, and its kernels' attention must
    meet the other ranks' keys and values (the engine gives such kernels).
    """

    def __init__(
        self,
        shape: Shape,
        attention: str = "sdpa",
        rmsnorm_kind: str = "torch",
        checkpointing: str = "none",
        *,
        kernels: Kernels | None = None,
        layers: range | None = None,
        first: bool = True,
        last: bool = True,
        seq_len: int | None = None,
        cp: int = 1,
        cp_index: int = 0,
    ):
        super().__init__()
        kernels = kernels or Kernels.of(attention, rmsnorm_kind)
        self.shape, self.seq_len = shape, seq_len
        self.cp, self.cp_index = cp, cp_index
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.hidden) if first else None
        held = range(shape.layers) if layers is None else layers
        self.layers = nn.ModuleDict({str(i): Block(shape, kernels) for i in held})
        self.norm = RMSNorm(shape.hidden, shape.norm_eps, kernels.rmsnorm) if last else None
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False) if last else None
        self.tie_weights()
        self.set_checkpointing(checkpointing)

    def tie_weights(self) -> None:
        tie_embeddings(self.shape, self.tok_embeddings, self.output)

    def set_checkpointing(self, mode: str, checkpoint_fn=_checkpoint) -> None:
        """`full` runs each block through checkpoint_fn(block, h, cos, sin) (torch's non-reentrant
        checkpoint unless an engine brings its own); `selective` recomputes the attention core;
        `selective_op` runs each block under the per-op policy (harness.model.op_checkpoint)."""
        self.checkpointing, self.checkpoint_fn = mode, checkpoint_fn
        for layer in self.layers.values():
            layer.attention.recompute_core = mode == "selective"

    def rotary(self, seq_len: int, device):
        return shape_rotary(self.shape, seq_len, device, self.cp, self.cp_index)

    def run_layers(self, h, cos, sin):
        for layer in self.layers.values():
            if self.checkpointing == "full" and torch.is_grad_enabled():
                h = self.checkpoint_fn(layer, h, cos, sin)
            elif self.checkpointing == "selective_op" and torch.is_grad_enabled():
                h = checkpoint_block(layer, h, cos, sin)
            else:
                h = layer(h, cos, sin)
        return h

    def forward(self, x):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if len(self.layers):
            cos, sin = self.rotary(self.seq_len or x.shape[1] * self.cp, x.device)
            h = self.run_layers(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def lm_loss(logits, targets, reduction: str = "mean"):
    """Next-token cross-entropy computed in fp32: the mean over every token, or per token ("none")."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


@functools.lru_cache(maxsize=8)
def _parameter_table(shape: Shape) -> dict[str, tuple[int, torch.Size]]:
    """name -> (index, size) of every parameter, in the model's definition order."""
    with torch.device("meta"):
        return {n: (i, p.shape) for i, (n, p) in enumerate(Llama(shape).named_parameters())}


def reference_tensor(shape: Shape, seed: int, name: str) -> torch.Tensor:
    """One initial weight, fp32 on CPU, bit-identical from (seed, name) alone.

    Each tensor draws from its own generator seeded by (seed, index), so an engine can build
    any subset (a shard's parameters, one at a time) and still get the same values. Output
    projections (wo, w2) are scaled by 1/sqrt(2·layers), as GPT-2 and Megatron do; biases start
    at zero (as transformers and Megatron initialise them). A tied LM head is tok_embeddings.weight.
    """
    index, size = _parameter_table(shape)[name]
    if name.endswith("norm.weight"):
        return torch.ones(size)
    if name.endswith(".bias"):
        return torch.zeros(size)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    std = 0.02 / (2 * shape.layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
    return torch.randn(size, generator=g) * std


class ReferenceWeights(Mapping):
    """The initial weights as a lazy mapping: a tensor is generated when it is asked for."""

    def __init__(self, shape: Shape, seed: int):
        self.shape, self.seed = shape, seed

    def __getitem__(self, name: str) -> torch.Tensor:
        return reference_tensor(self.shape, self.seed, name)

    def __iter__(self):
        return iter(_parameter_table(self.shape))

    def __len__(self) -> int:
        return len(_parameter_table(self.shape))


def reference_state_dict(shape: Shape, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights every engine starts from, all at once (see reference_tensor)."""
    return dict(ReferenceWeights(shape, seed).items())


def load_reference(model: Llama, reference: Mapping[str, torch.Tensor], device) -> Llama:
    """Allocate a model (or stage) built on the meta device and fill it with `reference` (the
    initial weights by plain name: ReferenceWeights, or all of them at once); the head is tied
    again (to_empty makes a new Parameter per module)."""
    model = model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reference[name])
    return model


def build_model(
    shape: Shape,
    seed: int,
    attention: str = "sdpa",
    rmsnorm_kind: str = "torch",
    checkpointing: str = "none",
    device="cpu",
    kernels: Kernels | None = None,
) -> Llama:
    with torch.device("meta"):
        model = Llama(shape, attention, rmsnorm_kind, checkpointing, kernels=kernels)
    return load_reference(model, reference_state_dict(shape, seed), device)
