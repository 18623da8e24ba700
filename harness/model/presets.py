"""Named model shapes, resolved to a transformers LlamaConfig.

The `paper-*` presets are the shapes the reference study actually trained (Hagemann et al.
2023, arXiv 2311.05610): LLaMA's layers/hidden/heads, but an untied vocabulary of 128,000 and,
for 30B, a feed-forward width of 17,888. That was derived from the published sweep data: the
PaLM MFU formula reproduces the published MFU column only with these parameter counts.
"""

from __future__ import annotations

import json
import math
import os
import re
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
    norm_eps: float = 1e-5  # RMSNorm epsilon (config.json: rms_norm_eps)
    tie_embeddings: bool = False  # LM head shares the embedding's weight (tie_word_embeddings)
    attention_bias: bool = False  # biases on q/k/v/o projections (attention_bias)
    # Llama 3.1 rope scaling (rope_scaling / rope_parameters with rope_type llama3); factor 1: none
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192

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


# What transformers' LlamaConfig assumes when config.json leaves a field out.
_HF_DEFAULTS = {
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "rope_theta": 10000.0,
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _number(raw: dict, key: str, kind, where: str, field: str):
    """raw[key] (or transformers' default) as a positive int or float, or a SpecError."""
    value = raw[key] if raw.get(key) is not None else _HF_DEFAULTS.get(key)
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (kind is float or float(value).is_integer())
    )  # json reads NaN and Infinity
    if not ok or value <= 0:
        raise SpecError(
            field, f"{key} must be a positive {'integer' if kind is int else 'number'}, got {value!r} ({where})"
        )
    return kind(value)


def _flag(raw: dict, key: str, where: str, field: str) -> bool:
    value = raw.get(key, _HF_DEFAULTS[key])
    if not isinstance(value, bool):
        raise SpecError(field, f"{key} must be true or false, got {value!r} ({where})")
    return value


