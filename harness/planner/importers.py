"""`harness import`: a user's Megatron-LM arguments, torchtitan recipe or ds_config as a harness run spec.

Each reader returns (raw spec, not carried): the spec (workload and layout, as harness.spec reads
them) that runs the same layout and optimizer here, and one line per field the harness cannot carry,
with why. Bad input raises SpecError naming the field. The formats are those harness/planner/export.py
writes (for the versions it names); a user's own file may say more, which is listed, never guessed.
The torchtitan recipe is read as text (ast), never run. Nothing here imports torch.
"""

from __future__ import annotations

import json
import shlex

from harness.errors import SpecError
from harness.model.presets import PRESETS
from harness.parallel_dims import ParallelDims
from harness.planner.import_torchtitan import read_torchtitan

IMPORT_FORMATS = ("megatron", "torchtitan", "deepspeed")
# Megatron-LM's --attention-backend, back to the harness's kernel (export.MEGATRON_ATTENTION inverted; its
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
# ds_config keys carried (or listed by name below)
DEEPSPEED_KEYS = {
    *"train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps gradient_clipping bf16".split(),
    *"optimizer zero_optimization data_types communication_data_type tensor_parallel pipeline".split(),
    *"sequence_parallel_size activation_checkpointing scheduler".split(),
}
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


def import_megatron(text: str, gpus: int | None = None) -> tuple[dict, list[str]]:
    """A spec from Megatron-LM's pretrain_gpt.py arguments."""
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
    return _spec("megatron", workload, layout, lost)


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


def import_deepspeed(text: str, model: str | None, seq_len: int | None) -> tuple[dict, list[str]]:
    """A spec from a ds_config; the model and sequence length, which a ds_config does not hold, from
    the arguments."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError("ds_config", f"not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SpecError("ds_config", "top level must be an object")
    lost = []

    def need(key, kind=int):
        v = cfg.get(key)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise SpecError(key, f"needs a whole number, got {v!r}")
        return v

    micro, accum = need("train_micro_batch_size_per_gpu"), need("gradient_accumulation_steps")
    batch = need("train_batch_size")
    tp = ((cfg.get("tensor_parallel") or {}).get("autotp_size")) or 1
    pp = ((cfg.get("pipeline") or {}).get("stages")) or 1
    cp = cfg.get("sequence_parallel_size") or 1
    if batch % (micro * accum):
        raise SpecError("train_batch_size", f"{batch} is not micro-batch {micro} x accumulation {accum} x dp")
    zero = cfg.get("zero_optimization") or {}
    ckpt = cfg.get("activation_checkpointing")
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": batch // (micro * accum),
        "cp": cp,
        "micro_batch_size": micro,
        "zero_stage": zero.get("stage", 0),
        "activation_checkpointing": "full"
        if ckpt is not None or (cfg.get("pipeline") or {}).get("activation_checkpoint_interval")
        else "none",
        **({"cp_impl": "ulysses"} if cp > 1 else {}),
    }
    if ckpt is not None:
        lost.append(
            "activation_checkpointing: not carried: which blocks are wrapped is in the model code; written as full"
        )
    opt = cfg.get("optimizer") or {}
    if opt and opt.get("type", "").lower() not in ("adamw", "adam"):
        lost.append(f"optimizer.type: not carried: {opt.get('type')}; the harness trains with AdamW")
    params = opt.get("params") or {}
    workload = {
        "model": model or "tiny",
        "seq_len": seq_len or 128,
        "global_batch_size": batch,
        "precision": "bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp32",
        "optimizer": {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params},
    }
    for key, field in (("grad_accum_dtype", "grad_accum_dtype"), ("communication_data_type", "grad_reduce_dtype")):
        value = (cfg.get("data_types") or {}).get(key) if key == "grad_accum_dtype" else cfg.get(key)
        if value in ("fp32", "bf16"):
            workload[field] = value
        elif value is not None:
            lost.append(f"{key}: not carried: {value}; the harness accumulates and reduces in fp32 or bf16")
    lost.append("attention: not carried: a ds_config has none (the model code chooses); written as sdpa")
    lost += [f"{k}: not carried: the harness has no such setting" for k in cfg if k not in DEEPSPEED_KEYS]
    lost += [
        f"zero_optimization.{k}: not carried: engine deepspeed runs the harness's ds_configs/"
        for k in zero
        if k != "stage"
    ]
    if "gradient_clipping" in cfg:
        workload["grad_clip"] = cfg["gradient_clipping"]
    if model is None:
        lost.append("model: not carried: a ds_config has none; written as tiny (give --model)")
    if seq_len is None:
        lost.append("seq_len: not carried: a ds_config has none; written as 128 (give --seq-len)")
    if cfg.get("scheduler"):
        lost.append("scheduler: not carried: the harness trains at a constant learning rate")
    return _spec("deepspeed", workload, layout, lost)


def import_torchtitan(text: str, gpus: int | None = None) -> tuple[dict, list[str]]:
    """A spec from a torchtitan recipe (the form export_torchtitan writes)."""
    workload, layout, lost = read_torchtitan(text, gpus)
    return _spec("fsdp", workload, layout, lost)


def _spec(engine: str, workload: dict, layout: dict, lost: list[str]) -> tuple[dict, list[str]]:
    """The raw spec, checked by harness.spec: for the harness's engine of that name when it runs the
    layout, else for the own engine (the harness's Megatron-style engine); each with the layout's
    attention kernel, else sdpa (which picks its flash kernel where one runs). What changed is said
    in `lost`."""
    from harness.spec import parse_spec

    own = {**layout, "zero_stage": min(layout.get("zero_stage", 3), 1)}  # full sharding: ZeRO-1 at most
    own.pop("reshard_after_forward", None)
    tries = [(engine, layout), ("own", own)]
    first, why = None, {}
    for name, lay in tries:
        for attention in dict.fromkeys((lay.get("attention", "sdpa"), "sdpa")):
            raw = {"workload": workload, "layout": {"engine": name, **lay, "attention": attention}}
            try:
                parse_spec(raw)
            except SpecError as e:
                first, why[name] = first or e, e
                continue
            if name != engine:
                lost.append(
                    f"layout.engine: not carried: engine {engine} here refuses it ({why[engine]}); "
                    "written for engine own"
                )
            if attention != lay.get("attention", "sdpa"):
                lost.append(f"layout.attention: not carried: {lay['attention']} is refused here; written as sdpa")
            return raw, lost
    raise first
