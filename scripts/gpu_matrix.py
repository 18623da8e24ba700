"""Single-GPU matrix on LLaMA-13B-shaped layers: kernels, checkpointing, micro-batch, seq 2048/8192.

Runs every point in this one process (no launcher start-up per point), records each in the
results store (ok, oom or failed, never lost) and writes a JSON summary. Stops starting new
points when the time budget is spent and says which were not run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

import harness.model.llama as llama
from harness.errors import SpecError
from harness.run import run
from harness.runtime import RunContext
from harness.spec import parse_spec
from harness.store import ResultsStore, mentions_oom, new_record, now_iso

# The same 1B-parameter initial weights serve every point: generate them once.
llama.reference_state_dict = functools.lru_cache(maxsize=1)(llama.reference_state_dict)

BASE = {"attention": "sdpa_flash", "rmsnorm": "torch", "activation_checkpointing": "none", "micro_batch_size": 1}


def points(seq_lens=(2048, 8192)):
    """One factor at a time around BASE, for each sequence length."""
    out = []
    for seq in seq_lens:
        out.append((seq, dict(BASE)))
        for att in ("naive", "sdpa", "sdpa_efficient", "sdpa_cudnn", "flash2"):
            out.append((seq, {**BASE, "attention": att}))
        for ck in ("full", "selective"):
            out.append((seq, {**BASE, "activation_checkpointing": ck}))
            out.append((seq, {**BASE, "attention": "naive", "activation_checkpointing": ck}))
        for mbs in (2, 4):
            out.append((seq, {**BASE, "micro_batch_size": mbs}))
            out.append((seq, {**BASE, "micro_batch_size": mbs, "activation_checkpointing": "selective"}))
        out.append((seq, {**BASE, "rmsnorm": "fused"}))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="llama-13b", help="shapes of the layers (default: LLaMA-13B's)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of this script")
    ap.add_argument("--seq-lens", default="2048,8192")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    store_path = os.path.join(args.out, "results.sqlite")
    store = ResultsStore(store_path)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    ctx = RunContext(0, 1, 0, device, None)
    start, summary = time.monotonic(), []
    for seq, layout in points(tuple(int(x) for x in args.seq_lens.split(","))):
        raw = {
            "name": "gpu-matrix",
            "store": store_path,
            "workload": {
                "model": args.model,
                "model_overrides": {"layers": args.layers},
                "seq_len": seq,
                "global_batch_size": 4 * layout["micro_batch_size"],
                "steps": args.steps,
                "warmup_steps": 2,
                "precision": "bf16",
                "device": args.device,
            },
            "layout": {"engine": "single", **layout},
        }
        row = {"seq_len": seq, **layout}
        if time.monotonic() - start > args.budget_s:
            summary.append({**row, "status": "not run (time budget)"})
            continue
        spec = parse_spec(raw)
        try:
            rec = run(spec, ctx, store_path=store_path, progress=False)
            m = rec["metrics"]
            row.update(
                status="ok",
                step_time_ms=m["step_time_s"]["median"] * 1e3,
                ci95_ms=[m["step_time_s"]["ci95_low"] * 1e3, m["step_time_s"]["ci95_high"] * 1e3],
                tokens_per_s=m["tokens_per_s"],
                mfu_palm=(m["mfu"] or {}).get("palm"),
                hfu=(m["mfu"] or {}).get("hardware"),
                peak_memory_gib=m["peak_memory_bytes"] / 2**30,
                rmsnorm_backend=m["rmsnorm_backend"],
                measured_matmul_tflops=m["measured_matmul_tflops"],
            )
        except SpecError as e:  # a kernel this machine cannot run: recorded, not hidden
            rec = new_record(spec.to_dict())
            rec.update(status="failed", error=f"not runnable here: {e}", ended_at=now_iso())
            store.write(rec)
            row.update(status="unavailable", error=str(e))
        except Exception as e:  # oom / failed records were written by run()
            row.update(status="oom" if mentions_oom(str(e)) else "failed", error=str(e)[:300])
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        summary.append(row)
        print(json.dumps(row), flush=True)
        write_summary(args, device, summary)  # after every point: a killed run keeps what it measured


def write_summary(args, device, summary):
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "layers": args.layers,
                "model": f"{args.model} layer shapes",
                "points": summary,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
