"""Every valid layout for a model, workload and cluster: tp, cp, pp, dp and the per-layout options.

tp divides the attention heads (and KV heads) and stays within what the node allows or crosses
nodes in whole nodes; cp is a power of two splitting the sequence into 2 cp chunks, with the
implementations the engine's facts say it runs (harness/planner/context.py; none under the study's
engine); pp is at most the number of layers and one the engine builds the model with (its facts'
model_limits); tp x cp x pp divides the GPUs and dp follows by the one rule
(ParallelDims.derive); the micro-batch divides the per-replica batch. Sequence parallelism is
enumerated only where tp > 1 (and the rank's seq / cp tokens divide by tp).
"""

from __future__ import annotations

import itertools

from harness import registry
from harness.errors import SpecError
from harness.model.presets import Shape
from harness.parallel_dims import ParallelDims
from harness.planner import context, schedules
from harness.planner.layout import ATTENTION, PAPER, PlannerLayout, Workload
from harness.spec import CHECKPOINTING, RMSNORM_KERNELS, model_limit_error
from harness.spec import Layout as SpecLayout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_request(shape: Shape, wl: Workload, gpus: int, gpus_per_node: int) -> None:
    if gpus < 1:
        raise SpecError("--gpus", "must be at least 1")
    if gpus_per_node < 1:
        raise SpecError("--gpus-per-node", "must be at least 1")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise SpecError("--gpus", f"{gpus} GPUs are not a whole number of {gpus_per_node}-GPU nodes")
    if wl.seq_len < 1:
        raise SpecError("--seq-len", "must be at least 1")
    if wl.global_batch_size < 1:
        raise SpecError("--global-batch-size", "must be at least 1")


def layouts(
    shape: Shape,
    wl: Workload,
    gpus: int,
    gpus_per_node: int,
    *,
    attention,
    rmsnorm,
    micro_batch_sizes,
    checkpointing,
    sequence_parallel,
    zero_stage: int,
    pp_values=None,
    cp_values=None,
    cp_impls=None,
    pipeline_schedules=None,
    virtual_stages=None,
    precisions=("bf16",),
    **fields,
):
    """Yield every valid PlannerLayout; raise SpecError if an explicit pp choice is impossible. `fields`
    are further PlannerLayout fields every layout takes (engine, fsdp); cp_values and cp_impls the cp
    degrees and implementations asked for (default: context.degrees', the engine's);
    pipeline_schedules and virtual_stages the schedules of pp > 1 layouts and the chunks per rank of
    the interleaved ones (default: schedules_of, schedules.virtual_stage_choices); precisions the
    PlannerLayout.precision values (default bf16 only)."""
    check_request(shape, wl, gpus, gpus_per_node)
    for p in pp_values or ():
        if p > shape.layers:
            raise SpecError("--pp", f"{p} pipeline stages for {shape.layers} layers")
    engine = fields.get("engine", PAPER)
    scheds = list(pipeline_schedules) if pipeline_schedules else schedules_of(engine)
    even = engine != PAPER and registry.facts(engine).memory.layer_split == "even"
    for tp in divisors(gpus):
        if shape.heads % tp or shape.kv_heads % tp and tp > shape.kv_heads:
            continue
        if tp > gpus_per_node and tp % gpus_per_node:
            continue
        for cp in context.degrees(wl.seq_len, gpus, tp, cp_values) if context.engine_impls(engine) else (1,):
            impls = [i for i in context.impls(shape, engine, tp, cp) if cp == 1 or not cp_impls or i in cp_impls]
            for pp in divisors(gpus):
                if not ParallelDims(tp=tp, cp=cp, pp=pp).divides(gpus):
                    continue
                if pp > shape.layers or (pp_values and pp not in pp_values):
                    continue
                if engine != PAPER and model_limit_error(shape, SpecLayout(engine=engine, tp=tp, cp=cp, pp=pp)):
                    continue  # the engine cannot build the model so split (its facts' model_limits: tied
                    # embeddings across stages, Megatron-core's even split of the layers)
                dp = ParallelDims.derive(gpus, "--gpus", tp=tp, cp=cp, pp=pp).dp
                if wl.global_batch_size % dp:
                    continue
                pipes = _pipelines(shape.layers, pp, scheds, virtual_stages, even)
                for mb, (sched, v), ck, sp, att, rms, impl, prec in itertools.product(
                    micro_batch_sizes, pipes, checkpointing, sequence_parallel, attention, rmsnorm, impls, precisions
                ):
                    if sp and (tp == 1 or (wl.seq_len // cp) % tp):
                        continue
                    if (wl.global_batch_size // dp) % mb:
                        continue
                    if sched in schedules.INTERLEAVED and (wl.global_batch_size // dp // mb) % pp:
                        continue  # Megatron's interleaved schedule (and the spec's): micro-batches divisible by pp
                    yield PlannerLayout(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        micro_batch_size=mb,
                        activation_checkpointing=ck,
                        sequence_parallel=sp,
                        attention=att,
                        rmsnorm=rms,
                        zero_stage=zero_stage,
                        cp=cp,
                        cp_impl=impl,
                        pipeline_schedule=sched,
                        virtual_stages=v,
                        precision=prec,
                        **fields,
                    )


def schedules_of(engine: str) -> list[str]:
    """The default schedules of pp > 1 candidates: 1F1B, and interleaved 1F1B where the engine runs
    it (its facts; the study's engine did not). The zero-bubble schedules only when asked for
    (`harness plan --pipeline-schedule`): no engine here runs them yet."""
    if engine == PAPER:
        return ["1f1b"]
    return ["1f1b", *registry.facts(engine).runs("layout.pipeline_schedule", ["interleaved"])]


def _pipelines(layers: int, pp: int, scheds: list[str], virtual, even: bool) -> list[tuple[str, int]]:
    """(schedule, virtual stages) of the layouts at this pp: one chunk per rank when pp is 1."""
    if pp == 1:
        return [("1f1b", 1)]
    out = []
    for sched in scheds:
        if sched in schedules.INTERLEAVED:
            out += [(sched, v) for v in schedules.virtual_stage_choices(layers, pp, virtual, even)]
        elif sched in schedules.V_SCHEDULES:
            if 2 * pp <= layers:
                out.append((sched, 1))
        else:
            out.append((sched, 1))
    return out


def parse_list(text: str | None, allowed, field: str, default, cast=str):
    """A comma-separated flag value checked against the allowed values."""
    if text is None:
        return list(default)
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            value = cast(item)
        except ValueError:
            raise SpecError(field, f"{item!r} is not valid") from None
        if allowed is not None and value not in allowed:
            raise SpecError(field, f"{item!r} is not one of {', '.join(map(str, allowed))}")
        out.append(value)
    if not out:
        raise SpecError(field, "is empty")
    return out


def parse_bool(item: str) -> bool:
    low = item.lower()
    if low in ("on", "true", "1", "yes"):
        return True
    if low in ("off", "false", "0", "no"):
        return False
    raise ValueError(item)


DEFAULTS = {
    "attention": ATTENTION,
    "rmsnorm": RMSNORM_KERNELS,
    "micro_batch_sizes": (1, 2, 4, 8),
    "checkpointing": CHECKPOINTING,
    "sequence_parallel": (False, True),
}
