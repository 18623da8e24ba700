"""What engine deepspeed (ZeRO 1/2/3, AutoTP, Ulysses, its pipeline engine, DeepSpeed's MoE layer or AutoEP)
runs, declared without importing torch or DeepSpeed; adapter.py builds engine.py (ZeRO, AutoTP, Ulysses
through ulysses.py, MoE through experts.py or autoep.py) or pipe.py (PipelineModule)."""

from __future__ import annotations

from harness.frameworks.deepspeed.config import validate
from harness.registry import ANY, EngineFacts, MemoryModel, not_both, tied_across_stages
from harness.spec import EVERY_ENGINE, FP8, MOE, MUON, honoured, some

ULYSSES = "DeepSpeed's context parallelism is Ulysses (DistributedAttention): set cp_impl: ulysses"

_MOE = "mixture of experts"
MOE_LIMITS = [
    (
        _MOE,
        lambda s, lay: (
            not s.moe
            or lay.ds_moe == "autoep"  # AutoEP's router: any k, renormalised or not (autoep_config.py)
            or (s.experts_per_token == 2 and s.norm_topk)
            or (s.experts_per_token == 1 and not s.norm_topk)
        ),
        "DeepSpeed's TopKGate renormalises top-2 weights and keeps top-1's softmax weight: experts_per_token 2 "
        "with norm_topk true, or 1 with norm_topk false (ds_moe autoep routes any k either way)",
    ),
    (
        _MOE,
        lambda s, lay: s.moe or lay.ds_moe == "layer",
        "ds_moe autoep has DeepSpeed AutoEP replace a mixture of experts' blocks, and this model has none",
    ),
    (
        _MOE,
        lambda s, lay: not s.moe or (lay.tp == 1 and lay.pp == 1 and lay.cp == 1),
        "engine deepspeed runs DeepSpeed's MoE layer with ZeRO data and expert parallelism only: its AutoTP, "
        "pipeline engine and Ulysses are not built or checked with it here; set tp=pp=cp=1",
    ),
    (
        _MOE,
        lambda s, lay: not s.moe or lay.zero_stage != 3 or lay.ds_moe == "autoep",  # (0: refused without pp)
        "DeepSpeed's MoE layer runs here under ZeRO-1 or 2 (MoE parameter groups); ZeRO-3's zero.Init build "
        "is not wired to it: set zero_stage 1 or 2, or ds_moe autoep (AutoEP partitions the experts it builds)",
    ),
    (
        _MOE,
        lambda s, lay: not s.moe or (lay.model_impl == "own" and lay.compile == "none"),
        "DeepSpeed's MoE layer replaces the own model's feed-forward: model_impl own, compile none",
    ),
]


def _moe(w) -> bool:
    from harness.model.presets import resolve_shape

    return resolve_shape(w.model, w.model_overrides).moe


# Where DeepSpeed 0.19.8's Muon runs the workload's (harness/frameworks/deepspeed/muon.py): BF16_Optimizer's.
MUON_LIMITS = [
    (
        "optimizer.name",
        lambda w, lay: w.optimizer.name != "muon" or (w.precision == "bf16" and w.grad_accum_dtype == "fp32"),
        "muon under engine deepspeed needs precision bf16 with grad_accum_dtype fp32 (its BF16_Optimizer): "
        "DeepSpeed runs Newton-Schulz in bf16 wherever the device has bf16 (deepspeed/runtime/zero/muon/"
        "original_muon.py:47, ns_compute_dtype), not in fp32 as the fp32 policy does, and its ZeRO optimizer for "
        "fp32 (or bf16-accumulated) gradients orthogonalises them while partitioning (runtime/zero/"
        "stage_1_and_2.py:2741-2760, get_flat_partition), before step() clips by a global norm that then "
        "measures the updates, not the gradients",
    ),
    (
        "optimizer.name",
        lambda w, lay: (
            w.optimizer.name != "muon"
            or (lay.zero_stage == 1 and lay.tp == lay.cp == lay.pp == lay.ep == 1 and not _moe(w))
        ),
        "muon under engine deepspeed runs at zero_stage 1 over data parallelism alone, no MoE: DeepSpeed's "
        "BF16_Optimizer takes Muon without an mpu or MoE layers only (runtime/bf16_optimizer.py:59-61), and "
        "ZeRO-2/3 orthogonalise elsewhere (not checked here)",
    ),
    (
        "optimizer.muon_adjust_lr",
        lambda w, lay: w.optimizer.name != "muon" or w.optimizer.muon_adjust_lr == "original",
        "DeepSpeed's muon_update scales each update by sqrt(max(1, rows/cols)) (runtime/zero/muon/"
        "original_muon.py, _aspect_ratio_scale), torch's adjust_lr_fn original: set muon_adjust_lr original",
    ),
]

