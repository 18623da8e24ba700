#!/usr/bin/env bash
# One command on one GPU, at most ~8 minutes: install the project without touching the
# machine's torch, then run the single-GPU matrix on LLaMA-13B-shaped layers.
# Writes $OUT/results.sqlite, $OUT/summary.json and $OUT/report.csv.
set -euo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
pip install --no-deps -q -e . >/dev/null 2>&1 || pip install --no-deps -e .
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
timeout 470 python scripts/gpu_matrix.py --out "$OUT" --budget-s 380 2>&1 | tee "$OUT/log.txt"
python -m harness.cli results export --store "$OUT/results.sqlite" --format csv --out "$OUT/report.csv"
echo "wrote $OUT"
