"""The planner's Megatron memory beside Megatron-LM's own theoretical estimate.

Megatron-LM prints a theoretical memory footprint (megatron/training/theoretical_memory_usage.py,
read at NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 of 2026-08-22). `megatron_estimate`
below re-derives its formula from that file's text, in this project's terms (no code copied):

  model states  the most loaded pipeline rank (the first: its 1/pp of the layers and the embedding,
                and the output layer too when untied at pp 1) at 18 bytes a parameter, or with the
                distributed optimizer 6 + 12 / d (bf16 weight and fp32 main gradient on every rank,
                fp32 master and Adam's two moments sharded over d); d is the data-parallel size for
                the dense parameters (Megatron's dp, without cp) and world / (etp x ep x pp) for the
                experts, which are split over etp x ep. Attention 2 h^2 (1 + groups / heads) x
                (query width / h), SwiGLU 3 h F, norms 2 h a layer, routed experts 3 h f E, the router h E.
  activations   with sequence parallelism and selective recomputation: per layer s b h (18 + 4 F / h),
                all layers' worth (the first rank holds pp micro-batches of its 1/pp), times
                1 + (pp - 1) / (pp vp) when interleaved or min(1, m / pp) when not; the embedding's
                input (8 s b pp) and output (s b h pp); at pp 1 the output layer's input and fp32
                logits 4 s b h (1 + V / h); all of it over tp. Otherwise (no recomputation or no SP):
                per layer s b h (10 + 24 / tp), the same embedding terms and schedule factors, at pp 1
                the bf16 logits 2 s b (V / tp + h), times 1.05, not divided by tp.

The estimator knows what the planner calls the model states and the activations held; the planner
adds terms the estimator has not, each printed by name: the working set of the layer running
backward, the loss's peak, Transformer Engine's fp8 copies and the overhead (CUDA context, NCCL,
fragmentation: memory_terms). Its per-layer formula is Korthikanti et al.'s (arXiv 2205.05198,
Table 2) for a GPT layer (a 4h two-matrix MLP, h-wide q, k, v: its own TODO), where the planner
counts each saved tensor of the layer that runs (SwiGLU, grouped-query k and v, flash's log-sum-exp;
memory_engines.py); the activations' difference is printed term by term (activation_terms): the layers
in flight, a layer's norms, attention and feed-forward, the embedding and LM head.

    python benchmarks/megatron_memory.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.model.presets import PRESETS, Shape  # noqa: E402
from harness.planner import memory_terms as terms  # noqa: E402
from harness.planner.layout import PlannerLayout, Workload  # noqa: E402
from harness.planner.memory import GIB, worst_stage_memory  # noqa: E402
from harness.planner.memory_engines import _attention_bytes, _norm_bytes, engine_layer_bytes, engine_stage_items  # noqa: E402


def megatron_estimate(shape: Shape, lay: PlannerLayout, wl: Workload) -> dict[str, float]:
    """Megatron-LM's theoretical memory (module docstring), in bytes: 'states' and 'activations'."""
    h, L, V, F = shape.hidden, shape.layers, shape.vocab, shape.ffn
    t, pp, vp = lay.tp, lay.pp, lay.virtual_stages if lay.pp > 1 and lay.pipeline_schedule == "interleaved" else 0
    q = shape.heads * shape.head_dim
    attention = 2 * h * h * (1 + shape.kv_heads / shape.heads) * (q / h)
    moe = shape.moe
    mlp = 0 if moe else 3 * h * F
    experts = 3 * h * shape.moe_ffn * shape.experts if moe else 0
    router = h * shape.experts if moe else 0
    emb = h * V
    tp_sharded = (L * (attention + mlp) / pp + emb) / t
    if not shape.tie_embeddings and pp == 1:
        tp_sharded += emb / t
    replicated = L * (2 * h + router) / pp + h
    # Megatron's expert_tensor_parallel_size is the layout's tp, or 1 under parallel folding (layout.expert_tp),
    # where its expert-parallel group is the planner's ep x tp
    etp, ep = (1, lay.ep * lay.tp) if lay.expert_tp == 1 else (lay.tp, lay.ep)
    expert_sharded = L * experts / pp / (etp * ep)
    dp = lay.dp  # Megatron's data-parallel size, without cp
    edp = lay.gpus // (etp * ep * pp)
    states = (tp_sharded + replicated) * (6 + 12 / dp) + expert_sharded * (6 + 12 / edp)
    s, b = wl.seq_len, lay.micro_batch_size
    m = wl.micro_batches(lay)
    sbh = s * b * h
    sp_branch = lay.sequence_parallel and lay.activation_checkpointing == "selective"
    # per layer and micro-batch on a rank, and (SP branch) its parts: norms' inputs 4, attention 11 (Q, K, V
    # and their input, the output projection's input, a dropout mask), MLP 3 + 4 F / h (Korthikanti's Table 2)
    layer = sbh * (18 + 4 * F / h) / t if sp_branch else sbh * (10 + 24 / t) * 1.05
    parts = {"norms": 4 * sbh / t, "attention": 11 * sbh / t, "mlp": (3 + 4 * F / h) * sbh / t} if sp_branch else {}
    factor = 1.0
    if vp:
        factor = 1 + (pp - 1) / (pp * vp)
    elif pp > 1:
        factor = min(1, m / pp)
    rest = (8 * s * b * pp + sbh * pp) * factor
    if sp_branch:
        rest = (rest + (sbh * 4 * (1 + V / h) if pp == 1 else 0.0)) / t
    else:
        rest = (rest + ((s * b * V / t + sbh) * 2 if pp == 1 else 0.0)) * 1.05
    layers_in_flight = L * factor
    act = layers_in_flight * layer + rest
    return {
        "states": states,
        "activations": act,
        "layer": layer,
        "layer_parts": parts,
        "layers_in_flight": layers_in_flight,
        "embedding_and_head": rest,
    }


