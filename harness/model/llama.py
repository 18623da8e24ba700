"""The plain single-device LLaMA: readable, no parallel code in it.

RMSNorm, rotary embeddings (transformers' rotate-half convention, so HF weights load as is;
Llama 3.1 rope scaling), SwiGLU MLP, grouped-query attention with optional q/k/v/o biases,
embedding and LM head untied or tied (the Shape says which, as config.json does). FSDP2 and DeepSpeed shard
this very module from outside (harness/frameworks); the own engine mirrors it block for block
(harness/engine/model.py: the same parameter names, this file's attention core, kernels and
rotary tables), so every engine starts from the same reference weights (reference_tensor).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from harness.model.kernels import attention_fn, rmsnorm
from harness.model.presets import Shape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, kernel: str = "torch"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = kernel

    def forward(self, x):
        return rmsnorm(self.kernel, x, self.weight, self.eps)


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


def rotary_tables(seq_len: int, head_dim: int, theta: float, device, offset: int = 0, scaling: tuple | None = None):
    """cos and sin, [seq, head_dim], for positions offset..offset+seq_len-1 (fp32)."""
    inv_freq = rope_inv_freq(head_dim, theta, device, scaling)
    pos = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def shape_rotary(shape: Shape, seq_len: int, device, offset: int = 0):
    """The model's rotary tables (theta and rope scaling from the shape): what every engine uses."""
    return rotary_tables(seq_len, shape.hidden // shape.heads, shape.rope_theta, device, offset, shape.rope_scaling)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin):
    """x: [batch, heads, seq, head_dim]."""
    return (x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype))


def attention_core(q, k, v, kernel: str):
    """softmax(QKᵀ)V on [batch, heads, seq, head_dim], K/V heads repeated for grouped-query
    attention: the part selective checkpointing recomputes (Korthikanti et al. 2022)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return attention_fn(kernel)(q, k, v)


class Attention(nn.Module):
    def __init__(self, shape: Shape, kernel: str = "sdpa"):
        super().__init__()
        self.head_dim = shape.hidden // shape.heads
        bias = shape.attention_bias
        self.wq = nn.Linear(shape.hidden, shape.heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(shape.hidden, shape.kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(shape.hidden, shape.kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(shape.heads * self.head_dim, shape.hidden, bias=bias)
        self.kernel = kernel
        self.recompute_core = False  # selective activation checkpointing

    def core(self, q, k, v):
        return attention_core(q, k, v, self.kernel)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, shape: Shape):
        super().__init__()
        self.w1 = nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.w3 = nn.Linear(shape.hidden, shape.ffn, bias=False)
        self.w2 = nn.Linear(shape.ffn, shape.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, shape: Shape, attention: str, rmsnorm_kind: str):
        super().__init__()
        self.attention_norm = RMSNorm(shape.hidden, shape.norm_eps, kernel=rmsnorm_kind)
        self.attention = Attention(shape, attention)
        self.ffn_norm = RMSNorm(shape.hidden, shape.norm_eps, kernel=rmsnorm_kind)
        self.feed_forward = FeedForward(shape)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, shape: Shape, attention: str = "sdpa", rmsnorm_kind: str = "torch",
                 checkpointing: str = "none"):
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(Block(shape, attention, rmsnorm_kind) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, shape.norm_eps, kernel=rmsnorm_kind)
        self.output = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.tie_weights()
        self.set_checkpointing(checkpointing)

    def tie_weights(self) -> None:
        """With tied embeddings the LM head is the embedding's Parameter (one tensor, one name:
        tok_embeddings.weight). Call again after to_empty, which makes a new Parameter per module."""
        if self.shape.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def set_checkpointing(self, mode: str) -> None:
        self.checkpointing = mode
        for layer in self.layers:
            layer.attention.recompute_core = mode == "selective"

    def rotary(self, seq_len: int, device):
        return shape_rotary(self.shape, seq_len, device)

    def run_layers(self, h, cos, sin):
        for layer in self.layers:
            if self.checkpointing == "full" and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        return h

    def forward(self, tokens):
        """tokens [batch, seq] -> logits [batch, seq, vocab]."""
        cos, sin = self.rotary(tokens.shape[1], tokens.device)
        h = self.run_layers(self.tok_embeddings(tokens), cos, sin)
        return self.output(self.norm(h))


def lm_loss(logits, targets):
    """Mean next-token cross-entropy over every token, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


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


def build_model(shape: Shape, seed: int, attention: str = "sdpa", rmsnorm_kind: str = "torch",
                checkpointing: str = "none", device="cpu") -> Llama:
    with torch.device("meta"):
        model = Llama(shape, attention, rmsnorm_kind, checkpointing)
    model = model.to_empty(device=device)
    model.tie_weights()
    state = reference_state_dict(shape, seed)
    if shape.tie_embeddings:  # state_dict() names the shared tensor under both modules
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state)
    return model
