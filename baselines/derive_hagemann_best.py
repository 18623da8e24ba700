"""Derive baselines/hagemann2023_best.csv from the study's published per-run sheets.

Why a script: the best configuration and MFU per sweep are facts of the published data, so
they are computed from it (reproducibly) rather than copied by hand. Input: the CSV sheets
of Hagemann et al. 2023 (arXiv 2311.05610; data CC BY-NC-SA 4.0), as kept in
baselines/paper_sweeps/ (or a directory given as the first argument).

    python baselines/derive_hagemann_best.py [SHEETS_DIR]
"""

from __future__ import annotations

import csv
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = (
    "Hagemann, Weinbach, Dobler, Schall, de Melo: Efficient Parallelization Layouts for "
    "Large-Scale Distributed Model Training, arXiv 2311.05610 (2023), published sweep data"
)
HARDWARE = "NVIDIA A100 80GB (DGX A100, 8 GPUs per node), bf16"
FIELDS = [
    "sweep",
    "model",
    "harness_model",
    "seq_len",
    "global_batch_size",
    "gpus",
    "hardware",
    "precision",
    "tp",
    "pp",
    "dp",
    "micro_batch_size",
    "activation_checkpointing",
    "kernel",
    "sequence_parallel",
    "step_time_s",
    "mfu",
    "mfu_convention",
    "peak_tflops",
    "runs",
    "runs_ok",
    "runs_oom",
    "source",
    "source_file",
    "license",
]


def best_of(path: str) -> dict:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    ok = []
    for r in rows:
        try:
            ok.append((float(r["Average MFU"]), r))
        except ValueError:
            pass
    mfu, best = max(ok, key=lambda t: t[0])
    name = os.path.basename(path)
    size = re.search(r"llama_(\d+)B", name).group(1)
    gpus = int(best["World Size"])
    tp, pp = int(best["model_parallel_size"]), int(best["pipe_parallel_size"])
    return {
        "sweep": os.path.splitext(name)[0],
        "model": f"LLaMA {size}B",
        "harness_model": f"paper-{size.lower()}b",
        "seq_len": 2048,
        "global_batch_size": 2048,
        "gpus": gpus,
        "hardware": HARDWARE,
        "precision": "bf16",
        "tp": tp,
        "pp": pp,
        "dp": gpus // (tp * pp),
        "micro_batch_size": int(best["micro_batch_size"]),
        "activation_checkpointing": best["activation_checkpointing_type"],
        "kernel": best["kernel"],
        "sequence_parallel": best.get("sequence_parallel", "False"),
        "step_time_s": float(best["Average Step Time"]),
        "mfu": round(mfu, 4),
        "mfu_convention": "palm (6P + 12Lhs per token)",
        "peak_tflops": 312,
        "runs": len(rows),
        "runs_ok": len(ok),
        "runs_oom": sum("OOM" in r["Average MFU"] for r in rows),
        "source": SOURCE,
        "source_file": name,
        "license": "CC BY-NC-SA 4.0",
    }


def main(argv: list[str]) -> int:
    src = argv[0] if argv else os.path.join(HERE, "paper_sweeps")
    sheets = sorted(p for p in os.listdir(src) if p.endswith(".csv"))
    if not sheets:
        print(f"no CSV sheets in {src}", file=sys.stderr)
        return 2
    out = os.path.join(HERE, "hagemann2023_best.csv")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for s in sheets:
            w.writerow(best_of(os.path.join(src, s)))
    print(f"wrote {out} from {len(sheets)} sheets")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
