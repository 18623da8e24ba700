"""The engines: one line per engine (its name and its adapter module), and EngineFacts, what each
adapter declares at its top as `ENGINE = EngineFacts(...)`: which layouts it runs, where it cannot
follow the precision policy or build the model, its label, how it is launched.

Adding an engine is its adapter module plus one line in ENGINES. The spec, build_engine, compare,
sweeps and reports ask `facts(name)`; `layout.engine` takes ENGINES' names. The adapters lie above
the spec (they import torch and the model), yet the spec's checks need their facts: reaching up to
them by module name, on first use, is this module's one job. It imports no adapter itself, so
`import harness.spec` stays light; an adapter is imported when a check or a label first needs its
facts. single, deepspeed and fsdp import torch at their top (own.py does not: its build imports the
engine), so the first such lookup in a process without torch costs torch's import (about 1 s).
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

# A rule: (field, takes(...), why not). The first rule a spec breaks is the error; `why` may name
# {engine}. Fields are the Layout's (capabilities, batch limits) or the Workload's (precision limits).
# The arguments are harness.spec's Layout and Workload and harness.model.presets' Shape (above this module).
Rule = tuple[str, typing.Callable[..., bool], str]  # takes(layout)
PolicyRule = tuple[str, typing.Callable[..., bool], str]  # follows(workload, layout)
ModelRule = tuple[str, typing.Callable[..., bool], str]  # takes(shape, layout)
BatchRule = tuple[str, typing.Callable[..., bool], typing.Callable[..., str]]  # takes(w, layout), why(w, layout)


@dataclass(frozen=True)
class EngineFacts:
    """What one engine runs, declared once in its adapter. Every list is empty unless given: an
    engine with no rules of a kind takes whatever the spec's own checks allow."""

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
    # checks of its own files (spec) -> None, raising SpecError, run by every rank before anything is
    # built (a ds_config that contradicts the workload is a spec error, not a failed run)
    preflight: typing.Callable[..., None] | None = None

    def variant(self, layout: dict) -> str:
        return self.label(layout) if self.label is not None else self.name


def known(name) -> bool:
    """Whether `name` (any value a spec holds) is a registered engine."""
    return isinstance(name, str) and name in ENGINES


def available(name) -> bool:
    """Whether `name` is a registered engine whose adapter module is present in this checkout."""
    return known(name) and importlib.util.find_spec(ENGINES[name]) is not None \
        and importlib.util.find_spec(ENGINES[name] + ".facts") is not None


def facts(name: str) -> EngineFacts:
    """The facts the engine's adapter declares (importing the adapter on first use)."""
    if not known(name):
        raise SpecError("layout.engine", f"{name!r} is not one of {', '.join(ENGINES)}")
    if not available(name):
        raise SpecError("layout.engine", f"engine {name!r} is not available in this checkout "
                                         f"({ENGINES[name]} missing)")
    declared = importlib.import_module(ENGINES[name] + ".facts").ENGINE
    if declared.name != name:
        raise ValueError(f"{ENGINES[name]} declares engine {declared.name!r}, registered as {name!r}")
    return declared


def adapter(name: str):
    """The engine's adapter module (its build(spec, shape, ctx))."""
    facts(name)
    return importlib.import_module(ENGINES[name] + ".adapter")


# Fields only one engine takes: every other engine refuses them (each lists them where its order of
# checks puts them).
ONLY_DEEPSPEED: list[Rule] = [
    ("ds_config", lambda lay: not lay.ds_config, "only for engine deepspeed"),
    ("model_impl", lambda lay: lay.model_impl == "own", "hf (transformers' LlamaForCausalLM) is for engine deepspeed"),
]
ONLY_OWN: list[Rule] = [
    ("pipeline_p2p", lambda lay: lay.pipeline_p2p == "auto",
     "chooses the own engine's pipeline transfers; engine {engine} has its own"),
]


def tied_across_stages(what: str, engine: str, takes) -> ModelRule:
    """An engine's refusal of tied embeddings split over pipeline stages: `what` says how it splits them."""
    return ("tie_word_embeddings", takes,
            f"{what}; splitting them needs the embedding gradient all-reduced between the first and the last "
            f"pipeline stage (Megatron's embedding group), which {engine} does not do here")
