"""DeepSpeed configs: locate, fill "auto" fields from the workload, refuse contradictions.

A ds_config is DeepSpeed's own JSON schema. Fields the workload decides are "auto" and are
filled here from the spec; an explicit value that contradicts the workload is refused with
SpecError(f"{file}: {key}", reason) - the CLI prints `error: <file>: <key>: <reason>` and exits
with 2 - before anything launches. Every contradiction of a file is listed at once (SpecErrors,
one line each), and so is every key that would change the precision policy (policy_keys.py:
bf16 master weights or optimizer states, fp16, torch_autocast, quantized ZeRO, ZenFlow, ...).
Knobs the workload does not decide (ZeRO bucket sizes, prefetch, persistence threshold, overlap)
are taken from the file as written: they are the deliberate choices documented in
ds_configs/README.md.

Workload-owned keys (explicit values must equal the workload's):
  train_batch_size                 = global_batch_size
  train_micro_batch_size_per_gpu   = layout.micro_batch_size
  gradient_accumulation_steps      = global_batch_size / (dp x micro_batch_size)
  gradient_clipping                = workload.grad_clip
  bf16.enabled                     = precision == bf16   (fp16.enabled must be false)
  data_types.grad_accum_dtype      = workload.grad_accum_dtype (fp32 under precision fp32): the
                                   dtype gradients are summed in over micro-batches. With bf16 at
                                   ZeRO-1 fp32 selects DeepSpeed's BF16_Optimizer (fp32 gradient
                                   buffer of the whole model), bf16 its ZeRO optimizer (runtime/
                                   engine.py, _do_optimizer_sanity_check)
  communication_data_type          = workload.grad_reduce_dtype (fp32 under precision fp32): the
                                   dtype of the data-parallel gradient reduction (DeepSpeed's
                                   default would be the parameters' dtype, bf16)
  seq_parallel_communication_data_type = the same, when cp > 1: under Ulysses DeepSpeed reduces
                                   the gradients in it instead (runtime/engine.py; default fp32)
  bf16.check_grad_overflow         = false under bf16: DeepSpeed's ZeRO-1/2 optimizer would skip
                                   a step whose gradients are not finite, which the reference
                                   never does. (BF16_Optimizer and ZeRO-3 skip such a step
                                   whatever this says; the adapter then stops the run with an
                                   error, deepspeed_common.DeepSpeedBase.check_step_applied.)
  data_types.param_dtype           = the precision, when given (DeepSpeed asserts the same)
  optimizer.type                   = AdamW (or Adam with adam_w_mode true)
  optimizer.params.lr/betas/eps/weight_decay = workload.optimizer
  optimizer.params.torch_adam      auto: true on CPU (torch.optim.AdamW, the reference's
                                   optimizer), left out on GPU (DeepSpeed's FusedAdam; with
                                   optimizer offload its CPUAdam)
  zero_optimization.stage          = layout.zero_stage (0 only under the pipeline engine, pp > 1)
  tensor_parallel.autotp_size      = layout.tp (DeepSpeed's AutoTP training; filled when tp > 1)
  expert_parallel.*                = layout.ds_moe autoep: AutoEP's section (autoep_config.py); refused
                                   enabled under ds_moe layer
  scheduler                        refused: the workload's learning rate is constant
"""

from __future__ import annotations

import copy
import json
import math
import os

from harness import resources
from harness.errors import SpecError, raise_all
from harness.frameworks.deepspeed.autoep_config import fill_expert_parallel
from harness.frameworks.deepspeed.policy_keys import policy_switches
from harness.spec import micro_batch_count
from harness.spec.schema import BF16_PRECISIONS

AUTO = "auto"
# The folder holding ds_configs/: the repository root, or the installed package's copy (harness.resources)
DATA_ROOT = str(resources.root())
DS_CONFIG_DIR = str(resources.path("ds_configs"))
DEFAULT_FILES = {0: "zero0.json", 1: "zero1.json", 2: "zero2.json", 3: "zero3.json"}

