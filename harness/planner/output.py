"""What `harness plan` hands a user to act on: distinct rows, a sweep to measure, a training config.

- group(): predictions that differ only in an attention kernel the planner cannot tell apart
  (kernels of one cost class, harness.planner.predict.prediction_key) are one row listing them.
- sweep_spec(): a sweep (harness/sweep/spec.py format) of the top layouts predicted to fit, that
  `harness sweep FILE` runs as it is: gpus and nodes set, the workload's precision and device
  from the hardware profile, only kernels and fields this harness runs, every point checked by
  harness.spec, the prediction as a comment beside each point (not as a field).
- export_deepspeed(), export_megatron(), export_torchtitan(): the chosen layout as a DeepSpeed
  JSON config, Megatron-LM arguments, or a torchtitan TOML job config, with a list of notes on
  what the target does differently (printed to stderr by the command).

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from harness import registry
from harness.model.presets import Shape
from harness.planner.layout import ATTENTION_CLASS, PlannerLayout, Workload
from harness.planner.predict import Prediction

EXPORT_FORMATS = ("deepspeed", "megatron", "torchtitan")
# Each target's name for the cp implementations it runs: Megatron-LM's --cp-comm-type (p2p: the
# ring of K/V blocks; a2a: Ulysses' all-to-all), torchtitan's context_parallel_rotate_method
# (alltoall: K/V shards passed on per step, the ring; allgather), DeepSpeed's Ulysses only.
CP_COMM = {
    "megatron": {"ring": "p2p", "allgather": "all_gather", "ulysses": "a2a"},
    "torchtitan": {"ring": "alltoall", "allgather": "allgather"},
    "deepspeed": {"ulysses": "ulysses"},
}


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
    """Whether this harness's engines run the layout's kernels (the planner also knows the study's
    fused_softmax and flash1, which no engine here runs)."""
    from harness.spec import ATTENTION_KERNELS

    return lay.attention in ATTENTION_KERNELS


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
        try:
            parse_spec({"workload": workload, "layout": layout})
        except Exception as e:  # a SpecError: a layout the harness refuses
            left_out.append(f"{layout}: {e}")
            continue
        points.append((layout, row.pred))
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


# ---------------------------------------------------------------- --export


def _deepspeed_refuses(lay: PlannerLayout) -> str:
    """Why engine deepspeed's facts refuse the layout ("" if they do not), its ZeRO stage the
    layout's sharding (full sharding is stage 3)."""
    from harness.spec import Layout, capability_error

    layout = {**lay.to_spec(), "engine": "deepspeed", "zero_stage": lay.sharding_stage}
    if lay.pp == 1 and lay.sharding_stage == 0:
        layout["zero_stage"] = 1  # DeepSpeed runs stage 0 (plain data parallelism); the harness measures ZeRO
    error = capability_error(Layout(**layout))
    return "" if error is None else error.reason


def exportable(lay: PlannerLayout, fmt: str) -> str:
    """Empty when `fmt` can express the layout, else why not."""
    if lay.cp > 1 and lay.cp_impl not in CP_COMM[fmt]:
        return f"{fmt} has no {lay.cp_impl} context parallelism (it runs {', '.join(CP_COMM[fmt])})"
    if lay.shard_group < lay.replicas and (fmt != "torchtitan" or lay.shard_group % lay.cp):
        # torchtitan's FSDP mesh is data_parallel_shard_degree x cp: a group of whole cp groups
        return f"{fmt} has no sharding group of {lay.shard_group} of the dp x cp = {lay.replicas} ranks (HSDP)"
    if fmt == "deepspeed":  # what the harness's engine deepspeed runs (its facts): AutoTP or its pipeline
        return _deepspeed_refuses(lay)  # engine, Ulysses without either, no sequence parallelism, 1F1B only
    if fmt == "megatron":
        if lay.sharding_stage > 1:
            return "Megatron-LM shards over dp with its distributed optimizer (ZeRO-1); ZeRO-2/3 is Megatron-FSDP"
        if lay.pp > 1 and lay.pipeline_schedule == "gpipe":
            return "Megatron-LM runs 1F1B or interleaved 1F1B, not GPipe"
    if fmt == "torchtitan" and lay.tp > 1 and not lay.sequence_parallel:
        return "torchtitan's tensor parallelism always shards the sequence (sequence parallel)"
    return ""


