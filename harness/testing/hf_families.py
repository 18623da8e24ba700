"""transformers' own model of a LLaMA-family config.json (LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM) holding the plain
model's weights: the yardstick the config.json import is checked against.

Names map as hf_llama.py's do for the dense parts; beyond them:
  layers.N.attention.q_norm|k_norm           model.layers.N.self_attn.q_norm|k_norm
  layers.N.feed_forward.router.weight        model.layers.N.mlp.gate.weight
  layers.N.feed_forward.experts.E.w1|w3      model.layers.N.mlp.experts.gate_up_proj[E] (gate rows, then up)
  layers.N.feed_forward.experts.E.w2         model.layers.N.mlp.experts.down_proj[E]
(transformers 5 keeps a layer's experts as two fused 3-D tensors)."""

from __future__ import annotations

import importlib

import torch

from harness.frameworks.deepspeed.hf_llama import to_hf_name

CLASSES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mixtral": "Mixtral",
    "qwen3_moe": "Qwen3Moe",
}


def hf_config(raw: dict):
    """transformers' config object of this config.json, eager attention and experts (the exact loops)."""
    transformers = importlib.import_module("transformers")
    model_type = raw.get("model_type", "llama")
    cls = getattr(transformers, CLASSES[model_type] + "Config")
    cfg = cls(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "eager"
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "eager"
    return cfg


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The plain model's state dict under transformers' names, experts fused per layer."""
    out, experts = {}, {}
    for name, tensor in state.items():
        if ".feed_forward.experts." in name:
            _, layer, _, _, e, which, _ = name.split(".")
            experts.setdefault(int(layer), {}).setdefault(int(e), {})[which] = tensor
        elif name.endswith("feed_forward.router.weight"):
            out[f"model.layers.{name.split('.')[1]}.mlp.gate.weight"] = tensor
        elif ".attention.q_norm." in name or ".attention.k_norm." in name:
            _, layer, _, norm, leaf = name.split(".")
            out[f"model.layers.{layer}.self_attn.{norm}.{leaf}"] = tensor
        else:
            out[to_hf_name(name)] = tensor
    for layer, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        prefix = f"model.layers.{layer}.mlp.experts."
        out[prefix + "gate_up_proj"] = torch.stack([torch.cat([w["w1"], w["w3"]]) for w in order])
        out[prefix + "down_proj"] = torch.stack([w["w2"] for w in order])
    return out


def hf_model(raw: dict, state: dict[str, torch.Tensor]):
    """transformers' ForCausalLM of `raw` with `state` (the plain model's names) loaded, in eval mode;
    every one of its parameters is loaded (only the rotary buffers are its own)."""
    transformers = importlib.import_module("transformers")
    cfg = hf_config(raw)
    cls = getattr(transformers, CLASSES[raw.get("model_type", "llama")] + "ForCausalLM")
    model = cls(cfg).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(state), strict=False)
    if unexpected or any("rotary" not in m for m in missing):
        raise AssertionError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return model
