"""What the GPU adds to the CPU's checks, each run beside its bf16 eager baseline: tokens/s and the CUDA
allocator peak of `harness train` on LLaMA-13B-shaped layers (4 layers, seq 2048, global batch 4).

  world size 1   own and fsdp: bf16 eager (sdpa), FP8 (workload.precision fp8, fp8_recipe tensorwise:
                 torchao's float8 on the GPU's FP8 matmuls, carried as a wheel: scripts/gpu_engines.sh),
                 compiled blocks (layout.compile blocks, warm-up 2 steps); own and megatron: the same layers
                 as a mixture of 8 experts, top-2, each expert half the dense width (so the same active
                 parameters as the dense baseline beside it: the router, the dispatch and the small expert
                 GEMMs are what differ; Megatron-core's grouped GEMM where its kernels are installed,
                 SequentialMLP otherwise, as its record's describe says)
  world size 2   own cp2 ring with attention naive (its fp32 blocks), sdpa_flash and sdpa_efficient (torch's
                 LSE ops per block: harness/engine/lse_attention.py); own and fsdp pp2 1F1B and zero-bubble
                 (layout.pipeline_schedule zbv)
  one process    first, in a child process (this one keeps no CUDA memory): the cp2 ring's blocks of
                 both ranks (harness.testing.cp_blocks) for every block op (flash, efficient, cuDNN,
                 sdpa's choice, naive) against the whole sequence's fp32 attention, with each op's time
                 and peak: the CUDA adapters' check where two ranks cannot run (NCCL takes one rank
                 per GPU: world size 2 needs 2 GPUs)

A row the spec refuses (a field not there yet, an engine that does not run it) is printed with the
refusal and skipped; so is a world-size-2 row on a machine with one GPU, and any row once the deadline
(--deadline, seconds since the epoch, or --budget-s from now) leaves less than a minute. Rows are written
after each run ($OUT/variants.json, variants.md). `--device cpu` is the smoke test (tiny shape, gloo,
the peak is the process's RSS; no FP8).

    python scripts/gpu_variants.py --out gpu-out                 # on the GPU (scripts/gpu_engines.sh)
    python scripts/gpu_variants.py --out /tmp/x --device cpu     # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 1024**3
FP8 = {"precision": "fp8", "fp8_recipe": "tensorwise"}
COMPILE = {"compile": "blocks"}
CP = {"engine": "own", "cp": 2, "cp_impl": "ring"}
PP = {"pp": 2}
# (name, world size, layout, workload changes, the name of its baseline); a baseline precedes its rows
VARIANTS = [
    ("own bf16 eager", 1, {"engine": "own"}, {}, None),
    ("own fp8 tensorwise", 1, {"engine": "own"}, FP8, "own bf16 eager"),
    ("own compile blocks", 1, {"engine": "own", **COMPILE}, {}, "own bf16 eager"),
    ("own moe 8x top2", 1, {"engine": "own"}, {"moe": (8, 2)}, "own bf16 eager"),
    ("megatron bf16 eager", 1, {"engine": "megatron"}, {}, None),
    ("megatron moe 8x top2", 1, {"engine": "megatron"}, {"moe": (8, 2)}, "megatron bf16 eager"),
    ("fsdp bf16 eager", 1, {"engine": "fsdp"}, {}, None),
    ("fsdp fp8 tensorwise", 1, {"engine": "fsdp"}, FP8, "fsdp bf16 eager"),
    ("fsdp compile blocks", 1, {"engine": "fsdp", **COMPILE}, {}, "fsdp bf16 eager"),
    ("own cp2 ring naive", 2, {**CP, "attention": "naive"}, {}, None),
    ("own cp2 ring sdpa_flash", 2, {**CP, "attention": "sdpa_flash"}, {}, "own cp2 ring naive"),
    ("own cp2 ring sdpa_efficient", 2, {**CP, "attention": "sdpa_efficient"}, {}, "own cp2 ring naive"),
    ("own pp2 1f1b", 2, {"engine": "own", **PP}, {}, None),
    ("own pp2 zbv", 2, {"engine": "own", **PP, "pipeline_schedule": "zbv"}, {}, "own pp2 1f1b"),
    # FSDP2 runs the split-backward schedules only without resharding after forward (its facts): so does its 1F1B
    ("fsdp pp2 1f1b", 2, {"engine": "fsdp", **PP, "reshard_after_forward": False}, {}, None),
    (
        "fsdp pp2 zbv",
        2,
        {"engine": "fsdp", **PP, "reshard_after_forward": False, "pipeline_schedule": "zbv"},
        {},
        "fsdp pp2 1f1b",
    ),
]
WORDS = ("fp8", "float8", "compile", "graph", "schedule", "zb")  # what a record says about a variant
BLOCK_KERNELS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa", "naive")


def raw_spec(args, name: str, layout: dict, workload: dict) -> dict:
    workload, overrides = dict(workload), {"layers": args.layers}
    if "moe" in workload:  # (experts, top-k): each expert dense ffn / k wide, the dense model's active width
        from harness.model.presets import resolve_shape

        experts, k = workload.pop("moe")
        overrides.update(experts=experts, experts_per_token=k, moe_ffn=resolve_shape(args.model).ffn // k)
    return {
        "name": "gpu-variants-" + name.replace(" ", "-"),
        "store": os.path.join(args.out, "results.sqlite"),
        "workload": {
            "model": args.model,
            "model_overrides": overrides,
            "seq_len": args.seq_len,
            "global_batch_size": args.global_batch_size,
            "steps": args.steps,
            "warmup_steps": 2,  # compile blocks needs >= 1: compiled in warm-up, never in a measured step
            "precision": "bf16",
            "device": args.device,
            "seed": 1234,
            **workload,
        },
        "layout": {"micro_batch_size": 1, "attention": "sdpa", "rmsnorm": "torch", **layout},
    }


def mentions(tree, words=WORDS, path: str = "", depth: int = 0) -> dict:
    """Every scalar of a record whose key path names one of `words` (compile time, FP8 recipe, schedule):
    what the run says about the variant, whatever the engines call it."""
    out = {}
    if isinstance(tree, dict) and depth < 4:
        for key, value in tree.items():
            p = f"{path}.{key}" if path else str(key)
            if isinstance(value, dict | list):
                out.update(mentions(value, words, p, depth + 1))
            elif any(w in p.lower() for w in words) and not isinstance(value, list):
                out[p] = value
    return out


def run(args, name: str, world: int, layout: dict, workload: dict, timeout_s: float) -> dict:
    from harness import launch, registry
    from harness.errors import SpecError
    from harness.spec import parse_spec

    raw = raw_spec(args, name, layout, workload)
    try:
        spec = parse_spec(raw)
    except SpecError as e:
        return {"status": "skipped", "why": f"the spec refuses it: {e}"}
    rec = launch.run_spec(
        raw,
        nproc=world,
        launcher=registry.facts(spec.layout.engine).launcher,
        store_path=raw["store"],
        timeout_s=timeout_s,
        log_dir=os.path.join(args.out, "logs"),
        run_id=raw["name"],
    )
    if rec.get("status") != "ok":
        return {"status": rec.get("status") or "failed", "why": (rec.get("error") or "")[:300]}
    m = rec["metrics"]
    return {
        "status": "ok",
        "tokens_per_s": round(m["tokens_per_s"]),
        "peak_gib": round(m["peak_memory_bytes"] / GIB, 3),
        "memory_kind": m["memory_kind"],
        "step_time_ms": round(m["step_time_s"]["median"] * 1e3, 2),
        "losses": [round(x, 4) for x in m["losses"][:3]],
        "says": mentions({k: v for k, v in rec.items() if k != "spec"}),  # what it reports, not what it was asked
    }


def cp_blocks(args) -> list[dict]:
    """Both cp2 ranks' ring blocks in this process (harness.testing.cp_blocks), per block op: the largest
    error of the output and q/k/v gradients against fp32 attention on the whole sequence, beside that
    of the same kernel run on the whole sequence (merging blocks in fp32 adds at most one rounding of each
    block's output: ok when within twice the whole kernel's error plus 1e-3), and the time and peak of
    both ranks' forward and backward (the second call; the peak includes the inputs and the reference)."""
    import torch

    from harness.model.kernels import attention_fn, attention_naive
    from harness.model.llama import attention_core
    from harness.testing.cp_blocks import blockwise_attention

    cuda = args.device == "cuda"
    dev, dtype = torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32
    b, hq, hkv, s, d = (1, 32, 8, args.cp_seq_len, 128) if cuda else (1, 4, 2, 64, 16)  # llama3-8b's heads
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, s, d, device=dev, dtype=dtype, generator=g) for h in (hq, hkv, hkv, hq))
    leaves = [t.float().clone().requires_grad_() for t in (q, k, v)]
    want = attention_core(*leaves, attention_naive)
    want.backward(grad.float())
    want = [want.detach(), *(t.grad for t in leaves)]

    def err(got):
        return max((a.float() - w).abs().max().item() for a, w in zip(got, want, strict=True))

    rows = []
    for kernel in BLOCK_KERNELS:
        row = {"name": f"cp2 ring blocks {kernel} (one process)", "kernel": kernel}
        if not cuda and kernel in ("sdpa_efficient", "sdpa_cudnn"):
            row.update(status="skipped", why="a CUDA op")
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        try:
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attention_core(*whole, attention_fn(kernel))
            out.backward(grad)
            row["whole_kernel_error"] = err([out, *(t.grad for t in whole)])
            del whole, out
            blockwise_attention(q, k, v, grad, 2, kernel)  # warm-up: the timed call is the second
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            got = blockwise_attention(q, k, v, grad, 2, kernel)
            if cuda:
                torch.cuda.synchronize()
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
            row["blocks_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            row["blocks_error"] = err(got)
            ok = row["blocks_error"] <= 2 * row["whole_kernel_error"] + 1e-3
            row["status"] = "ok" if ok else "MISMATCH"
        except Exception as e:  # noqa: BLE001 - an op this machine lacks is a row's finding
            row.update(status="failed", why=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def blocks_in_child(args, timeout_s: float) -> list[dict]:
    """cp_blocks in a child process (--blocks-only), so that this one holds no CUDA context or cached
    memory while the runs' ranks use the GPU; its rows as it printed them, or why there are none."""
    import subprocess

    if timeout_s < 20:
        return [{"name": "cp2 ring blocks", "kernel": "-", "status": "skipped", "why": "time budget"}]
    cmd = [sys.executable, os.path.abspath(__file__), "--blocks-only", "--out", args.out, "--device", args.device]
    cmd += ["--cp-seq-len", str(args.cp_seq_len)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [{"name": "cp2 ring blocks", "kernel": "-", "status": "timed out", "why": f"after {timeout_s:.0f} s"}]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        print(json.dumps(row), flush=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        rows.append({"name": "cp2 ring blocks", "kernel": "-", "status": "failed", "why": last[:300]})
    return rows


def write(args, rows: list[dict], device: str) -> None:
    from harness.report.render import markdown
    from harness.report.sections import Items, Section, Table

    with open(os.path.join(args.out, "variants.json"), "w") as f:
        json.dump({"device": device, "model": args.model, "layers": args.layers, "rows": rows}, f, indent=2)
    title = (
        f"Variants on {device}: {args.model} layer shapes ({args.layers} layers), seq {args.seq_len}, "
        f"global batch {args.global_batch_size}; each beside its baseline (bf16 eager, cp2 naive, pp2 1F1B)"
    )
    cols = "name world status tokens_per_s tokens_vs_base peak_gib peak_vs_base step_time_ms".split()
    body = [Table(cols, [[str(r.get(c, "-")) for c in cols] for r in rows if "world" in r])]
    blocks = [r for r in rows if "kernel" in r]
    if blocks:
        bcols = "name status blocks_error whole_kernel_error blocks_ms peak_gib".split()
        body.append(Table(bcols, [[str(r.get(c, "-")) for c in bcols] for r in blocks]))
    notes = [f"{r['name']}: {r['why']}" for r in rows if r.get("why")]
    notes += [f"{r['name']} says: {r['says']}" for r in rows if r.get("says")]
    body.append(Items(notes))
    with open(os.path.join(args.out, "variants.md"), "w") as f:
        f.write(markdown(title, [Section("variants", "", body=body)], "", contents=False))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test (tiny shape)")
    ap.add_argument("--model", help="whose layer shapes (default llama-13b; tiny on cpu)")
    ap.add_argument("--layers", type=int, default=4, help="4: two per stage at pp2, one per zbv chunk")
    ap.add_argument("--seq-len", type=int, help="default 2048 (32 on cpu)")
    ap.add_argument("--cp-seq-len", type=int, default=8192, help="the one-process cp blocks check's sequence")
    ap.add_argument("--global-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", default="", help="comma list of words: run the variants whose name has one")
    ap.add_argument("--budget-s", type=float, default=300, help="no run starts with less than 60 s left of this")
    ap.add_argument("--deadline", type=float, help="the same as an epoch time (overrides --budget-s)")
    ap.add_argument("--timeout-s", type=float, default=150, help="per run")
    ap.add_argument("--blocks-only", action="store_true", help="only the cp blocks check, rows on stdout")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.model = args.model or ("tiny" if cpu else "llama-13b")
    args.seq_len = args.seq_len or (32 if cpu else 2048)
    deadline = args.deadline or time.time() + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count() if not cpu else 2  # gloo: any number of ranks on a CPU
    device = "cpu" if cpu else torch.cuda.get_device_name(0)
    words = [w for w in args.only.split(",") if w]
    if args.blocks_only:  # the child of blocks_in_child: its rows as JSON lines
        cp_blocks(args)
        return 0
    rows: list[dict] = []
    if not words or any(w in "cp2 ring blocks" for w in words):  # first: the CUDA ops' check, short
        rows += blocks_in_child(args, min(180.0, deadline - time.time() - 10))
        write(args, rows, device)
    for name, world, layout, workload, base in VARIANTS:
        if words and not any(w in name for w in words):
            continue
        row = {"name": name, "world": world}
        left = deadline - time.time()
        if cpu and workload.get("precision") == "fp8":
            row.update(status="skipped", why="FP8 needs a GPU's FP8 matmuls")
        elif world > gpus:
            row.update(
                status="skipped",
                why=f"world size {world} needs {world} GPUs, this machine has {gpus} (NCCL takes one rank per GPU)",
            )
        elif left < 60:
            row.update(status="skipped", why=f"time budget: {left:.0f} s left")
        else:
            row.update(run(args, name, world, layout, workload, min(args.timeout_s, left - 10)))
        baseline = next((r for r in rows if r["name"] == base and r.get("status") == "ok"), None)
        if baseline and row.get("status") == "ok":
            row["tokens_vs_base"] = round(row["tokens_per_s"] / baseline["tokens_per_s"], 3)
            row["peak_vs_base"] = round(row["peak_gib"] / baseline["peak_gib"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
        write(args, rows, device)
    print(f"wrote {os.path.join(args.out, 'variants.json')} and variants.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
