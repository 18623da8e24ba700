"""Synthetic records with the full metrics schema, for the report's scale benchmark and tests.

The numbers follow a plausible shape (micro-batch 1 and no checkpointing fastest, OOM for
large micro-batches without model parallelism) only so the plots have something to show;
they are labelled synthetic wherever they are used and never stored as results.
"""

from __future__ import annotations

import random
import uuid

from harness.parallel_dims import ParallelDims

SWEEPS = [
    ("syn-13b-seq2048-64gpu", "paper-13b", 2048, 64),
    ("syn-30b-seq2048-256gpu", "paper-30b", 2048, 256),
    ("syn-13b-seq8192-128gpu", "paper-13b", 8192, 128),
    ("syn-65b-seq2048-128gpu", "paper-65b", 2048, 128),
    ("syn-8gpu-node", "llama2-7b", 4096, 8),
]


def _model_parallel(gpus: int) -> list[tuple[int, int]]:
    """The (tp, pp) pairs of degrees up to 8 that a sweep's GPUs hold a whole number of times."""
    return [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if ParallelDims(tp=tp, pp=pp).divides(gpus)]


def make_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sweep, model, seq, gpus = SWEEPS[i % len(SWEEPS)]
        engine = rng.choice(["own"] * 6 + ["deepspeed", "fsdp"])
        tp, pp = rng.choice(_model_parallel(gpus)) if engine == "own" else (1, 1)
        dims = ParallelDims.derive(gpus, tp=tp, pp=pp)
        dp = dims.dp
        mb = rng.choice([1, 2, 4, 8])
        ckpt = rng.choice(["none", "full", "selective"])
        attn = rng.choice(["naive", "sdpa", "flash2"])
        norm = rng.choice(["torch", "fused"])
        sp = engine == "own" and tp > 1 and rng.random() < 0.5
        layout = {
            "engine": engine,
            "tp": tp,
            "pp": pp,
            "dp": dp,
            "micro_batch_size": mb,
            "activation_checkpointing": ckpt,
            "sequence_parallel": sp,
            "attention": attn,
            "rmsnorm": norm,
            "zero_stage": rng.choice([1, 2, 3]) if engine == "deepspeed" else (1 if engine == "own" else 0),
            "reshard_after_forward": rng.random() < 0.5,
        }
        workload = {
            "model": model,
            "seq_len": seq,
            "global_batch_size": 2048 if seq == 2048 else 512,
            "steps": 20,
            "warmup_steps": 3,
            "precision": "bf16",
        }
        mem_pressure = mb * (1 if ckpt == "none" else 0.3) / dims.excluding("dp")
        status = "ok"
        if mem_pressure > 1.5 and rng.random() < 0.8:
            status = "oom"
        elif rng.random() < 0.03:
            status = rng.choice(["failed", "timeout"])
        mfu = (
            0.62
            - 0.03 * (mb - 1) ** 0.5
            - (0.1 if ckpt == "full" else 0.04 if ckpt == "selective" else 0)
            - (0.12 if attn == "naive" else 0.05 if attn == "sdpa" else 0)
            - (0.02 if norm == "torch" else 0)
            - 0.015 * (tp - 1)
            - 0.008 * (pp - 1)
            + rng.gauss(0, 0.01)
        )
        mfu = max(0.05, mfu)
        step = 1.0 / mfu
        rec = {
            "schema_version": 1,
            "run_id": uuid.UUID(int=rng.getrandbits(128)).hex,
            "status": status,
            "error": None,
            "started_at": f"2026-01-01T00:{i // 60 % 60:02d}:{i % 60:02d}+00:00",
            "ended_at": None,
            "sweep": sweep,
            "point_key": f"{i:016x}",
            "spec": {"workload": workload, "layout": layout, "name": sweep, "store": "x"},
            "metrics": {},
            "fingerprint": {
                "world_size": gpus,
                "device_name": "NVIDIA A100-SXM4-80GB (synthetic)",
                "hosts": [f"node{k}" for k in range(gpus // 8)],
                "torch": "2.13.0",
            },
        }
        if status == "oom":
            rec["error"] = "rank 3: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
        elif status != "ok":
            rec["error"] = "RuntimeError: NCCL watchdog timeout" if status == "failed" else "timed out after 1800 s"
        else:
            times = [step * (1 + rng.gauss(0, 0.01)) for _ in range(20)]
            srt = sorted(times)
            m = {
                "step_time_s": {
                    "median": srt[10],
                    "mean": sum(times) / 20,
                    "p10": srt[2],
                    "p90": srt[18],
                    "std": step * 0.01,
                    "ci95_low": srt[6],
                    "ci95_high": srt[13],
                    "n": 20,
                },
                "step_times_s": times,
                "tokens_per_step": 4194304,
                "tokens_per_s": 4194304 / srt[10],
                "tokens_per_s_per_device": 4194304 / srt[10] / gpus,
                "mfu": {"palm": mfu, "palm_causal": mfu * 0.97, "megatron": mfu * 1.02, "hardware": mfu * 1.1},
                "peak_memory_bytes": int(8e10 * min(1, mem_pressure)),
                "memory_kind": "cuda_max_allocated",
                "losses": [10 - 0.1 * k for k in range(20)],
            }
            if engine == "own" and rng.random() < 0.9:
                bub = step * (pp - 1) / (pp - 1 + 2048 / (dp * mb) / 1) * 0.5 if pp > 1 else 0.0
                m["breakdown_s"] = {
                    "compute": step * 0.7,
                    "tp_comm": step * 0.05 * (tp - 1),
                    "bubble": bub,
                    "dp_comm": step * 0.05,
                    "optimizer": step * 0.03,
                }
            if engine == "own" and pp > 1 and rng.random() < 0.5:
                m["pipeline_timeline"] = _timeline(pp, 2 * pp)
            m.update(profiled(engine, tp, pp, dp, zero=layout["zero_stage"], step_ms=1e3 * srt[10]))
            rec["metrics"] = m
            rec["traces"] = [
                {"rank": 0, "path": f"traces/{rec['run_id']}-rank0.json.gz", "role": "rank 0"},
                {"rank": gpus - 1, "path": f"traces/{rec['run_id']}-rank{gpus - 1}.json.gz", "role": "slowest rank"},
            ]
        out.append(rec)
    return out


# Exposed data-parallel share per engine: FSDP2 overlaps nothing on CPU, DeepSpeed ZeRO a little.
DP_EXPOSED = {"own": 0.04, "deepspeed": 0.08, "fsdp": 0.15}


def profiled(engine: str, tp: int, pp: int, dp: int, zero: int | None, step_ms: float) -> dict:
    """The profiler's fields of a record (breakdown_ms, breakdown_source, collectives) for a run
    of this shape: shares of the step that sum to it, drawn from no random numbers (so the
    records' other fields stay what they were)."""
    shares = {
        "tp": 0.03 * (tp - 1),
        "pp": 0.01 * (pp - 1),
        "dp": DP_EXPOSED.get(engine, 0.04) if dp > 1 else 0.0,
        "bubble": 0.1 * (pp - 1) / (pp + 3),
        "optimizer": 0.03,
    }
    shares["compute"] = 0.97 - sum(shares.values())
    ms = {k: round(v * step_ms, 3) for k, v in shares.items()}
    other = round(step_ms - sum(ms.values()), 3)
    breakdown = {
        "compute": ms["compute"],
        "optimizer": ms["optimizer"],
        "exposed_comm": {axis: ms[axis] for axis, n in (("tp", tp), ("pp", pp), ("dp", dp)) if n > 1},
        "bubble": ms["bubble"],
        "other": other,
        "step": round(step_ms, 3),
    }
    grads = 2**27 // ParallelDims(tp=tp, pp=pp).product("tp", "pp")
    coll = []
    if tp > 1:
        coll.append({"axis": "tp", "kind": "all_reduce", "count": 96, "bytes": 96 * 2**20})
    if pp > 1:
        coll.append({"axis": "pp", "kind": "send", "count": 8, "bytes": 8 * 2**22})
    if dp > 1:
        kinds = {
            "fsdp": ("reduce_scatter", "all_gather"),
            "deepspeed": ("reduce_scatter", "all_gather") if (zero or 0) >= 2 else ("all_reduce",),
        }.get(engine, ("all_reduce",))
        coll += [{"axis": "dp", "kind": k, "count": 4, "bytes": grads} for k in kinds]
    return {
        "breakdown_ms": breakdown,
        "breakdown_source": "profiler",
        "collectives": coll,
        "breakdown_ms_by_rank": [breakdown],
    }


def _timeline(stages: int, micro: int) -> list[dict]:
    """A GPipe-shaped schedule: forward waves, then backward waves (times in seconds)."""
    ev, f, b = [], 0.01, 0.02
    for s in range(stages):
        for m in range(micro):
            start = (s + m) * f
            ev.append({"stage": s, "kind": "F", "micro": m, "start_s": start, "end_s": start + f})
    t_end = (stages + micro - 1) * f
    for s in reversed(range(stages)):
        for m in range(micro):
            start = t_end + ((stages - 1 - s) + m) * b
            ev.append({"stage": s, "kind": "B", "micro": m, "start_s": start, "end_s": start + b})
    return ev
