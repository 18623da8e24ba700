"""`harness plan`: predict memory, fit and speed of every layout, or calibrate a profile.

Prints a table of distinct layouts (kernels predicted identically share a row), or with
--format json only a JSON list on stdout (one object per layout). --explain adds the memory and
time breakdown of the shown layouts. --emit-sweep writes a sweep spec of the top layouts predicted
to fit that `harness sweep FILE` runs as it is. --export deepspeed|megatron|torchtitan prints the
best layout predicted to fit that the target runs, as a DeepSpeed JSON config, Megatron-LM
arguments or a torchtitan recipe (Trainer.Config), each for a named version, on stdout (notes on
stderr); `harness import` reads them back as a spec. --findings prints what the plan
predicts of the reference study's findings on each --hardware profile (a comma list with it only):
harness/planner/findings.py, printed by plan_findings.py. --calibrate / --calibrate-csv
fit the profile's efficiencies to measurements and save the calibrated profile (--calibrate-out,
default ./<hardware>-calibrated.yaml).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys

from harness import registry
from harness.errors import SpecError

DESCRIPTION = __doc__.split(":", 1)[1].strip()

EXAMPLES = """\
examples:
  harness plan --model paper-13b --seq-len 2048 --global-batch-size 2048 --gpus 64 --hardware a100-80gb
  harness plan --model paper-13b --seq-len 2048 --global-batch-size 2048 --gpus 64 --top 5 --explain
  harness plan --model paper-30b --seq-len 2048 --global-batch-size 2048 --gpus 64 --emit-sweep top.yaml
  harness plan --model paper-13b --seq-len 4096 --global-batch-size 1024 --gpus 64 --export megatron
  harness plan --findings --hardware a100-80gb,h100-sxm,h200 --model paper-13b --seq-len 2048 \\
      --global-batch-size 2048 --gpus 64
  harness plan --model llama3-8b --seq-len 131072 --global-batch-size 64 --gpus 64 --cp 1,8
  harness plan --model llama3-8b --seq-len 8192 --global-batch-size 128 --gpus 8 --hardware h200 --precision bf16,fp8
  harness plan --model llama3-8b --seq-len 8192 --global-batch-size 128 --gpus 8 --engine fsdp --compile blocks
  harness plan --hardware a100-80gb --calibrate results.sqlite --calibrate-out my-cluster.yaml"""


def add_arguments(p) -> None:
    from harness.planner.hardware import profile_names
    from harness.planner.layout import planner_engines
    from harness.spec import CHECKPOINTING, COMPILE, RMSNORM_KERNELS

    p.add_argument("--model", help="preset name (see harness.model.presets) or a config.json")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    p.add_argument("--gpus", type=int)
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the profile's (8 for DGX)")
    p.add_argument(
        "--hardware",
        default="a100-80gb",
        help=f"{', '.join(profile_names())} or a YAML path (with --findings a comma list)",
    )
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=1, help="ZeRO stage (default 1, as the study)")
    p.add_argument(
        "--engine",
        choices=planner_engines(),
        default="own",
        help="whose memory to model: the harness's own engine (default), deepspeed (ZeRO stage from "
        "--zero), fsdp (FSDP2, fully sharded), megatron (Megatron-core: --zero 1 is its "
        "distributed optimizer; pp dividing the layers), or paper (the study's engine, as its "
        "sweeps ran)",
    )
    p.add_argument("--attention", help="comma list; default: naive,fused_softmax,flash1,flash2,sdpa,...")
    p.add_argument("--rmsnorm", help=f"comma list of {','.join(RMSNORM_KERNELS)}")
    p.add_argument("--micro-batch-sizes", help="comma list, default 1,2,4,8")
    p.add_argument("--activation-checkpointing", help=f"comma list of {','.join(CHECKPOINTING)}")
    p.add_argument("--sequence-parallel", help="comma list of off,on")
    p.add_argument(
        "--cp",
        help="comma list of context-parallel degrees (default: 1 and the powers of two leaving "
        "every rank at least 4096 tokens of a sequence)",
    )
    p.add_argument("--cp-impl", help="comma list of ring,allgather,ulysses (default: those the engine runs)")
    p.add_argument(
        "--precision",
        help="comma list of bf16,fp8 (default bf16): fp8 runs the linear layers' GEMMs in FP8 (torchao's "
        "tensorwise recipe; Transformer Engine's current scaling under megatron), attention and norms in bf16",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE,
        default="none",
        help="torch.compile of every layout (layout.compile): blocks fuses each block's elementwise work "
        "(norms as one kernel, fewer launches: harness/planner/features.py)",
    )
    p.add_argument(
        "--pipeline-schedule",
        help="comma list of 1f1b,interleaved,gpipe,zero_bubble,zbv,dualpipev for pp > 1 (default: 1f1b, and "
        "interleaved where the engine runs it)",
    )
    p.add_argument(
        "--virtual-stages",
        help="comma list of model chunks per rank of the interleaved schedules (default: every v >= 2 with pp x v "
        "dividing the layers)",
    )
    p.add_argument(
        "--dp-shard",
        help="engine fsdp: comma list of sharding group sizes (HSDP; 0 or dp x cp: full sharding; default: "
        "full sharding and the powers of two from 2 dividing dp x cp)",
    )
    p.add_argument("--ep", help="comma list of expert-parallel degrees of a MoE model (default: every one dividing it)")
    p.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="the model's positions, raised (as workload.model_overrides.max_positions) for sequences "
        "beyond its max_position_embeddings",
    )
    p.add_argument("--top", type=int, default=None, help="show the K fastest (table default 20)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--emit-sweep", metavar="FILE", help="write a sweep spec of the top layouts that fit")
    p.add_argument(
        "--export",
        choices=("deepspeed", "megatron", "torchtitan"),
        help="print the best fitting layout as a DeepSpeed config, Megatron-LM arguments or a torchtitan recipe",
    )
    p.add_argument("--explain", action="store_true", help="print memory and time breakdowns")
    p.add_argument(
        "--findings",
        action="store_true",
        help="the reference study's findings as the plan predicts them, per --hardware profile",
    )
    p.add_argument("--calibrate", metavar="RESULTS.sqlite", help="fit efficiencies to harness records")
    p.add_argument("--calibrate-csv", metavar="FILE", nargs="+", help="fit to sweeps in the study's CSV format")
    p.add_argument("--calibrate-out", metavar="FILE", help="where to save the calibrated profile")
    from harness.commands.plan_recipe import add_recipe_arguments

    add_recipe_arguments(p)  # the published recipes' memory settings (plan_recipe.py)


def _need(args, *names):
    for name in names:
        if getattr(args, name.replace("-", "_")) is None:
            raise SpecError(f"--{name}", "is required")


def main(args) -> int:
    """The command, with the cyclic garbage collector paused: a plan holds hundreds of thousands of
    acyclic objects (layouts, predictions), over which each of the collector's full passes costs about a
    tenth of the plan (benchmarks/plan_speed.py); reference counting frees them all the same."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _main(args)
    finally:
        if paused:
            gc.enable()


