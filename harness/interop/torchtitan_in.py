"""A torchtitan recipe read back as a harness workload and layout (harness/interop/imports.py).

harness/interop/torchtitan_recipe.py reads the recipe (a config_registry function, chosen by name where
the file has several; as text, never run); this module turns its settings into the harness's: the
llama3 flavor matched to its preset, the degrees, the batch from the release's fields or main's token
budgets (TORCHTITAN_MAIN, MAIN_FIELDS), FP8 from a Float8LinearConverter; unset fields take
torchtitan's defaults.
"""

from __future__ import annotations

from harness.errors import SpecError
from harness.interop import exact
from harness.interop.model_match import match_model
from harness.interop.torchtitan_out import ATTENTION, CP_ATTENTION, FLAVORS, MAIN_FIELDS, QWEN3_MOE, SCHEDULES
from harness.interop.torchtitan_recipe import read_recipe
from harness.model.presets import PRESETS
from harness.spec import Workload as SpecWorkload


def read_torchtitan(text: str, gpus: int | None, recipe: str | None = None) -> tuple[dict, dict, list[str]]:
    """(workload, layout, not carried) of a torchtitan recipe (the function named `recipe`)."""
    got, lost = read_recipe(text, recipe)
    flavor, family = got.get("flavor"), got["family"]
    qwen3 = {f: name for name, f in QWEN3_MOE.items()}
    if (family == "qwen3" and flavor not in qwen3) or (family == "llama3" and flavor not in FLAVORS):
        known = ", ".join(qwen3 if family == "qwen3" else FLAVORS)
        raise SpecError("model_spec", f"{family} flavor {flavor!r} has no harness preset (it has {known})")
    par, tr = got["parallelism"], got["training"]
    tp, pp, cp = par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"]
    rep, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    if shard == -1:  # torchtitan: the ranks left over
        if gpus is None:
            raise SpecError("parallelism.data_parallel_shard_degree", "-1 (the ranks left over): give --gpus")
        if gpus % (rep * tp * pp * cp) or gpus < rep * tp * pp * cp:
            raise SpecError("--gpus", f"{gpus} is not divisible by replicate x tp x pp x cp = {rep * tp * pp * cp}")
        shard = gpus // (rep * tp * pp * cp)
    elif gpus is not None and gpus != rep * shard * tp * pp * cp:
        raise SpecError("--gpus", f"{gpus} is not the recipe's world, {rep * shard * tp * pp * cp} ranks")
    dp = rep * shard
    seq, micro, batch = _batch(got, pp, dp)
    schedule = {v: k for k, v in SCHEDULES.items()}.get(par["pipeline_parallel_schedule"])
    if schedule is None:
        raise SpecError(
            "parallelism.pipeline_parallel_schedule",
            f"{par['pipeline_parallel_schedule']!r} is not one of {', '.join(SCHEDULES.values())}",
        )
    vp = 1
    if schedule == "interleaved" and pp > 1:
        vp = _stages_per_rank(par, PRESETS[qwen3[flavor]].layers if family == "qwen3" else FLAVORS[flavor][0], pp, lost)
    backend = got.get("attn_backend", "flex")
    attention = {"varlen": "flash2", "flex": "sdpa_efficient", "flex_flash": "flash2"}.get(backend)
    if attention is None:
        raise SpecError("model_spec.attn_backend", f"{backend!r} is not one of varlen, flex, flex_flash")
    if cp > 1 and backend == "varlen":  # torchtitan: "Variable-length attention CP is not yet supported"
        raise SpecError("parallelism.context_parallel_degree", "torchtitan runs cp with flex attention, not varlen")
    compiled = got.get("compile") or {}
    components = compiled.get("components", ["model", "loss"])  # CompileConfig's default
    blocks = bool(compiled.get("enable")) and "model" in components
    # the plan's own kernels (`plan --export`'s comment): those attn_backend stands for; a fused norm compiled
    given = exact.read_comment(text)
    kernels = [k for k, b in (CP_ATTENTION if cp > 1 else ATTENTION).items() if b == backend]
    attention = exact.choose("attention", given.get("attention"), attention, kernels, "model_spec.attn_backend", lost)
    norms = ("torch", "fused") if blocks else ("torch",)
    rmsnorm = exact.choose("rmsnorm", given.get("rmsnorm"), "torch", norms, "compile.enable", lost)
    if rep > 1:
        lost.append(
            "parallelism.data_parallel_replicate_degree: not carried: "
            f"HSDP ({rep} replicas) written as dp {dp} fully sharded"
        )
    sched = got.get("lr_scheduler")
    if sched is None or sched.get("warmup_steps", 200) != 0 or sched.get("decay_ratio") != 0.0:
        lost.append("lr_scheduler: not carried: the harness trains at a constant learning rate")
    ac = got.get("activation_checkpoint")
    if ac is None:
        lost.append(
            "activation_checkpoint: not carried: unset (the recipe's own); "
            "written as selective_op (SelectiveAC, per-op), Trainer.Config's default"
        )
    if compiled.get("enable") and "loss" in components:
        lost.append("compile.components: not carried: loss (the harness compiles the transformer blocks only)")
    opt = got["optimizer"]
    if family == "qwen3":
        model, overrides = qwen3[flavor], {}
    else:
        layers, hidden, ffn, heads, kv, vocab = FLAVORS[flavor]
        model, overrides = match_model(
            {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "kv_heads": kv, "vocab": vocab}
        )
    workload = {
        "model": model,
        **({"model_overrides": overrides} if overrides else {}),
        "seq_len": seq,
        "global_batch_size": batch,
        "precision": "bf16" if tr["mixed_precision_param"] == "bfloat16" or tr["dtype"] == "bfloat16" else "fp32",
        "optimizer": {
            "lr": opt["lr"],
            "betas": list(opt["betas"]),
            "eps": opt["eps"],
            "weight_decay": opt["weight_decay"],
        },
        "grad_clip": tr["max_norm"],
    }
    if got.get("fp8"):
        workload.update(precision="fp8", fp8_recipe=got["fp8"])
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        **({"cp_impl": "allgather"} if cp > 1 else {}),  # torchtitan's flex-attention cp all-gathers K/V
        **({"ep": par["expert_parallel_degree"]} if par["expert_parallel_degree"] > 1 else {}),
        "micro_batch_size": micro,
        "sequence_parallel": tp > 1 and par["enable_sequence_parallel"],
        "activation_checkpointing": ac or "selective_op",
        "attention": attention,
        "rmsnorm": rmsnorm,
        "pipeline_schedule": schedule if pp > 1 else "1f1b",
        "virtual_stages": vp,
        "reshard_after_forward": par["fsdp_reshard_after_forward"] != "never",
        "compile": "blocks" if blocks else "none",
    }
    default = SpecWorkload()
    lost.append(
        "training.steps, debug.seed: not carried: the harness runs its own length and seed; written as the "
        f"harness's ({default.steps} steps, seed {default.seed})"
    )
    if family == "qwen3":
        lost.append(
            "moe_aux_loss_coeff: not carried: torchtitan's qwen3 load balancing is its model config's; "
            f"written as {default.moe_aux_loss_coeff:g}"
        )
    return workload, layout, lost