ENGINE = EngineFacts(
    name="deepspeed",
    memory=MemoryModel("deepspeed"),
    honours={
        **EVERY_ENGINE,
        **FP8,
        **MOE,  # the harness's router losses on DeepSpeed's MoE layer (deepspeed/experts.py)
        **MUON,  # DeepSpeed's MuonWithAuxAdam over the workload's split (deepspeed/muon.py); MUON_LIMITS
        "layout.ep": ANY,  # DeepSpeed's MoE ep_size
        **honoured(
            "layout",
            "tp pp dp cp zero_stage ds_config",
            ds_moe="autoep",
            activation_checkpointing="selective",
            attention="flash2",
            rmsnorm="fused",
            model_impl="hf",
            compile="blocks",
        ),
        "layout.cp_impl": some("layout.cp_impl", "ulysses", why=ULYSSES),
        "layout.pipeline_schedule": some(
            "layout.pipeline_schedule", "1f1b", why="DeepSpeed's pipeline engine runs its 1F1B TrainSchedule only"
        ),
    },
    why_not={
        "layout.sequence_parallel": "DeepSpeed has no Megatron-style sequence parallelism (AutoTP shards weights only)"
    },
    capabilities=[
        ("cp_impl", lambda lay: lay.cp == 1 or lay.cp_impl == "ulysses", ULYSSES),
        not_both(
            "cp", "pp", "DeepSpeed's pipeline engine has no sequence-parallel groups (Ulysses): set pp=1 with cp > 1"
        ),
        not_both(
            "cp",
            "tp",
            "DeepSpeed's Ulysses and AutoTP each bring their own mpu to deepspeed.initialize: set tp=1 with cp > 1",
        ),
        (
            "cp",
            lambda lay: lay.cp == 1 or lay.model_impl == "own",
            "DeepSpeed's Ulysses here wraps the harness's own model's attention: set model_impl: own with cp > 1",
        ),
        ("zero_stage", lambda lay: lay.pp > 1 or lay.zero_stage in (1, 2, 3), "deepspeed runs ZeRO stage 1, 2 or 3"),
        (
            "zero_stage",
            lambda lay: lay.pp == 1 or lay.zero_stage in (0, 1),
            "DeepSpeed's pipeline engine (pp > 1) runs with ZeRO stage 0 or 1 only",
        ),
        not_both(
            "tp",
            "pp",
            "DeepSpeed's tensor parallelism (AutoTP) does not combine with its pipeline engine: set tp=1 or pp=1",
        ),
        (
            "model_impl",
            lambda lay: lay.model_impl == "own" or lay.pp == 1,
            "hf (transformers' LlamaForCausalLM) is not a pipeline of layers: use model_impl own with pp > 1",
        ),
        (
            "activation_checkpointing",
            lambda lay: lay.model_impl == "own" or lay.activation_checkpointing != "selective",
            "selective is not offered by transformers' LlamaForCausalLM (model_impl hf); use none or full",
        ),
        (
            "attention",
            lambda lay: lay.model_impl == "own" or lay.attention in ("naive", "sdpa"),
            "model_impl hf runs attention naive (eager) or sdpa",
        ),
        (
            "rmsnorm",
            lambda lay: lay.model_impl == "own" or lay.rmsnorm == "torch",
            "model_impl hf runs transformers' own RMSNorm: rmsnorm fused needs model_impl own",
        ),
        (
            "compile",
            lambda lay: lay.compile == "none" or (lay.pp == 1 and lay.tp == 1 and lay.model_impl == "own"),
            "engine deepspeed compiles the own model's blocks before deepspeed.initialize: needs pp=1 (its pipeline "
            "engine builds its own layers), tp=1 (dynamo fails on the all_reduce in AutoTP's ColumnParallel "
            "backward, torch 2.13) and model_impl own",
        ),
    ],
    precision_limits=[
        *MUON_LIMITS,
        (
            "precision",
            lambda w, lay: lay.ds_moe != "autoep" or w.precision == "fp32",
            "AutoEP's router computes its logits in the parameters' dtype (its gate Linear, deepspeed/moe/"
            "ep_router.py), the reference's in fp32 whatever the precision: ds_moe autoep runs precision fp32",
        ),
        (
            "precision",
            lambda w, lay: w.precision != "fp8" or (lay.tp == 1 and lay.pp == 1 and lay.model_impl == "own"),
            "fp8 under engine deepspeed converts the harness's own model's linears (torchao) before "
            "deepspeed.initialize: with tp=1 and pp=1 and model_impl own only (AutoTP would replace the FP8 "
            "linears with its own bf16 ones; the pipeline module and transformers' model are not converted here)",
        ),
        (
            "grad_accum_dtype",
            lambda w, lay: w.precision != "bf16" or lay.pp == 1 or lay.zero_stage != 0 or w.grad_accum_dtype == "bf16",
            "DeepSpeed's pipeline engine without ZeRO (pp > 1, zero_stage 0) accumulates bf16 parameters' gradients "
            "in bf16 only (deepspeed/runtime/engine.py, _do_optimizer_sanity_check: 'unsupported mix'); set "
            "zero_stage: 1 (its BF16_Optimizer accumulates in fp32) or grad_accum_dtype: bf16",
        ),
    ],
    model_limits=[
        tied_across_stages(
            "tied embeddings with pp > 1: DeepSpeed's pipeline module here has no TiedLayerSpec",
            "engine deepspeed",
            lambda s, lay: not s.tie_embeddings or lay.pp == 1,
        ),
        (
            "qk_norm",
            lambda s, lay: not s.qk_norm or (lay.tp == 1 and lay.model_impl == "own"),
            "per-head q/k RMSNorms (Qwen3): with model_impl hf transformers' LlamaForCausalLM has none, and under "
            "AutoTP (tp > 1) each rank's q/k norm gradient covers only its heads, which DeepSpeed does not sum "
            "over tp: use model_impl own with tp 1",
        ),
        (
            "qkv_bias",
            lambda s, lay: not s.qkv_bias or lay.model_impl == "own",
            "q/k/v biases without o's (Qwen2): transformers' LlamaForCausalLM (model_impl hf) biases all four or "
            "none; use model_impl own",
        ),
        *MOE_LIMITS,
    ],
    runs_moe=True,
    label=lambda lay: (
        f"deepspeed ZeRO-{lay['zero_stage']}"
        + (" hf" if lay["model_impl"] == "hf" else "")
        + (" AutoEP" if lay.get("ds_moe") == "autoep" else "")
    ),
    launcher="deepspeed",
    process_group=True,
    preflight=validate,
    untraced="DeepSpeed's initialize is not traceable on fake tensors",
)