def _main(args) -> int:
    from harness.model.presets import resolve_shape

    profiles = _profiles(args)
    profile = profiles[0]
    if args.calibrate_out:
        from harness.commands.outputs import check_output_path

        check_output_path(args.calibrate_out, "--calibrate-out", directory=False)
    if args.calibrate or args.calibrate_csv:
        from harness.commands.plan_outputs import calibrate_profile

        return calibrate_profile(args, profile)
    _need(args, "model", "seq-len", "global-batch-size", "gpus")
    if args.emit_sweep:  # before the plan is computed: it can take a while
        from harness.commands.outputs import check_output_path
        from harness.files.atomic import check_writable

        check_output_path(args.emit_sweep, "--emit-sweep", directory=False)
        check_writable(args.emit_sweep, "--emit-sweep")
    shape = resolve_shape(args.model, field="--model")
    if args.max_positions is not None:
        if args.max_positions < 1:
            raise SpecError("--max-positions", "must be at least 1")
        shape = dataclasses.replace(shape, max_positions=args.max_positions)
    from harness.spec import check_device_count, check_tokens  # the ranges a spec's workload has

    check_tokens(
        shape,
        args.seq_len,
        args.global_batch_size,
        args.model,
        {"seq_len": "--seq-len", "global_batch_size": "--global-batch-size"},
        positions=f"--max-positions {args.seq_len}",
    )
    check_device_count(args.gpus, "--gpus")
    if args.findings:
        from harness.commands.plan_findings import show_findings

        return show_findings(
            args, {p.name: plan_of(args, shape, p)[2] for p in profiles}, {p.name: p for p in profiles}
        )
    return _table(args, shape, profile, *plan_of(args, shape, profile))


