"""The engines: one line per engine (its name and its package), and EngineFacts, what each engine
declares in its package's facts.py as `ENGINE = EngineFacts(...)`: the fields it honours and their
values (opt-in: any other field not at its default is refused; harness/spec/honours.py names a choice
field's values in the schema's words, and what every engine honours), its defaults where a field must
differ, which layouts it runs, where it cannot follow the precision policy or build the model, its
label, how it is launched, whether `harness memory` traces it and whether the planner models it.

Adding an engine is its package (facts.py, adapter.py with build(), its heavy modules) plus one line
in ENGINES. The spec, build_engine, compare, sweeps, reports, the planner and the memory trace ask
`facts(name)`; `layout.engine` takes ENGINES' names. The engines lie above the spec (they import
torch and the model), yet the spec's checks need their facts: reaching up to them by module name,
on first use, is this module's one job. It imports no engine itself, and facts.py imports no torch,
so `import harness.spec` and reading every engine's facts stay light.
"""

from __future__ import annotations

import importlib
import importlib.util
import typing
from dataclasses import dataclass, field

from harness.errors import SpecError

ENGINES: dict[str, str] = {
    "single": "harness.frameworks.single",
    "own": "harness.engine",
    "deepspeed": "harness.frameworks.deepspeed",
    "fsdp": "harness.frameworks.fsdp",
    "megatron": "harness.frameworks.megatron",
}


@dataclass(frozen=True)
class Honoured:
    """A field an engine honours: the values it runs (None: any value, for a field that is not a choice)
    and, where it runs only some, why. A field at its default is never refused (it asks for nothing)."""

    values: tuple | None = None
    why: str = ""


ANY = Honoured()


def only(*values, why: str) -> Honoured:
    """The field is honoured with these values only; `why` is the one-line reason for the others. For a
    field that is not a choice (a degree, a ZeRO stage): a choice field's are harness.spec.honours.some's."""
    return Honoured(tuple(values), why)


# Better words than "does not use it" for the fields only one engine has ({engine}: the refusing one).
ONE_ENGINES_FIELDS: dict[str, str] = {
    "layout.ds_config": "only for engine deepspeed",
    "layout.model_impl": "hf (transformers' LlamaForCausalLM) is for engine deepspeed",
    "layout.ds_moe": "for engine deepspeed: its MoE layer, deepspeed.moe.layer.MoE (layer) or AutoEP (autoep)",
    "layout.pipeline_p2p": "chooses the own engine's pipeline transfers; engine {engine} has its own",
    "layout.fp8_all_gather": "FSDP2's FP8 all-gather (torchao enable_fsdp_float8_all_gather) is for engine fsdp",
}


@dataclass(frozen=True)
class MemoryModel:
    """What the planner's memory model reads of an engine (harness/planner/memory_engines.py): facts of
    its code, each checked against its census or a `harness memory` trace."""

    # the model states' closed form: "megatron" (bf16 parameters, fp32 main gradients in flat buffers, ZeRO-1
    # sharding the fp32 masters and Adam's moments), "deepspeed" (its ZeRO stages' partitions) or "fsdp"
    # (FSDP2: the sharded fp32 parameters are the master)
    states: str
    # "balanced": layers split by cost over pp x virtual-stage chunks (harness.engine.partition); "even":
    # layers / pp per rank (Megatron-core's get_num_layers_to_build)
    layer_split: str = "balanced"
    vocab_parallel_loss: bool = False  # the LM head's cross-entropy vocabulary-parallel under tp > 1
    sp_regathers: bool = False  # under SP a column-parallel GEMM keeps its local input, re-gathered in backward


# A rule: (field, takes(...), why not). The first rule a spec breaks is the error; `why` may name
# {engine}. Fields are the Layout's (capabilities, batch limits) or the Workload's (precision limits).
# The arguments are harness.spec's Layout and Workload and harness.model.presets' Shape (above this module).
Rule = tuple[str, typing.Callable[..., bool], str]  # takes(layout)
PolicyRule = tuple[str, typing.Callable[..., bool], str]  # follows(workload, layout)
ModelRule = tuple[str, typing.Callable[..., bool], str]  # takes(shape, layout)
BatchRule = tuple[str, typing.Callable[..., bool], typing.Callable[..., str]]  # takes(w, layout), why(w, layout)


