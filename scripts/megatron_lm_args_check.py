"""Megatron-LM's own argument checks on the harness's Megatron exports: for each Megatron case of the round-trip
test (tests/test_interop_roundtrip.py: dense, fp8 tensorwise and rowwise, MoE), `harness plan --export megatron`'s
arguments go through pretrain_gpt.py's parse_and_validate_args (parse_args + validate_args) at the layout's world
size, then gpt_config_from_args (Megatron-core's TransformerConfig checks) and pretrain_cfg_container_from_args.

Not part of CI: Megatron-LM's training package needs Python 3.12 (typing.override) and its megatron.core imports
triton, while the project runs Python 3.11 with megatron-core 0.16. Two interpreters:

    python scripts/megatron_lm_args_check.py --python /tmp/mlm312/bin/python --megatron-lm /tmp/mlm-src

runs under the project's Python (writes the exports) and starts, per export, `--python` (a Python 3.12 with torch,
numpy and packaging; the PyPI torch 2.13.0 is the one there is for 3.12 off the CPU index) with the Megatron-LM
checkout (commit MEGATRON_LM) first on its path. No GPU: validate_args reads the device's compute capability, so
the child answers as the exports' target, an H100 (sm90); CUDA_DEVICE_MAX_CONNECTIONS=1 is set as the export's
note says. gpt_config_from_args then needs Transformer Engine (rope and permute fusion), which is CUDA-only:
`--diagnose` adds --no-rope-fusion and drops --moe-permute-fusion to see the checks past them (not the export).
Prints one line per step and export; exits 1 if any export fails parse_and_validate_args.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent

CHILD = """
import os, shlex, sys, types
import torch
torch.cuda.get_device_capability = lambda device=None: (9, 0)  # the exports' target GPU, an H100
torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
    major=9, minor=0, name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, multi_processor_count=132)
sys.argv = ["pretrain_gpt.py", *shlex.split(open(os.environ["EXPORT"]).read())]
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
try:
    a = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})  # as pretrain_gpt.py
except BaseException as e:
    print(f"FAIL parse_and_validate_args: {type(e).__name__}: {e}")
    sys.exit(1)
print(f"ok parse_and_validate_args: world {a.world_size} dp {a.data_parallel_size} tp {a.tensor_model_parallel_size}"
      f" pp {a.pipeline_model_parallel_size} vp {a.virtual_pipeline_model_parallel_size} cp {a.context_parallel_size}"
      f" ep {a.expert_model_parallel_size} sp {a.sequence_parallel} fp8 {a.fp8} {a.fp8_recipe if a.fp8 else ''}"
      f" train_iters {a.train_iters}")
try:
    cfg = gpt_config_from_args(a)
    print("ok gpt_config_from_args")
    pretrain_cfg_container_from_args(a, cfg)
    print("ok pretrain_cfg_container_from_args")
except BaseException as e:
    print(f"FAIL config: {type(e).__name__}: {e}")
"""


def exports(out: pathlib.Path) -> list[tuple[str, pathlib.Path, int]]:
    """The round-trip test's Megatron cases, exported as `harness plan --export megatron` writes them."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from test_interop_roundtrip import CASES, OPT

    from harness.interop.exports import EXPORTERS
    from harness.model.presets import PRESETS
    from harness.planner.layout import Workload
    from harness.spec import Optimizer

    done = []
    for name, (fmt, model, fields, lay) in CASES.items():
        if fmt != "megatron":
            continue
        kw = {"steps": 20, "moe_aux_loss_coeff": fields.get("moe_aux_loss_coeff", 0.0)}
        kw.update({"fp8_recipe": fields["fp8_recipe"]} if "fp8_recipe" in fields else {})
        text, _ = EXPORTERS[fmt](PRESETS[model], lay, Workload(4096, 64), Optimizer(**OPT), 0.5, **kw)
        path = out / f"{name}.args"
        path.write_text(text)
        done.append((name, path, lay.gpus))
    return done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="a Python 3.12 with torch, numpy and packaging")
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout (harness.interop.megatron_out)")
    ap.add_argument("--diagnose", action="store_true", help="add --no-rope-fusion, drop --moe-permute-fusion")
    a = ap.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, world in exports(pathlib.Path(tmp)):
            if a.diagnose:
                path.write_text(path.read_text().replace(" --moe-permute-fusion", "") + " --no-rope-fusion")
            env = {
                **os.environ,
                "PYTHONPATH": a.megatron_lm,
                "EXPORT": str(path),
                "WORLD_SIZE": str(world),
                "RANK": "0",
                "LOCAL_RANK": "0",
                "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            }
            r = subprocess.run(
                [a.python, "-W", "ignore", "-c", CHILD], env=env, cwd=a.megatron_lm, capture_output=True, text=True
            )
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("ok ", "FAIL "))]
            if not lines:
                lines = [f"FAIL to start: {shlex.quote(a.python)}: {r.stderr.strip().splitlines()[-1:]}"]
            for line in lines:
                print(f"{name} (WORLD_SIZE={world}): {line}")
            failed += r.returncode != 0 or not lines[0].startswith("ok parse_and_validate_args")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