def plan_of(args, shape, profile) -> tuple:
    """(workload, GPUs per node, predictions ranked: fitting first, fastest first) of the candidate
    layouts the flags ask for on one hardware profile (the flags checked in plan_checks.py)."""
    from harness.commands.plan_checks import check_used, options
    from harness.planner import candidates as en
    from harness.planner.layout import Workload
    from harness.planner.predict_columns import plan_predictions

    gpn = profile.gpus_per_node if args.gpus_per_node is None else args.gpus_per_node  # 0 is refused, not the default
    wl = Workload(args.seq_len, args.global_batch_size, 4 if profile.name.startswith("cpu") else 2)
    opts = options(args, shape, profile)
    table = en.candidate_table(shape, wl, args.gpus, gpn, **opts)
    preds = plan_predictions(shape, table, wl, profile) if len(table) else []  # ranked: fitting first, fastest first
    if not preds and opts["dp_shards"]:
        raise SpecError("--dp-shard", f"{args.dp_shard} divides the dp x cp of no layout of {args.gpus} GPUs")
    if not preds and (opts["ep_values"] or opts["virtual_stages"]):
        check_used(args, opts, [])  # the degrees asked for are those no split takes
    if not preds:
        raise SpecError(
            "--gpus", f"no valid layout of {args.gpus} GPUs for {args.model} (global batch {args.global_batch_size})"
        )
    check_used(args, opts, table)
    return wl, gpn, preds


