"""The chosen layout as a torchtitan recipe, for torchtitan TORCHTITAN (the release on PyPI).

torchtitan dropped its TOML job configs in February 2026: a run is now a Python function returning
a complete `Trainer.Config` (torchtitan/config/README.md, "Configuration"), selected with
`--module` and `--config`. The recipe written here starts from torchtitan's own llama3 recipe of
the model's flavor (torchtitan/models/llama3/config_registry.py) and sets, by assignment, the
fields of torchtitan/config/configs.py (TrainingConfig, ParallelismConfig), the optimizer
(default_adamw), a constant learning rate (LRSchedulersContainer.Config) and the activation
checkpointing policy (FullAC / SelectiveAC / None) as that release has them. torchtitan's main
branch (TORCHTITAN_MAIN) has renamed the batch fields to token budgets (MAIN_FIELDS);
harness/interop/torchtitan_in.py reads both. Nothing here imports torch.
"""

from __future__ import annotations

import json

from harness.interop import exact
from harness.interop.optimizer import optimizer_and_clip
from harness.model.presets import PRESETS, Shape
from harness.planner.layout import PlannerLayout, Workload
from harness.spec import Optimizer

TORCHTITAN = "0.3.0"  # torchtitan on PyPI, 2026-09-03
VERSION = f"torchtitan {TORCHTITAN} (Trainer.Config recipe)"
# the cp implementations it runs: context parallelism with flex attention, which all-gathers K/V
# (varlen attention has no cp: "Variable-length attention CP is not yet supported")
CP_COMM = {"allgather": "allgather"}
TORCHTITAN_MAIN = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"  # pytorch/torchtitan main, 2026-08-21
# main's names for what the release calls training.local_batch_size, global_batch_size, seq_len and
# parallelism.pipeline_parallel_microbatch_size (in tokens per micro-batch / step, pipeline micro-batches)
MAIN_FIELDS = (
    "training.num_tokens_per_microbatch_per_dp_rank",
    "training.num_tokens_per_train_step",
    "training.max_context_length",
    "parallelism.num_pp_microbatches",
)
# torchtitan's llama3 flavors (torchtitan/models/llama3/__init__.py): layers, dim, ffn hidden
# (compute_ffn_hidden_dim), heads, kv heads, vocabulary.
FLAVORS = {
    "8B": (32, 4096, 14336, 32, 8, 128256),
    "70B": (80, 8192, 28672, 64, 8, 128256),
    "405B": (126, 16384, 53248, 128, 8, 128256),
}
RECIPES = {"8B": "llama3_8b", "70B": "llama3_70b", "405B": "llama3_405b"}
# torchtitan's qwen3 MoE flavors (torchtitan/models/qwen3/__init__.py) by the harness's preset, and the
# recipe each starts from (config_registry has qwen3_30b_a3b only: the 235B flavor starts from it too)
QWEN3_MOE = {"qwen3-30b-a3b": "30B-A3B", "qwen3-235b-a22b": "235B-A22B"}
QWEN3_RECIPE = "qwen3_30b_a3b"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}
# torchtitan's language-model attention backends (models/common/config_utils.get_attention_config):
# varlen is FlashAttention's varlen kernel, flex is FlexAttention (tiled, memory-efficient).
ATTENTION = {
    "flash1": "varlen",
    "flash2": "varlen",
    "sdpa": "varlen",
    "sdpa_flash": "varlen",
    "sdpa_cudnn": "varlen",
    "sdpa_efficient": "flex",
}
# With cp: FlexAttention, on its flash backend (Hopper, Blackwell) for the flash-class kernels
CP_ATTENTION = {**dict.fromkeys(ATTENTION, "flex_flash"), "sdpa_efficient": "flex"}
AC = {"full": "FullAC.Config()", "selective": "SelectiveAC.Config()", "none": "None"}
FUNCTION = "harness_plan"
MXFP8 = "mxfp8"  # the workload's fp8_recipe that torchtitan's MX converters run
GW_HP = "rowwise_with_gw_hp"  # the other fp8_recipe its Float8LinearConverter takes by name
# MXFP8LinearConverter's fqns: an include list (substring match; empty converts every Linear, the LM head
# included), as torchtitan's deepseek_v3_debugmodel_mxfp8 writes it: the blocks' attention and dense
# feed-forward linears, so that the LM head and a MoE's router gate stay in high precision as the harness keeps them
MX_FQNS = ("attention", "feed_forward")


def torchtitan_flavor(shape: Shape) -> str | None:
    """The llama3 flavor with this shape (a qwen3 MoE flavor for a qwen3 MoE preset), or None."""
    if shape.moe:
        return next((QWEN3_MOE[n] for n, p in PRESETS.items() if n in QWEN3_MOE and p == shape), None)
    key = (shape.layers, shape.hidden, shape.ffn, shape.heads, shape.kv_heads, shape.vocab)
    return next((name for name, dims in FLAVORS.items() if dims == key), None)


