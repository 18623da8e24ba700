#!/usr/bin/env bash
# One command on one GPU, at most 7 minutes: every engine this machine has at world size 1 on
# LLaMA-13B-shaped layers (2 layers, seq 2048, global batch 4, bf16, naive attention): own, FSDP2,
# Megatron-core (from the wheel carried in wheels/; no device shim on a GPU) and DeepSpeed where it
# imports. Per engine the CUDA allocator peak of a real run beside `harness memory`'s traced peak and
# the planner's prediction (scripts/gpu_engines.py). Writes $OUT/engines.json, $OUT/engines.md,
# $OUT/results.sqlite and $OUT/log.txt.
#
# The GPU machine has Python 3.12 and PyTorch 2.11 and no network. Carry Megatron-core as a wheel,
# downloaded here once into the git-ignored wheels/ folder:
#   pip download megatron-core==0.16.1 --no-deps --python-version 3.12 --only-binary=:all: -d wheels/
# and name the folder in the device run's carry: run(command="bash scripts/gpu_engines.sh", carry=["wheels"]).
# Its own dependencies (numpy, packaging) are on the image. DeepSpeed runs only if its wheel is carried
# too, with those of its dependencies the image lacks (hjson, pydantic, pydantic-core, annotated-types,
# typing-inspection; `pip wheel deepspeed==0.19.8 --no-deps -w wheels/` builds DeepSpeed's, which PyPI
# ships as a source archive); otherwise its row says "not installed".
#
# DEVICE=cpu bash scripts/gpu_engines.sh is the smoke test (tiny shape, nothing installed: it runs the
# checkout on PYTHONPATH).
set -euo pipefail
OUT=${OUT:-gpu-out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)  # the image's python3 is the one with PyTorch
if [ "$DEVICE" = cuda ]; then
  # no network: build with the machine's own setuptools; where even that fails, PYTHONPATH is the package
  "$PY" -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "editable install failed; using PYTHONPATH"
  shopt -s nullglob
  wheels=(wheels/*.whl)
  [ ${#wheels[@]} -gt 0 ] || echo "no wheels/ carried: Megatron-core and DeepSpeed run only if the image has them"
  for wheel in "${wheels[@]}"; do  # one at a time: a wheel that does not install leaves the others
    "$PY" -m pip install --no-index --no-deps -q "$wheel" >/dev/null 2>&1 && echo "installed $wheel" \
      || echo "carried wheel did not install: $wheel"
  done
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
fi
timeout 400 "$PY" scripts/gpu_engines.py --out "$OUT" --device "$DEVICE" --budget-s 240 --timeout-s 150 "$@" 2>&1 \
  | tee "$OUT/log.txt"
echo "wrote $OUT"
