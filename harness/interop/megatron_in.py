"""Megatron-LM's pretrain_gpt.py arguments (a launch script or an argument file) read back as a harness
workload and layout (harness/interop/imports.py checks them as a spec). Flag names are
megatron/training/arguments.py's at the commit megatron_out names; a flag the harness cannot carry
is listed with why, never guessed. Bad input raises SpecError naming the flag.
"""

from __future__ import annotations

from harness.errors import SpecError
from harness.interop.megatron_out import MEGATRON_ATTENTION
from harness.interop.model_match import match_model
from harness.interop.shell import FLAGS, command_words, unresolved
from harness.parallel_dims import ParallelDims
from harness.spec.schema import ATTENTION_KERNELS, MAX_STEPS

# Megatron-LM's --attention-backend, back to the harness's kernel (megatron_out.MEGATRON_ATTENTION inverted; its
# local attention is the materialised one the harness calls naive).
ATTENTION_OF_BACKEND = {"flash": "flash2", "fused": "sdpa_cudnn", "unfused": "naive", "local": "naive"}

# Megatron-LM flags carried, by value type (megatron/training/arguments.py's names).
MEGATRON_INT = {
    *"tensor-model-parallel-size pipeline-model-parallel-size context-parallel-size micro-batch-size".split(),
    *"global-batch-size seq-length max-position-embeddings num-layers hidden-size ffn-hidden-size".split(),
    *"num-attention-heads num-query-groups rotary-base recompute-num-layers lr-warmup-iters kv-channels".split(),
    *"num-virtual-stages-per-pipeline-rank num-layers-per-virtual-pipeline-stage vocab-size".split(),
    *"expert-model-parallel-size expert-tensor-parallel-size num-experts moe-router-topk moe-ffn-hidden-size".split(),
    "train-iters",
    "seed",
}
# Whole-number flags that may be 0 (Megatron-LM: no warm-up, no experts, no iterations, no recomputed layers)
ZERO_OK = {"lr-warmup-iters", "num-experts", "train-iters", "recompute-num-layers", "seed"}
MEGATRON_FLOAT = {*"lr min-lr weight-decay adam-beta1 adam-beta2 adam-eps clip-grad norm-epsilon".split()}
MEGATRON_FLOAT |= {"attention-dropout", "hidden-dropout", "rope-scaling-factor", "moe-z-loss-coeff"}
MEGATRON_STR = {
    *"cp-comm-type recompute-granularity recompute-method normalization position-embedding-type".split(),
    *"lr-decay-style attention-backend transformer-impl optimizer spec fp8-format fp8-recipe".split(),
    *"moe-router-load-balancing-type moe-aux-loss-coeff moe-router-dtype".split(),
}
MEGATRON_FLAGS = {
    *"sequence-parallel group-query-attention swiglu disable-bias-linear untie-embeddings-and-output-weights".split(),
    *"bf16 fp16 accumulate-allreduce-grads-in-fp32 use-distributed-optimizer overlap-grad-reduce".split(),
    *"overlap-param-gather use-rope-scaling add-qkv-bias use-flash-attn grad-reduce-in-bf16".split(),
    *"recompute-activations qk-layernorm moe-router-pre-softmax".split(),
}
# Flags of another model than a LLaMA that no flag of the harness's model has: refused, with why.
MEGATRON_OTHER_MODEL = {
    "enable-gpt-oss": "gpt-oss's model (attention sinks, sliding-window layers, clamped GeGLU experts)",
    "quick-geglu": "a quick-GeGLU MLP",
    "softmax-type": "an attention softmax with learnable sinks",
    "window-size": "sliding-window attention",
    "multi-latent-attention": "multi-latent attention (DeepSeek)",
    "moe-shared-expert-intermediate-size": "shared experts",
    "num-experts-per-layer": "experts in some layers only",
    "moe-layer-freq": "experts in some layers only",
}
CP_OF_COMM = {"p2p": "ring", "all_gather": "allgather", "a2a": "ulysses"}
# Megatron-LM's --fp8-recipe (Transformer Engine's) as the harness's (torchao's): current per-tensor
# scaling is tensorwise; blockwise is rowwise's kind; mxfp8 is the harness's mxfp8 (the same block format).
FP8_RECIPE = {"tensorwise": "tensorwise", "delayed": "tensorwise", "blockwise": "rowwise", "mxfp8": "mxfp8"}
# The gradients' element type each harness recipe casts to (torchao's): e5m2 under tensorwise, e4m3 otherwise;
# --fp8-format hybrid has e5m2 gradients, e4m3 none (megatron_out.TE_FORMAT writes the matching one)
GRAD_FORMAT = {"tensorwise": "hybrid", "rowwise": "e4m3", "rowwise_with_gw_hp": "e4m3", "mxfp8": "e4m3"}
# The programs whose arguments these are (Megatron-LM's GPT pretraining).
PROGRAMS = ("pretrain_gpt.py",)
# A Megatron-LM or torchrun launch line's world size, when it says it.
TORCHRUN = {"--nproc-per-node", "--nproc_per_node", "--nnodes"}


