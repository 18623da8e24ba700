"""Megatron-LM's pretrain_gpt.py arguments (a launch script or an argument file) read back as a harness
workload and layout (harness/interop/imports.py checks them as a spec). Flag names are
megatron/training/arguments.py's at the commit megatron_out names; a flag the harness cannot carry
is listed with why, never guessed. Bad input raises SpecError naming the flag.
"""

from __future__ import annotations

import shlex

from harness.errors import SpecError
from harness.model.presets import PRESETS
from harness.parallel_dims import ParallelDims

# Megatron-LM's --attention-backend, back to the harness's kernel (megatron_out.MEGATRON_ATTENTION inverted; its
# local attention is the materialised one the harness calls naive).
ATTENTION_OF_BACKEND = {"flash": "flash2", "fused": "sdpa_cudnn", "unfused": "naive", "local": "naive"}

# Megatron-LM flags carried, by value type (megatron/training/arguments.py's names).
MEGATRON_INT = {
    *"tensor-model-parallel-size pipeline-model-parallel-size context-parallel-size micro-batch-size".split(),
    *"global-batch-size seq-length max-position-embeddings num-layers hidden-size ffn-hidden-size".split(),
    *"num-attention-heads num-query-groups rotary-base recompute-num-layers lr-warmup-iters".split(),
    *"num-virtual-stages-per-pipeline-rank num-layers-per-virtual-pipeline-stage vocab-size".split(),
}
MEGATRON_FLOAT = {*"lr min-lr weight-decay adam-beta1 adam-beta2 adam-eps clip-grad norm-epsilon".split()}
MEGATRON_FLOAT |= {"attention-dropout", "hidden-dropout", "rope-scaling-factor"}
MEGATRON_STR = {
    *"cp-comm-type recompute-granularity recompute-method normalization position-embedding-type".split(),
    *"lr-decay-style attention-backend transformer-impl optimizer spec".split(),
}
MEGATRON_FLAGS = {
    *"sequence-parallel group-query-attention swiglu disable-bias-linear untie-embeddings-and-output-weights".split(),
    *"bf16 accumulate-allreduce-grads-in-fp32 use-distributed-optimizer overlap-grad-reduce".split(),
    *"overlap-param-gather use-rope-scaling add-qkv-bias use-flash-attn grad-reduce-in-bf16".split(),
}
CP_OF_COMM = {"p2p": "ring", "all_gather": "allgather", "a2a": "ulysses"}
# A Megatron-LM or torchrun launch line's world size, when it says it.
TORCHRUN = {"--nproc-per-node", "--nproc_per_node", "--nnodes"}


def _number(kind, text: str, field: str):
    try:
        return kind(text)
    except ValueError:
        raise SpecError(field, f"{text!r} is not {'an int' if kind is int else 'a number'}") from None


def split_megatron(text: str) -> tuple[dict, int | None, list[str]]:
    """The `--flag [value...]` pairs of a launch script or argument file (shlex-split, comments and
    line continuations as a shell reads them; what precedes a `*.py` program is the launcher's), the
    world size the launcher gives (torchrun --nproc-per-node x --nnodes), and the tokens that are
    no option."""
    tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    program = max((i for i, t in enumerate(tokens) if t.endswith(".py")), default=-1)
    launcher, tokens = tokens[: program + 1], tokens[program + 1 :]
    world = None
    for i, t in enumerate(launcher):
        name, _, value = t.partition("=")
        if name in TORCHRUN:
            value = value or (launcher[i + 1] if i + 1 < len(launcher) else "")
            world = (world or 1) * _number(int, value, name)
    args, stray, key = {}, [], None
    for t in tokens:
        if t.startswith("--"):
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
    if len(values) != 1 and not (flag in ("cp-comm-type", "spec") and values):
        raise SpecError(f"--{flag}", f"needs one value, got {len(values)}")
    kind = int if flag in MEGATRON_INT else float if flag in MEGATRON_FLOAT else str
    return _number(kind, values[0], f"--{flag}") if kind is not str else values[0]


def match_model(shape: dict) -> tuple[str, dict]:
    """The preset whose shape has every given field, else the closest base (tiny) with the given fields
    as model_overrides."""
    for name, preset in PRESETS.items():
        if all(getattr(preset, k) == v for k, v in shape.items()):
            return name, {}
    return "tiny", dict(shape)


