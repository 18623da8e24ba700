"""The memory terms every engine's model shares: bytes per GiB, the parameters a stage holds,
the micro-batches a stage keeps in flight, and the two calibrated overheads outside PyTorch's
tensors (CONTEXT_GIB, FRAGMENTATION; see their comments).

One definition for the study's engine (memory_paper), the harness's engines (memory_engines) and
`harness memory`'s untraced terms (harness/memtrace/terms.py), so that none of them drifts from
the others; memory.py re-exports them.
"""

from __future__ import annotations

from harness.model.presets import Shape
from harness.planner import feedforward, schedules
from harness.planner.layout import PlannerLayout

GIB = 1024**3

# Calibrated (grid search over the two, globally, on the OOM outcomes of the four published
# sweeps in baselines/paper_sweeps; leave-one-sweep-out figures in tests/test_planner_paper.py):
# memory outside PyTorch's tensors: CUDA context with cuBLAS/cuDNN workspaces and NCCL's buffers
# for the tensor-, pipeline- and data-parallel communicators. The CUDA context of an A100 is
# ~0.5-0.8 GiB and NCCL's ring/tree buffers with several communicators ~0.5-1 GiB.
CONTEXT_GIB = 1.0
# The caching allocator's fragmentation, as a fraction of the dynamic (activation, logit)
# memory. Without a pipeline, a micro-batch's activations are freed in the reverse order of
# their allocation (LIFO) and the allocator reuses its blocks cleanly; under 1F1B the stage
# frees micro-batch i's tensors while micro-batch i+p's are being allocated, interleaving
# lifetimes, and cached blocks split (reserved/allocated of 1.05-1.3 in PyTorch memory-snapshot
# studies of pipelined training).
# (The harness's engines add, beside these fractions, the free blocks the allocator's rules leave stranded at a
# stage's peak that the planner can name from its own terms: memory_reserve.py.)
FRAGMENTATION = 0.05
FRAGMENTATION_PIPELINED = 0.20


def stage_params(shape: Shape, has_emb: bool, layers: int, has_head: bool, tp: int, ep: int = 1) -> float:
    """Parameters held per GPU of a stage: matrices split over tp (vocab-parallel embedding/head;
    a tied head on the embedding's stage is the same tensor, counted once; attention biases: q/k/v's
    split over tp, o's replicated; q/k norms replicated); a MoE layer's experts E / ep per rank, split
    over tp, and its router replicated (feedforward.py)."""
    head_dim = shape.head_dim
    attn = shape.hidden * shape.heads * head_dim * 2 + 2 * shape.hidden * shape.kv_heads * head_dim
    ffn = feedforward.of(shape)
    per_layer = (attn + ffn.tp_params()) / tp + 2 * shape.hidden + ffn.replicated_params()
    if shape.has_qkv_bias:
        per_layer += (shape.heads + 2 * shape.kv_heads) * head_dim / tp
    per_layer += shape.hidden * shape.attention_bias + 2 * head_dim * shape.qk_norm  # o bias, q/k norms: replicated
    vocab = shape.vocab * shape.hidden / tp
    head = 0 if shape.tie_embeddings and has_emb else vocab
    experts = ffn.expert_params(layers, tp, ep)
    return layers * per_layer + experts + (vocab if has_emb else 0) + ((head + shape.hidden) if has_head else 0)


def in_flight(lay: PlannerLayout, stage: int, m: int) -> float:
    """Micro-batches (in units of the stage's layers) whose activations a stage holds at peak
    (the schedule's: harness/planner/schedules.py)."""
    extra = int(lay.moe_a2a_overlap)  # Megatron's one more warm-up micro-batch (PlannerLayout.moe_a2a_overlap)
    return schedules.in_flight(lay.pipeline_schedule, lay.virtual_stages, lay.pp, stage, m, extra)


def muon_matrix_params(shape: Shape, layers: int, tp: int, ep: int = 1) -> tuple[float, float]:
    """(dense, expert) parameters per GPU of a stage's `layers` blocks that Muon updates
    (harness.model.muon.muon_matrix: a block's 2-D weights): the attention's projections and the MLP's
    matrices split over tp, a MoE's router replicated; and its experts' matrices (E / ep per rank, over tp),
    sharded over the expert-data-parallel group. Norms and biases, the embedding and the head: AdamW's."""
    head_dim = shape.head_dim
    attn = shape.hidden * shape.heads * head_dim * 2 + 2 * shape.hidden * shape.kv_heads * head_dim
    ffn = feedforward.of(shape)
    return layers * ((attn + ffn.tp_params()) / tp + ffn.replicated_params()), ffn.expert_params(layers, tp, ep)


def muon_saving(shape: Shape, lay: PlannerLayout, layers: int, shard: float, expert_shard: float) -> float:
    """fp32 bytes workload.optimizer.name muon saves on a stage against AdamW: one momentum per Muon element
    (harness.model.muon.MuonWithAdamW) where AdamW keeps two moments, divided as the engine shards its
    optimizer states (`shard`: over the replicas under ZeRO-1 or FSDP2, else 1; `expert_shard`: the experts')."""
    dense, experts = muon_matrix_params(shape, layers, lay.tp, lay.ep)
    return 4 * (dense / shard + experts / expert_shard)