@dataclass(frozen=True)
class EngineFacts:
    """What one engine runs, declared once in its package's facts.py. Every list is empty unless given:
    an engine with no rules of a kind takes whatever the spec's own checks allow of the fields it
    honours."""

    name: str
    # which layouts it runs, checked in order (a field no rule names takes any value the field allows);
    # the compare report's layout-by-engine matrix shows these reasons in its dashes
    capabilities: list[Rule] = field(default_factory=list)
    # where it cannot follow the workload's precision policy (PrecisionPolicy); refused as workload.<field>
    precision_limits: list[PolicyRule] = field(default_factory=list)
    # where it cannot build the model's architecture (config.json fields) under a layout: (what, takes(shape,
    # layout), why); refused as workload.model
    model_limits: list[ModelRule] = field(default_factory=list)
    # where it cannot split the workload's batch under a layout: (layout field, takes(workload, layout),
    # why(workload, layout)); checked with the sizes, before the memory bound
    batch_limits: list[BatchRule] = field(default_factory=list)
    # its name in labels (engine_variant), from a layout dict holding every field; None: the name
    label: typing.Callable[[dict], str] | None = None
    launcher: str = "torchrun"  # how compare starts its ranks on this machine (harness.launch.LOCAL_LAUNCHERS)
    one_process: bool = False  # runs in one process whatever nproc a comparison gives (the reference)
    # needs a torch.distributed process group even as one process: `harness train` refuses it without a launcher
    process_group: bool = False
    # checks of its own files (spec) -> None, raising SpecError, run by every rank before anything is
    # built (a ds_config that contradicts the workload is a spec error, not a failed run)
    preflight: typing.Callable[..., None] | None = None
    # the fields it honours, "layout.<field>" or "workload.<field>", with the values it runs (opt-in: a field
    # missing here is refused unless at its default; harness.spec.honours: EVERY_ENGINE, honoured, some);
    # why_not: a better reason than "does not use it" for a field it does not honour
    honours: dict[str, Honoured] = field(default_factory=dict)
    why_not: dict[str, str] = field(default_factory=dict)
    # where its default differs from the field's (megatron's attention); a spec that does not give the
    # field takes this one, and the compare report's differing-fields column shows it
    defaults: dict[str, typing.Any] = field(default_factory=dict)
    # the harness.memtrace module that traces one rank of its step on fake tensors (`harness memory`);
    # None: not traceable, and untraced says why
    tracer: str | None = None
    untraced: str = ""
    # how the planner models its memory (harness/planner/memory_engines.py); None: not modelled. The engines
    # `harness plan --engine` offers are those with one that run more than one process.
    memory: MemoryModel | None = None
    # builds mixture-of-experts models (Shape.experts > 0); else such a model is refused as workload.model
    runs_moe: bool = False

    def variant(self, layout: dict) -> str:
        return self.label(layout) if self.label is not None else self.name

    def default(self, path: str, general):
        """The value a spec that does not give field `path` takes under this engine."""
        return self.defaults.get(path, general)

    def refuses(self, path: str, value, default) -> str | None:
        """Why this engine refuses `value` for field `path` ("layout.cp"), whose default is `default`
        (this engine's); None if it runs it."""
        if value == default:
            return None
        honoured = self.honours.get(path)
        if honoured is None:
            why = self.why_not.get(path) or ONE_ENGINES_FIELDS.get(path) or "engine {engine} does not use it"
            return why.format(engine=self.name)
        if honoured.values is not None and value not in honoured.values:
            return (honoured.why or f"engine {self.name} runs {', '.join(map(str, honoured.values))} only").format(
                engine=self.name
            )
        return None

    def runs(self, path: str, values) -> list:
        """Those of `values` this engine runs for field `path` (the planner's candidates)."""
        honoured = self.honours.get(path)
        if honoured is None:
            return []
        return [v for v in values if honoured.values is None or v in honoured.values]


def known(name) -> bool:
    """Whether `name` (any value a spec holds) is a registered engine."""
    return isinstance(name, str) and name in ENGINES


def available(name) -> bool:
    """Whether `name` is a registered engine whose adapter module is present in this checkout."""
    return (
        known(name)
        and importlib.util.find_spec(ENGINES[name]) is not None
        and importlib.util.find_spec(ENGINES[name] + ".facts") is not None
    )


def facts(name: str) -> EngineFacts:
    """The facts the engine's adapter declares (importing the adapter on first use)."""
    if not known(name):
        raise SpecError("layout.engine", f"{name!r} is not one of {', '.join(ENGINES)}")
    if not available(name):
        raise SpecError("layout.engine", f"engine {name!r} is not available in this checkout ({ENGINES[name]} missing)")
    declared = importlib.import_module(ENGINES[name] + ".facts").ENGINE
    if declared.name != name:
        raise ValueError(f"{ENGINES[name]} declares engine {declared.name!r}, registered as {name!r}")
    return declared


def layout_defaults(name) -> dict:
    """The layout fields engine `name` defaults differently from the fields (EngineFacts.defaults, by field
    name: megatron's attention); none for an engine not available here."""
    if not available(name):
        return {}
    return {path.split(".", 1)[1]: v for path, v in facts(name).defaults.items() if path.startswith("layout.")}


def planned() -> tuple[str, ...]:
    """The engines `harness plan --engine` models (a MemoryModel, more than one process), in ENGINES' order."""
    return tuple(
        name for name in ENGINES if available(name) and facts(name).memory is not None and not facts(name).one_process
    )


def adapter(name: str):
    """The engine's adapter module (its build(spec, shape, ctx))."""
    facts(name)
    return importlib.import_module(ENGINES[name] + ".adapter")


def not_both(field: str, other: str, why: str) -> Rule:
    """A rule refusing `field` above 1 together with `other` above 1 (cp with pp, say), as layout.<field>."""
    return (field, lambda lay: getattr(lay, field) == 1 or getattr(lay, other) == 1, why)


def tied_across_stages(what: str, engine: str, takes) -> ModelRule:
    """An engine's refusal of tied embeddings split over pipeline stages: `what` says how it splits them."""
    return (
        "tie_word_embeddings",
        takes,
        f"{what}; splitting them needs the embedding gradient all-reduced between the first and the last "
        f"pipeline stage (Megatron's embedding group), which {engine} does not do here",
    )
