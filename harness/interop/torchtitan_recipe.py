"""A torchtitan recipe's settings, read as text (ast), never run: one function of a `config_registry.py`
(chosen by name where the file has several) returning a Trainer.Config, either built in place
(`return Trainer.Config(model_spec=..., training=TrainingConfig(...), ...)`, as torchtitan's own
recipes are) or derived from another recipe (`config = llama3_8b()` then `config.x.y = ...`). A base
recipe of the same file is read first; one imported from torchtitan takes the values its
config_registry gives it at TORCHTITAN_MAIN (UPSTREAM). Only constant values are taken (numbers,
strings, their arithmetic); any other statement is listed as not carried. Field names are
torchtitan/config/configs.py's (TrainingConfig, ParallelismConfig) at the release or main.
"""

from __future__ import annotations

import ast
import operator

from harness.errors import SpecError

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
    "expert_parallel_degree": 1,
    "pipeline_parallel_layers_per_stage": None,
    "pipeline_parallel_first_stage_less_layers": 1,
    "pipeline_parallel_last_stage_less_layers": 1,
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
AC = {"FullAC": "full", "SelectiveAC": "selective_op"}  # SelectiveAC is per-op only (0.3.0 and main)
# torchtitan's llama3 recipes (torchtitan/models/llama3/config_registry.py at TORCHTITAN_MAIN), for a
# recipe derived from one it imports: the settings they make that the harness carries.
UPSTREAM = {
    "llama3_8b": {
        "flavor": "8B",
        "optimizer": {"lr": 3e-4},
        "training": {"num_tokens_per_microbatch_per_dp_rank": 8192, "max_context_length": 8192},
        "activation_checkpoint": "selective_op",
    },
    "llama3_70b": {
        "flavor": "70B",
        "optimizer": {"lr": 1.5e-4},
        "training": {"num_tokens_per_microbatch_per_dp_rank": 8 * 8192, "max_context_length": 8192},
        "parallelism": {"tensor_parallel_degree": 8},
        "activation_checkpoint": "full",
    },
    "qwen3_30b_a3b": {  # torchtitan/models/qwen3/config_registry.py
        "family": "qwen3",
        "flavor": "30B-A3B",
        "optimizer": {"lr": 8e-4},
        "lr_scheduler": {"warmup_steps": 600},
        "training": {"num_tokens_per_microbatch_per_dp_rank": 2 * 4096, "max_context_length": 4096},
        "activation_checkpoint": "full",
    },
    "llama3_405b": {
        "flavor": "405B",
        "fp8": "rowwise",
        "optimizer": {"lr": 8e-5},
        "lr_scheduler": {"warmup_steps": 600},
        "training": {"num_tokens_per_microbatch_per_dp_rank": 2 * 8192, "max_context_length": 8192},
        "parallelism": {"tensor_parallel_degree": 8},
        "activation_checkpoint": "full",
        "compile": {"enable": True},
    },
}
# Model converters (torchtitan/components/quantization): torchao's Float8 (rowwise in torchtitan's
# Float8LinearConverter) is the harness's fp8 rowwise; its MX converters (torchao's MXFP8Linear and MXFP8
# grouped GEMM, RCEIL scales) the harness's mxfp8.
CONVERTERS = {
    "Float8LinearConverter.Config": "rowwise",
    "Float8GroupedExpertsConverter.Config": "rowwise",
    "MXFP8LinearConverter.Config": "mxfp8",
    "MXFP8GroupedExpertsConverter.Config": "mxfp8",
}
# MXFP8LinearConverter's fqns (an include list, substring match) that convert exactly the harness's linears:
# every block linear (attention, a dense feed-forward), not the LM head nor a MoE's router gate
MX_BLOCK_FQNS = {"attention", "feed_forward"}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}
_OPS[ast.Div] = operator.truediv
# Trainer.Config's sections that say nothing about the layout, the batch or the optimizer
IGNORED = {"loss", "hf_assets_path", "profiler", "metrics", "dataloader", "checkpoint", "validator", "comm"}


def fresh() -> dict:
    return {
        "parallelism": dict(PARALLELISM),
        "training": dict(TRAINING),
        "optimizer": dict(ADAMW),
        "set": set(),
        "upstream": set(),
    }


def constant(node, field: str, names: dict | None = None):
    """A constant: a literal, its arithmetic, or a local name bound to one."""
    if isinstance(node, ast.Name) and names and node.id in names:
        return constant(names[node.id], field, names)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](constant(node.left, field, names), constant(node.right, field, names))
    if isinstance(node, (ast.List, ast.Tuple)):
        return [constant(e, field, names) for e in node.elts]
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise SpecError(field, f"not a constant: {ast.unparse(node)}") from None


