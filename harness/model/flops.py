"""Analytic training FLOPs per token under the conventions that published MFUs use.

Published MFU figures disagree partly because they count different FLOPs. We count every
convention from the shapes, side by side:

- palm:        6·P + 12·L·h·s  (PaLM/Chinchilla; P counts every parameter, embedding
               included, a tied LM head once; the reference study's MFU column uses this with
               its untied 128k vocab)
- palm_causal: 6·P + 6·L·h·s   (the same, but the causal mask halves the attention matmuls)
- megatron:    3 × forward matmul FLOPs (Narayanan et al. 2021 generalised to SwiGLU and GQA):
               projections, SwiGLU, QKᵀ and AV (4·s·h per layer), LM head (tied or not: it is
               computed either way); no embedding FLOPs, no bias additions
- hardware:    megatron plus what activation checkpointing recomputes (HFU): a full extra
               forward of every layer for `full`, the attention core (QKᵀ, AV) for `selective`

Mixture of experts (Shape.moe): a token passes through experts_per_token experts of a layer, not all
of them, and through the router (an h x E GEMM: 2·h·E forward FLOPs). Every convention counts the
active experts only: palm's P is the active parameters (presets.active_param_count, the router
included), i.e. MFU = 6 x active parameters per token plus attention, the convention Megatron-LM and
DeepSeek report MoE MFU with; megatron's layer GEMMs are k expert SwiGLUs and the router.
"""

from __future__ import annotations

from harness.model.presets import Shape, active_param_count, expert_params, param_count

CONVENTIONS = ("palm", "palm_causal", "megatron", "hardware")


def layer_matmul_params(shape: Shape) -> int:
    """The GEMM weights one token passes through in one layer (under MoE its k experts and the router)."""
    head_dim = shape.head_dim
    q_o = 2 * shape.hidden * shape.heads * head_dim
    kv = 2 * shape.hidden * shape.kv_heads * head_dim
    if shape.moe:  # the experts a token is routed to, and the router
        return q_o + kv + shape.experts_per_token * expert_params(shape) + shape.hidden * shape.experts
    return q_o + kv + 3 * shape.hidden * shape.ffn


def flops_per_token(shape: Shape, seq_len: int, checkpointing: str = "none") -> dict[str, float]:
    """Training FLOPs (forward + backward) per token, per convention."""
    L, h, s = shape.layers, shape.hidden, seq_len
    P = active_param_count(shape)  # every parameter of a dense model
    attn_core_fwd = 4 * s * h  # QKᵀ and AV per layer per token, 2 FLOPs per MAC
    layer_fwd = 2 * layer_matmul_params(shape) + attn_core_fwd
    head_fwd = 2 * h * shape.vocab
    megatron = 3 * (L * layer_fwd + head_fwd)
    if checkpointing == "full":
        recompute = L * layer_fwd
    elif checkpointing == "selective":
        recompute = L * attn_core_fwd
    else:
        recompute = 0
    return {
        "palm": 6 * P + 12 * L * h * s,
        "palm_causal": 6 * P + 6 * L * h * s,
        "megatron": float(megatron),
        "hardware": float(megatron + recompute),
    }


def palm_terms(shape: Shape, seq_len: int) -> dict[str, int]:
    """The palm convention's terms for a report to state: N (parameters a token passes through: under
    MoE the active ones), P (every parameter), L, h, s, the attention term 12·L·h·s and their sum."""
    n, attention = active_param_count(shape), 12 * shape.layers * shape.hidden * seq_len
    return {
        "N": n,
        "P": param_count(shape),
        "L": shape.layers,
        "h": shape.hidden,
        "s": seq_len,
        "attention": attention,
        "per_token": 6 * n + attention,
    }