def config_dict_to_shape(raw: dict, where: str = "config.json", field: str = "workload.model") -> Shape:
    """A Hugging Face LLaMA config.json (as a dict) as a Shape, every field that changes the
    model's math either honoured or refused (SpecError naming `field`), none silently dropped:

    honoured: sizes, num_key_value_heads, head_dim (= hidden_size / num_attention_heads only),
    rms_norm_eps, rope_theta, rope_scaling / rope_parameters of rope_type default or llama3,
    tie_word_embeddings, attention_bias, max_position_embeddings;
    refused: model_type other than llama, hidden_act other than silu, mlp_bias, attention_dropout,
    other rope types (linear, dynamic, yarn, longrope, ...), partial_rotary_factor != 1.
    Missing fields take transformers' LlamaConfig defaults (rms_norm_eps 1e-6, no tying, no bias).
    Fields that do not change the math (token ids, torch_dtype, use_cache, initializer_range,
    pretraining_tp, which transformers itself no longer reads) are ignored.
    """
    if not isinstance(raw, dict):
        raise SpecError(field, f"{where} does not hold a JSON object")
    model_type = raw.get("model_type", "llama")
    if model_type != "llama":
        raise SpecError(field, f"model_type {model_type} is not supported ({where}); only llama")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise SpecError(field, f"{where} lacks {', '.join(missing)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise SpecError(field, f"hidden_act {act} is not supported ({where}); LLaMA's SwiGLU uses silu")
    if _flag(raw, "mlp_bias", where, field):
        raise SpecError(field, f"mlp_bias true is not supported ({where}); no LLaMA checkpoint has MLP biases")
    dropout = raw.get("attention_dropout") or 0.0
    if dropout != 0:
        raise SpecError(
            field,
            f"attention_dropout {dropout} is not supported ({where}); the harness trains "
            f"without dropout, as LLaMA does",
        )
    hidden, heads = (
        _number(raw, "hidden_size", int, where, field),
        _number(raw, "num_attention_heads", int, where, field),
    )
    if raw.get("num_key_value_heads") is None:
        kv_heads = heads
    else:
        kv_heads = _number(raw, "num_key_value_heads", int, where, field)
    if raw.get("head_dim") is not None:
        head_dim = _number(raw, "head_dim", int, where, field)
        if head_dim * heads != hidden:
            raise SpecError(
                field,
                f"head_dim {head_dim} x num_attention_heads {heads} != hidden_size {hidden} "
                f"({where}); only head_dim = hidden_size / num_attention_heads is supported",
            )
    rope = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise SpecError(field, f"rope_scaling must be a mapping or null ({where}), got {scaling!r}")
    rope.update(scaling or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise SpecError(
            field, f"rope_scaling rope_type {rope_type} is not supported ({where}); only llama3 (Llama 3.1) or none"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise SpecError(field, f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported ({where})")
    theta = _number(rope if "rope_theta" in rope else raw, "rope_theta", float, where, field)
    max_positions = _number(raw, "max_position_embeddings", int, where, field)
    eps = _number(raw, "rms_norm_eps", float, where, field)
    extra = {}
    if rope_type == "llama3":
        absent = [k for k in _LLAMA3_KEYS[:3] if k not in rope]
        if absent:
            raise SpecError(field, f"rope_scaling llama3 lacks {', '.join(absent)} ({where})")
        vals = {k: _number(rope, k, float, where, field) for k in _LLAMA3_KEYS[:3]}
        orig = _number(
            {"original_max_position_embeddings": max_positions, **rope},
            "original_max_position_embeddings",
            int,
            where,
            field,
        )
        if vals["high_freq_factor"] <= vals["low_freq_factor"]:
            raise SpecError(field, f"rope_scaling llama3 needs high_freq_factor > low_freq_factor ({where})")
        extra = dict(
            rope_factor=vals["factor"],
            rope_low_freq_factor=vals["low_freq_factor"],
            rope_high_freq_factor=vals["high_freq_factor"],
            rope_original_max_positions=orig,
        )
    return Shape(
        layers=_number(raw, "num_hidden_layers", int, where, field),
        hidden=hidden,
        ffn=_number(raw, "intermediate_size", int, where, field),
        heads=heads,
        kv_heads=kv_heads,
        vocab=_number(raw, "vocab_size", int, where, field),
        rope_theta=theta,
        max_positions=max_positions,
        norm_eps=eps,
        tie_embeddings=_flag(raw, "tie_word_embeddings", where, field),
        attention_bias=_flag(raw, "attention_bias", where, field),
        **extra,
    )


def config_to_shape(cfg) -> Shape:
    """A transformers config object as a Shape (through its dict, with the same checks)."""
    return config_dict_to_shape(cfg.to_dict(), where=type(cfg).__name__)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _hub_cache_dir() -> str:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once,
    at import): HF_HUB_CACHE, else HF_HOME/hub, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def find_config(model: str, field: str = "workload.model") -> str | None:
    """Where `model`'s config.json is: the file itself, a folder holding it, or a hub id
    ("meta-llama/Llama-2-7b-hf") found in the local Hugging Face cache (never downloaded).
    None when `model` is neither a path nor a hub id (a preset name, or a typo of one)."""
    if os.path.isfile(model):
        return model
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise SpecError(field, f"folder {model!r} holds no config.json")
        return path
    looks_like_path = (
        model.endswith(".json")
        or model.startswith((".", "~", os.path.sep))
        or (os.path.sep != "/" and os.path.sep in model)
    )
    if looks_like_path:
        raise SpecError(field, f"config file {model!r} does not exist")
    if not _HUB_ID.match(model):
        return None
    from huggingface_hub import try_to_load_from_cache

    cache = _hub_cache_dir()
    try:
        found = try_to_load_from_cache(model, "config.json", cache_dir=cache)
    except Exception:  # noqa: BLE001 - an id huggingface_hub finds malformed ("a/b..c") is not there either
        found = None
    if not isinstance(found, str) or not os.path.isfile(found):
        raise SpecError(
            field,
            f"{model!r} is no local file or folder, and not in the local Hugging Face cache "
            f"{cache} (offline: nothing is downloaded; fetch it once with "
            f"`hf download {model} config.json`)",
        )
    return found


def read_config(path: str, field: str = "workload.model") -> Shape:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(field, f"cannot read {path!r}: {e}") from None
    return config_dict_to_shape(raw, where=path, field=field)


_BOOL_FIELDS = ("tie_embeddings", "attention_bias")


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
        shape = read_config(path, field)
    if overrides:
        names = set(Shape.__dataclass_fields__)
        for key, value in overrides.items():
            if key not in names:
                raise SpecError(f"workload.model_overrides.{key}", f"unknown; allowed: {', '.join(sorted(names))}")
            if key in _BOOL_FIELDS:
                if not isinstance(value, bool):
                    raise SpecError(f"workload.model_overrides.{key}", "must be true or false")
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"workload.model_overrides.{key}", "must be a positive number")
        shape = Shape(**{**shape.__dict__, **overrides})
    if shape.hidden % shape.heads:
        raise SpecError(field, f"hidden {shape.hidden} not divisible by heads {shape.heads}")
    if shape.heads % shape.kv_heads:
        raise SpecError(field, f"heads {shape.heads} not divisible by KV heads {shape.kv_heads}")
    if shape.rope_scaling is not None and shape.rope_high_freq_factor <= shape.rope_low_freq_factor:
        raise SpecError(field, "llama3 rope scaling needs rope_high_freq_factor > rope_low_freq_factor")
    return shape


def param_count(shape: Shape) -> int:
    """Parameters of the LLaMA: embedding + layers + final norm + LM head (counted once when tied)."""
    head_dim = shape.hidden // shape.heads
    attn = (
        shape.hidden * (shape.heads * head_dim)
        + 2 * shape.hidden * (shape.kv_heads * head_dim)
        + (shape.heads * head_dim) * shape.hidden
    )
    if shape.attention_bias:
        attn += (shape.heads + 2 * shape.kv_heads) * head_dim + shape.hidden
    mlp = 3 * shape.hidden * shape.ffn
    norms = 2 * shape.hidden
    embeddings = (1 if shape.tie_embeddings else 2) * shape.vocab * shape.hidden
    return embeddings + shape.layers * (attn + mlp + norms) + shape.hidden