def _number(kind, text: str, field: str):
    if unresolved(text):
        raise SpecError(field, f"depends on {unresolved(text)[0]}, which the script does not set")
    try:
        return kind(text)
    except ValueError:
        raise SpecError(field, f"{text!r} is not {'an int' if kind is int else 'a number'}") from None


def split_megatron(text: str) -> tuple[dict, int | None, list[str]]:
    """The `--flag [value...]` pairs of a launch script or argument file (its variables resolved by
    harness/interop/shell.py; what precedes a `*.py` program is the launcher's), the world size the
    launcher gives (torchrun --nproc-per-node x --nnodes), and the tokens that are no option."""
    tokens = command_words(text)
    program = max((i for i, t in enumerate(tokens) if t.endswith(".py")), default=-1)
    launcher, tokens = tokens[: program + 1], tokens[program + 1 :]
    stray = launcher[program:] if program >= 0 else []
    world = None
    for i, t in enumerate(launcher):
        name, _, value = t.partition("=")
        if name in TORCHRUN:
            value = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
            world = (world or 1) * _number(int, value, name)
    args, key = {}, None
    for t in tokens:
        if t.startswith(FLAGS):
            stray.append(t)
        elif t.startswith("--"):
            key, _, value = t.partition("=")
            args[key] = [value] if value else []
        elif key is not None:
            args[key].append(t)
        else:
            stray.append(t)
    return args, world, stray


def _megatron_value(args: dict, flag: str):
    values = args.get(f"--{flag}")
    if values is None:
        return None
    if flag in MEGATRON_FLAGS:
        if values:
            raise SpecError(f"--{flag}", f"takes no value, got {' '.join(values)!r}")
        return True
    if len(values) != 1 and not (flag in ("cp-comm-type", "spec", "moe-aux-loss-coeff") and values):
        raise SpecError(f"--{flag}", f"needs one value, got {len(values)}")
    kind = int if flag in MEGATRON_INT else float if flag in MEGATRON_FLOAT else str
    if kind is str and unresolved(values[0]):
        raise SpecError(f"--{flag}", f"depends on {unresolved(values[0])[0]}, which the script does not set")
    value = _number(kind, values[0], f"--{flag}") if kind is not str else values[0]
    if kind is int and value < (0 if flag in ZERO_OK else 1):
        raise SpecError(f"--{flag}", f"must be at least {0 if flag in ZERO_OK else 1}, got {value}")
    return value


def _lost_flags(args: dict, carried: set) -> list[str]:
    """One line per flag not carried (what it depends on, where the script does not set it)."""
    lost = []
    for f, values in args.items():
        if f[2:] in carried:
            continue
        why = next((unresolved(v)[0] for v in values if unresolved(v)), None)
        lost.append(f"{f}: not carried: " + (f"depends on {why}" if why else "the harness has no such setting"))
    return lost


