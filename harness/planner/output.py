"""What `harness plan` hands a user to act on: distinct rows, a sweep to measure, a training config.

- group(): predictions that differ only in an attention kernel the planner cannot tell apart
  (kernels of one cost class, harness.planner.predict.prediction_key) are one row listing them.
- sweep_spec(): a sweep (harness/sweep/spec.py format) of the top layouts predicted to fit, that
  `harness sweep FILE` runs as it is: gpus and nodes set, the workload's precision and device
  from the hardware profile, only kernels and fields this harness runs, every point checked by
  harness.spec, the prediction as a comment beside each point (not as a field).
- the exports to DeepSpeed, Megatron-LM and torchtitan are harness/interop/exports.py.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from harness import registry
from harness.planner.layout import PlannerLayout
from harness.planner.predict import Prediction


@dataclass
class Row:
    """One distinct prediction: the first layout (in ranking order) and every kernel sharing it."""

    pred: Prediction
    kernels: list[str] = field(default_factory=list)
    members: list[Prediction] = field(default_factory=list)


def _row_key(p: Prediction) -> tuple:
    return (
        dataclasses.replace(p.layout, attention=""),
        p.fits and p.available,
        round(p.memory_gib, 3),
        round(p.step_time_s, 6),
    )


def group(preds: list[Prediction], limit: int | None = None) -> list[Row]:
    """Rows in the order of `preds` (ranked: fitting first, fastest first): layouts equal but for
    the attention kernel and predicted identically (memory, fit, step time) share the row of the
    first of them. With `limit`, the first `limit` rows (aliases rank together, having the same
    prediction, so the scan stops once past them)."""
    rows: dict = {}
    for p in preds:
        if limit is not None and len(rows) > limit:
            last = list(rows.values())[limit - 1].pred
            if (p.fits and p.available, p.mfu) != (last.fits and last.available, last.mfu):
                break
        key = _row_key(p)
        row = rows.get(key)
        if row is None:
            rows[key] = Row(p, [p.layout.attention], [p])
        else:
            row.kernels.append(p.layout.attention)
            row.members.append(p)
    out = list(rows.values())
    return out[:limit] if limit is not None else out


# ---------------------------------------------------------------- --emit-sweep


def runnable(lay: PlannerLayout) -> bool:
    """Whether this harness's engines run the layout's kernels and schedule (the planner also knows
    the study's fused_softmax and flash1, which no engine here runs)."""
    from harness.spec import ATTENTION_KERNELS, SCHEDULES

    return lay.attention in ATTENTION_KERNELS and (lay.pp == 1 or lay.pipeline_schedule in SCHEDULES)


def spec_layout(lay: PlannerLayout) -> dict:
    """The layout as a harness.spec layout: the planner's engine names mapped to the harness's
    (the study's engine, `paper`, is modelled but not run here: the own engine is its analogue)."""
    out = dict(lay.to_spec())
    if out.get("engine") is not None and not registry.known(out["engine"]):
        out["engine"] = "own"
    if out.get("engine") == "own" and out.get("zero_stage", 0) > 1:
        out["zero_stage"] = 1  # the own engine shards optimizer states at most (ZeRO-1)
    return out


def sweep_spec(
    rows: list[Row],
    *,
    model: str,
    seq_len: int,
    global_batch_size: int,
    gpus: int,
    gpus_per_node: int,
    profile,
    top: int,
) -> tuple[str, int, list[str]]:
    """The YAML text of a sweep over the first `top` rows predicted to fit (per row the first
    kernel this harness runs), how many points it has, and the rows left out and why."""
    import yaml

    from harness.spec import parse_spec

    cpu = profile.name.startswith("cpu")
    nodes = gpus // gpus_per_node if gpus > gpus_per_node else 1
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"plan-{model.split('/')[-1]}-seq{seq_len}-{gpus}gpus").strip("-")
    workload = {
        "model": model,
        "seq_len": seq_len,
        "global_batch_size": global_batch_size,
        "precision": "fp32" if cpu else "bf16",
        "device": "cpu" if cpu else "cuda",
    }
    points, left_out = [], []
    for row in rows:
        if len(points) >= top:
            break
        if not (row.pred.fits and row.pred.available):
            continue
        if row.pred.layout.shard_group < row.pred.layout.replicas:
            left_out.append(
                f"{row.pred.layout.tp}/{row.pred.layout.pp}/{row.pred.layout.dp} dp_shard {row.pred.layout.dp_shard}: "
                "hybrid sharding, which engine fsdp here does not run (it shards over all of dp x cp)"
            )
            continue
        lay = next((m.layout for m in row.members if runnable(m.layout)), None)
        if lay is None:
            left_out.append(
                f"{row.pred.layout.tp}/{row.pred.layout.pp}/{row.pred.layout.dp} "
                f"{'/'.join(row.kernels)}: no kernel this harness runs"
            )
            continue
        layout = spec_layout(lay)
        fp8 = {"workload.precision": "fp8"} if lay.precision == "fp8" else {}  # the point's own workload field
        try:
            parse_spec({"workload": {**workload, **({"precision": "fp8"} if fp8 else {})}, "layout": layout})
        except Exception as e:  # a SpecError: a layout the harness refuses
            left_out.append(f"{layout}{' fp8' if fp8 else ''}: {e}")
            continue
        points.append(({**layout, **fp8}, row.pred))
    header = [
        f"# Written by `harness plan`: the {len(points)} fastest distinct layouts predicted to fit "
        f"{model} (seq {seq_len}, batch {global_batch_size}) on {gpus} x {profile.name}.",
        "# Run it with `harness sweep FILE` (--launcher slurm for several nodes); the planner's",
        "# prediction is the comment beside each point.",
    ]
    header += [f"# left out: {why}" for why in left_out]
    body = {
        "name": name,
        "gpus": gpus,
        "nodes": nodes,
        "launcher": "slurm" if nodes > 1 else "torchrun",
        "store": "results.sqlite",
        "workload": workload,
    }
    text = "\n".join(header) + "\n" + yaml.safe_dump(body, sort_keys=False)
    text += "points:\n"
    for layout, pred in points:
        flow = yaml.safe_dump(layout, default_flow_style=True, sort_keys=False, width=10_000).strip()
        text += (
            f"  - {flow}  # predicted {pred.memory_gib:.1f} GiB, {pred.step_time_s:.3g} s/step, MFU {pred.mfu:.3f}\n"
        )
    if not points:
        text += "  []\n"
    return text, len(points), left_out