# Layouts Megatron's estimator models (bf16, distributed optimizer, fp32 main gradients), dense and MoE.
SEL = "selective"
LAYOUTS = [
    ("llama3-8b", dict(tp=1, pp=1, dp=8, micro_batch_size=1), Workload(8192, 128)),
    ("llama3-8b", dict(tp=2, pp=1, dp=4, micro_batch_size=1, activation_checkpointing=SEL), Workload(8192, 64)),
    (
        "llama3-70b",
        dict(tp=4, pp=8, dp=2, micro_batch_size=1, pipeline_schedule="interleaved", virtual_stages=5),
        Workload(8192, 128),
    ),
    ("llama3-70b", dict(tp=8, pp=4, dp=2, micro_batch_size=1, activation_checkpointing=SEL), Workload(4096, 64)),
    ("llama2-7b", dict(tp=2, pp=2, dp=2, micro_batch_size=2, activation_checkpointing=SEL), Workload(4096, 64)),
    ("qwen3-30b-a3b", dict(tp=2, pp=1, dp=8, micro_batch_size=1, ep=8), Workload(4096, 128)),
    (
        "qwen3-30b-a3b",
        dict(tp=4, pp=2, dp=4, micro_batch_size=1, ep=4, activation_checkpointing=SEL),
        Workload(4096, 64),
    ),
    ("qwen3-30b-a3b", dict(tp=2, pp=1, dp=8, micro_batch_size=1, ep=4, expert_tp=1), Workload(4096, 128)),
]


def layout(fields: dict) -> PlannerLayout:
    base = dict(
        engine="megatron", attention="flash2", rmsnorm="fused", zero_stage=1, sequence_parallel=fields["tp"] > 1
    )
    return PlannerLayout(**{**base, **fields})


