"""A run spec from what a user wrote: the raw mapping (a YAML file, a record's stored spec) with its
engine's defaults filled in, built field by field (build.py), then checked whole (checks.py).
"""

from __future__ import annotations

import typing

from harness import registry
from harness.errors import SpecError
from harness.files.yaml_reader import read_yaml
from harness.model.presets import Shape
from harness.spec.build import build_spec, coerce
from harness.spec.checks import check_sizes
from harness.spec.schema import Layout, RunSpec


def with_engine_defaults(raw: dict) -> dict:
    """`raw` with the layout fields it does not give at its engine's defaults where they differ from the
    field's (EngineFacts.defaults: megatron's attention); an unknown engine is left to the builder."""
    layout = raw.get("layout")
    engine = layout.get("engine", Layout.engine) if isinstance(layout, dict) else Layout.engine
    own = registry.layout_defaults(engine)
    if not own:
        return raw
    given = layout if isinstance(layout, dict) else {}
    return {**raw, "layout": {**{k: v for k, v in own.items() if k not in given}, **given}}


def parse_spec(raw: dict | None) -> RunSpec:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError("spec", "top level must be a mapping")
    spec = build_spec(RunSpec, with_engine_defaults(raw), "")
    shape_types = typing.get_type_hints(Shape)
    spec.workload.model_overrides = {  # numbers as in the other fields (`layers: 1e9` is a string to YAML 1.1)
        k: coerce(v, shape_types[k], f"workload.model_overrides.{k}") if k in shape_types else v
        for k, v in spec.workload.model_overrides.items()
    }
    check_sizes(spec)
    return spec


def load_spec(path: str | None) -> RunSpec:
    """Load a YAML spec; None gives the embedded default (tiny model, this machine)."""
    return parse_spec({} if path is None else read_yaml(path))


def spec_from_dict(d: dict) -> RunSpec:
    """Rebuild a spec stored in a record (trusted: it was validated when written)."""
    return parse_spec(d)
