"""`harness import` of bad input: one line `error: <field>: <reason>`, exit code 2, nothing written; and
the launch-script reading that makes real scripts importable (harness/interop/shell.py): variables,
defaults, arithmetic, arrays and decidable conditions resolved without running the script, what it
cannot resolve named. Quick: no processes."""

from __future__ import annotations

import pytest

from harness.cli import main as cli
from harness.errors import SpecError
from harness.interop.shell import command_words, unresolved

DS_BATCH = '"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1'
MEGATRON = (
    b"torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
    b"--seq-length 64 --micro-batch-size 1"
)
RECIPE = b"def f():\n    config = llama3_8b()\n    config.parallelism.%s\n    return config\n"
BAD = {  # id: (format, file bytes, extra argv, the error line's start)
    "binary-megatron": ("megatron", b"\x89PNG\r\n\x1a\n\x00\xff\xfe", [], "error: FILE:"),
    "binary-deepspeed": ("deepspeed", b"\xff\xfe{\x00}", [], "error: FILE:"),
    "binary-torchtitan": ("torchtitan", b"\x00\x01\x02\xc3\x28", [], "error: FILE:"),
    "nul-in-text-megatron": ("megatron", b"--num-layers 2\x00", [], "error: script:"),
    "unclosed-single-quote": ("megatron", b"torchrun x.py --num-layers '2 --hidden-size 64\n", [], "error: script:"),
    "unclosed-double-quote": ("megatron", b'NAME="a\ntorchrun x.py --num-layers $NAME\n', [], "error: script:"),
    "unclosed-brace": ("megatron", b"torchrun x.py --num-layers ${N:-2\n", [], "error: script:"),
    "unresolved-carried-value": (
        "megatron",
        b"torchrun pretrain_gpt.py --num-layers $1 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        b"--micro-batch-size 1\n",
        ["--gpus", "1"],
        "error: --num-layers: depends on $1",
    ),
    "megatron-tp-zero": (
        "megatron",
        MEGATRON + b" --tensor-model-parallel-size 0",
        [],
        "error: --tensor-model-parallel-size:",
    ),
    "megatron-heads-zero": ("megatron", MEGATRON.replace(b"heads 4", b"heads 0"), [], "error: --num-attention-heads:"),
    "megatron-vp-layers": (
        "megatron",
        MEGATRON + b" --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
        [],
        "error: --num-layers-per-virtual-pipeline-stage:",
    ),
    "torchtitan-string-degree": ("torchtitan", RECIPE % b'tensor_parallel_degree = "2"', [], "error: parallelism."),
    "torchtitan-zero-microbatch": (
        "torchtitan",
        RECIPE % b"pipeline_parallel_microbatch_size = 0",
        [],
        "error: parallelism.pipeline_parallel_microbatch_size:",
    ),
    "torchtitan-pp-over-world": (
        "torchtitan",
        RECIPE % b"pipeline_parallel_degree = 64",
        ["--gpus", "8"],
        "error: --gpus:",
    ),
    "micro-batch-zero": (
        "deepspeed",
        b'{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 0, "gradient_accumulation_steps": 1}',
        [],
        "error: train_micro_batch_size_per_gpu:",
    ),
    "accumulation-zero": (
        "deepspeed",
        b'{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 0}',
        [],
        "error: gradient_accumulation_steps:",
    ),
    "zero-optimization-int": (
        "deepspeed",
        f'{{{DS_BATCH}, "zero_optimization": 3}}'.encode(),
        [],
        "error: zero_optimization:",
    ),
    "zero-stage-4": (
        "deepspeed",
        f'{{{DS_BATCH}, "zero_optimization": {{"stage": 4}}}}'.encode(),
        [],
        "error: zero_optimization.stage:",
    ),
    "tensor-parallel-list": (
        "deepspeed",
        f'{{{DS_BATCH}, "tensor_parallel": [2]}}'.encode(),
        [],
        "error: tensor_parallel:",
    ),
    "autotp-string": (
        "deepspeed",
        f'{{{DS_BATCH}, "tensor_parallel": {{"autotp_size": "2"}}}}'.encode(),
        [],
        "error: tensor_parallel.autotp_size:",
    ),
    "sequence-parallel-string": (
        "deepspeed",
        f'{{{DS_BATCH}, "sequence_parallel_size": "2"}}'.encode(),
        [],
        "error: sequence_parallel_size:",
    ),
    "optimizer-params-list": (
        "deepspeed",
        f'{{{DS_BATCH}, "optimizer": {{"type": "AdamW", "params": [1]}}}}'.encode(),
        [],
        "error: optimizer.params:",
    ),
    "batch-mismatch-with-gpus": ("deepspeed", f"{{{DS_BATCH}}}".encode(), ["--gpus", "4"], "error: train_batch_size:"),
    "recipe-not-in-file": ("torchtitan", b"def a():\n    return 1\n", ["--recipe", "b"], "error: --recipe:"),
    "recipe-not-named": ("torchtitan", b"def a():\n    pass\n\n\ndef b():\n    pass\n", [], "error: --recipe:"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_import_is_one_line_exit_2_nothing_written(name, tmp_path, capsys):
    fmt, data, argv, first = BAD[name]
    src, out = tmp_path / "in", tmp_path / "spec.yaml"
    src.write_bytes(data)
    code = cli(["import", fmt, str(src), "--out", str(out), *argv])
    got = capsys.readouterr()
    assert code == 2 and got.out == "" and not out.exists()
    assert got.err.startswith(first) and len(got.err.strip().splitlines()) == 1, got.err


SCRIPT = """\
#!/bin/bash
GPUS_PER_NODE=8
NNODES=${SLURM_NNODES:-"2"}   # a default: the script run with no environment
WORLD=$(($GPUS_PER_NODE*$NNODES))
TP=2; PP=${PP:-2}
DTYPE="fp8"
ARGS=(
    --tensor-model-parallel-size $TP   # comment after a flag
    --pipeline-model-parallel-size ${PP}
)
ARGS+=("--seq-length 4096")
if [[ "$DTYPE" == "fp8" ]]; then
    ARGS+=(--fp8-format hybrid)
else
    ARGS+=(--bf16)
fi
if [ -n "${WANDB_API_KEY}" ]; then
    ARGS+=(--wandb-project mine)
fi
echo "launching pretrain_gpt.py"
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES pretrain_gpt.py \\
    "${ARGS[@]}" --save "$1" --world $WORLD
"""


def test_a_script_is_read_as_bash_would_without_running_it():
    words = command_words(SCRIPT)
    resolved = [w for w in words if not unresolved(w)]
    assert resolved[:6] == ["torchrun", "--nproc_per_node", "8", "--nnodes", "2", "pretrain_gpt.py"]
    assert resolved[6:12] == [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--seq-length 4096",  # quoted "${ARGS[@]}": one word per element, as bash
        "--fp8-format",
    ]
    assert "--bf16" not in words and "--world" in words and words[words.index("--world") + 1] == "16"
    # what the script does not set is named: $1, and the flags added under a condition on the environment
    named = [u for w in words for u in unresolved(w)]
    assert named[0].startswith("ARGS (set under `if [ -n ${WANDB_API_KEY} ]") and named[1] == "$1"


def test_an_argument_file_is_every_word():
    assert command_words("--num-layers 2 \\\n  --hidden-size 64\n--seq-length 8  # comment\n") == [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--seq-length",
        "8",
    ]


def test_an_unclosed_quote_names_its_line():
    with pytest.raises(SpecError, match="line 2: unclosed double quote"):
        command_words('A=1\nB="x\n')
