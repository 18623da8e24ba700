"""`harness import megatron|torchtitan|deepspeed FILE`: the layout a user already runs, as a harness run spec.

Reads Megatron-LM's pretrain_gpt.py arguments (a launch script or an argument file: what follows the
`*.py` program, shell comments and line continuations allowed; the world size from torchrun's
--nproc-per-node x --nnodes or --gpus; its variables resolved, never run), a torchtitan recipe (the
Trainer.Config function `harness plan --export torchtitan` writes, or one of a config_registry.py by
--recipe) or a ds_config JSON, and writes a run spec (as `harness train` reads it, a compare's workload
and one run) with the layout, workload and optimizer it carries. Each field it cannot carry is one line
on stderr: `import: FIELD: not carried: WHY`; where this machine's engine cannot train the layout (no
Transformer Engine here, say), the spec keeps the tool's engine and layout and one line says why.
"""

from __future__ import annotations

import sys

from harness.errors import SpecError

DESCRIPTION = __doc__.split(":", 1)[1].strip()

EXAMPLES = """\
examples:
  harness import megatron train_llama.sh --out mine.yaml
  harness import megatron args.txt --gpus 64 --out mine.yaml
  harness import torchtitan my_recipe.py --out mine.yaml
  harness import torchtitan torchtitan/models/llama3/config_registry.py --recipe llama3_70b --gpus 64
  harness import deepspeed ds_config.json --model llama3-8b --seq-len 8192 --out mine.yaml
  harness plan --model llama3-8b --seq-len 8192 --global-batch-size 64 --gpus 16 --export megatron > a.txt
  harness import megatron a.txt --gpus 16"""


def add_arguments(p) -> None:
    from harness.interop.imports import IMPORT_FORMATS

    p.add_argument("format", choices=IMPORT_FORMATS, help="what FILE is")
    p.add_argument("file", metavar="FILE", help="the launch script / argument file, recipe or ds_config")
    p.add_argument("--out", metavar="SPEC.yaml", help="write the spec there (default: stdout)")
    p.add_argument(
        "--gpus", type=int, help="world size (megatron, torchtitan: where FILE does not say it; deepspeed: dp)"
    )
    p.add_argument("--recipe", metavar="NAME", help="torchtitan: the config_registry function (where FILE has several)")
    p.add_argument("--model", help="deepspeed: the model (a ds_config has none; default tiny)")
    p.add_argument("--seq-len", type=int, help="deepspeed: the sequence length (a ds_config has none)")


def main(args) -> int:
    import yaml

    from harness.interop import imports

    if args.out:
        from harness.commands.outputs import check_output_path

        check_output_path(args.out, "--out", directory=False)
    if args.gpus is not None and args.gpus < 1:
        raise SpecError("--gpus", f"must be at least 1, got {args.gpus}")
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SpecError("FILE", f"{args.file}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise SpecError("FILE", f"{args.file}: not a text file (byte {e.start} is not UTF-8)") from None
    if args.format == "megatron":
        raw, lost = imports.import_megatron(text, args.gpus)
    elif args.format == "torchtitan":
        raw, lost = imports.import_torchtitan(text, args.gpus, args.recipe)
    else:
        raw, lost = imports.import_deepspeed(text, args.model, args.seq_len, args.gpus)
    for line in lost:
        print(f"import: {line}", file=sys.stderr)
    name = f"imported-{args.format}"
    kept = any(line.startswith(f"layout.engine: {raw['layout']['engine']} kept;") for line in lost)
    run = (
        "this machine's engine cannot train it (see the import's note)" if kept else "run it with `harness train FILE`"
    )
    header = f"# Written by `harness import {args.format} {args.file}`: {run}.\n"
    text = header + yaml.safe_dump({"name": name, **raw}, sort_keys=False)
    if args.out:
        from harness.files.atomic import Together

        with Together("--out") as files:
            files.write(args.out, text)
    else:
        sys.stdout.write(text)
    return 0