def read_megatron(text: str, gpus: int | None = None) -> tuple[dict, dict, list[str]]:
    """(workload, layout, not carried) of Megatron-LM's pretrain_gpt.py arguments."""
    args, world, stray = split_megatron(text)
    program = next((t for t in stray if t.endswith(".py")), None)
    if program is not None and program.rsplit("/", 1)[-1] not in PROGRAMS:
        raise SpecError(program, f"not one of {', '.join(PROGRAMS)}: the harness trains decoder-only GPT models")
    if args.get("--use-megatron-fsdp") is not None:
        strategy = (args.get("--data-parallel-sharding-strategy") or ["optim_grads_params"])[0]
        raise SpecError(
            "--use-megatron-fsdp",
            f"Megatron-FSDP ({strategy}): engine megatron runs Megatron-core's DDP or distributed optimizer (ZeRO-1)",
        )
    other = next((f for f in args if f[2:] in MEGATRON_OTHER_MODEL), None)
    if other is not None:
        raise SpecError(
            other, f"{MEGATRON_OTHER_MODEL[other[2:]]}: the harness's model is a LLaMA (or Mixtral/Qwen3 MoE)"
        )
    lost = [
        f"{unresolved(t)[0] if unresolved(t) else t}: not carried: "
        + (
            "flags added under a condition decided at run time"
            if t.startswith(FLAGS)
            else "the script does not set it"
            if unresolved(t)
            else "not an option"
        )
        for t in stray
        if t is not program
    ]
    a = {f[2:]: _megatron_value(args, f[2:]) for f in args if f[2:] in MEGATRON_INT | MEGATRON_FLOAT | MEGATRON_STR}
    a.update({f[2:]: _megatron_value(args, f[2:]) for f in args if f[2:] in MEGATRON_FLAGS})
    lost += _lost_flags(args, set(a))
    lost += _megatron_model_lost(a)
    for need in ("num-layers", "hidden-size", "num-attention-heads", "seq-length", "micro-batch-size"):
        if a.get(need) is None:
            raise SpecError(f"--{need}", "missing: the spec needs it")
    world = gpus or world
    if world is None:
        raise SpecError("--gpus", "missing: Megatron-LM takes data parallelism from the world size; give --gpus")
    tp, pp, cp = (
        a.get(k) or 1 for k in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size")
    )
    ep = a.get("expert-model-parallel-size") or 1
    try:
        dims = ParallelDims.derive(world, "--gpus", tp=tp, pp=pp, cp=cp)
    except SpecError as e:
        raise SpecError(
            "--gpus", e.reason + ("" if gpus else " (the script's torchrun world size): give --gpus")
        ) from None
    if dims.product("dp", "cp") % ep:
        on = f"{world} ranks" + ("" if gpus else " (the script's torchrun world size: give --gpus)")
        raise SpecError(
            "--expert-model-parallel-size", f"{ep} does not divide dp x cp = {dims.product('dp', 'cp')} on {on}"
        )
    dp = dims.dp
    if a.get("expert-tensor-parallel-size", tp) != tp:  # Megatron-LM's default: the experts' tp is tp
        lost.append(
            f"--expert-tensor-parallel-size: not carried: {a['expert-tensor-parallel-size']}; the harness shards "
            f"each expert over tp {tp}"
        )
    vp = a.get("num-virtual-stages-per-pipeline-rank")
    if vp is None and a.get("num-layers-per-virtual-pipeline-stage"):
        per = pp * a["num-layers-per-virtual-pipeline-stage"]
        if a["num-layers"] % per:
            raise SpecError(
                "--num-layers-per-virtual-pipeline-stage", f"{a['num-layers']} layers are not pp x it = {per}"
            )
        vp = a["num-layers"] // per
    vp = vp or 1
    backend = a.get("attention-backend") or ("flash" if a.get("use-flash-attn") else "auto")
    if backend not in (*ATTENTION_OF_BACKEND, "auto"):
        raise SpecError("--attention-backend", f"{backend!r} is not one of {', '.join(ATTENTION_OF_BACKEND)}, auto")
    if backend == "auto":
        lost.append("--attention-backend: not carried: auto (Megatron-LM picks at run time); written as sdpa")
    te = a.get("transformer-impl", "transformer_engine") == "transformer_engine"
    # an exported plan's own kernels have no place in pretrain_gpt.py's arguments (parsed strictly): say which
    # settings stand for several
    kernels = [k for k, b in MEGATRON_ATTENTION.items() if b == backend and k in ATTENTION_KERNELS]
    many = ["Transformer Engine's RMSNorm is fused: written as fused"] if te else []
    if len(kernels) > 1:
        wrote = ATTENTION_OF_BACKEND[backend]
        many.insert(0, f"--attention-backend {backend} runs {', '.join(kernels)}: written as {wrote}")
    if many:
        why = " (pretrain_gpt.py's arguments have no place for a plan's own)"
        lost.append("kernels: not carried exactly: " + "; ".join(many) + why)
    sp = bool(a.get("sequence-parallel"))
    if sp and tp == 1:  # Megatron-LM's validate_args turns it off (arguments.py: "Disabling sequence parallelism")
        sp = False
        lost.append("--sequence-parallel: not carried: Megatron-LM turns it off at tensor parallel size 1")
    granularity = "selective" if a.get("recompute-activations") else a.get("recompute-granularity")
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "ep": ep,
        "micro_batch_size": a["micro-batch-size"],
        "sequence_parallel": sp,
        "activation_checkpointing": granularity or "none",
        "attention": ATTENTION_OF_BACKEND.get(backend, "sdpa"),
        "rmsnorm": "fused" if te else "torch",
        "pipeline_schedule": "interleaved" if vp > 1 else "1f1b",
        "virtual_stages": vp,
        "zero_stage": 1 if a.get("use-distributed-optimizer") else 0,
    }
    if cp > 1:
        comm = (args.get("--cp-comm-type") or ["p2p"])[0]
        if comm not in CP_OF_COMM:
            raise SpecError("--cp-comm-type", f"{comm!r} is not one of {', '.join(CP_OF_COMM)}")
        layout["cp_impl"] = CP_OF_COMM[comm]
        if len(args.get("--cp-comm-type") or []) > 1:
            lost.append("--cp-comm-type: not carried: one type per layer; written as the first layer's")
    if granularity == "full" and (a.get("recompute-method"), a.get("recompute-num-layers")) not in (
        ("uniform", 1),
        (None, None),
    ):
        lost.append("--recompute-method: not carried: the harness recomputes every layer (uniform, 1)")
    model, overrides = match_model(megatron_shape(a))
    if model == "tiny" and a.get("max-position-embeddings"):
        overrides["max_positions"] = a["max-position-embeddings"]
    if a.get("vocab-size") is None:
        lost.append(f"vocabulary: not carried: set by the tokenizer; written as {model}'s (give --vocab-size)")
    workload = {
        "model": model,
        **({"model_overrides": overrides} if overrides else {}),
        "seq_len": a["seq-length"],
        "global_batch_size": a.get("global-batch-size") or a["micro-batch-size"] * dp,
        "precision": "bf16" if a.get("bf16") or a.get("fp16") else "fp32",
        "optimizer": {},
    }
    if a.get("fp16"):
        lost.append("--fp16: not carried: the harness trains in fp32, bf16 or fp8; written as bf16 (2 bytes too)")
    if a.get("fp8-format"):
        recipe = a.get("fp8-recipe", "delayed")  # Megatron-core's TransformerConfig default
        if recipe not in FP8_RECIPE:
            raise SpecError("--fp8-recipe", f"{recipe!r} is not one of {', '.join(FP8_RECIPE)}")
        workload.update(precision="fp8", fp8_recipe=FP8_RECIPE[recipe])
        if recipe != FP8_RECIPE[recipe]:
            lost.append(f"--fp8-recipe: not carried: {recipe} (Transformer Engine's); written as {FP8_RECIPE[recipe]}")
        fmt, ours = a["fp8-format"], GRAD_FORMAT[FP8_RECIPE[recipe]]
        if fmt not in ("e4m3", "hybrid"):  # Megatron-LM's choices
            raise SpecError("--fp8-format", f"{fmt!r} is not one of e4m3, hybrid")
        if fmt != ours:
            lost.append(
                f"--fp8-format: not carried: {fmt} ({'e5m2' if fmt == 'hybrid' else 'e4m3'} gradients); the harness's "
                f"{FP8_RECIPE[recipe]} casts gradients to {'e5m2' if ours == 'hybrid' else 'e4m3'}"
            )
    if a.get("bf16") and a.get("grad-reduce-in-bf16"):  # Megatron-LM's main grads then bf16 (validate_args)
        workload.update(grad_accum_dtype="bf16", grad_reduce_dtype="bf16")
    lost += [
        f"--{f}: not carried: the harness has no such setting"
        for f in ("overlap-grad-reduce", "overlap-param-gather")
        if a.get(f)
    ]
    if a.get("global-batch-size") is None:
        lost.append("--global-batch-size: not carried: absent; written as micro-batch x dp")
    if a.get("seed") is not None:
        workload["seed"] = a["seed"]
    iters = a.get("train-iters")
    if iters is not None and 1 <= iters <= MAX_STEPS:
        workload["steps"] = iters
    elif iters is not None:
        lost.append(f"--train-iters: not carried: {iters}; the harness measures 1 to {MAX_STEPS} steps")
    _megatron_moe(a, workload, lost)
    _megatron_optimizer(a, workload, lost)
    return workload, layout, lost


