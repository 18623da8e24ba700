"""The layout's text label: one line naming a layout (engine variant, parallel degrees, the fields
that change what is measured), the same in every view of a run (console, sweep, compare, report).
Tolerates the partial layouts of old or foreign records.
"""

from __future__ import annotations

import dataclasses

from harness import registry
from harness.parallel_dims import LABEL_ORDER, ParallelDims
from harness.spec.schema import Layout

_DEFAULT_LAYOUT = dataclasses.asdict(Layout())


def _layout_dict(layout) -> dict:
    """A layout as a dict with every field (a partial one, as a compare spec's run or an old
    record holds, takes the defaults)."""
    return dataclasses.asdict(layout) if dataclasses.is_dataclass(layout) else {**_DEFAULT_LAYOUT, **(layout or {})}


def engine_variant(layout) -> str:
    """The engine and its sharding mode: own, own ZeRO-1, deepspeed ZeRO-3, FSDP2 reshard, ...
    (tolerates the partial layouts of old or foreign records)."""
    lay = _layout_dict(layout)
    engine = lay["engine"]
    return registry.facts(engine).variant(lay) if registry.available(engine) else engine


def parallel_label(layout) -> str:
    """The parallel degrees other than 1, SP and the CP implementation: 'tp2 pp2', 'dp8', 'tp4 dp2 sp',
    'cp2 dp2 ring' ('' for none)."""
    lay = _layout_dict(layout)
    dims = ParallelDims.of(lay)
    impl = (lay.get("cp_impl") or "ring") if dims.cp > 1 else ""
    return " ".join(p for p in (dims.label(), "sp" if lay.get("sequence_parallel") else "", impl) if p)


def layout_label(layout, short: bool = False) -> str:
    """One line naming a layout, used by every view of a run (console, sweep, compare, report).

    short: the engine variant and parallel_label (what tells a comparison's runs apart);
    otherwise every field that changes what is measured."""
    lay = _layout_dict(layout)
    compiled = "compiled" if (lay.get("compile") or "none") != "none" else ""
    if short:
        return " ".join(p for p in (engine_variant(lay), parallel_label(lay), compiled) if p)
    degrees = {k: ParallelDims.of(lay).degree(k) for k in LABEL_ORDER}
    parts = [engine_variant(lay)] + [
        f"{k}{v}" + (f" {lay.get('cp_impl') or 'ring'}" if k == "cp" else "")
        for k, v in degrees.items()
        if k != "cp" or v > 1
    ]
    parts += ParallelDims.of(lay).split_labels()  # a MoE's experts shared out (carved from dp: no other degree moves)
    parts += [
        f"mb{lay.get('micro_batch_size', '?')}",
        f"ckpt={lay.get('activation_checkpointing') or 'none'}",
        f"{lay.get('attention') or '?'}/{lay.get('rmsnorm') or '?'}",
    ]
    virtual = int(lay.get("virtual_stages") or 1)
    if (degrees["pp"] > 1 or virtual > 1) and lay.get("pipeline_schedule"):
        parts.append(lay["pipeline_schedule"] + (f" v{virtual}" if virtual > 1 else ""))
    if lay.get("sequence_parallel"):
        parts.append("sp")
    return " ".join(parts + [compiled] if compiled else parts)


def process_counts(nprocs: list[int]) -> str:
    """How many runs and on how many processes each, in one phrase ("16 runs: 15 on 2 processes,
    1 on 1 process"): a comparison's runs need not all run the same count (the reference runs one)."""
    counts: dict[int, int] = {}
    for n in nprocs:
        counts[n] = counts.get(n, 0) + 1
    each = ", ".join(
        f"{k} on {n} process{'es' if n != 1 else ''}" for n, k in sorted(counts.items(), key=lambda kv: -kv[1])
    )
    return f"{len(nprocs)} run{'s' if len(nprocs) != 1 else ''}: {each}"
