"""What each LLaMA-family model_type's config.json adds to LLaMA's fields, as transformers' own
config and modeling classes define it (their defaults when a field is missing): Mistral's sliding
window, Qwen2's q/k/v biases, Qwen3's per-head q/k norms and free head width, Mixtral's and
Qwen3-MoE's routed experts. config_json.py reads the fields every family shares; `family_fields`
the rest, each honoured or refused in one line naming the spec field, none silently dropped.

Fields without math in a training forward are ignored: output_router_logits and
router_aux_loss_coef (transformers adds its router loss to the loss it returns only when asked;
the harness's own coefficients are workload.moe_aux_loss_coeff / moe_z_loss_coeff), and, as
transformers itself ignores them, attention_bias of Mistral and Mixtral (their projections have
no biases) and of Qwen2 (q/k/v always biased, o never)."""

from __future__ import annotations

from harness.errors import SpecError, shown

# transformers 5's defaults per model_type where they differ from LlamaConfig's (config_json._HF_DEFAULTS)
FAMILY_DEFAULTS = {
    "llama": {},
    "mistral": {"max_position_embeddings": 131072},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
    "mixtral": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "qwen3_moe": {"max_position_embeddings": 32768},
}
TOO_LARGE = 1e15  # json reads integers of any length (float() of one overflows): no model's size is this large
_SLIDING_DEFAULT = 4096  # MistralConfig's, and Qwen's when use_sliding_window is set without it


def _positive(raw: dict, key: str, default, where: str, field: str) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(field, f"{key} must be a positive integer, got {shown(value)} ({where})")
    if value >= TOO_LARGE:
        raise SpecError(field, f"{key} must be below {TOO_LARGE:.0e}, got {shown(value)} ({where})")
    return value


def _bool(raw: dict, key: str, default: bool, where: str, field: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(field, f"{key} must be true or false, got {value!r} ({where})")
    return value


def _window(raw: dict, default, where: str, field: str) -> int:
    """sliding_window as a Shape's (0: none); null means none, as in transformers."""
    if raw.get("sliding_window", default) is None:
        return 0
    return _positive(raw, "sliding_window", default, where, field)


def _qwen_window(raw: dict, model_type: str, layers: int, where: str, field: str) -> int:
    """Qwen2/Qwen3: the window is in effect only with use_sliding_window, on the layers layer_types
    names sliding_attention (by default those from max_window_layers on); Qwen3-MoE: on every layer."""
    use = _bool(raw, "use_sliding_window", False, where, field)
    types = raw.get("layer_types")
    if model_type == "qwen3_moe":
        sliding = use
    elif types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise SpecError(field, f"layer_types must list one type per layer ({layers}) ({where})")
        sliding = "sliding_attention" in types
        if sliding and not use:
            raise SpecError(
                field, f"layer_types names sliding_attention but use_sliding_window is false ({where}): no window given"
            )
    else:
        sliding = use and _positive(raw, "max_window_layers", 28, where, field) < layers
    return _window(raw, _SLIDING_DEFAULT, where, field) if sliding else 0


def _expert_count(raw: dict, default: int, where: str, field: str) -> int:
    """num_local_experts or num_experts: transformers 5 maps either onto the other (attribute_map) and
    writes num_local_experts back for both Mixtral and Qwen3-MoE."""
    given = {k: raw[k] for k in ("num_local_experts", "num_experts") if raw.get(k) is not None}
    if len(set(map(str, given.values()))) > 1:
        raise SpecError(field, f"num_local_experts and num_experts differ: {given} ({where})")
    key = next(iter(given), "num_experts")
    return _positive(raw, key, default, where, field)


def _experts(raw: dict, model_type: str, ffn: int, where: str, field: str) -> dict:
    if model_type == "mixtral":
        jitter = raw.get("router_jitter_noise") or 0.0
        if jitter != 0:
            raise SpecError(
                field,
                f"router_jitter_noise {jitter} is not supported ({where}): the harness routes "
                "deterministically, as every engine must reproduce the reference",
            )
        return dict(
            experts=_expert_count(raw, 8, where, field),
            experts_per_token=_positive(raw, "num_experts_per_tok", 2, where, field),
            moe_ffn=ffn,  # Mixtral's intermediate_size is its experts' width
            norm_topk=True,
        )
    step = raw.get("decoder_sparse_step", 1)
    if step != 1:
        raise SpecError(
            field, f"decoder_sparse_step {step} is not supported ({where}): only every layer a mixture of experts"
        )
    if raw.get("mlp_only_layers"):
        raise SpecError(
            field,
            f"mlp_only_layers {raw['mlp_only_layers']} is not supported ({where}): only every layer a mixture "
            "of experts",
        )
    return dict(
        experts=_expert_count(raw, 128, where, field),
        experts_per_token=_positive(raw, "num_experts_per_tok", 8, where, field),
        moe_ffn=_positive(raw, "moe_intermediate_size", 768, where, field),
        norm_topk=_bool(raw, "norm_topk_prob", False, where, field),
    )


def family_fields(raw: dict, model_type: str, layers: int, ffn: int, where: str, field: str) -> dict:
    """The Shape fields `model_type` decides beyond LLaMA's: attention_bias, qkv_bias, qk_norm,
    sliding_window and the experts (ffn: the config's intermediate_size)."""
    out = dict(attention_bias=False, qkv_bias=False, qk_norm=False, sliding_window=0)
    if model_type in ("llama", "qwen3", "qwen3_moe"):
        out["attention_bias"] = _bool(raw, "attention_bias", False, where, field)
    if model_type == "qwen2":
        out["qkv_bias"] = True  # Qwen2Attention: q/k/v biased, o not, whatever attention_bias says
    if model_type in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = True
    if model_type == "mistral":
        out["sliding_window"] = _window(raw, _SLIDING_DEFAULT, where, field)
    elif model_type == "mixtral":
        out["sliding_window"] = _window(raw, None, where, field)
    elif model_type.startswith("qwen"):
        out["sliding_window"] = _qwen_window(raw, model_type, layers, where, field)
    if model_type in ("mixtral", "qwen3_moe"):
        out.update(_experts(raw, model_type, ffn, where, field))
    return out