def megatron_shape(a: dict) -> dict:
    """The model's dimensions as Megatron-LM runs them from its arguments (its defaults where absent:
    validate_args' ffn width and head width, rotary base 10000, epsilon 1e-5, tied embeddings)."""
    h, heads = a["hidden-size"], a["num-attention-heads"]
    ffn = a.get("ffn-hidden-size") or (int((4 * h * 2 / 3) / 64) * 64 if a.get("swiglu") else 4 * h)
    shape = {
        "layers": a["num-layers"],
        "hidden": h,
        "heads": heads,
        "ffn": ffn,
        "kv_heads": a.get("num-query-groups") or heads if a.get("group-query-attention") else heads,
        "head_dim": a.get("kv-channels") or h // heads,
        "rope_theta": float(a.get("rotary-base") or 10000),
        "norm_eps": a.get("norm-epsilon") or 1e-5,
        "tie_embeddings": not a.get("untie-embeddings-and-output-weights"),
        "qkv_bias": bool(a.get("add-qkv-bias")),
        "qk_norm": bool(a.get("qk-layernorm")),
        "rope_factor": float(a.get("rope-scaling-factor") or 8.0) if a.get("use-rope-scaling") else 1.0,
    }
    if a.get("num-experts"):
        shape.update(experts=a["num-experts"], experts_per_token=a.get("moe-router-topk") or 2)
        shape.update(moe_ffn=a.get("moe-ffn-hidden-size") or ffn, norm_topk=not a.get("moe-router-pre-softmax"))
    else:
        shape.update(experts=0)
    if a.get("vocab-size"):
        shape["vocab"] = a["vocab-size"]
    return shape


