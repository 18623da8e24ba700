"""`harness plan`'s options, checked: each one parsed, refused in one line where the engine's facts or the
model say it cannot be honoured, and, after the candidates are enumerated, refused where no candidate
takes a value it asked for. No option is silently ignored: a value is either used or refused.
"""

from __future__ import annotations

from harness import registry
from harness.errors import SpecError


def options(args, shape, profile) -> dict:
    """The keyword arguments of candidates.layouts that the flags ask for (but the workload and GPUs)."""
    from harness.commands.plan_recipe import recipe_fields
    from harness.planner import candidates as en
    from harness.planner.layout import ATTENTION, PRECISIONS
    from harness.planner.schedules import SCHEDULES
    from harness.spec import CHECKPOINTING, CP_IMPLS, RMSNORM_KERNELS

    attention = en.parse_list(
        args.attention,
        ATTENTION,
        "--attention",
        [a for a in en.DEFAULTS["attention"] if a in profile.attention_kernels],
    )
    rmsnorm = en.parse_list(args.rmsnorm, RMSNORM_KERNELS, "--rmsnorm", en.DEFAULTS["rmsnorm"])
    mbs = en.parse_list(args.micro_batch_sizes, None, "--micro-batch-sizes", en.DEFAULTS["micro_batch_sizes"], int)
    if any(m < 1 for m in mbs):
        raise SpecError("--micro-batch-sizes", "must be positive")
    ck = en.parse_list(
        args.activation_checkpointing, CHECKPOINTING, "--activation-checkpointing", en.DEFAULTS["checkpointing"]
    )
    sp = en.parse_list(
        args.sequence_parallel, (False, True), "--sequence-parallel", en.DEFAULTS["sequence_parallel"], en.parse_bool
    )
    no_sp = args.engine != "paper" and registry.facts(args.engine).refuses("layout.sequence_parallel", True, False)
    if no_sp and True in sp:  # DeepSpeed's: asked for, refused; by default, not a candidate
        if args.sequence_parallel is not None:
            raise SpecError("--sequence-parallel", f"on: {no_sp}")
        sp = [False]
    cps = en.parse_list(args.cp, None, "--cp", (), int) if args.cp is not None else None
    if cps is not None and any(c < 1 for c in cps):
        raise SpecError("--cp", "must be positive")
    impls = en.parse_list(args.cp_impl, CP_IMPLS, "--cp-impl", ()) if args.cp_impl is not None else None
    scheds = en.parse_list(args.pipeline_schedule, SCHEDULES, "--pipeline-schedule", ()) or None
    virtual = en.parse_list(args.virtual_stages, None, "--virtual-stages", (), int) or None
    if virtual and min(virtual) < 1:
        raise SpecError("--virtual-stages", "must be positive")
    _check_pipeline(args, scheds, virtual)
    precisions = en.parse_list(args.precision, PRECISIONS, "--precision", ("bf16",))
    if "fp8" in precisions and not profile.fp8:
        raise SpecError("--precision", f"fp8: {profile.name} has no FP8 tensor cores (its profile says fp8: false)")
    shards = en.parse_list(args.dp_shard, None, "--dp-shard", (), int) if args.dp_shard is not None else None
    if shards is not None and (args.engine != "fsdp" or any(v < 0 for v in shards)):
        raise SpecError("--dp-shard", "takes sizes >= 0 under --engine fsdp only (its sharding groups)")
    eps = en.parse_list(args.ep, None, "--ep", (), int) if args.ep is not None else None
    if eps is not None and (min(eps) < 1 or not shape.moe and eps != [1]):
        raise SpecError("--ep", "takes positive degrees, above 1 for a mixture-of-experts model only")
    for e in eps or ():
        if shape.moe and shape.experts % e:
            raise SpecError("--ep", f"{e} does not divide the {shape.experts} experts of {args.model}")
    if args.top is not None and args.top < 1:
        raise SpecError("--top", "must be at least 1")
    return dict(
        attention=attention,
        rmsnorm=rmsnorm,
        micro_batch_sizes=mbs,
        checkpointing=ck,
        sequence_parallel=sp,
        zero_stage=args.zero,
        cp_values=cps,
        cp_impls=impls,
        pipeline_schedules=scheds,
        virtual_stages=virtual,
        precisions=precisions,
        dp_shards=shards,
        ep_values=eps,
        **on_engine(args, shape, cps, impls),
        **recipe_fields(args, shape, ck, precisions),
    )