def read_megatron(text: str, gpus: int | None = None) -> tuple[dict, dict, list[str]]:
    """(workload, layout, not carried) of Megatron-LM's pretrain_gpt.py arguments."""
    args, world, stray = split_megatron(text)
    lost = [f"{t}: not carried: not an option" for t in stray]
    a = {f[2:]: _megatron_value(args, f[2:]) for f in args if f[2:] in MEGATRON_INT | MEGATRON_FLOAT | MEGATRON_STR}
    a.update({f[2:]: _megatron_value(args, f[2:]) for f in args if f[2:] in MEGATRON_FLAGS})
    lost += [f"{f}: not carried: the harness has no such setting" for f in args if f[2:] not in a]
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
    dp = ParallelDims.derive(world, "--gpus", tp=tp, pp=pp, cp=cp).dp
    vp = a.get("num-virtual-stages-per-pipeline-rank")
    if vp is None and a.get("num-layers-per-virtual-pipeline-stage"):
        vp = a["num-layers"] // (pp * a["num-layers-per-virtual-pipeline-stage"])
    vp = vp or 1
    backend = a.get("attention-backend") or ("flash" if a.get("use-flash-attn") else None)
    if backend not in (None, *ATTENTION_OF_BACKEND):
        raise SpecError("--attention-backend", f"{backend!r} is not one of {', '.join(ATTENTION_OF_BACKEND)}")
    if backend is None:
        lost.append("--attention-backend: not carried: auto (Megatron-LM picks at run time); written as sdpa")
    te = a.get("transformer-impl", "transformer_engine") == "transformer_engine"
    shape = {"layers": a["num-layers"], "hidden": a["hidden-size"], "heads": a["num-attention-heads"]}
    for key, flag in (("ffn", "ffn-hidden-size"), ("rope_theta", "rotary-base"), ("norm_eps", "norm-epsilon")):
        if a.get(flag) is not None:
            shape[key] = float(a[flag]) if key == "rope_theta" else a[flag]
    shape["kv_heads"] = a.get("num-query-groups") if a.get("group-query-attention") else a["num-attention-heads"]
    shape["tie_embeddings"] = not a.get("untie-embeddings-and-output-weights")
    shape["attention_bias"] = bool(a.get("add-qkv-bias"))
    if a.get("vocab-size"):
        shape["vocab"] = a["vocab-size"]
    model, overrides = match_model(shape)
    if overrides:
        if a.get("max-position-embeddings"):
            overrides["max_positions"] = a["max-position-embeddings"]
        lost.append("vocabulary: not carried: set by the tokenizer; the model keeps tiny's unless --vocab-size")
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "micro_batch_size": a["micro-batch-size"],
        "sequence_parallel": bool(a.get("sequence-parallel")),
        "activation_checkpointing": a.get("recompute-granularity") or "none",
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
        if len(args["--cp-comm-type"]) > 1:
            lost.append("--cp-comm-type: not carried: one type per layer; written as the first layer's")
    if a.get("recompute-granularity") == "full" and (a.get("recompute-method"), a.get("recompute-num-layers")) not in (
        ("uniform", 1),
        (None, None),
    ):
        lost.append("--recompute-method: not carried: the harness recomputes every layer (uniform, 1)")
    workload = {
        "model": model,
        **({"model_overrides": overrides} if overrides else {}),
        "seq_len": a["seq-length"],
        "global_batch_size": a.get("global-batch-size") or a["micro-batch-size"] * dp,
        "precision": "bf16" if a.get("bf16") else "fp32",
        "optimizer": {},
    }
    if a.get("bf16") and a.get("grad-reduce-in-bf16"):  # Megatron-LM's main grads then bf16 (validate_args)
        workload.update(grad_accum_dtype="bf16", grad_reduce_dtype="bf16")
    lost += [
        f"--{f}: not carried: the harness has no such setting"
        for f in ("overlap-grad-reduce", "overlap-param-gather")
        if a.get(f)
    ]
    if a.get("global-batch-size") is None:
        lost.append("--global-batch-size: not carried: absent; written as micro-batch x dp")
    _megatron_optimizer(a, workload, lost)
    return workload, layout, lost


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
