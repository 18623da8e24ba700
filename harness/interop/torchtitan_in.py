"""A torchtitan recipe read back as a harness workload and layout (harness/interop/imports.py).

The recipe is the form harness/interop/torchtitan_out.py writes for torchtitan TORCHTITAN: one
function that starts from a llama3 recipe and assigns fields. It is read as text with ast, never
run: only literal values are taken; any other statement is listed as not carried. Field names are
torchtitan/config/configs.py's (TrainingConfig, ParallelismConfig) in that release, or main's
token-budget names (TORCHTITAN_MAIN, MAIN_FIELDS); unset fields take their defaults there.
"""

from __future__ import annotations

import ast

from harness.errors import SpecError
from harness.interop.torchtitan_out import FLAVORS, MAIN_FIELDS, RECIPES, SCHEDULES

# torchtitan/config/configs.py in TORCHTITAN and at TORCHTITAN_MAIN (main's names last): the
# defaults of the fields the harness carries.
PARALLELISM = {
    "data_parallel_replicate_degree": 1,
    "data_parallel_shard_degree": -1,
    "fsdp_reshard_after_forward": "default",
    "tensor_parallel_degree": 1,
    "enable_sequence_parallel": True,
    "pipeline_parallel_degree": 1,
    "pipeline_parallel_schedule": "1F1B",
    "context_parallel_degree": 1,
    "pipeline_parallel_layers_per_stage": None,
    "pipeline_parallel_microbatch_size": 1,
    "num_pp_microbatches": 1,
}
TRAINING = {
    "local_batch_size": 8,
    "global_batch_size": -1,
    "seq_len": 2048,
    "num_tokens_per_microbatch_per_dp_rank": 16384,
    "num_tokens_per_train_step": -1,
    "max_context_length": 2048,
    "max_norm": 1.0,
    "dtype": "float32",
    "mixed_precision_param": "bfloat16",
    "mixed_precision_reduce": "float32",
    "disable_cuda_graphs": False,
}
# default_adamw's (torchtitan/components/optimizer/optimizer.py)
ADAMW = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
AC = {"FullAC": "full", "SelectiveAC": "selective"}


def _literal(node, field: str):
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise SpecError(field, f"not a literal: {ast.unparse(node)}") from None


