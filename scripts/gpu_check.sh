#!/usr/bin/env bash
# One command on one GPU, at most ~7 minutes: install the project without touching the
# machine's torch, then run the single-GPU matrix on LLaMA-13B-shaped layers.
# Writes $OUT/results.sqlite, $OUT/summary.json and $OUT/report.csv.
set -euo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
# The device has no network: build isolation cannot fetch setuptools, so build with the machine's
# own; where even that fails, the source tree on PYTHONPATH is the package.
pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "editable install failed; using PYTHONPATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
timeout 400 python scripts/gpu_matrix.py --out "$OUT" --budget-s 300 2>&1 | tee "$OUT/log.txt"
python -m harness.cli results export --store "$OUT/results.sqlite" --format csv --out "$OUT/report.csv"
echo "wrote $OUT"