def export_deepspeed(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple[str, list[str]]:
    """A ds_config (DeepSpeed's JSON config keys) for the layout."""
    bf16 = wl.dtype_bytes == 2
    cfg = {
        "train_batch_size": wl.global_batch_size,
        "train_micro_batch_size_per_gpu": lay.micro_batch_size,
        "gradient_accumulation_steps": wl.micro_batches(lay),
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": lay.sharding_stage},
    }
    if bf16:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        cfg["communication_data_type"] = "fp32"
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
    if lay.cp > 1:  # Ulysses' degree: ZeRO then shards over the dp x cp ranks
        cfg["sequence_parallel_size"] = lay.cp
    if lay.pp > 1:
        cfg["pipeline"] = {
            "stages": lay.pp,
            "partition": "uniform",
            "activation_checkpoint_interval": 1 if lay.activation_checkpointing == "full" else 0,
        }
    if lay.activation_checkpointing != "none":
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    ulysses = " x sequence_parallel_size" if lay.cp > 1 else ""
    notes = [
        f"data parallel degree {lay.dp} = world size / (tp x pp{ulysses}): launch {lay.gpus} ranks",
        "Ulysses: wrap the attention core in deepspeed.sequence.layer.DistributedAttention over a sequence "
        f"group of {lay.cp} ranks and feed each its chunks i and 2cp-1-i"
        if lay.cp > 1
        else "",
        "pipeline stages are the PipelineModule's num_stages in your code; the config repeats them"
        if lay.pp > 1
        else "",
    ]
    if lay.activation_checkpointing == "selective":
        notes.append(
            "DeepSpeed has no selective recomputation: wrap the attention core in "
            "deepspeed.checkpointing.checkpoint yourself"
        )
    elif lay.activation_checkpointing == "full" and lay.pp == 1:
        notes.append("full checkpointing: wrap each block in deepspeed.checkpointing.checkpoint")
    notes.append(f"attention {lay.attention}, rmsnorm {lay.rmsnorm}: kernels are chosen in the model code")
    return json.dumps(cfg, indent=2), [n for n in notes if n]


def export_megatron(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple[str, list[str]]:
    """Megatron-LM's pretrain_gpt.py arguments for the layout and the model's shape."""
    args = ["--tensor-model-parallel-size", lay.tp, "--pipeline-model-parallel-size", lay.pp]
    if lay.cp > 1:
        args += ["--context-parallel-size", lay.cp, "--cp-comm-type", CP_COMM["megatron"][lay.cp_impl]]
    if lay.sequence_parallel:
        args.append("--sequence-parallel")
    args += [
        "--micro-batch-size",
        lay.micro_batch_size,
        "--global-batch-size",
        wl.global_batch_size,
        "--seq-length",
        wl.seq_len,
        "--max-position-embeddings",
        max(wl.seq_len, shape.max_positions),
        "--num-layers",
        shape.layers,
        "--hidden-size",
        shape.hidden,
        "--ffn-hidden-size",
        shape.ffn,
        "--num-attention-heads",
        shape.heads,
    ]
    if shape.kv_heads != shape.heads:
        args += ["--group-query-attention", "--num-query-groups", shape.kv_heads]
    # LLaMA has no dropout (Megatron-LM's default is 0.1) and no MLP biases
    args += [
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--norm-epsilon",
        f"{shape.norm_eps:g}",
        "--position-embedding-type",
        "rope",
        "--rotary-base",
        int(shape.rope_theta),
        "--attention-dropout",
        0,
        "--hidden-dropout",
        0,
        "--disable-bias-linear",
    ]
    if shape.rope_scaling:
        args += ["--use-rope-scaling", "--rope-scaling-factor", f"{shape.rope_scaling[0]:g}"]
    if shape.attention_bias:
        args.append("--add-qkv-bias")
    if not shape.tie_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if wl.dtype_bytes == 2:  # the planner's policy: main gradients accumulated and reduced in fp32
        args += ["--bf16", "--accumulate-allreduce-grads-in-fp32"]
    if lay.sharding_stage >= 1 and lay.dp > 1:
        args.append("--use-distributed-optimizer")
    if lay.activation_checkpointing == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    elif lay.activation_checkpointing == "selective":
        args += ["--recompute-granularity", "selective"]
    if ATTENTION_CLASS.get(lay.attention) in ("flash1", "flash2"):
        args.append("--use-flash-attn")
    notes = []
    if lay.pipeline_schedule == "interleaved" and lay.virtual_stages > 1:
        per_chunk = shape.layers // (lay.pp * lay.virtual_stages)
        args += ["--num-layers-per-virtual-pipeline-stage", per_chunk]
        if shape.layers % (lay.pp * lay.virtual_stages):
            notes.append(f"{shape.layers} layers do not split evenly into {lay.pp} x {lay.virtual_stages} chunks")
    elif lay.pipeline_schedule == "gpipe" and lay.pp > 1:
        notes.append("Megatron-LM runs 1F1B (or interleaved), not GPipe: the memory differs from the prediction")
    notes.append(f"vocabulary {shape.vocab}: set by your tokenizer (--tokenizer-type/--vocab-size)")
    notes.append(
        f"data parallel {lay.dp}: Megatron-LM takes it from the world size, {lay.gpus} ranks / (tp x pp"
        + (" x cp)" if lay.cp > 1 else ")")
    )
    if lay.cp > 1:
        notes.append(
            "Megatron-LM's context parallelism runs in Transformer Engine's attention (--transformer-impl "
            "transformer_engine, its default)"
        )
    if shape.attention_bias:
        notes.append(
            "the output projection's bias (transformers' o_proj) has no Megatron-LM flag: "
            "--add-qkv-bias covers q/k/v only"
        )
    if lay.rmsnorm == "torch":
        notes.append("Megatron-LM's RMSNorm is fused (Transformer Engine/Apex): faster than the eager one predicted")
    return " ".join(str(a) for a in args), notes


def export_torchtitan(shape: Shape, lay: PlannerLayout, wl: Workload) -> tuple[str, list[str]]:
    """The [training], [parallelism] and [activation_checkpoint] sections of a torchtitan job config
    (torchtitan/config/job_config.py field names)."""
    schedule = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B"}[lay.pipeline_schedule]
    local = wl.global_batch_size // lay.dp if lay.pp > 1 else lay.micro_batch_size

    def val(v):
        return ("true" if v else "false") if isinstance(v, bool) else (f'"{v}"' if isinstance(v, str) else str(v))

    sections = {
        "training": {
            "local_batch_size": local,
            "global_batch_size": wl.global_batch_size,
            "seq_len": wl.seq_len,
            "max_norm": 1.0,
            "mixed_precision_param": "bfloat16" if wl.dtype_bytes == 2 else "float32",
            "mixed_precision_reduce": "float32",
        },
        "parallelism": {
            "data_parallel_replicate_degree": lay.replicas // lay.shard_group,  # HSDP: the sharding groups
            "data_parallel_shard_degree": lay.shard_group // lay.cp,
            "fsdp_reshard_after_forward": "default",
            "tensor_parallel_degree": lay.tp,
            "enable_async_tensor_parallel": False,
            "pipeline_parallel_degree": lay.pp,
            "pipeline_parallel_schedule": schedule,
            "context_parallel_degree": lay.cp,
        },
        "activation_checkpoint": {"mode": lay.activation_checkpointing},
    }
    if lay.pp > 1:
        sections["parallelism"]["pipeline_parallel_microbatch_size"] = lay.micro_batch_size
    if lay.cp > 1:
        sections["parallelism"]["context_parallel_rotate_method"] = CP_COMM["torchtitan"][lay.cp_impl]
    if lay.activation_checkpointing == "selective":
        sections["activation_checkpoint"]["selective_ac_option"] = "op"
    text = "\n\n".join(
        f"[{name}]\n" + "\n".join(f"{k} = {val(v)}" for k, v in body.items()) for name, body in sections.items()
    )
    notes = [
        "torchtitan shards parameters, gradients and optimizer states with FSDP2 (ZeRO-3-like) over "
        f"data_parallel_shard_degree: its memory is below the ZeRO-{lay.sharding_stage} prediction",
        "attention runs through scaled_dot_product_attention; the model's shape is its [model] flavor",
    ]
    if lay.pp == 1 and wl.micro_batches(lay) > 1:
        notes.append(
            f"global_batch_size > local_batch_size x dp: torchtitan accumulates "
            f"{wl.micro_batches(lay)} micro-batches per step"
        )
    return text + "\n", notes


EXPORTERS = {"deepspeed": export_deepspeed, "megatron": export_megatron, "torchtitan": export_torchtitan}
