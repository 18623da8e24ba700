#!/usr/bin/env bash
# One command on one GPU, at most 9 minutes (BUDGET_S, default 540: a device call runs at most 600 s), in
# two phases (PHASES, default "engines variants" on a GPU, "engines" with DEVICE=cpu):
#   engines   every engine this machine has at world size 1 on LLaMA-13B-shaped layers (2 layers, seq 2048,
#             global batch 4, bf16, naive attention): own, FSDP2, Megatron-core (from the wheel carried in
#             wheels/; no device shim on a GPU) and DeepSpeed where it imports. Per engine the CUDA allocator
#             peak of a real run beside `harness memory`'s traced peak and the planner's prediction
#             (scripts/gpu_engines.py; arguments to this script go to it). $OUT/engines.json, engines.md.
#   variants  tokens/s and peak memory beside bf16 eager (scripts/gpu_variants.py; VARIANTS_ARGS go to
#             it): FP8 tensorwise (torchao), compiled blocks, own cp2 ring with sdpa_flash and
#             sdpa_efficient blocks, pp2 1F1B vs zero-bubble (zbv) for own and fsdp, and the cp2 ring's
#             blocks for every CUDA op in one process. A row whose field the spec refuses, or that needs
#             more GPUs than the machine has (world size 2: NCCL takes one rank per GPU), is printed with
#             the reason and skipped. $OUT/variants.json, variants.md.
# Both write $OUT/results.sqlite and append to $OUT/log.txt; per-run logs in $OUT/logs/.
#
# The GPU machine has Python 3.12 and PyTorch 2.11 and no network. Carry the packages it lacks as wheels,
# downloaded here once into the git-ignored wheels/ folder, and name the folder in the device run's carry:
# run(command="bash scripts/gpu_engines.sh", carry=["wheels"]). Each wheel is installed with
# `pip install --no-index --no-deps` into the machine's Python, one at a time (one that fails leaves the rest).
#   Megatron-core: pip download megatron-core==0.19.2 --no-deps --python-version 3.12 --only-binary=:all: -d wheels/
#     (0.19, as pyproject picks for Python 3.12; its own dependencies, numpy and packaging, are on the image,
#     and triton, which 0.19 imports, comes with PyPI's CUDA torch)
#   torchao (FP8): pip download torchao==0.18.0 --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d wheels/
#     gives torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl (3.3 MB): the stable ABI
#     from CPython 3.10 on, so it installs on 3.12; no required dependencies. Its float8 training is Python
#     over torch._scaled_mm; its C++ extensions (built for CUDA, sm90a kernels) load only on torch >= 2.11,
#     and torchao skips them with a warning otherwise.
#   DeepSpeed runs only if its wheel is carried too, with those of its dependencies the image lacks (hjson,
#     pydantic, pydantic-core, annotated-types, typing-inspection; `pip wheel deepspeed==0.19.8 --no-deps
#     -w wheels/` builds DeepSpeed's, which PyPI ships as a source archive); otherwise its row says
#     "not installed".
#
# DEVICE=cpu bash scripts/gpu_engines.sh is the smoke test (tiny shape, nothing installed: it runs the
# checkout on PYTHONPATH); PHASES="engines variants" adds the variants' smoke test.
set -euo pipefail
OUT=${OUT:-gpu-out}
DEVICE=${DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-540}
if [ "$DEVICE" = cuda ]; then PHASES=${PHASES:-engines variants}; else PHASES=${PHASES:-engines}; fi
deadline=$(($(date +%s) + BUDGET_S))
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python) # the image's python3 is the one with PyTorch
if [ "$DEVICE" = cuda ]; then
  # no network: build with the machine's own setuptools; where even that fails, PYTHONPATH is the package
  "$PY" -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "editable install failed; using PYTHONPATH"
  shopt -s nullglob
  wheels=(wheels/*.whl)
  [ ${#wheels[@]} -gt 0 ] || echo "no wheels/ carried: Megatron-core, DeepSpeed and torchao (FP8) run only if the image has them"
  for wheel in "${wheels[@]}"; do # one at a time: a wheel that does not install leaves the others
    "$PY" -m pip install --no-index --no-deps -q "$wheel" >/dev/null 2>&1 && echo "installed $wheel" \
      || echo "carried wheel did not install: $wheel"
  done
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "capability", torch.cuda.get_device_capability(0))' || true
  "$PY" -c 'import torchao; print("torchao", torchao.__version__)' 2>&1 | tail -1 || true
fi
for phase in $PHASES; do
  left=$((deadline - $(date +%s)))
  if [ "$left" -lt 60 ]; then
    echo "phase $phase not started: ${left} s left of BUDGET_S=$BUDGET_S" | tee -a "$OUT/log.txt"
    continue
  fi
  case $phase in
    engines)
      # the variants phase keeps at least 4 minutes when it follows
      limit=$((left < 400 ? left : 400))
      case " $PHASES " in *" engines variants "*) limit=$((left - 240 < limit ? left - 240 : limit)) ;; esac
      limit=$((limit < 60 ? 60 : limit))
      timeout "$limit" "$PY" scripts/gpu_engines.py --out "$OUT" --device "$DEVICE" \
        --budget-s $((limit * 3 / 5)) --timeout-s $((limit * 2 / 5)) "$@" 2>&1 | tee -a "$OUT/log.txt" \
        || echo "phase engines ended with status $?" | tee -a "$OUT/log.txt"
      ;;
    variants)
      # shellcheck disable=SC2086 # VARIANTS_ARGS is a list of words
      timeout "$left" "$PY" scripts/gpu_variants.py --out "$OUT" --device "$DEVICE" --deadline "$deadline" \
        --timeout-s 150 ${VARIANTS_ARGS:-} 2>&1 | tee -a "$OUT/log.txt" \
        || echo "phase variants ended with status $?" | tee -a "$OUT/log.txt"
      ;;
    *)
      echo "error: PHASES: unknown phase '$phase' (engines, variants)" >&2
      exit 2
      ;;
  esac
done
echo "wrote $OUT"
