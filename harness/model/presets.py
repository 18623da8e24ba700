"""Named model shapes, resolved to a transformers LlamaConfig.

The `paper-*` presets are the shapes the reference study actually trained (Hagemann et al.
2023, arXiv 2311.05610): LLaMA's layers/hidden/heads, but an untied vocabulary of 128,000 and,
for 30B, a feed-forward width of 17,888. That was derived from the published sweep data: the
PaLM MFU formula reproduces the published MFU column only with these parameter counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import SpecError
from harness.model.config_json import find_config, read_config_fields


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    max_positions: int = 8192
    norm_eps: float = 1e-5  # RMSNorm epsilon (config.json: rms_norm_eps)
    tie_embeddings: bool = False  # LM head shares the embedding's weight (tie_word_embeddings)
    attention_bias: bool = False  # biases on q/k/v/o projections (attention_bias)
    qkv_bias: bool = False  # biases on q/k/v only, none on o (Qwen2); attention_bias implies them
    # Llama 3.1 rope scaling (rope_scaling / rope_parameters with rope_type llama3); factor 1: none
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    # A head's width (config.json head_dim, Megatron's kv_channels); 0: hidden / heads. Qwen3 sets it apart.
    kv_channels: int = 0
    # Mixture of experts (Mixtral, Qwen3-MoE): every block's feed-forward is `experts` SwiGLU experts of
    # width moe_ffn, each token routed to experts_per_token of them (harness/model/moe.py); 0 experts: dense.
    experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0
    norm_topk: bool = True  # the top-k routing weights renormalised to sum to 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    # Qwen3: an RMSNorm of width head_dim on each query and key head, before rotary (q_norm, k_norm)
    qk_norm: bool = False
    # Mistral's sliding window (keys within the last sliding_window positions); 0: none. Only a window
    # >= the run's seq_len is run (it is then plain causal attention): harness/spec/checks.py refuses shorter.
    sliding_window: int = 0

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden // self.heads

    @property
    def has_qkv_bias(self) -> bool:
        """q/k/v projections carry biases (attention_bias or qkv_bias); o's only with attention_bias."""
        return self.attention_bias or self.qkv_bias

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), or None."""
        if self.rope_factor == 1.0:
            return None
        return (
            self.rope_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_positions,
        )


PRESETS: dict[str, Shape] = {
    # LLaMA 1 as published (Touvron et al. 2023).
    "llama-13b": Shape(40, 5120, 13824, 40, 40, 32000),
    "llama-30b": Shape(60, 6656, 17920, 52, 52, 32000),
    "llama-65b": Shape(80, 8192, 22016, 64, 64, 32000),
    # As the reference study trained them.
    "paper-13b": Shape(40, 5120, 13824, 40, 40, 128000),
    "paper-30b": Shape(60, 6656, 17888, 52, 52, 128000),
    "paper-65b": Shape(80, 8192, 22016, 64, 64, 128000),
    # Llama 2 / Llama 3.
    "llama2-7b": Shape(32, 4096, 11008, 32, 32, 32000),
    "llama2-70b": Shape(80, 8192, 28672, 64, 8, 32000),
    # llama3-8b is Llama 3.1 8B's config.json: Llama 3 8B's shape with the llama3 rope scaling and
    # 131,072 positions (the 128k-context release long-sequence layouts are planned for).
    "llama3-8b": Shape(32, 4096, 14336, 32, 8, 128256, rope_theta=500000.0, max_positions=131072, rope_factor=8.0),
    # Llama 2 13B and Llama 3.1 70B / 405B (their config.json files), the published runs' models
    # (baselines/published_runs).
    "llama2-13b": Shape(40, 5120, 13824, 40, 40, 32000),
    "llama3-70b": Shape(80, 8192, 28672, 64, 8, 128256, rope_theta=500000.0, max_positions=131072, rope_factor=8.0),
    "llama3-405b": Shape(126, 16384, 53248, 128, 8, 128256, rope_theta=500000.0, max_positions=131072, rope_factor=8.0),
    # Tiny shapes for CPU tests and demos (grouped-query attention on purpose).
    "tiny": Shape(2, 64, 176, 4, 2, 256, max_positions=2048),
    "tiny-4l": Shape(4, 128, 352, 8, 4, 512, max_positions=2048),
    "tiny-256": Shape(4, 256, 688, 8, 4, 1024, max_positions=2048),
    # Mixture of experts. tiny-moe: a CPU-sized Mixtral (8 experts, top-2, renormalised).
    "tiny-moe": Shape(2, 64, 176, 4, 2, 256, max_positions=2048, experts=8, experts_per_token=2, moe_ffn=96),
    # Mixtral 8x7B, Qwen3-30B-A3B and Qwen3-235B-A22B as their config.json files give them (Qwen3-MoE:
    # head_dim 128 apart from hidden / heads, norm_topk_prob true, untied).
    "mixtral-8x7b": Shape(
        32,
        4096,
        14336,
        32,
        8,
        32000,
        rope_theta=1e6,
        max_positions=32768,
        experts=8,
        experts_per_token=2,
        moe_ffn=14336,
    ),
    "qwen3-30b-a3b": Shape(
        48,
        2048,
        6144,
        32,
        4,
        151936,
        rope_theta=1e6,
        max_positions=40960,
        norm_eps=1e-6,
        kv_channels=128,
        qk_norm=True,
        experts=128,
        experts_per_token=8,
        moe_ffn=768,
    ),
    "qwen3-235b-a22b": Shape(
        94,
        4096,
        12288,
        64,
        4,
        151936,
        rope_theta=1e6,
        max_positions=40960,
        norm_eps=1e-6,
        kv_channels=128,
        qk_norm=True,
        experts=128,
        experts_per_token=8,
        moe_ffn=1536,
    ),
}


def shape_to_config(shape: Shape):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": shape.rope_theta,
            "factor": shape.rope_factor,
            "low_freq_factor": shape.rope_low_freq_factor,
            "high_freq_factor": shape.rope_high_freq_factor,
            "original_max_position_embeddings": shape.rope_original_max_positions,
        }
    kwargs = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=shape.norm_eps,
        tie_word_embeddings=shape.tie_embeddings,
        attention_bias=shape.attention_bias,
        mlp_bias=False,
        hidden_act="silu",
    )
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:  # rope_theta and its scaling in rope_parameters
        return LlamaConfig(**kwargs, rope_parameters=rope)
    scaling = None if shape.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"}
    return LlamaConfig(**kwargs, rope_theta=shape.rope_theta, rope_scaling=scaling)


_BOOL_FIELDS = ("tie_embeddings", "attention_bias", "qkv_bias", "qk_norm", "norm_topk")
_ZERO_FIELDS = (
    "kv_channels",
    "experts",
    "experts_per_token",
    "moe_ffn",
    "sliding_window",
)  # 0 means "none" / "derived"


def resolve_shape(model: str, overrides: dict | None = None, field: str = "workload.model") -> Shape:
    """A preset name, a local Hugging Face config.json, a folder holding one, or a hub id in the
    local Hugging Face cache; with optional overrides."""
    if model in PRESETS:
        shape = PRESETS[model]
    else:
        path = find_config(model, field)
        if path is None:
            raise SpecError(
                field,
                f"unknown preset {model!r}; known: {', '.join(sorted(PRESETS))} "
                f"(or a config.json, a folder holding one, or a hub id in the local cache)",
            )
        shape = Shape(**read_config_fields(path, field))
    if overrides:
        names = set(Shape.__dataclass_fields__)
        for key, value in overrides.items():
            if key not in names:
                raise SpecError(f"workload.model_overrides.{key}", f"unknown; allowed: {', '.join(sorted(names))}")
            if key in _BOOL_FIELDS:
                if not isinstance(value, bool):
                    raise SpecError(f"workload.model_overrides.{key}", "must be true or false")
            elif key in _ZERO_FIELDS:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise SpecError(f"workload.model_overrides.{key}", "must be a non-negative integer")
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"workload.model_overrides.{key}", "must be a positive number")
        shape = Shape(**{**shape.__dict__, **overrides})
    if not shape.kv_channels and shape.hidden % shape.heads:
        raise SpecError(field, f"hidden {shape.hidden} not divisible by heads {shape.heads}")
    if shape.heads % shape.kv_heads:
        raise SpecError(field, f"heads {shape.heads} not divisible by KV heads {shape.kv_heads}")
    if shape.rope_scaling is not None and shape.rope_high_freq_factor <= shape.rope_low_freq_factor:
        raise SpecError(field, "llama3 rope scaling needs rope_high_freq_factor > rope_low_freq_factor")
    check_moe_shape(shape, field)
    return shape


def check_moe_shape(shape: Shape, field: str) -> None:
    """A MoE shape names all three of experts, experts_per_token and moe_ffn, with 1 <= k <= experts."""
    moe = (shape.experts, shape.experts_per_token, shape.moe_ffn)
    if any(moe) and not all(moe):
        raise SpecError(field, f"experts {moe[0]}, experts_per_token {moe[1]}, moe_ffn {moe[2]}: a MoE needs all three")
    if shape.experts_per_token > shape.experts:
        raise SpecError(field, f"experts_per_token {shape.experts_per_token} > experts {shape.experts}")


def expert_params(shape: Shape) -> int:
    """One expert's parameters (a SwiGLU of width moe_ffn)."""
    return 3 * shape.hidden * shape.moe_ffn