def _megatron_moe(a: dict, workload: dict, lost: list[str]) -> None:
    """The MoE losses' coefficients (Megatron-LM's --moe-aux-loss-coeff, one for every layer here)."""
    if not a.get("num-experts"):
        return
    balance = a.get("moe-router-load-balancing-type", "aux_loss")
    coeff = a.get("moe-aux-loss-coeff")
    if coeff is not None:
        values = [_number(float, v, "--moe-aux-loss-coeff") for v in [coeff]]
        workload["moe_aux_loss_coeff"] = values[0] if balance == "aux_loss" else 0.0
    if balance != "aux_loss":
        lost.append(f"--moe-router-load-balancing-type: not carried: {balance}; the harness's is aux_loss")
    if a.get("moe-router-dtype", "fp32") != "fp32":
        lost.append(f"--moe-router-dtype: not carried: {a['moe-router-dtype']}; the harness routes in fp32")
    if a.get("moe-z-loss-coeff"):
        workload["moe_z_loss_coeff"] = a["moe-z-loss-coeff"]


def _megatron_model_lost(a: dict) -> list[str]:
    """The flags (given, or their Megatron-LM defaults) that describe another model than the harness's
    LLaMA (RMSNorm, SwiGLU, RoPE, no linear biases, no dropout)."""
    lost = []
    for flag, want, default in (
        ("normalization", "RMSNorm", "LayerNorm"),
        ("position-embedding-type", "rope", "learned_absolute"),
    ):
        if a.get(flag, default) != want:
            lost.append(f"--{flag}: not carried: {a.get(flag, default)}; the harness's LLaMA has {want}")
    if not a.get("swiglu"):
        lost.append("--swiglu: not carried: absent (a GeLU MLP); the harness's LLaMA has SwiGLU")
    if not a.get("disable-bias-linear"):
        lost.append("--disable-bias-linear: not carried: absent (linear biases); the harness's LLaMA has none")
    for flag in ("attention-dropout", "hidden-dropout"):
        if a.get(flag, 0.1) != 0:
            lost.append(f"--{flag}: not carried: {a.get(flag, 0.1)}; the harness's LLaMA has no dropout")
    return lost


def _megatron_optimizer(a: dict, workload: dict, lost: list[str]) -> None:
    opt = workload["optimizer"]
    if a.get("optimizer", "adam") != "adam":
        lost.append(f"--optimizer: not carried: {a['optimizer']}; the harness trains with AdamW")
    for key, flag in (("lr", "lr"), ("eps", "adam-eps"), ("weight_decay", "weight-decay")):
        if a.get(flag) is not None:
            opt[key] = a[flag]
    if a.get("adam-beta1") is not None or a.get("adam-beta2") is not None:
        opt["betas"] = [a.get("adam-beta1", 0.9), a.get("adam-beta2", 0.999)]  # Megatron-LM's defaults
    if a.get("clip-grad") is not None:
        workload["grad_clip"] = a["clip-grad"]
    style = a.get("lr-decay-style")
    if style not in (None, "constant") or (a.get("lr-warmup-iters") or 0) > 0:
        lost.append(f"--lr-decay-style: not carried: {style}; the harness trains at a constant learning rate")