def layers_per_stage(layers: int, lay: PlannerLayout) -> int | None:
    """pipeline_parallel_layers_per_stage for the layout's virtual stages, with the first and last stage's
    extra layers set to 0: torchtitan makes ceil(layers / per_stage) stages, which must be pp x vp."""
    per_stage = -(-layers // (lay.pp * lay.virtual_stages))
    return per_stage if -(-layers // per_stage) == lay.pp * lay.virtual_stages else None


def torchtitan_refuses(shape: Shape | None, lay: PlannerLayout) -> str:
    """Why torchtitan at TORCHTITAN cannot run the layout ("" if it can)."""
    if shape is not None and shape.moe and torchtitan_flavor(shape) is None:
        return f"torchtitan's MoE recipes here are qwen3's ({', '.join(QWEN3_MOE.values())}): no flavor of this shape"
    if shape is not None and shape.moe and lay.tp > 1:
        return (
            "this export writes qwen3 MoE with expert_parallel_degree at tp 1 (expert tensor parallelism not written)"
        )
    if lay.cp > 1 and lay.attention not in CP_ATTENTION:
        return f"torchtitan's cp runs in FlexAttention, not {lay.attention}"
    if lay.tp > 1 and not lay.sequence_parallel:
        return "torchtitan's tensor parallelism always shards the sequence (sequence parallel)"
    if lay.rmsnorm == "fused" and lay.compile != "blocks":
        return "torchtitan's RMSNorm is torch's (nn.RMSNorm), fused only when compiled: rmsnorm torch or compile blocks"
    if lay.attention not in ATTENTION:
        return f"torchtitan's llama3 runs varlen (FlashAttention) or flex attention, not {lay.attention}"
    if lay.pp > 1 and lay.pipeline_schedule not in SCHEDULES:
        return f"torchtitan has no {lay.pipeline_schedule} pipeline schedule here"
    if lay.pp > 1 and lay.pipeline_schedule == "interleaved" and lay.virtual_stages < 2:
        return "torchtitan's Interleaved1F1B needs at least 2 stages per rank"
    interleaved = lay.pp > 1 and lay.pipeline_schedule == "interleaved"
    if shape is not None and interleaved and layers_per_stage(shape.layers, lay) is None:
        return f"torchtitan cannot cut {shape.layers} layers into {lay.pp} x {lay.virtual_stages} stages"
    if shape is not None and torchtitan_flavor(shape) is None:
        return f"torchtitan's llama3 has no flavor of this shape (it has {', '.join(FLAVORS)})"
    return ""


def _converter_names(shape: Shape, mx: bool) -> list[str]:
    kind = "MXFP8" if mx else "Float8"
    return [f"{kind}GroupedExpertsConverter", f"{kind}LinearConverter"] if shape.moe else [f"{kind}LinearConverter"]


def fp8_converters(shape: Shape, mx: bool, compiled: bool, recipe: str = "rowwise") -> list[str]:
    """model_registry's converters for the workload's FP8. Float8 rowwise with lm_head filtered out (torchtitan's
    converter otherwise converts every linear whose sizes are multiples of 16, the head included) and a MoE's
    router gate (the harness routes in fp32), its experts through Float8GroupedExpertsConverter (torchao's
    rowwise grouped GEMM; the harness runs each expert's tokens through a rowwise Float8Linear); mxfp8: the MX
    linear converter on MX_FQNS (its MXFP8Linear is torchao's, whose defaults are the harness's recipe: RCEIL
    scales, the weight gradient in MXFP8 too) and, with experts, the grouped-GEMM converter (its mxfp8_rceil,
    pad_multiple 32: the harness's per-expert padding, harness/model/mxfp8.py). model_compile_enabled only
    silences torchtitan's warning that MXFP8 is slow eager. `recipe`: Float8's recipe_name (rowwise, or
    rowwise_with_gw_hp, which its converter takes too)."""
    if not mx and not shape.moe:
        return [f'Float8LinearConverter.Config(recipe_name="{recipe}", filter_fqns=["lm_head"])']
    if not mx:
        return [
            f'Float8LinearConverter.Config(recipe_name="{recipe}", filter_fqns=["lm_head", "router.gate"])',
            f"Float8GroupedExpertsConverter.Config(model_compile_enabled={compiled})",
        ]
    out = [f"MXFP8LinearConverter.Config(fqns={json.dumps(list(MX_FQNS))}, model_compile_enabled={compiled})"]
    if shape.moe:
        out.append(
            f'MXFP8GroupedExpertsConverter.Config(recipe_name="mxfp8_rceil", pad_multiple=32, '
            f"model_compile_enabled={compiled})"
        )
    return out


def _literal(v) -> str:
    return repr(tuple(v)) if isinstance(v, (list, tuple)) else repr(v)


def export_torchtitan(
    shape: Shape,
    lay: PlannerLayout,
    wl: Workload,
    optimizer: Optimizer | None = None,
    grad_clip: float | None = None,
    fp8_recipe: str | None = None,
) -> tuple[str, list[str]]:
    """A torchtitan recipe module: one function, FUNCTION, returning the run's Trainer.Config. FP8 is rowwise:
    0.3.0's Float8LinearConverter takes recipe_name rowwise or rowwise_with_gw_hp only (a note says so where
    the workload's `fp8_recipe` is tensorwise); mxfp8 is its MX converters' (fp8_converters)."""
    opt, clip = optimizer_and_clip(optimizer, grad_clip)
    flavor = torchtitan_flavor(shape)
    if flavor is None:  # exportable() refuses it first; a direct call says so here
        raise ValueError(f"torchtitan's llama3 has no flavor of this shape (it has {', '.join(FLAVORS)})")
    micro = wl.micro_batches(lay)
    fp8 = lay.precision == "fp8"
    family, recipe = ("qwen3", QWEN3_RECIPE) if shape.moe else ("llama3", RECIPES[flavor])
    backend = (CP_ATTENTION if lay.cp > 1 else ATTENTION)[lay.attention]
    mx = fp8 and fp8_recipe == MXFP8
    titan_recipe = fp8_recipe if fp8_recipe == GW_HP else "rowwise"
    converters = (
        f", converters=[{', '.join(fp8_converters(shape, mx, lay.compile == 'blocks', titan_recipe))}]" if fp8 else ""
    )
    parallelism = {
        "data_parallel_replicate_degree": lay.replicas // lay.shard_group,  # HSDP: the sharding groups
        "data_parallel_shard_degree": lay.shard_group // lay.cp,
        "fsdp_reshard_after_forward": "default" if lay.reshard_after_forward else "never",
        "tensor_parallel_degree": lay.tp,
        "enable_sequence_parallel": lay.sequence_parallel or lay.tp == 1,
        "pipeline_parallel_degree": lay.pp,
        "pipeline_parallel_schedule": SCHEDULES.get(lay.pipeline_schedule, "1F1B"),
        "pipeline_parallel_microbatch_size": lay.micro_batch_size,
        "context_parallel_degree": lay.cp,
    }
    if lay.pp > 1:  # the embedding and the head add no stage's worth of layers (the harness's even split)
        parallelism["pipeline_parallel_first_stage_less_layers"] = 0
        parallelism["pipeline_parallel_last_stage_less_layers"] = 0
    if lay.pp > 1 and lay.pipeline_schedule == "interleaved":
        parallelism["pipeline_parallel_layers_per_stage"] = layers_per_stage(shape.layers, lay)
    if shape.moe:
        parallelism["expert_parallel_degree"] = lay.ep
    bf16 = wl.dtype_bytes == 2
    training = {
        # per data-parallel rank and accumulation step: with pp, every micro-batch of the step
        "local_batch_size": lay.micro_batch_size * micro if lay.pp > 1 else lay.micro_batch_size,
        "global_batch_size": wl.global_batch_size,
        "seq_len": wl.seq_len,
        "max_norm": clip,
        "dtype": "float32",
        "mixed_precision_param": "bfloat16" if bf16 else "float32",
        "mixed_precision_reduce": "float32",
    }
    if lay.pp > 1 or (shape.moe and lay.ep > 1):
        # torchtitan's CUDA graphs (on by default) refuse pipeline parallelism and, with ep > 1, the all-to-all
        # token dispatcher that its qwen3 recipe uses (Trainer.Config._validate_cuda_graphs)
        training["disable_cuda_graphs"] = True
    adamw = f"lr={opt.lr!r}, betas={_literal(opt.betas)}, eps={opt.eps!r}, weight_decay={opt.weight_decay!r}"
    lines = [
        f'"""torchtitan recipe written by `harness plan`, for torchtitan {TORCHTITAN}',
        f"(pip install torchtitan=={TORCHTITAN}).",
        "",
        f"Save as {FUNCTION}.py where Python finds it and launch {lay.gpus} ranks (8 a node):",
        f"    torchrun --nproc-per-node 8 --nnodes {max(1, lay.gpus // 8)} -m torchtitan.train "
        f"--module {FUNCTION} --config {FUNCTION}"
        if lay.gpus > 8 and lay.gpus % 8 == 0
        else f"    torchrun --nproc-per-node {lay.gpus} -m torchtitan.train --module {FUNCTION} --config {FUNCTION}",
        '"""',
        "",
        # the plan's own kernels: attn_backend stands for several, and the recipe has no norm kernel
        exact.comment(attention=lay.attention, rmsnorm=lay.rmsnorm),
        "",
        "from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw",
        "from torchtitan.config import CompileConfig",
        "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: F401",
        *([f"from torchtitan.components.quantization import {', '.join(_converter_names(shape, mx))}"] if fp8 else []),
        f"from torchtitan.models.{family} import model_registry",
        f"from torchtitan.models.{family}.config_registry import {recipe}",
        "from torchtitan.trainer import Trainer",
        "",
        "",
        f"def {FUNCTION}() -> Trainer.Config:",
        f"    config = {recipe}()",
        f'    config.model_spec = model_registry("{flavor}", attn_backend="{backend}"{converters})',
    ]
    lines += [f"    config.parallelism.{k} = {_literal(v)}" for k, v in parallelism.items()]
    lines += [f"    config.training.{k} = {_literal(v)}" for k, v in training.items()]
    lines += [
        f"    config.optimizer = default_adamw({adamw})",
        "    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0)",
        f"    config.activation_checkpoint = {AC[lay.activation_checkpointing]}",
        # each TransformerBlock compiled (torchtitan's apply_compile), as layout.compile blocks; the loss eager
        f'    config.compile = CompileConfig(enable={lay.compile == "blocks"}, components=["model"])',
        "    return config",
    ]
    notes = [
        f"for torchtitan {TORCHTITAN}: a recipe (Trainer.Config), torchtitan's config system since its "
        "TOML files ended in February 2026",
        f"torchtitan main ({TORCHTITAN_MAIN[:12]}) names the batch in tokens instead: {', '.join(MAIN_FIELDS)}",
        "torchtitan shards parameters, gradients and optimizer states with FSDP2 (ZeRO-3-like) over "
        f"data_parallel_shard_degree x context_parallel_degree: its memory is below the ZeRO-{lay.sharding_stage} "
        "prediction"
        if lay.sharding_stage < 3
        else "",
        f"attention {lay.attention}: torchtitan's {backend} backend",
        "context parallelism: FlexAttention's, which all-gathers K and V (not a ring)"
        + (" on its flash backend (Hopper or Blackwell)" if backend == "flex_flash" else "")
        if lay.cp > 1
        else "",
        f"{shape.layers} layers do not split evenly into {lay.pp} x {lay.virtual_stages} chunks"
        if lay.pp > 1 and lay.pipeline_schedule == "interleaved" and shape.layers % (lay.pp * lay.virtual_stages)
        else "",
        f"FP8: torchtitan's Float8LinearConverter (torchao Float8, {titan_recipe} scaling; every linear but the LM head"
        + (" and the router gate; the experts through Float8GroupedExpertsConverter)" if shape.moe else ")")
        + (
            f"; the workload's {fp8_recipe} has no recipe_name there (it takes rowwise or rowwise_with_gw_hp)"
            if fp8_recipe not in (None, "rowwise", GW_HP)
            else "; recipe_name rowwise_with_gw_hp: its weight gradients are torchao's bf16 products (the harness's "
            "own engine and reference accumulate them in fp32 into their main gradients)"
            if fp8_recipe == GW_HP
            else ""
        )
        if fp8 and not mx
        else "",
        "FP8 mxfp8: torchtitan's MXFP8LinearConverter (torchao's MXFP8Linear: e4m3, an e8m0 scale per 32, RCEIL) "
        f"on the linears under {', '.join(MX_FQNS)} (an include list: the LM head and the router stay bf16)"
        + (
            "; the experts through MXFP8GroupedExpertsConverter (mxfp8_rceil, token groups padded to 32, as the "
            "harness pads them)"
            if shape.moe
            else ""
        )
        + "; torchtitan refuses MXFP8 below compute capability 10.0 (Blackwell)"
        if mx
        else "",
        f"MoE: torchtitan's qwen3 {flavor} with expert_parallel_degree {lay.ep} (its experts over ep ranks of the "
        "data-parallel shard x cp mesh)"
        if shape.moe
        else "",
    ]
    if lay.pp == 1 and micro > 1:
        notes.append(f"torchtitan accumulates {micro} micro-batches per step (global_batch_size)")
    if lay.activation_checkpointing == "selective" and lay.selective_policy != "per_op":
        notes.append(
            "SelectiveAC is torchtitan's per-op policy (every other matmul's output kept, the rest recomputed): it "
            "keeps less and recomputes more than the Megatron-style selective recomputation the plan predicted"
        )
    return "\n".join(lines) + "\n", [n for n in notes if n]