def active_param_count(shape: Shape) -> int:
    """Parameters a token passes through: param_count with experts_per_token experts a layer, not all
    (the convention MoE MFU is computed with: 6 x active parameters per token, as Megatron and
    DeepSeek report it)."""
    total = param_count(shape)
    if not shape.moe:
        return total
    return total - shape.layers * (shape.experts - shape.experts_per_token) * expert_params(shape)


def param_count(shape: Shape) -> int:
    """Parameters of the LLaMA: embedding + layers + final norm + LM head (counted once when tied)."""
    head_dim = shape.head_dim
    attn = (
        shape.hidden * (shape.heads * head_dim)
        + 2 * shape.hidden * (shape.kv_heads * head_dim)
        + (shape.heads * head_dim) * shape.hidden
    )
    if shape.has_qkv_bias:
        attn += (shape.heads + 2 * shape.kv_heads) * head_dim
    if shape.attention_bias:
        attn += shape.hidden
    if shape.qk_norm:
        attn += 2 * head_dim
    mlp = (
        expert_params(shape) * shape.experts + shape.experts * shape.hidden
        if shape.moe
        else 3 * shape.hidden * shape.ffn
    )
    norms = 2 * shape.hidden
    embeddings = (1 if shape.tie_embeddings else 2) * shape.vocab * shape.hidden
    return embeddings + shape.layers * (attn + mlp + norms) + shape.hidden