# ZeRO knobs that may be "auto": the Hugging Face Trainer's convention from the hidden size.
_ZERO_AUTO = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def resolve_path(path: str, zero_stage: int) -> str:
    """The config file a layout means: its ds_config, else ds_configs/zero<stage>.json.

    A relative path is tried against the working directory first, then the folder holding the
    shipped ds_configs/ (the repository root, or the installed package's copy), then ds_configs/
    itself (so specs written as `ds_config: ds_configs/zero3.json` work from anywhere).
    """
    if not path:
        if zero_stage not in DEFAULT_FILES:
            raise SpecError("layout.zero_stage", "deepspeed runs ZeRO stage 1, 2 or 3 (0 with pp > 1)")
        return os.path.join(DS_CONFIG_DIR, DEFAULT_FILES[zero_stage])
    if os.path.isabs(path) or os.path.isfile(path):
        return os.path.abspath(path)
    for base in (DATA_ROOT, DS_CONFIG_DIR):
        candidate = os.path.join(base, path)
        if os.path.isfile(candidate):
            return candidate
    return os.path.abspath(path)


def recorded_name(path: str, zero_stage: int) -> str:
    """What records, reports and messages call a layout's ds_config: the path as the user gave
    it (relative stays relative), or `ds_configs/zero<stage>.json` for the default, wherever the
    file itself is read from (resolve_path)."""
    return path or f"ds_configs/{DEFAULT_FILES.get(zero_stage, f'zero{zero_stage}.json')}"


def load_raw(path: str) -> dict:
    if not os.path.isfile(path):
        raise SpecError("layout.ds_config", f"file {path!r} does not exist")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise SpecError(path, f"not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise SpecError(path, "top level must be a JSON object")
    return raw


# DeepSpeed's spellings of a dtype (runtime/config.py: DtypeEnum; communication_data_type
# takes fp32/bf16/fp16 in any case)
_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def _same_dtype(a, b) -> bool:
    return isinstance(a, str) and _DTYPE_ALIASES.get(a.lower()) == b


def _same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=False))
    return a == b


class _Filler:
    """Fills a config's workload-owned keys and collects every contradiction (not only the first:
    a user fixes a file in one go), raised together at the end of build_config."""

    def __init__(self, name: str, cfg: dict):
        self.name, self.cfg = name, cfg
        self.filled: list[str] = []
        self.errors: list[SpecError] = []

    def refuse(self, dotted: str, reason: str) -> None:
        self.errors.append(SpecError(f"{self.name}: {dotted}", reason))

    def fatal(self, dotted: str, reason: str) -> None:
        """A contradiction that stops the reading here (a section that is not a JSON object): it
        is raised at once, with those found before it."""
        self.refuse(dotted, reason)
        raise_all(self.errors)

    def own(self, dotted: str, value, what: str, required: bool = True, same=None):
        """Set a workload-owned key: fill "auto"/missing, refuse an explicit different value
        (`same(explicit, value)` decides equality where DeepSpeed accepts several spellings)."""
        parent, key = self._parent(dotted, create=required)
        if parent is None:
            return
        if key not in parent or parent[key] == AUTO:
            if key in parent or required:
                parent[key] = value
                self.filled.append(dotted)
            return
        if not (same or _same)(parent[key], value):
            self.refuse(
                dotted, f'{parent[key]!r} contradicts the workload\'s {what} = {value!r}; use "auto" or {value!r}'
            )

    def _parent(self, dotted: str, create: bool):
        node = self.cfg
        parts = dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            if part not in node:
                if not create:
                    return None, parts[-1]
                node[part] = {}
            if not isinstance(node[part], dict):
                self.fatal(".".join(parts[: i + 1]), "must be a JSON object")
            node = node[part]
        return node, parts[-1]