def _stages_per_rank(par: dict, layers: int, pp: int, lost: list[str]) -> int:
    """Model chunks per pipeline rank as torchtitan counts them (distributed/pipeline_parallel.py):
    ceil((layers + first stage's + last stage's less layers) / layers per stage) stages over pp ranks."""
    per_stage = par["pipeline_parallel_layers_per_stage"]
    if not per_stage:
        return 2  # torchtitan's default for a multi-stage schedule
    first, last = par["pipeline_parallel_first_stage_less_layers"], par["pipeline_parallel_last_stage_less_layers"]
    stages = -(-(layers + first + last) // per_stage)
    if stages % pp:
        raise SpecError(
            "parallelism.pipeline_parallel_layers_per_stage",
            f"{stages} virtual stages ({layers} layers + {first} + {last}) are not divisible by pp {pp} (torchtitan)",
        )
    if first or last:
        lost.append(
            "parallelism.pipeline_parallel_first_stage_less_layers: not carried: the harness splits the layers "
            "evenly (embedding and head on no extra stage)"
        )
    return stages // pp


def _batch(got: dict, pp: int, dp: int) -> tuple[int, int, int]:
    """(sequence length, micro-batch size, global batch in sequences), from the release's fields or
    main's token budgets (whichever the recipe sets; not both)."""
    par, tr = got["parallelism"], got["training"]
    main = got["set"] & set(MAIN_FIELDS)
    release = got["set"] & {"training.local_batch_size", "training.global_batch_size", "training.seq_len"}
    if main and release:
        raise SpecError(sorted(main)[0], "mixes torchtitan main's token budgets with the release's batch fields")
    if main or (not release and got["upstream"] & set(MAIN_FIELDS)):  # a base recipe of torchtitan's own
        seq, per_micro = tr["max_context_length"], tr["num_tokens_per_microbatch_per_dp_rank"]
        if per_micro % seq:
            raise SpecError(
                "training.num_tokens_per_microbatch_per_dp_rank", f"{per_micro} is not whole sequences of {seq}"
            )
        micro, step = per_micro // seq, tr["num_tokens_per_train_step"]
        if step == -1:
            step = per_micro * (par["num_pp_microbatches"] if pp > 1 else 1) * dp
        if step % seq:
            raise SpecError("training.num_tokens_per_train_step", f"{step} is not whole sequences of {seq}")
        return seq, micro, step // seq
    local, micro = tr["local_batch_size"], tr["local_batch_size"]
    if pp > 1:
        micro = par["pipeline_parallel_microbatch_size"]
        if local % micro:
            raise SpecError("training.local_batch_size", f"{local} is not whole pipeline micro-batches of {micro}")
    batch = tr["global_batch_size"]
    return tr["seq_len"], micro, local * dp if batch == -1 else batch
