"""Every valid layout for a model, workload and cluster: tp, cp, pp, dp and the per-layout options.

tp divides the attention heads (and KV heads) and stays within what the node allows or crosses
nodes in whole nodes; cp is a power of two splitting the sequence into 2 cp chunks, with the
implementations the engine's facts say it runs (harness/planner/context.py; none under the study's
engine); pp is at most the number of layers and one the engine builds the model with (its facts'
model_limits); tp x cp x pp divides the GPUs and dp follows by the one rule
(ParallelDims.derive); the micro-batch divides the per-replica batch. Sequence parallelism is
enumerated only where tp > 1 (and the rank's seq / cp tokens divide by tp). A mixture-of-experts model
ranges over ep too: every divisor of dp x cp that divides the experts (harness/planner/feedforward.py).
"""

from __future__ import annotations

import dataclasses

from harness import registry
from harness.errors import SpecError
from harness.model.presets import Shape
from harness.parallel_dims import ParallelDims
from harness.planner import context, feedforward, schedules
from harness.planner.candidate_table import OPTIONS, Table, split_rules
from harness.planner.layout import ATTENTION, PAPER, PlannerLayout, Workload
from harness.spec import CHECKPOINTING, RMSNORM_KERNELS, model_limit_error, through
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


def layouts(shape: Shape, wl: Workload, gpus: int, gpus_per_node: int, **options):
    """Yield every valid PlannerLayout; raise SpecError if an explicit pp choice is impossible. `fields`
    are further PlannerLayout fields every layout takes (engine, fsdp); cp_values and cp_impls the cp
    degrees and implementations asked for (default: context.degrees', the engine's);
    pipeline_schedules and virtual_stages the schedules of pp > 1 layouts and the chunks per rank of
    the interleaved ones (default: schedules_of, schedules.virtual_stage_choices); precisions the
    PlannerLayout.precision values (default bf16 only); dp_shards the fsdp sharding groups asked for
    (shard_groups); ep_values the expert-parallel degrees asked for (default: FeedForward.ep_degrees')."""
    table = candidate_table(shape, wl, gpus, gpus_per_node, **options)
    for i in range(len(table)):
        yield table.layout(i)


def candidate_table(
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
    dp_shards=None,
    ep_values=None,
    **fields,
) -> Table:
    """layouts() as columns (candidate_table.Table: its rows are layouts()'s layouts, in its order); SpecError
    as layouts() raises it."""
    check_request(shape, wl, gpus, gpus_per_node)
    for p in pp_values or ():
        if p > shape.layers:
            raise SpecError("--pp", f"{p} pipeline stages for {shape.layers} layers")
    engine = fields.get("engine", PAPER)
    scheds = list(pipeline_schedules) if pipeline_schedules else schedules_of(engine)
    even = engine != PAPER and registry.facts(engine).memory.layer_split == "even"
    table = Table()
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
                if engine != PAPER and cannot_build(shape, engine, tp=tp, cp=cp, pp=pp):
                    continue  # the engine cannot build the model so split (its facts' model_limits: tied
                    # embeddings across stages, Megatron-core's even split of the layers)
                dims = ParallelDims.derive(gpus, "--gpus", tp=tp, cp=cp, pp=pp)
                dp = dims.dp
                if wl.global_batch_size % dp:
                    continue
                pipes = _pipelines(shape.layers, pp, scheds, virtual_stages, even)
                shards = shard_groups(dims.replicas(), dp_shards, tp, gpus_per_node) if fields.get("fsdp") else (0,)
                eps = feedforward.of(shape).ep_degrees(dims.replicas(), ep_values)
                if engine != PAPER and shape.moe:  # the degrees the engine shares experts out over (fsdp: none)
                    eps = [e for e in eps if e == 1 or registry.facts(engine).runs("layout.ep", [e])]
                if not eps:
                    continue  # no ep asked for (--ep) divides this split's dp x cp: no layout here
                # the split's fields once (one PlannerLayout built as usual); the options per row, as codes
                split = _fields_of(
                    PlannerLayout(tp=tp, pp=pp, dp=dp, micro_batch_size=1, zero_stage=zero_stage, cp=cp, **fields)
                )
                options = dict(
                    zip(
                        OPTIONS,
                        (
                            list(micro_batch_sizes),
                            pipes,
                            list(checkpointing),
                            list(sequence_parallel),
                            list(attention),
                            list(rmsnorm),
                            impls,
                            list(precisions),
                            list(shards),
                            list(eps),
                        ),
                        strict=True,
                    )
                )
                table.add_split(split, options, split_rules(wl, tp, cp, dp, pp, options))
    return table.close()


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(PlannerLayout))


def _fields_of(lay: PlannerLayout) -> dict:
    """A layout's fields by name, in the dataclass's order (and nothing else its __dict__ may hold)."""
    return {name: getattr(lay, name) for name in _FIELD_NAMES}


def cannot_build(shape: Shape, engine: str, **degrees) -> bool:
    """Whether the engine's facts say it cannot build the model so split (model_limits: tied embeddings
    across stages, Megatron-core's even split). A MoE model under an engine that builds none yet
    (EngineFacts.runs_moe) is planned as its memory model and feedforward.py would hold it: the plan says so."""
    lay = SpecLayout(engine=engine, **degrees)
    facts = registry.facts(engine)
    if shape.moe and not facts.runs_moe:
        return any(not takes(shape, lay) for _, takes, _ in facts.model_limits)
    return model_limit_error(shape, lay) is not None


def schedules_of(engine: str) -> list[str]:
    """The default schedules of pp > 1 candidates: 1F1B, and interleaved 1F1B where the engine runs
    it (its facts; the study's engine did not). The zero-bubble schedules only when asked for
    (`harness plan --pipeline-schedule`): engines own and fsdp run them."""
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


def shard_groups(replicas: int, asked=None, inner: int = 1, gpus_per_node: int = 1) -> tuple[int, ...]:
    """The fsdp sharding groups (PlannerLayout.dp_shard) of a layout with `replicas` = dp x cp ranks,
    `inner` ranks apart (tp: the flattened replica group's stride): 0 (full sharding) and, by
    default, every power of two below dp x cp that divides it and spans at least one node (hybrid
    sharding in groups of 1, 2, 4, ... nodes). A smaller group saves no link (its all-gathers run
    on NVLink as a node's would) and holds more: the model ranks it below the node's group, so it
    is left out to keep the candidates few (at most log2 of the nodes per layout). `asked`
    (--dp-shard): those of its values that divide dp x cp (dp x cp itself meaning 0)."""
    if asked is None:
        least = max(2, -(-gpus_per_node // inner))
        return (0,) + tuple(
            2**k for k in range(1, replicas.bit_length()) if least <= 2**k < replicas and replicas % 2**k == 0
        )
    return tuple(dict.fromkeys(0 if v in (0, replicas) else v for v in asked if v == 0 or replicas % v == 0))


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
    "checkpointing": through(CHECKPOINTING, "selective"),  # selective_op by name only: its time is not modelled
    "sequence_parallel": (False, True),
}