def _table(args, shape, profile, wl, gpn, preds) -> int:
    """The plan's outputs for one profile: an export, a sweep, the JSON list or the table."""
    from harness.planner.output import group
    from harness.planner.schedules import schedule_label

    fitting = preds[: preds.plan.n_fitting]  # ranked first (predict_columns.Ranked: built when read)
    if args.export:
        from harness.commands.plan_outputs import export

        return export(args, shape, wl, fitting)
    if args.emit_sweep:
        from harness.commands.plan_outputs import emit_sweep

        emit_sweep(args, fitting, profile, gpn)
    if args.format == "json":
        shown = preds[: args.top] if args.top else preds
        print(json.dumps([p.row() for p in shown]))
        return 0
    rows = group(preds, args.top or 20)
    print(
        f"{args.model} seq {args.seq_len} batch {args.global_batch_size} on {args.gpus} x {profile.name}: "
        f"{len(preds)} layouts, {len(fitting)} predicted to fit"
        + ("; every block compiled (torch.compile: the rms column does not apply)" if args.compile != "none" else "")
    )
    near, note = _near_the_fastest(fitting, profile)  # a step time within the error of the fastest, or None
    width = max([14] + [len(",".join(row.kernels)) for row in rows])
    prec = preds.distinct("precision") > 1  # a precision column only when several are asked
    fsdp = args.engine == "fsdp"  # a column of the sharding group's ranks (HSDP below dp x cp)
    ep = shape.moe  # a column of the expert-parallel degree
    print(
        f"{'tp':>3} {'cp':>3} {'impl':9} {'pp':>3} {'sched':5} {'dp':>5} {' ep ' if ep else ''}"
        f"{'shard ' if fsdp else ''}{'mb':>3} "
        f"{'ckpt':9} {'sp':3} {'attention':{width}} "
        f"{'rms':5} {'prec ' if prec else ''}{'mem GiB':>8} {'fits':4} {'step s':>8} {'MFU':>6}"
    )
    for row in rows:
        p = row.pred
        r = p.row()
        shard = f"{r['dp_shard']:>5} " if fsdp else ""
        print(
            f"{r['tp']:>3} {r['cp']:>3} {r['cp_impl'] or '-':9} {r['pp']:>3} {schedule_label(p.layout):5} "
            f"{r['dp']:>5} {format(r['ep'], '>3') + ' ' if ep else ''}{shard}{r['micro_batch_size']:>3} "
            f"{r['activation_checkpointing']:9} "
            f"{'on' if r['sequence_parallel'] else 'off':3} {','.join(row.kernels):{width}} {r['rmsnorm']:5} "
            f"{r['precision'].ljust(5) + ' ' if prec else ''}"
            f"{r['memory_gib']:8.1f} {_fits_cell(p):4} {r['step_time_s']:8.2f} {r['mfu']:6.3f}"
            f"{' *' if near is not None and p.fits and p.available and p.step_time_s <= near else ''}"
        )
        if args.explain:
            mem = ", ".join(f"{k} {v:.1f}" for k, v in p.memory_breakdown_gib.items() if k != "total")
            t = ", ".join(f"{k} {v:.3g}" for k, v in p.time_breakdown_s.items())
            print(f"      memory GiB (stage {p.worst_stage}): {mem}")
            print(f"      time: {t}")
            if p.why_unavailable:
                print(f"      unavailable: {p.why_unavailable}")
    print(note)
    for line in _margin_lines([row.pred for row in rows], profile) + _cp_lines(args, preds, fitting):
        print(line)
    for line in _moe_lines(args, shape):
        print(line)
    if args.emit_sweep:
        print(f"wrote {args.emit_sweep}", file=sys.stderr)
    return 0


def _fits_cell(p) -> str:
    """yes, no, or yes! for a layout that fits within the allocator's margin of the device."""
    return ("yes!" if p.tight else "yes") if p.fits and p.available else "no"


def _margin_lines(shown, profile) -> list[str]:
    """The shown layouts that fit within the allocator's margin of the device (predict.tight_fit)."""
    from harness.planner.predict import ALLOCATOR_MARGIN

    tight = [p for p in shown if p.fits and p.available and p.tight]
    if not tight:
        return []
    worst = max(tight, key=lambda p: p.memory_gib)
    return [
        f"! {worst.memory_gib:.1f} GiB of {profile.memory_gib:g}: within the {ALLOCATOR_MARGIN:.0%} allocator margin "
        f"(the memory model's fragmentation, harness/planner/memory_terms.py): may not fit (the {len(tight)} "
        f"layouts marked yes!, from {min(p.memory_gib for p in tight):.1f} GiB)"
    ]


# What --findings does not combine with: each prints its own output of one plan.
NOT_WITH_FINDINGS = ("calibrate", "calibrate_csv", "calibrate_out", "export", "emit_sweep", "explain", "top")


def _profiles(args) -> list:
    """The --hardware profiles: one, or with --findings a comma list of distinct ones."""
    from harness.planner.hardware import load_profile

    names = [n.strip() for n in args.hardware.split(",")]
    if len(names) > 1 and not args.findings:
        raise SpecError("--hardware", f"{args.hardware!r}: a comma list of profiles needs --findings; name one")
    if args.findings:
        for name in NOT_WITH_FINDINGS:
            if getattr(args, name) not in (None, False):
                raise SpecError("--findings", f"does not combine with --{name.replace('_', '-')}")
    profiles = [load_profile(n) for n in names]
    seen = [p.name for p in profiles]
    for name in seen:
        if seen.count(name) > 1:
            raise SpecError("--hardware", f"names profile {name} twice")
    return profiles