def _check_pipeline(args, scheds, virtual) -> None:
    """The schedules the engine runs (its facts: harness/engine/facts.py, harness/frameworks/*/facts.py; the
    study's engine ran 1F1B only), and virtual stages only with a schedule that has them."""
    from harness.planner.candidates import schedules_of
    from harness.planner.layout import PAPER
    from harness.planner.schedules import INTERLEAVED

    if scheds and args.engine == PAPER and scheds != ["1f1b"]:
        raise SpecError("--pipeline-schedule", "the study's engine ran 1f1b only")
    if args.engine != PAPER:
        facts = registry.facts(args.engine)
        for sched in scheds or ():
            why = facts.refuses("layout.pipeline_schedule", sched, "1f1b")
            if why:
                raise SpecError("--pipeline-schedule", f"{sched}: {why}")
    if virtual and not any(s in INTERLEAVED for s in scheds or schedules_of(args.engine)):
        given = f"--pipeline-schedule {','.join(scheds)}" if scheds else f"engine {args.engine}'s default schedules"
        raise SpecError(
            "--virtual-stages",
            f"chunks per rank of the interleaved schedules ({', '.join(INTERLEAVED)}): {given} has none",
        )


def on_engine(args, shape, cps, impls) -> dict:
    """The PlannerLayout fields of the candidate layouts under --engine (the memory model of that engine's
    precision policy and sharding: harness/planner/memory_engines.py); fsdp shards fully whatever --zero
    says. An option the engine's facts say it cannot honour is refused here, in one line.
    (Given to candidates.layouts, not set on each layout after: 16,000 copies cost 0.1 s.)"""
    from harness.planner import context
    from harness.planner.layout import PAPER
    from harness.spec import Layout, model_limit_error

    if args.engine != PAPER:
        facts = registry.facts(args.engine)
        # (an engine that runs stage 3 shards fully: fsdp takes any --zero)
        if args.zero > 1 and not facts.runs("layout.zero_stage", (args.zero, 3)):
            raise SpecError("--zero", facts.refuses("layout.zero_stage", args.zero, 0))
        error = model_limit_error(shape, Layout(engine=args.engine))
        if error is not None and not (shape.moe and not facts.runs_moe):  # MoE: planned all the same (_moe_lines)
            raise SpecError("--engine", f"{args.engine}: {error}")
        if args.compile != "none" and facts.refuses("layout.compile", args.compile, "none"):
            raise SpecError("--compile", facts.refuses("layout.compile", args.compile, "none"))
        if args.ep and any(e.strip() not in ("", "1") for e in args.ep.split(",")) and facts.refuses("layout.ep", 2, 1):
            raise SpecError("--ep", facts.refuses("layout.ep", 2, 1))
    runs = context.engine_impls(args.engine)
    if cps and max(cps) > 1 and not runs:
        raise SpecError("--cp", context.no_cp(args.engine))
    for impl in impls or ():
        if impl not in runs:
            raise SpecError(
                "--cp-impl", f"engine {args.engine} runs {', '.join(runs) or 'no context parallelism'}, not {impl}"
            )
    return {"engine": args.engine, "fsdp": args.engine == "fsdp", "compile": args.compile}


def check_used(args, opts: dict, layouts) -> None:
    """Refuse a value asked for that no candidate layout takes (an ep no split's dp x cp divides, virtual
    stages that split the layers at no pp, a schedule no pp > 1 layout runs): planning without it would
    answer another question than the one asked. `layouts`: the candidates (a sequence of PlannerLayout)."""
    from harness.planner.schedules import INTERLEAVED

    where = f"of {args.gpus} GPUs for {args.model} (global batch {args.global_batch_size})"
    for e in opts["ep_values"] or ():
        if not any(lay.ep == e for lay in layouts):
            raise SpecError("--ep", f"{e} is the expert-parallel degree of no layout {where}: ep divides dp x cp")
    for v in opts["virtual_stages"] or ():
        if not any(lay.pipeline_schedule in INTERLEAVED and lay.virtual_stages == v for lay in layouts):
            raise SpecError(
                "--virtual-stages",
                f"{v} is the chunks per rank of no interleaved layout {where}: pp x {v} must divide the layers"
                " (and the micro-batches divide by pp)",
            )
    for sched in opts["pipeline_schedules"] or ():
        if not any(lay.pp > 1 and lay.pipeline_schedule == sched for lay in layouts):
            raise SpecError("--pipeline-schedule", f"{sched} is the schedule of no pp > 1 layout {where}")
