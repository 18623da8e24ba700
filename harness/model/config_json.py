"""A Hugging Face config.json as a Shape's fields (presets.py builds the Shape): every field that
changes the model's math honoured or refused in one line naming the spec field, none silently
dropped; where the file is (a path, a folder, a hub id in the local cache: nothing is downloaded)."""

from __future__ import annotations

import json
import math
import os
import re

from harness.errors import SpecError, shown
from harness.model.config_families import FAMILY_DEFAULTS, TOO_LARGE, family_fields

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


def _number(raw: dict, key: str, kind, where: str, field: str, defaults: dict = _HF_DEFAULTS):
    """raw[key] (or transformers' default) as a positive int or float, or a SpecError."""
    value = raw[key] if raw.get(key) is not None else defaults.get(key)
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (isinstance(value, int) or math.isfinite(value))  # json reads NaN and Infinity
        and (kind is float or isinstance(value, int) or value.is_integer())
    )
    if not ok or value <= 0:
        raise SpecError(
            field, f"{key} must be a positive {'integer' if kind is int else 'number'}, got {shown(value)} ({where})"
        )
    if value >= TOO_LARGE:
        raise SpecError(field, f"{key} must be below {TOO_LARGE:.0e}, got {shown(value)} ({where})")
    return kind(value)


def _flag(raw: dict, key: str, where: str, field: str) -> bool:
    value = raw.get(key, _HF_DEFAULTS[key])
    if not isinstance(value, bool):
        raise SpecError(field, f"{key} must be true or false, got {value!r} ({where})")
    return value


def config_fields(raw: dict, where: str = "config.json", field: str = "workload.model") -> dict:
    """A Hugging Face config.json (as a dict) of the LLaMA family as Shape's fields, every field that
    changes the model's math either honoured or refused (SpecError naming `field`), none silently dropped:

    model_type llama, mistral, qwen2, qwen3, mixtral or qwen3_moe (what each adds: config_families.py);
    honoured: sizes, num_key_value_heads, head_dim (kv_channels when apart from hidden_size /
    num_attention_heads), rms_norm_eps, rope_theta, rope_scaling / rope_parameters of rope_type default
    or llama3, tie_word_embeddings, attention_bias, max_position_embeddings;
    refused: other model types, hidden_act other than silu, mlp_bias, attention_dropout,
    other rope types (linear, dynamic, yarn, longrope, ...), partial_rotary_factor != 1.
    Missing fields take the defaults of transformers' config class of that model_type (LlamaConfig:
    rms_norm_eps 1e-6, no tying, no bias; Qwen3Config: head_dim 128; MixtralConfig: rope_theta 1e6).
    Fields that do not change the math (token ids, torch_dtype, use_cache, initializer_range,
    pretraining_tp, which transformers itself no longer reads) are ignored. A MoE's `ffn` is the
    config's intermediate_size as given (Mixtral: also its experts' width; Qwen3-MoE: unused, every
    layer being a mixture of experts).
    """
    if not isinstance(raw, dict):
        raise SpecError(field, f"{where} does not hold a JSON object")
    model_type = raw.get("model_type", "llama")
    if not isinstance(model_type, str):
        raise SpecError(field, f"model_type must be a string, got {shown(model_type)} ({where})")
    if model_type not in FAMILY_DEFAULTS:
        raise SpecError(field, f"model_type {model_type} is not supported ({where}); only {', '.join(FAMILY_DEFAULTS)}")
    defaults = {**_HF_DEFAULTS, **FAMILY_DEFAULTS[model_type]}
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise SpecError(field, f"{where} lacks {', '.join(missing)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise SpecError(field, f"hidden_act {act} is not supported ({where}); LLaMA's SwiGLU uses silu")
    if model_type == "llama" and _flag(raw, "mlp_bias", where, field):
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
    head_dim = (
        _number(raw, "head_dim", int, where, field, defaults)
        if defaults.get("head_dim") or (raw.get("head_dim") is not None)
        else None
    )
    kv_channels = head_dim if head_dim is not None and head_dim * heads != hidden else 0
    parameters = raw.get("rope_parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise SpecError(field, f"rope_parameters must be a mapping or null ({where}), got {shown(parameters)}")
    rope = dict(parameters or {})
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise SpecError(field, f"rope_scaling must be a mapping or null ({where}), got {shown(scaling)}")
    rope.update(scaling or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise SpecError(
            field, f"rope_scaling rope_type {rope_type} is not supported ({where}); only llama3 (Llama 3.1) or none"
        )
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise SpecError(field, f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported ({where})")
    theta = _number(rope if "rope_theta" in rope else raw, "rope_theta", float, where, field, defaults)
    max_positions = _number(raw, "max_position_embeddings", int, where, field, defaults)
    eps = _number(raw, "rms_norm_eps", float, where, field, defaults)
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
    layers, ffn = (
        _number(raw, "num_hidden_layers", int, where, field),
        _number(raw, "intermediate_size", int, where, field),
    )
    return dict(
        layers=layers,
        hidden=hidden,
        ffn=ffn,
        heads=heads,
        kv_heads=kv_heads,
        vocab=_number(raw, "vocab_size", int, where, field),
        rope_theta=theta,
        max_positions=max_positions,
        norm_eps=eps,
        tie_embeddings=_flag(raw, "tie_word_embeddings", where, field),
        kv_channels=kv_channels,
        **family_fields(raw, model_type, layers, ffn, where, field),
        **extra,
    )


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


def read_config_fields(path: str, field: str = "workload.model") -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(field, f"cannot read {path!r}: {e}") from None
    return config_fields(raw, where=path, field=field)