def _find_auto(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _find_auto(v, f"{prefix}.{k}" if prefix else k)
    elif node == AUTO:
        yield prefix


def _adamw(f, cfg: dict, w, zero: dict, device_type: str) -> None:
    """The config's optimizer section: AdamW with the workload's hyperparameters (module docstring)."""
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    if not isinstance(opt, dict):
        f.fatal("optimizer", "must be a JSON object")
    otype = opt.get("type", "AdamW")
    params = opt.setdefault("params", {})
    if not isinstance(params, dict):
        f.fatal("optimizer.params", "must be a JSON object")
    if str(otype).lower() == "adam":
        if params.get("adam_w_mode", True) is not True:
            f.refuse("optimizer.params.adam_w_mode", "the workload's optimizer is AdamW")
    elif str(otype).lower() != "adamw":
        f.refuse("optimizer.type", f"{otype!r} contradicts the workload's optimizer AdamW")
    o = w.optimizer
    f.own("optimizer.params.lr", float(o.lr), "optimizer.lr")
    f.own("optimizer.params.betas", [float(b) for b in o.betas], "optimizer.betas")
    f.own("optimizer.params.eps", float(o.eps), "optimizer.eps")
    f.own("optimizer.params.weight_decay", float(o.weight_decay), "optimizer.weight_decay")
    offload = isinstance(zero.get("offload_optimizer"), dict) and zero["offload_optimizer"].get(
        "device", "none"
    ) not in ("none", None)
    if params.get("torch_adam", AUTO) == AUTO:
        # CPU: the reference's torch.optim.AdamW. GPU: FusedAdam; with optimizer offload,
        # DeepSpeed's CPUAdam (chosen by DeepSpeed itself when torch_adam is false). Written only
        # when true: false is DeepSpeed's default, and a key DeepSpeed does not take out itself
        # reaches whatever optimizer a config's section builds from these params.
        params.pop("torch_adam", None)
        if device_type == "cpu" and not offload:
            params["torch_adam"] = True
        f.filled.append("optimizer.params.torch_adam")


def build_config(
    spec, shape=None, *, dp: int | None = None, device_type: str | None = None, path: str | None = None
) -> tuple[dict, str, list[str]]:
    """The DeepSpeed config for this run: (config, its file as recorded (recorded_name), keys
    filled from the workload).

    Pure and cheap (no torch, no deepspeed import), so it runs before launch as well as in
    each rank. `dp` is the data-parallel degree (world size / (tp x pp); default layout.dp).
    `device_type` picks the optimizer implementation ("cpu": torch.optim.AdamW, "cuda":
    FusedAdam); None means decide from the spec (workload.device, else probe CUDA).
    """
    w, lay = spec.workload, spec.layout
    file = path or resolve_path(lay.ds_config, lay.zero_stage)
    name = path or recorded_name(lay.ds_config, lay.zero_stage)  # as given: no machine paths in records
    cfg = copy.deepcopy(load_raw(file))
    dp = dp or lay.dp
    f = _Filler(name, cfg)

    f.own("train_batch_size", w.global_batch_size, "global_batch_size")
    f.own("train_micro_batch_size_per_gpu", lay.micro_batch_size, "layout.micro_batch_size")
    f.own(
        "gradient_accumulation_steps",
        micro_batch_count(w.global_batch_size, dp, lay.micro_batch_size),
        f"global_batch_size / (dp x micro_batch_size) = {w.global_batch_size} / ({dp} x {lay.micro_batch_size})",
    )
    f.own("gradient_clipping", float(w.grad_clip), "grad_clip")
    f.own("bf16.enabled", w.precision in BF16_PRECISIONS, f"precision ({w.precision})")  # fp8: bf16 + FP8 GEMMs
    _precision_policy(f, cfg, w, lay)
    policy_switches(f, cfg)
    if "scheduler" in cfg:
        f.refuse("scheduler", "the workload's learning rate is constant; remove the scheduler")

    if device_type is None:
        device_type = _device_type(w.device)
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        f.fatal("zero_optimization", "must be a JSON object")
    if w.optimizer.name == "muon":  # no section: the harness hands DeepSpeed its MuonWithAuxAdam (deepspeed/muon.py)
        opt = cfg.pop("optimizer", {})  # the files' AdamW template, every value "auto": the workload decides
        params = opt.get("params", {}) if isinstance(opt, dict) else None
        if not isinstance(params, dict) or any(v != AUTO for v in params.values()):
            f.refuse(
                "optimizer",
                "the workload's optimizer is Muon, given to DeepSpeed as its MuonWithAuxAdam over the workload's "
                "split (harness/frameworks/deepspeed/muon.py): remove the section or leave its params auto",
            )
    else:
        _adamw(f, cfg, w, zero, device_type)

    # ZeRO
    f.own("zero_optimization.stage", lay.zero_stage, "layout.zero_stage")
    hidden = shape.hidden if shape is not None else None
    for key, rule in _ZERO_AUTO.items():
        if zero.get(key) == AUTO:
            if hidden is None:
                from harness.model.presets import resolve_shape

                hidden = resolve_shape(w.model, w.model_overrides).hidden
            zero[key] = rule(hidden)
            f.filled.append(f"zero_optimization.{key}")

    # AutoTP: its degree is the layout's tp (a file may say nothing, "auto" or the same number)
    f.own("tensor_parallel.autotp_size", lay.tp, "layout.tp", required=lay.tp > 1)
    # AutoEP (layout.ds_moe autoep): the expert_parallel section describing the harness's MoE block
    if shape is None and lay.ds_moe == "autoep":
        from harness.model.presets import resolve_shape

        shape = resolve_shape(w.model, w.model_overrides)
    fill_expert_parallel(f, cfg, lay, shape)

    # DeepSpeed activation checkpointing follows the layout; the section holds only its knobs.
    ac = cfg.get("activation_checkpointing")
    if ac is not None and not isinstance(ac, dict):
        f.fatal("activation_checkpointing", "must be a JSON object")
    pipe = cfg.get("pipeline")
    if pipe is not None and not isinstance(pipe, dict):
        f.fatal("pipeline", "must be a JSON object")
    if pipe and pipe.get("activation_checkpoint_interval") == AUTO:
        pipe["activation_checkpoint_interval"] = 0  # the pipeline engine is given it by the adapter
        f.filled.append("pipeline.activation_checkpoint_interval")
    if pipe and pipe.get("activation_checkpoint_interval", 0) != 0:
        f.refuse(
            "pipeline.activation_checkpoint_interval",
            'layout.activation_checkpointing decides it (full: every block); use "auto" or 0',
        )

    for key in _find_auto(cfg):
        f.refuse(key, '"auto" is not filled from the workload for this key; set a value')
    raise_all(f.errors)
    cfg.setdefault("steps_per_print", 10**9)
    cfg.setdefault("wall_clock_breakdown", False)
    return cfg, name, f.filled


def _precision_policy(f: _Filler, cfg: dict, w, lay) -> None:
    """DeepSpeed's keys for the workload's precision policy (harness/model/training.py,
    PrecisionPolicy): what gradients accumulate in, what they are reduced in, no skipped steps."""
    bf16 = w.precision in BF16_PRECISIONS  # fp8: bf16 parameters, FP8 GEMMs inside the linears (torchao)
    accum = w.grad_accum_dtype if bf16 else "fp32"
    reduce = w.grad_reduce_dtype if bf16 else "fp32"
    f.own("data_types.grad_accum_dtype", accum, "grad_accum_dtype", same=_same_dtype)
    f.own("communication_data_type", reduce, "grad_reduce_dtype", same=_same_dtype)
    f.own("data_types.param_dtype", "bf16" if bf16 else "fp32", "precision", required=False, same=_same_dtype)
    if lay.cp > 1:  # under Ulysses DeepSpeed reduces the gradients in this dtype instead (runtime/engine.py)
        f.own("seq_parallel_communication_data_type", reduce, "grad_reduce_dtype", same=_same_dtype)
        zero = cfg.get("zero_optimization") or {}
        if zero.get("reduce_scatter", True) is False:
            f.refuse(
                "zero_optimization.reduce_scatter",
                "false with cp > 1: under Ulysses DeepSpeed 0.19.8's all-reduce paths differ from its "
                "reduce-scatter (ZeRO-3 divides the gradients by dp instead of dp x cp, ZeRO-1/2 reduce "
                "in fp32 whatever communication_data_type says); remove the key or set true",
            )
    section = cfg.get("bf16")
    if bf16 or isinstance(section, dict) and section.get("check_grad_overflow") == AUTO:
        parent, _ = f._parent("bf16.check_grad_overflow", create=True)
        explicit = parent.get("check_grad_overflow", AUTO)
        if explicit == AUTO:
            parent["check_grad_overflow"] = False
            f.filled.append("bf16.check_grad_overflow")
        elif explicit is not False:
            f.refuse(
                "bf16.check_grad_overflow",
                f"{explicit!r} would let DeepSpeed skip a step whose gradients are not finite; the "
                f'reference never skips one: use "auto" or false',
            )


def _device_type(requested: str) -> str:
    if requested in ("cpu", "cuda"):
        return requested
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def validate(spec) -> None:
    """Refuse a contradicting ds_config before launch (no-op for other engines)."""
    if spec.layout.engine == "deepspeed":
        build_config(spec)