def _moe_lines(args, shape) -> list[str]:
    """What the plan says of a mixture of experts: its conventions, and an engine that runs no MoE or ep yet."""
    if not shape.moe:
        return []
    from harness.planner.feedforward import IMBALANCE

    out = ["MoE: MFU from active parameters (6 x active params per token plus attention); ep all-to-all exposed, "]
    out[0] += f"the busiest ep rank at {IMBALANCE}x the mean tokens (harness/planner/feedforward.py)"
    facts = registry.facts(args.engine)
    if not facts.runs_moe:
        out.append(f"engine {args.engine} runs no MoE yet (its facts): predicted as its memory model holds it")
    elif facts.refuses("layout.ep", 2, 1):
        out.append(f"engine {args.engine} runs MoE with every expert on every rank: ep 1 only (its facts)")
    return out


def _cp_lines(args, preds, fitting) -> list[str]:
    """What the plan says about context parallelism: that it proposes cp > 1 because no layout fits
    without it, why the engine has none, or what a flash ring stands for."""
    from harness.planner.context import MIN_LOCAL_TOKENS, no_cp
    from harness.planner.layout import ATTENTION_CLASS, MATERIALISED

    out = []
    offered = args.cp not in (None, "1") or args.seq_len >= 2 * MIN_LOCAL_TOKENS  # where cp would be a candidate
    if no_cp(args.engine) and offered:
        out.append(f"no cp > 1 candidates under engine {args.engine}: {no_cp(args.engine)}")
    cps = fitting.column("cp").tolist()
    if fitting and cps[0] > 1 and 1 not in cps:
        lay = fitting[0].layout
        every = zip(preds.column("cp").tolist(), preds.column("memory_gib").tolist(), strict=True)
        smallest = min((gib for cp, gib in every if cp == 1), default=None)  # the first of the least
        why = f" (the smallest without cp needs {smallest:.1f} GiB)" if smallest is not None else ""
        out.append(
            f"no layout fits without context parallelism{why}: the plan proposes cp {lay.cp} "
            f"{lay.cp_impl}, {args.seq_len // lay.cp} tokens of each sequence per rank"
        )
    if args.engine == "own" and any(
        p.layout.cp > 1 and p.layout.cp_impl != "ulysses" and ATTENTION_CLASS[p.layout.attention] not in MATERIALISED
        for p in fitting[:5]
    ):
        out.append(
            "cp ring/allgather with a flash kernel: predicted as the own engine's blocks (a flash kernel per "
            "block, merged in fp32), which it runs with attention naive, or sdpa on CPU only, so far"
        )
    return out


def _near_the_fastest(fitting, profile) -> tuple[float | None, str]:
    """The step time up to which this profile cannot tell a layout that fits from the fastest: within its
    calibration's median step-time error (None: no such bound). In the study's sweeps the best and third-best
    layouts are often 1-2 MFU points apart, less than that error, so these are the ones to measure, not to trust."""
    err = profile.calibrated.get("median_abs_error_pct")
    if not fitting:
        return None, "no layout is predicted to fit"
    if not err:
        fitted = profile.calibrated.get("fitted_on")
        what = f"constants from elsewhere: {fitted}" if fitted else "literature constants"
        return None, (
            f"{profile.name} is not calibrated on its own runs ({what}; error unknown): "
            "calibrate it on a few runs of your cluster (--calibrate) before trusting the ranking"
        )
    steps = fitting.column("step_time_s").tolist()
    near = min(steps) * (1 + err / 100)
    from harness.planner.output import group

    distinct = sum(1 for row in group([fitting[i] for i, t in enumerate(steps) if t <= near]))
    runs = profile.calibrated.get("samples", "?")
    source = profile.calibrated.get("constants_of")  # another profile's constants, checked on this one's runs
    whose = f"{source}'s constants on {runs} {profile.name} runs" if source else f"the calibration's, {runs} runs"
    return near, (
        f"* {distinct} layouts within {err:.1f}% (the median step-time error, {whose}) of the fastest: "
        "measure them, the model cannot rank them reliably"
    )
