#!/usr/bin/env bash
# One command on one GPU (a few minutes): the bf16 precision policy under the single-device
# reference, the own engine and FSDP2, each at world size 1 on LLaMA-13B-shaped layers (2 layers,
# seq 2048, bf16 policy: bf16 parameters, fp32 masters, main gradients and Adam states). Writes
# $OUT/results.sqlite, $OUT/policy.json (losses against the reference, memory census, saved
# activations, step times) and the log. DeepSpeed is left out where it is not installed.
set -euo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || echo "editable install failed; using PYTHONPATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.csv"
SPECS="$OUT/specs"; mkdir -p "$SPECS"
for engine in single own fsdp; do
  cat > "$SPECS/$engine.yaml" <<YAML
name: gpu-policy-$engine
workload: {model: llama-13b, model_overrides: {layers: 2}, seq_len: 2048, global_batch_size: 4, steps: 6,
           warmup_steps: 2, precision: bf16, device: cuda, seed: 1234}
layout: {engine: $engine, micro_batch_size: 1, attention: sdpa}
YAML
  if [ "$engine" = single ]; then
    timeout 300 python -m harness.cli train "$SPECS/$engine.yaml" --store "$OUT/results.sqlite" --run-id "$engine" --no-progress 2>&1 | tee -a "$OUT/log.txt"
  else
    timeout 300 python -m torch.distributed.run --nproc_per_node=1 -m harness.cli train "$SPECS/$engine.yaml" --store "$OUT/results.sqlite" --run-id "$engine" --no-progress 2>&1 | tee -a "$OUT/log.txt"
  fi
done
python scripts/policy_summary.py "$OUT/results.sqlite" | tee "$OUT/policy.json"
echo "wrote $OUT"
