"""`harness memory SPEC.yaml`: trace the memory of the run a spec describes, at full size, on a CPU.

Each pipeline stage of the spec's layout is built and stepped by its engine (own, or fsdp: FSDP2
with DTensor TP/SP and torch.distributed.pipelining) on fake tensors (shapes, no data) over a fake
process group, in this one process: per stage the memory census
(parameters, gradients, master parameters, optimizer states by dtype), the peak of live tensors
in a step, and the terms a trace cannot see (CUDA context and workspaces, allocator
fragmentation), beside the planner's prediction for the same layout and engine.
"""

from __future__ import annotations

import json

from harness.commands import add_set_argument

DESCRIPTION = __doc__.split(":", 1)[1].strip()

EXAMPLES = """\
examples:
  harness memory spec.yaml
  harness memory spec.yaml --format json
  harness memory examples/tiny.yaml --set layout.engine=own --set layout.tp=2
  harness memory examples/tiny.yaml --set layout.engine=fsdp --set layout.dp=2
  harness memory spec.yaml --hardware h100-sxm
  harness memory spec.yaml --set workload.model=paper-13b --set workload.seq_len=8192 --hardware h100-sxm"""


def add_arguments(p) -> None:
    p.add_argument(
        "spec",
        help="a run spec (as `harness train` takes); its layout's engine must be own or fsdp "
        "(DeepSpeed's initialize is not traceable on fake tensors)",
    )
    add_set_argument(p, "run spec")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument(
        "--hardware",
        default=None,
        help="profile whose device memory the peak is checked against (a100-80gb, h100-sxm, ... or a YAML); "
        "a spec names no device: without it the fit is not judged (the output says so)",
    )


def traced_engine(raw):
    """The raw spec, once its engine is one harness memory traces (memtrace's tracer): an engine it
    does not trace is named as such, before the layout is checked against that engine's rules (which
    would blame a field, e.g. deepspeed's zero_stage)."""
    from harness import registry
    from harness.memtrace.trace import tracer

    engine = ((raw or {}).get("layout") or {}).get("engine") if isinstance(raw, dict) else None
    if registry.available(engine):
        tracer(engine)
    return raw


def main(args) -> int:
    from harness.commands.overrides import parse_with_overrides
    from harness.planner.hardware import load_profile
    from harness.spec import parse_spec, read_yaml

    spec = parse_with_overrides(read_yaml(args.spec), args.overrides, lambda raw: parse_spec(traced_engine(raw)))
    if spec.shape().moe and spec.layout.engine == "fsdp" and spec.layout.ep == 1:
        from harness.errors import SpecError

        raise SpecError(
            "workload.model",
            "mixture of experts: engine fsdp runs the plain MoE layer, whose routing is data (torch.nonzero has no "
            "shape on fake tensors); its expert-parallel layer (ep > 1) and the own engine's are traced with even "
            "routing: set ep > 1 or engine: own",
        )
    profile = load_profile(args.hardware) if args.hardware is not None else None  # before the trace: a bad name
    from harness.memtrace.result import table_lines, trace_spec

    result = trace_spec(spec, profile)
    if args.format == "json":  # no device assumed: a spec carries none (an imported plan's was its --hardware)
        print(json.dumps(result if profile is not None else {**result, "hardware": None}))  # and no "fits"
    else:
        print("\n".join(table_lines(result)))
        if profile is None:
            print(NO_HARDWARE)
    return 0


NO_HARDWARE = (
    "fit not judged: the spec names no device; give --hardware (the profile the plan was made for, "
    "e.g. h100-sxm) to check the peak against its memory"
)