def _target(node) -> str:
    """`config.a.b` as "a.b" ("" for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == "config" else ""


def _call_name(node) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def _recipe_body(text: str) -> list:
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        raise SpecError("recipe", f"not Python: line {e.lineno}: {e.msg}") from None
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    if len(funcs) != 1:
        raise SpecError("recipe", f"needs one function returning Trainer.Config, found {len(funcs)}")
    return funcs[0].body


def read_recipe(text: str) -> tuple[dict, list[str]]:
    """The recipe's settings: {"recipe", "flavor", "attn_backend", "parallelism", "training",
    "optimizer", "lr_scheduler", "activation_checkpoint", "compile"}, and the statements not carried."""
    got = {"parallelism": dict(PARALLELISM), "training": dict(TRAINING), "optimizer": dict(ADAMW), "set": set()}
    lost = []
    for st in _recipe_body(text):
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
            continue  # a docstring
        if isinstance(st, ast.Return):
            continue
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
            lost.append(f"{ast.unparse(st).splitlines()[0]}: not carried: not an assignment")
            continue
        target, value = st.targets[0], st.value
        name = _target(target)
        if isinstance(target, ast.Name) and target.id == "config":
            recipe = _call_name(value)
            if recipe not in RECIPES.values():
                raise SpecError(
                    "recipe", f"starts from {recipe or ast.unparse(value)}, not one of {', '.join(RECIPES.values())}"
                )
            got["recipe"] = recipe
        elif name == "model_spec":
            if _call_name(value) != "model_registry" or not value.args:
                raise SpecError("model_spec", f"not model_registry(flavor, ...): {ast.unparse(value)}")
            got["flavor"] = _literal(value.args[0], "model_spec")
            for kw in value.keywords:
                if kw.arg == "attn_backend":
                    got["attn_backend"] = _literal(kw.value, "model_spec.attn_backend")
                else:
                    lost.append(f"model_spec.{kw.arg}: not carried: the harness's model has no such option")
        elif name.count(".") == 1 and name.split(".")[0] in ("parallelism", "training"):
            section, key = name.split(".")
            if key not in got[section]:
                lost.append(f"{name}: not carried: the harness has no such setting")
            else:
                got[section][key] = _literal(value, name)
                got["set"].add(name)
        elif name == "optimizer":
            if _call_name(value) != "default_adamw":
                raise SpecError("optimizer", f"not default_adamw(...): {ast.unparse(value)}")
            for kw in value.keywords:
                if kw.arg not in ADAMW:
                    lost.append(f"optimizer.{kw.arg}: not carried: the harness's AdamW has no such option")
                else:
                    got["optimizer"][kw.arg] = _literal(kw.value, f"optimizer.{kw.arg}")
        elif name == "lr_scheduler":
            got["lr_scheduler"] = {kw.arg: _literal(kw.value, f"lr_scheduler.{kw.arg}") for kw in value.keywords}
        elif name == "compile":
            if _call_name(value) != "CompileConfig":
                raise SpecError("compile", f"not CompileConfig(...): {ast.unparse(value)}")
            got["compile"] = {kw.arg: _literal(kw.value, f"compile.{kw.arg}") for kw in value.keywords}
        elif name in ("compile.enable", "compile.components"):
            got.setdefault("compile", {})[name.split(".")[1]] = _literal(value, name)
        elif name == "activation_checkpoint":
            call = _call_name(value).removesuffix(".Config")
            if isinstance(value, ast.Constant) and value.value is None:
                got["activation_checkpoint"] = "none"
            elif call in AC:
                got["activation_checkpoint"] = AC[call]
            else:
                raise SpecError("activation_checkpoint", f"not FullAC, SelectiveAC or None: {ast.unparse(value)}")
        else:
            lost.append(f"{ast.unparse(target)}: not carried: the harness has no such setting")
    return got, lost


def read_torchtitan(text: str, gpus: int | None) -> tuple[dict, dict, list[str]]:
    """(workload, layout, not carried) of a torchtitan recipe."""
    got, lost = read_recipe(text)
    flavor = got.get("flavor") or next((f for f, r in RECIPES.items() if r == got.get("recipe")), None)
    if flavor not in FLAVORS:
        raise SpecError("model_spec", f"flavor {flavor!r} is not one of {', '.join(FLAVORS)} (llama3)")
    par, tr = got["parallelism"], got["training"]
    tp, pp, cp = par["tensor_parallel_degree"], par["pipeline_parallel_degree"], par["context_parallel_degree"]
    rep, shard = par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]
    if shard == -1:  # torchtitan: the ranks left over
        if gpus is None:
            raise SpecError("parallelism.data_parallel_shard_degree", "-1 (the ranks left over): give --gpus")
        shard = gpus // (rep * tp * pp * cp)
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
        per_stage = par["pipeline_parallel_layers_per_stage"]
        vp = FLAVORS[flavor][0] // (pp * per_stage) if per_stage else 2
        if not per_stage:
            lost.append(
                "parallelism.pipeline_parallel_layers_per_stage: not carried: unset; written as 2 stages per rank"
            )
    backend = got.get("attn_backend", "flex")
    attention = {"varlen": "flash2", "flex": "sdpa_efficient", "flex_flash": "flash2"}.get(backend)
    if attention is None:
        raise SpecError("model_spec.attn_backend", f"{backend!r} is not one of varlen, flex, flex_flash")
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
            "written as selective, Trainer.Config's default"
        )
    compiled = got.get("compile") or {}
    components = compiled.get("components", ["model", "loss"])  # CompileConfig's default
    if compiled.get("enable") and "loss" in components:
        lost.append("compile.components: not carried: loss (the harness compiles the transformer blocks only)")
    opt = got["optimizer"]
    workload = {
        "model": "llama3-8b",  # the 8B flavor; the others its shape overridden below
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
    if flavor != "8B":
        layers, hidden, ffn, heads, kv, vocab = FLAVORS[flavor]
        workload["model_overrides"] = {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "kv_heads": kv}
    layout = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "micro_batch_size": micro,
        "sequence_parallel": tp > 1 and par["enable_sequence_parallel"],
        "activation_checkpointing": ac or "selective",
        "attention": attention,
        "pipeline_schedule": schedule if pp > 1 else "1f1b",
        "virtual_stages": vp,
        "reshard_after_forward": par["fsdp_reshard_after_forward"] != "never",
        "compile": "blocks" if compiled.get("enable") and "model" in components else "none",
    }
    return workload, layout, lost


def _batch(got: dict, pp: int, dp: int) -> tuple[int, int, int]:
    """(sequence length, micro-batch size, global batch in sequences), from the release's fields or
    main's token budgets (whichever the recipe sets; not both)."""
    par, tr = got["parallelism"], got["training"]
    main = got["set"] & set(MAIN_FIELDS)
    if main and got["set"] & {"training.local_batch_size", "training.global_batch_size", "training.seq_len"}:
        raise SpecError(sorted(main)[0], "mixes torchtitan main's token budgets with the release's batch fields")
    if main:
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
