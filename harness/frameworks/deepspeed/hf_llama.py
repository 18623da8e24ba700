"""transformers' LlamaForCausalLM with the harness's reference weights (model_impl: hf).

Many DeepSpeed users train the Hugging Face model rather than a hand-written one; this lets
the comparison measure that path with exactly the same initial weights. Names map one to one:

  tok_embeddings.weight              model.embed_tokens.weight
  layers.N.attention.wq|wk|wv|wo     model.layers.N.self_attn.q_proj|k_proj|v_proj|o_proj
  layers.N.feed_forward.w1|w3|w2     model.layers.N.mlp.gate_proj|up_proj|down_proj
  layers.N.attention_norm            model.layers.N.input_layernorm
  layers.N.ffn_norm                  model.layers.N.post_attention_layernorm
  norm.weight                        model.norm.weight
  output.weight                      lm_head.weight
"""

from __future__ import annotations

import torch

from harness.model.llama import reference_state_dict, tie_embeddings
from harness.model.presets import Shape, shape_to_config

_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTN_IMPL = {"naive": "eager", "sdpa": "sdpa"}


def to_hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, idx, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"model.layers.{idx}.{_LAYER[module]}.{leaf}"


def from_hf_name(name: str) -> str:
    for k, v in _TOP.items():
        if v == name:
            return k
    rest = name[len("model.layers.") :]
    idx, rest = rest.split(".", 1)
    module, leaf = rest.rsplit(".", 1)
    inverse = {v: k for k, v in _LAYER.items()}
    return f"layers.{idx}.{inverse[module]}.{leaf}"


class HFLlama(torch.nn.Module):
    """Wraps LlamaForCausalLM so that forward(tokens) -> logits, like the plain Llama."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, tokens):
        return self.hf(input_ids=tokens, use_cache=False).logits


def build_hf_llama(shape: Shape, seed: int, attention: str, device="cpu") -> HFLlama:
    from harness.errors import SpecError

    if attention not in _ATTN_IMPL:
        raise SpecError("layout.attention", f"model_impl hf runs attention naive (eager) or sdpa, not {attention!r}")
    from transformers import LlamaForCausalLM

    cfg = shape_to_config(shape)
    cfg._attn_implementation = _ATTN_IMPL[attention]
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    hf = hf.to_empty(device=device)
    tie_embeddings(shape, hf.model.embed_tokens, hf.lm_head)  # to_empty made lm_head a Parameter of its own
    ref = reference_state_dict(shape, seed)
    state = {to_hf_name(k): v for k, v in ref.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m and not (shape.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mapping incomplete: missing {missing}, unexpected {unexpected}")
    # non-persistent buffers (rotary inv_freq) were left uninitialised by to_empty: rebuild them
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(cfg).to(device)
    return HFLlama(hf)