def _target(node) -> str:
    """`config.a.b` as "a.b" ("" for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == "config" else ""


def call_name(node) -> str:
    return ast.unparse(node.func) if isinstance(node, ast.Call) else ""


def _toml(text: str) -> bool:
    import tomllib

    try:
        return bool(tomllib.loads(text))
    except tomllib.TOMLDecodeError:
        return False


def recipes(text: str) -> dict:
    """The file's functions by name (its recipes); a TOML job config is named as the old format."""
    old = SpecError(
        "recipe",
        "a TOML job config, torchtitan's format before February 2026: write it as a config_registry function "
        "returning Trainer.Config (torchtitan/config/README.md)",
    )
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        if _toml(text):
            raise old from None
        raise SpecError("recipe", f"not Python: line {e.lineno}: {e.msg}") from None
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if not funcs and _toml(text):
        raise old
    return funcs


def read_recipe(text: str, recipe: str | None = None) -> tuple[dict, list[str]]:
    """The recipe's settings: {"flavor", "attn_backend", "fp8", "parallelism", "training", "optimizer",
    "lr_scheduler", "activation_checkpoint", "compile", "set", "upstream"}, and what is not carried."""
    funcs = recipes(text)
    if recipe is None:
        if len(funcs) != 1:
            names = ", ".join(funcs) if funcs else "none"
            raise SpecError("--recipe", f"the file has {len(funcs)} recipe functions ({names}): name one")
        recipe = next(iter(funcs))
    elif recipe not in funcs:
        raise SpecError("--recipe", f"{recipe!r} is not a function of the file ({', '.join(funcs) or 'none'})")
    got, lost = fresh(), []
    # the model family whose model_registry the file calls (its imports say; llama3 unless qwen3's)
    got["family"] = "qwen3" if "models.qwen3" in text or "Qwen3Model" in text else "llama3"
    _apply(funcs, recipe, got, lost, 0)
    _check(got)
    return got, lost


# The values each carried field takes: whole numbers from a lower bound (-1: torchtitan's "the rest"),
# or a type.
WHOLE = {
    **dict.fromkeys(
        "tensor_parallel_degree pipeline_parallel_degree context_parallel_degree expert_parallel_degree "
        "data_parallel_replicate_degree pipeline_parallel_microbatch_size num_pp_microbatches local_batch_size "
        "seq_len num_tokens_per_microbatch_per_dp_rank max_context_length".split(),
        1,
    ),
    **dict.fromkeys("data_parallel_shard_degree global_batch_size num_tokens_per_train_step".split(), -1),
    **dict.fromkeys("pipeline_parallel_first_stage_less_layers pipeline_parallel_last_stage_less_layers".split(), 0),
}


def _check(got: dict) -> None:
    """SpecError for a carried value torchtitan would not take (a string degree, a zero batch, ...)."""
    for section in ("parallelism", "training"):
        for key, value in got[section].items():
            field = f"{section}.{key}"
            if key in WHOLE:
                low = WHOLE[key]
                if not isinstance(value, int) or isinstance(value, bool) or value < low or (low == -1 and value == 0):
                    need = "-1 or a whole number >= 1" if low == -1 else f"a whole number >= {low}"
                    raise SpecError(field, f"needs {need}, got {value!r}")
            elif key == "pipeline_parallel_layers_per_stage":
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                    raise SpecError(field, f"needs None or a whole number >= 1, got {value!r}")
            elif key in ("enable_sequence_parallel", "disable_cuda_graphs") and not isinstance(value, bool):
                raise SpecError(field, f"needs True or False, got {value!r}")
            elif key == "max_norm" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise SpecError(field, f"needs a number, got {value!r}")
            elif key not in ("max_norm",) and not isinstance(value, (int, float, str, bool)):
                raise SpecError(field, f"not a value torchtitan takes: {value!r}")
    components = (got.get("compile") or {}).get("components", [])
    if not isinstance(components, list) or not all(isinstance(c, str) for c in components):
        raise SpecError("compile.components", f"needs a list of names, got {components!r}")


def _upstream(name: str, got: dict) -> None:
    base = UPSTREAM[name]
    for section in ("parallelism", "training", "optimizer"):
        got[section].update(base.get(section, {}))
        got["upstream"] |= {f"{section}.{k}" for k in base.get(section, {})}
    for key in ("family", "flavor", "fp8", "activation_checkpoint", "lr_scheduler", "compile"):
        if key in base:
            got[key] = base[key]


