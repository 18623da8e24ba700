"""The plain Llama's parameter names and layouts <-> Megatron-core GPTModel's, per tensor-parallel rank.

Megatron's names inside one model chunk (global layer i = the TransformerLayer's layer_number - 1, so the
pipeline stages' and virtual chunks' layer offsets come from Megatron itself):

  embedding.word_embeddings.weight                 tok_embeddings.weight      rows split over tp (vocab)
  decoder.layers.j.input_layernorm.weight          layers.i.attention_norm.weight
  decoder.layers.j.self_attention.linear_qkv.*     layers.i.attention.wq/wk/wv.*  fused, interleaved per query
        group: for each of the kv_heads groups, its heads/kv_heads query heads, then its key head, then its value
        head; tp ranks hold consecutive groups
  decoder.layers.j.self_attention.q_layernorm/k_layernorm.weight   layers.i.attention.q_norm/k_norm.weight  whole
  decoder.layers.j.self_attention.linear_proj.*    layers.i.attention.wo.*    weight columns split over tp, bias whole
  decoder.layers.j.pre_mlp_layernorm.weight        layers.i.ffn_norm.weight
  decoder.layers.j.mlp.linear_fc1.weight           layers.i.feed_forward.w1 and w3: each tp rank holds
        [its rows of w1; its rows of w3] (Megatron's gated linear unit chunks the rank's output in two)
  decoder.layers.j.mlp.linear_fc2.weight           layers.i.feed_forward.w2   columns split over tp
  decoder.layers.j.mlp.router.weight               layers.i.feed_forward.router.weight   [E, hidden], whole
  decoder.layers.j.mlp.experts.local_experts.l.linear_fc1/linear_fc2.weight   (a MoE: SequentialMLP's experts)
        layers.i.feed_forward.experts.e.w1 and w3 / w2, laid out as the dense MLP's (expert tensor parallelism
        = tp); local expert l of expert-parallel rank r is global expert e = r * E/ep + l
  decoder.final_layernorm.weight                   norm.weight
  output_layer.weight                              output.weight (tied: tok_embeddings.weight) rows split over tp

No vocabulary padding: GPTModel takes the vocabulary as it is (the spec has checked tp divides it;
padding is Megatron-LM's make_vocab_size_divisible_by, not megatron-core's).
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_PLAIN_IN_LAYER = {
    "input_layernorm.weight": ["attention_norm.weight"],
    "self_attention.linear_qkv.weight": ["attention.wq.weight", "attention.wk.weight", "attention.wv.weight"],
    "self_attention.linear_qkv.bias": ["attention.wq.bias", "attention.wk.bias", "attention.wv.bias"],
    "self_attention.q_layernorm.weight": ["attention.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["attention.k_norm.weight"],
    "self_attention.linear_proj.weight": ["attention.wo.weight"],
    "self_attention.linear_proj.bias": ["attention.wo.bias"],
    "pre_mlp_layernorm.weight": ["ffn_norm.weight"],
    "mlp.linear_fc1.weight": ["feed_forward.w1.weight", "feed_forward.w3.weight"],
    "mlp.linear_fc2.weight": ["feed_forward.w2.weight"],
    "mlp.router.weight": ["feed_forward.router.weight"],
}
_EXPERT_PLAIN = {"linear_fc1.weight": ["w1.weight", "w3.weight"], "linear_fc2.weight": ["w2.weight"]}
_PLAIN_OUTSIDE = {
    "embedding.word_embeddings.weight": "tok_embeddings.weight",
    "decoder.final_layernorm.weight": "norm.weight",
    "output_layer.weight": "output.weight",
}


def plain_names(name: str, layer_number: dict[int, int], tied: bool, first_expert: int = 0) -> list[str]:
    """The plain Llama's names one Megatron parameter holds (layer_number: chunk-local index -> global
    1-based layer_number, as Megatron numbers its TransformerLayers; first_expert: the global index of
    this rank's local expert 0, expert-parallel rank x experts per rank)."""
    m = _LAYER.match(name)
    if m is None:
        plain = _PLAIN_OUTSIDE[name]
        return ["tok_embeddings.weight"] if tied and plain == "output.weight" else [plain]
    i = layer_number[int(m.group(1))] - 1
    expert = _EXPERT.match(m.group(2))
    if expert is not None:
        e = first_expert + int(expert.group(1))
        return [f"layers.{i}.feed_forward.experts.{e}.{p}" for p in _EXPERT_PLAIN[expert.group(2)]]
    return [f"layers.{i}.{p}" for p in _PLAIN_IN_LAYER[m.group(2)]]


def is_expert(name: str) -> bool:
    """Whether Megatron parameter `name` is one of a MoE layer's experts (held by one expert-parallel rank)."""
    m = _LAYER.match(name)
    return m is not None and _EXPERT.match(m.group(2)) is not None


def _qkv_groups(shape, q, k, v):
    """[groups, (heads/groups + 2) * head_dim, ...]: each query group's queries, key, value."""
    g = shape.kv_heads
    return torch.cat(
        [q.reshape(g, -1, *q.shape[1:]), k.reshape(g, -1, *k.shape[1:]), v.reshape(g, -1, *v.shape[1:])], dim=1
    )


def megatron_shard(name: str, plain: list[torch.Tensor], shape, tp: int, rank: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s part of Megatron parameter `name`, from the plain tensors it holds."""
    key = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
    if key.endswith("linear_qkv.weight") or key.endswith("linear_qkv.bias"):
        groups = _qkv_groups(shape, *plain)
        per = shape.kv_heads // tp
        return groups[rank * per : (rank + 1) * per].reshape(-1, *plain[0].shape[1:])
    if key.endswith("linear_fc1.weight"):
        return torch.cat([plain[0].chunk(tp)[rank], plain[1].chunk(tp)[rank]])
    if key.endswith(("linear_fc2.weight", "linear_proj.weight")):
        return plain[0].chunk(tp, dim=1)[rank]
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return plain[0].chunk(tp)[rank]
    return plain[0]  # norms, the projection's bias and the router: whole on every tp rank


def plain_tensors(name: str, shards: list[torch.Tensor], shape) -> list[torch.Tensor]:
    """The plain tensors (in plain_names' order) from every tp rank's part of Megatron parameter `name`."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        hd, per_group = shape.head_dim, shape.heads // shape.kv_heads
        parts = [s.reshape(-1, per_group + 2, hd, *s.shape[1:]) for s in shards]
        q = torch.cat([p[:, :per_group].reshape(-1, *s.shape[1:]) for p, s in zip(parts, shards, strict=True)])
        k = torch.cat([p[:, per_group].reshape(-1, *s.shape[1:]) for p, s in zip(parts, shards, strict=True)])
        v = torch.cat([p[:, per_group + 1].reshape(-1, *s.shape[1:]) for p, s in zip(parts, shards, strict=True)])
        return [q, k, v]
    if name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if name.endswith(("linear_fc2.weight", "linear_proj.weight")):
        return [torch.cat(shards, dim=1)]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [torch.cat(shards)]
    return [shards[0]]