def activation_terms(shape: Shape, lay: PlannerLayout, wl: Workload, stage: int, parts: dict, est: dict) -> dict:
    """The activations' difference, term by term, summing to it: the layers in flight (the planner's
    schedule, memory_terms.in_flight, against the estimator's all-layers-times-factor), the bytes a layer
    keeps (under SP and selective recomputation: its norms, its attention, its feed-forward, the planner's
    memory_engines terms against Korthikanti's; otherwise the estimator's no-SP branch, 10 + 24 / tp of
    s b h a layer and a 5% margin, against the planner's layer), and the embedding and LM head."""
    layers = engine_stage_items(shape, lay, wl.seq_len)[stage][1]
    k = terms.in_flight(lay, stage, wl.micro_batches(lay))
    mine = engine_layer_bytes(shape, lay, wl)["layer"]
    held = k * layers * mine
    out = {"layers in flight": (k * layers - est["layers_in_flight"]) * est["layer"]}
    if est["layer_parts"]:
        loc = wl.local(lay)
        n, sp = lay.micro_batch_size * loc.seq_len, lay.sequence_parallel and lay.tp > 1
        norms = 2 * _norm_bytes(lay, n, shape.hidden, loc.dtype_bytes, sp)
        attention = _attention_bytes(shape, lay, loc, lay.micro_batch_size)
        planner = {"norms": norms, "attention": attention, "mlp": mine - norms - attention}
        for name, v in est["layer_parts"].items():
            out[f"layer {name}"] = k * layers * (planner[name] - v)
    else:
        out["layer (no-SP branch)"] = k * layers * (mine - est["layer"])
    out["embedding and LM head"] = parts["activations"] - held - est["embedding_and_head"]
    return out


def compare(model: str, fields: dict, wl: Workload) -> dict:
    """The planner's worst Megatron stage beside Megatron's estimate, with the terms only the planner has."""
    shape, lay = PRESETS[model], layout(fields)
    stage, parts = worst_stage_memory(shape, lay, wl)
    est = megatron_estimate(shape, lay, wl)
    states = parts["weights"] + parts["gradients"] + parts["optimizer"]
    named = {
        "backward working set": parts["backward_working_set"],
        "loss peak": parts["logits_and_loss"],
        "fp8 copies": parts.get("fp8_weights_and_scales", 0.0),
        "overhead": parts["overhead"],
        **activation_terms(shape, lay, wl, stage, parts, est),
    }
    return {
        "model": model,
        "layout": lay,
        "planner_states": states,
        "megatron_states": est["states"],
        "planner_activations": parts["activations"],
        "megatron_activations": est["activations"],
        "planner_total": parts["total"],
        "megatron_total": est["states"] + est["activations"],
        "named": named,
    }


def main() -> None:
    print(f"{'layout':58} {'states GiB':>17} {'activations GiB':>17} {'total GiB':>15}  named differences (GiB)")
    for model, fields, wl in LAYOUTS:
        c = compare(model, fields, wl)
        lay = c["layout"]
        name = (
            f"{model} tp{lay.tp} pp{lay.pp} vp{lay.virtual_stages} dp{lay.dp} ep{lay.ep} mb{lay.micro_batch_size} "
            f"s{wl.seq_len} {lay.activation_checkpointing}{' etp1' if lay.expert_tp == 1 else ''}"
        )
        st = f"{c['planner_states'] / GIB:7.1f} {c['megatron_states'] / GIB:7.1f}"
        ac = f"{c['planner_activations'] / GIB:7.1f} {c['megatron_activations'] / GIB:7.1f}"
        tot = f"{c['planner_total'] / GIB:6.1f} {c['megatron_total'] / GIB:6.1f}"
        terms = ", ".join(f"{k} {v / GIB:+.1f}" for k, v in c["named"].items() if abs(v) >= 0.05 * GIB)
        print(f"{name:58} {st:>17} {ac:>17} {tot:>15}  {terms}")
        residual = c["planner_total"] - sum(c["named"].values()) - c["megatron_total"]
        assert math.isclose(residual, c["planner_states"] - c["megatron_states"], abs_tol=1.0)
    print("columns: planner | Megatron-LM's theoretical_memory_usage.py; the named differences sum to the totals'")


if __name__ == "__main__":
    main()