def _apply(funcs: dict, name: str, got: dict, lost: list[str], depth: int) -> None:
    if depth > len(funcs):
        raise SpecError("recipe", f"{name} derives from itself")
    names = {}
    for st in funcs[name].body:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant) or isinstance(st, ast.Assert):
            continue  # a docstring, an assertion
        if isinstance(st, ast.Return):
            if isinstance(st.value, ast.Call):
                _trainer_config(st.value, got, lost, names)
            continue
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
            lost.append(f"{ast.unparse(st).splitlines()[0]}: not carried: not an assignment")
            continue
        target, value = st.targets[0], st.value
        if isinstance(target, ast.Name) and target.id == "config":
            base = call_name(value)
            if base in funcs:
                _apply(funcs, base, got, lost, depth + 1)
            elif base in UPSTREAM:
                _upstream(base, got)
            else:
                raise SpecError("recipe", f"starts from {base or ast.unparse(value)}, not one of {', '.join(UPSTREAM)}")
        elif isinstance(target, ast.Name):
            names[target.id] = value
        else:
            _set(_target(target), value, got, lost, names)


def _trainer_config(call, got: dict, lost: list[str], names: dict) -> None:
    """`Trainer.Config(section=..., ...)`: each section as the assignment `config.section = ...`."""
    if call_name(call) != "Trainer.Config":
        raise SpecError("recipe", f"returns {ast.unparse(call.func)}(...), not Trainer.Config(...)")
    for kw in call.keywords:
        value = names.get(kw.value.id, kw.value) if isinstance(kw.value, ast.Name) else kw.value
        if kw.arg in IGNORED:
            continue
        if kw.arg in ("training", "parallelism") and call_name(value) in ("TrainingConfig", "ParallelismConfig"):
            for sub in value.keywords:
                _set(f"{kw.arg}.{sub.arg}", sub.value, got, lost, names)
        else:
            _set(kw.arg, value, got, lost, names)


def _set(name: str, value, got: dict, lost: list[str], names: dict) -> None:
    """One setting, `config.<name> = value`."""
    value = names.get(value.id, value) if isinstance(value, ast.Name) else value
    if name == "model_spec":
        _model_spec(value, got, lost, names)
    elif name.count(".") == 1 and name.split(".")[0] in ("parallelism", "training"):
        section, key = name.split(".")
        if key not in got[section]:
            lost.append(f"{name}: not carried: the harness has no such setting")
        else:
            got[section][key] = constant(value, name, names)
            got["set"].add(name)
    elif name == "optimizer":
        if call_name(value) != "default_adamw":
            raise SpecError("optimizer", f"not default_adamw(...): {ast.unparse(value)}")
        got["optimizer"] = dict(ADAMW)
        for kw in value.keywords:
            if kw.arg not in ADAMW:
                lost.append(f"optimizer.{kw.arg}: not carried: the harness's AdamW has no such option")
            else:
                got["optimizer"][kw.arg] = constant(kw.value, f"optimizer.{kw.arg}", names)
    elif name in ("lr_scheduler", "compile") and not isinstance(value, ast.Call):
        raise SpecError(name, f"not a config call: {ast.unparse(value)}")
    elif name == "lr_scheduler":
        got["lr_scheduler"] = {kw.arg: constant(kw.value, f"lr_scheduler.{kw.arg}", names) for kw in value.keywords}
    elif name == "compile":
        if call_name(value) != "CompileConfig":
            raise SpecError("compile", f"not CompileConfig(...): {ast.unparse(value)}")
        got["compile"] = {kw.arg: constant(kw.value, f"compile.{kw.arg}", names) for kw in value.keywords}
    elif name in ("compile.enable", "compile.components"):
        got.setdefault("compile", {})[name.split(".")[1]] = constant(value, name, names)
    elif name == "activation_checkpoint":
        call = call_name(value).removesuffix(".Config")
        if isinstance(value, ast.Constant) and value.value is None:
            got["activation_checkpoint"] = "none"
        elif call in AC:
            got["activation_checkpoint"] = AC[call]
        else:
            raise SpecError("activation_checkpoint", f"not FullAC, SelectiveAC or None: {ast.unparse(value)}")
    else:
        lost.append(f"{name or 'a statement'}: not carried: the harness has no such setting")


def _model_spec(value, got: dict, lost: list[str], names: dict) -> None:
    if call_name(value) != "model_registry" or not value.args:
        raise SpecError("model_spec", f"not model_registry(flavor, ...): {ast.unparse(value)}")
    got["flavor"] = constant(value.args[0], "model_spec", names)
    got.pop("fp8", None)
    for kw in value.keywords:
        if kw.arg == "attn_backend":
            got["attn_backend"] = constant(kw.value, "model_spec.attn_backend", names)
        elif kw.arg == "converters" and isinstance(kw.value, (ast.List, ast.Tuple)):
            _converters(kw.value.elts, got, lost, names)
        else:
            lost.append(f"model_spec.{kw.arg}: not carried: the harness's model has no such option")


