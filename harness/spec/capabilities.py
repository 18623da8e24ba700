"""What the chosen engine runs: a field it does not honour at its value, a layout rule it breaks,
where it cannot follow the precision policy and where it cannot build the model. Each engine's
facts.py declares these (harness.registry.EngineFacts); this module only asks them, so a layout
no engine can run is refused before anything launches.
"""

from __future__ import annotations

import dataclasses

from harness import registry
from harness.errors import CapabilityError
from harness.model.presets import Shape
from harness.spec.schema import Layout, Workload

# What an engine runs, where it cannot follow the precision policy and where it cannot build the model: its
# facts declare them (harness.registry.EngineFacts); check_sizes asks them last, in that order. Epsilon
# and Llama 3.1 rope scaling every engine applies (the plain model's RMSNorm and rotary tables); attention
# biases every engine adds (own engine: q/k/v's sharded, o's after the reduction).


def model_limit_error(shape: Shape, lay: Layout) -> CapabilityError | None:
    """Why the chosen engine cannot build this model under this layout (the first rule it breaks), or None."""
    if shape.moe and not registry.facts(lay.engine).runs_moe:
        return CapabilityError("workload.model", f"mixture of experts: engine {lay.engine} does not build MoE models")
    for what, takes, why in registry.facts(lay.engine).model_limits:
        if not takes(shape, lay):
            return CapabilityError("workload.model", f"{what}: {why}")
    return None


def check_model_limits(shape: Shape, lay: Layout) -> None:
    error = model_limit_error(shape, lay)
    if error is not None:
        raise error


def check_precision_policy(w: Workload, lay: Layout) -> None:
    for name, follows, why in registry.facts(lay.engine).precision_limits:
        if not follows(w, lay):
            raise CapabilityError(f"workload.{name}", why.format(engine=lay.engine))


def honoured_error(w: Workload | None, lay: Layout) -> CapabilityError | None:
    """The first field the chosen engine does not honour at its value (EngineFacts.honours: opt-in, so a
    field no engine declares is refused unless at its default), or None; w None: the layout's only."""
    facts = registry.facts(lay.engine)
    for prefix, spec_part in (("layout", lay), ("workload", w)):
        if spec_part is None:
            continue
        for f in dataclasses.fields(spec_part):
            path = f"{prefix}.{f.name}"
            general = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            why = facts.refuses(path, getattr(spec_part, f.name), facts.default(path, general))
            if why is not None:
                return CapabilityError(path, why)
    if w is not None:  # the optimizer's choices (honours.OPTIMIZER_CHOICES), opt-in as the fields above
        for f in dataclasses.fields(w.optimizer):
            path = f"workload.optimizer.{f.name}"
            if "choices" in f.metadata:
                why = facts.refuses(path, getattr(w.optimizer, f.name), f.default)
                if why is not None:
                    return CapabilityError(path, why)
    return None


def check_honoured(w: Workload, lay: Layout) -> None:
    error = honoured_error(w, lay)
    if error is not None:
        raise error


def rule_error(lay: Layout) -> CapabilityError | None:
    """The first of the chosen engine's capability rules this layout breaks, or None."""
    for name, takes, why in registry.facts(lay.engine).capabilities:
        if not takes(lay):
            return CapabilityError(f"layout.{name}", why.format(engine=lay.engine))
    return None


def capability_error(lay: Layout) -> CapabilityError | None:
    """Why the chosen engine cannot run this layout (a field it does not honour, else the first rule it
    breaks), or None."""
    return honoured_error(None, lay) or rule_error(lay)


def check_capabilities(lay: Layout) -> None:
    error = capability_error(lay)
    if error is not None:
        raise error


def check_rules(lay: Layout) -> None:
    """The capability rules alone, where check_honoured has run (check_sizes)."""
    error = rule_error(lay)
    if error is not None:
        raise error
