"""A model described by its dimensions (a launch script's flags, a recipe's flavor) matched to the harness's
preset of that shape (harness/model/presets.py), the fields it sets apart from the preset as
model_overrides. Nothing here imports torch."""

from __future__ import annotations

from harness.model.presets import PRESETS, Shape

# What makes two models the same network (their weights' shapes); the rest (rope, norm epsilon,
# tying, biases) is written as overrides of the preset.
CORE = ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "experts", "experts_per_token", "moe_ffn", "vocab")
SECONDARY = (
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "attention_bias",
    "qkv_bias",
    "qk_norm",
    "rope_factor",
    "norm_topk",
)


def _value(shape: Shape, key: str):
    return shape.head_dim if key == "head_dim" else getattr(shape, key)


def match_model(given: dict) -> tuple[str, dict]:
    """(preset, model_overrides): the preset whose core dimensions are the given ones (vocab only when
    given), the fewest overrides first; else tiny with every given field as an override. `given` holds
    Shape's fields, head_dim for the head width."""
    core = {k: v for k, v in given.items() if k in CORE}
    best = None
    for name, preset in PRESETS.items():
        if name.startswith("paper-") or any(_value(preset, k) != v for k, v in core.items()):
            continue
        overrides = {k: v for k, v in given.items() if k in SECONDARY and getattr(preset, k) != v}
        if best is None or len(overrides) < len(best[1]):
            best = (name, overrides)
    if best is not None:
        return best
    tiny = PRESETS["tiny"]
    overrides = {k: v for k, v in given.items() if k != "head_dim" and (k in CORE or getattr(tiny, k) != v)}
    if given.get("head_dim") and given["head_dim"] != given["hidden"] // given["heads"]:
        overrides["kv_channels"] = given["head_dim"]
    return "tiny", overrides