def _converters(elts, got: dict, lost: list[str], names: dict) -> None:
    """model_registry's converters: one FP8 recipe, Float8's (rowwise) or the MX converters' (mxfp8), and what
    of their filters the harness does not carry (it converts every block linear and a MoE's experts, never the
    LM head nor the router)."""
    kinds = [call_name(conv) for conv in elts]
    for kind, conv in zip(kinds, elts, strict=True):
        if kind not in CONVERTERS:
            raise SpecError(
                "model_spec.converters",
                f"{kind or ast.unparse(conv)}: the harness's converters are {', '.join(CONVERTERS)}",
            )
    recipes = {CONVERTERS[k] for k in kinds}
    if len(recipes) > 1:
        raise SpecError("model_spec.converters", "Float8 and MXFP8 converters together: the harness runs one recipe")
    gw_hp = False
    for kind, conv in zip(kinds, elts, strict=True):
        # the settings read (model_compile_enabled, often an expression in torchtitan's recipes, only warns)
        args = {
            k.arg: constant(k.value, f"model_spec.converters.{k.arg}", names)
            for k in conv.keywords
            if k.arg in ("recipe_name", "filter_fqns", "fqns")
        }
        if kind == "Float8LinearConverter.Config":
            recipe = args.get("recipe_name", "rowwise")
            if recipe not in ("rowwise", "rowwise_with_gw_hp"):
                raise SpecError(
                    "model_spec.converters", f"Float8 recipe {recipe!r}: the harness runs rowwise or rowwise_with_gw_hp"
                )
            gw_hp = recipe == "rowwise_with_gw_hp"
            skipped = set(args.get("filter_fqns", []))
            router = {"router.gate", "router", "gate"} if got["family"] == "qwen3" else set()
            if skipped - {"lm_head", "output"} - router:
                lost.append(
                    "model_spec.converters.filter_fqns: not carried: the harness converts every linear but the LM head"
                    + (" and the router gate" if router else "")
                )
            elif not skipped & {"lm_head", "output"}:
                lost.append(
                    "model_spec.converters.filter_fqns: not carried: the recipe converts the LM head too, "
                    "the harness keeps it in high precision"
                )
            elif router and not skipped & router:
                lost.append(
                    "model_spec.converters.filter_fqns: not carried: the recipe converts the router gate too, "
                    "the harness routes in fp32"
                )
        elif kind == "MXFP8LinearConverter.Config":
            _mx_fqns(args.get("fqns", []), got["family"], lost)
        elif kind == "MXFP8GroupedExpertsConverter.Config" and args.get("recipe_name", "mxfp8_rceil") != "mxfp8_rceil":
            raise SpecError(
                "model_spec.converters", f"MXFP8 recipe {args['recipe_name']!r}: the harness runs mxfp8_rceil"
            )
    moe = got["family"] == "qwen3"
    if "mxfp8" in recipes and "MXFP8LinearConverter.Config" not in kinds:
        lost.append(
            "model_spec.converters: not carried: the recipe keeps the block linears in bf16, the harness's "
            "mxfp8 converts them with the experts (MXFP8LinearConverter)"
        )
    for recipe, kind in (("mxfp8", "MXFP8"), ("rowwise", "Float8")):
        if recipe in recipes and moe and f"{kind}GroupedExpertsConverter.Config" not in kinds:
            lost.append(
                f"model_spec.converters: not carried: the recipe keeps the experts in bf16, the harness's {recipe} "
                f"converts them too ({kind}GroupedExpertsConverter)"
            )
    if "rowwise" in recipes and "Float8LinearConverter.Config" not in kinds:
        lost.append(
            "model_spec.converters: not carried: the recipe keeps the attention linears in bf16, the harness's "
            "rowwise converts them with the experts (Float8LinearConverter)"
        )
    got["fp8"] = recipes.pop() if recipes else None
    if got["fp8"] == "rowwise" and gw_hp:  # Float8LinearConverter's recipe_name, its weight gradients in bf16
        got["fp8"] = "rowwise_with_gw_hp"


def _mx_fqns(fqns: list, family: str, lost: list[str]) -> None:
    """MXFP8LinearConverter's include list against the harness's linears (MX_BLOCK_FQNS)."""
    exact = MX_BLOCK_FQNS | ({"layers"} if family == "llama3" else set())  # llama3's layers hold no router
    if not fqns:
        head = "the LM head and the router gate" if family == "qwen3" else "the LM head"
        lost.append(
            f"model_spec.converters.fqns: not carried: empty, the recipe converts every Linear, {head} included; "
            "the harness keeps them in high precision"
        )
    elif set(fqns) - exact:
        lost.append(
            f"model_spec.converters.fqns: not carried: {', '.join(sorted(set(fqns) - exact))}; the harness converts "
            "the block linears (attention, feed_forward) only"
        )
    elif not ("layers" in fqns or "attention" in fqns and ("feed_forward" in fqns or family == "qwen3")):
        lost.append(
            f"model_spec.converters.fqns: not carried: {', '.join(fqns)} leaves block linears in bf16; the harness "
            "converts every one (attention, feed_forward)"
        )
