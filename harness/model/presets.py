"""Named model shapes, resolved to a transformers LlamaConfig.

The `paper-*` presets are the shapes the reference study actually trained (Hagemann et al.
2023, arXiv 2311.05610): LLaMA's layers/hidden/heads, but an untied vocabulary of 128,000 and,
for 30B, a feed-forward width of 17,888. That was derived from the published sweep data: the
PaLM MFU formula reproduces the published MFU column only with these parameter counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from harness.errors import SpecError


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
    "llama3-8b": Shape(32, 4096, 14336, 32, 8, 128256, rope_theta=500000.0),
    # Tiny shapes for CPU tests and demos (grouped-query attention on purpose).
    "tiny": Shape(2, 64, 176, 4, 2, 256, max_positions=2048),
    "tiny-4l": Shape(4, 128, 352, 8, 4, 512, max_positions=2048),
    "tiny-256": Shape(4, 256, 688, 8, 4, 1024, max_positions=2048),
}


def shape_to_config(shape: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        rope_theta=shape.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )


def config_to_shape(cfg) -> Shape:
    rope_theta = getattr(cfg, "rope_theta", None)
    if rope_theta is None:  # transformers >= 5 keeps it in rope_parameters
        rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return Shape(
        layers=cfg.num_hidden_layers,
        hidden=cfg.hidden_size,
        ffn=cfg.intermediate_size,
        heads=cfg.num_attention_heads,
        kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        vocab=cfg.vocab_size,
        rope_theta=float(rope_theta),
        max_positions=getattr(cfg, "max_position_embeddings", 8192),
    )


def resolve_shape(model: str, overrides: dict | None = None, field: str = "workload.model") -> Shape:
    """A preset name or a path to a local Hugging Face config.json, with optional overrides."""
    if model in PRESETS:
        shape = PRESETS[model]
    elif model.endswith(".json") or os.path.sep in model:
        if not os.path.isfile(model):
            raise SpecError(field, f"config file {model!r} does not exist")
        try:
            with open(model) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SpecError(field, f"cannot read {model!r}: {e}") from None
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                               "intermediate_size", "vocab_size") if k not in raw]
        if missing:
            raise SpecError(field, f"{model!r} lacks {', '.join(missing)}")
        from transformers import LlamaConfig

        cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
        shape = config_to_shape(cfg)
    else:
        raise SpecError(field, f"unknown preset {model!r}; known: {', '.join(sorted(PRESETS))}")
    if overrides:
        names = set(Shape.__dataclass_fields__)
        for key, value in overrides.items():
            if key not in names:
                raise SpecError(f"workload.model_overrides.{key}", f"unknown; allowed: {', '.join(sorted(names))}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"workload.model_overrides.{key}", "must be a positive number")
        shape = Shape(**{**shape.__dict__, **overrides})
    if shape.hidden % shape.heads:
        raise SpecError(field, f"hidden {shape.hidden} not divisible by heads {shape.heads}")
    if shape.heads % shape.kv_heads:
        raise SpecError(field, f"heads {shape.heads} not divisible by KV heads {shape.kv_heads}")
    return shape


def param_count(shape: Shape) -> int:
    """Parameters of the untied LLaMA: embedding + layers + final norm + LM head."""
    head_dim = shape.hidden // shape.heads
    attn = shape.hidden * (shape.heads * head_dim) + 2 * shape.hidden * (shape.kv_heads * head_dim) \
        + (shape.heads * head_dim) * shape.hidden
    mlp = 3 * shape.hidden * shape.ffn
    norms = 2 * shape.hidden
    return 2 * shape.vocab * shape.hidden + shape.layers * (attn + mlp + norms) + shape.hidden
