"""Bad token data is one line `error: <field>: <why>` with exit code 2, and nothing is left
half-written.

`harness data prepare` on text that is not UTF-8, on an input holding no text, on JSONL lines
that are not objects or whose text is not a string, with a tokenizer file it cannot read, with
--out naming an input; a token file read directly (the testing helpers, benchmarks) with the
wrong dtype, against its .bin.json, or empty.

In-process through harness.cli.main (as tests/test_cli_errors.py); a process start fails a
quick test (tests/conftest.py).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from harness.cli import main as cli_main
from harness.data.source import TokenFile, token_source
from harness.errors import SpecError
from harness.spec import parse_spec

TINY = {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "steps": 2, "warmup_steps": 1, "device": "cpu"}
LATIN1 = "café au lait\n".encode("latin-1")  # 0xe9: not UTF-8
GOOD = "hello world\n" * 50


def _write(root, files: dict) -> None:
    for name, content in files.items():
        path = root / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, str):
            path.write_text(content)
        elif name.endswith(".yaml"):
            path.write_text(yaml.safe_dump(content))
        else:
            path.mkdir()


# (id, argv, files, the line's start, a part of the reason)
PREPARE = [
    ("not-utf8-text", ["t.txt"], {"t.txt": LATIN1}, "error: t.txt: ", "not UTF-8 text (byte 0xe9 at byte offset 3)"),
    (
        "not-utf8-jsonl-line",
        ["t.jsonl"],
        {"t.jsonl": b'{"text": "ok"}\n{"text": "caf' + b"\xe9" + b'"}\n'},
        "error: t.jsonl:2: ",
        "not UTF-8 text",
    ),
    ("not-utf8-second-input", ["a.txt", "b.txt"], {"a.txt": GOOD, "b.txt": LATIN1}, "error: b.txt: ", "not UTF-8"),
    ("empty-text-file", ["e.txt"], {"e.txt": ""}, "error: e.txt: ", "holds no text"),
    ("blank-text-file", ["e.txt"], {"e.txt": "\n  \n"}, "error: e.txt: ", "holds no text"),
    ("jsonl-only-empty-texts", ["e.jsonl"], {"e.jsonl": '{"text": ""}\n\n'}, "error: e.jsonl: ", "holds no text"),
    ("jsonl-line-a-list", ["l.jsonl"], {"l.jsonl": '{"text": "a"}\n[1, 2]\n'}, "error: l.jsonl:2: ", "JSON list"),
    ("jsonl-line-a-number", ["l.jsonl"], {"l.jsonl": "7\n"}, "error: l.jsonl:1: ", "JSON int"),
    (
        "jsonl-text-a-number",
        ["l.jsonl"],
        {"l.jsonl": '{"text": 5}\n'},
        "error: l.jsonl:1: ",
        "'text' must be a string, got 5",
    ),
    ("jsonl-text-null", ["l.jsonl"], {"l.jsonl": '{"text": null}\n'}, "error: l.jsonl:1: ", "got None"),
    (
        "tokenizer-not-a-tokenizer",
        ["t.txt", "--tokenizer", "tok.json"],
        {"t.txt": GOOD, "tok.json": "{}"},
        "error: --tokenizer: tok.json: ",
        "not a tokenizer.json",
    ),
    ("input-is-a-folder", ["d"], {"d": None}, "error: input: ", "is a folder"),
]


@pytest.mark.parametrize("inputs, files, start, reason", [c[1:] for c in PREPARE], ids=[c[0] for c in PREPARE])
def test_data_prepare_bad_input_is_one_line_and_writes_nothing(no_launch, one_line_error, inputs, files, start, reason):
    _write(no_launch, files)
    before = sorted(os.listdir(no_launch))
    line = one_line_error(cli_main(["data", "prepare", *inputs, "--out", "out.bin"]))
    assert line.startswith(start) and reason in line, line
    assert sorted(os.listdir(no_launch)) == before  # no .bin, no .bin.json, no temporary file


def test_a_failed_prepare_leaves_the_earlier_token_file_as_it_was(no_launch, capsys, one_line_error):
    _write(no_launch, {"a.txt": GOOD, "b.txt": LATIN1})
    assert cli_main(["data", "prepare", "a.txt", "--out", "out.bin"]) == 0
    capsys.readouterr()
    kept = {n: (no_launch / n).read_bytes() for n in ("out.bin", "out.bin.json")}
    listing = sorted(os.listdir(no_launch))
    line = one_line_error(cli_main(["data", "prepare", "a.txt", "b.txt", "--out", "out.bin"]))
    assert line.startswith("error: b.txt: ")
    assert sorted(os.listdir(no_launch)) == listing
    assert {n: (no_launch / n).read_bytes() for n in kept} == kept


def test_out_naming_an_input_is_refused_and_the_input_kept(no_launch, one_line_error):
    _write(no_launch, {"t.txt": GOOD})
    line = one_line_error(cli_main(["data", "prepare", "t.txt", "--out", "t.txt"]))
    assert line.startswith("error: --out: ") and "is also an input" in line
    assert (no_launch / "t.txt").read_text() == GOOD


def test_a_write_that_fails_is_one_line_and_leaves_no_temporary_file(no_launch, one_line_error, monkeypatch):
    _write(no_launch, {"t.txt": GOOD})

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    line = one_line_error(cli_main(["data", "prepare", "t.txt", "--out", "out.bin"]))
    assert line == "error: --out: cannot write out.bin: No space left on device"
    assert sorted(os.listdir(no_launch)) == ["t.txt"]


def test_prepare_skips_empty_documents_and_writes_its_metadata(no_launch, capsys):
    _write(no_launch, {"t.jsonl": '{"text": "ab"}\n{"text": ""}\n{"text": "c"}\n'})
    assert cli_main(["data", "prepare", "t.jsonl", "--out", "out.bin"]) == 0
    assert np.fromfile(no_launch / "out.bin", dtype=np.uint16).tolist() == [97, 98, 0, 99, 0]
    assert json.loads((no_launch / "out.bin.json").read_text()) == {
        "tokens": 5,
        "dtype": "uint16",
        "vocab_size": 256,
        "tokenizer": "bytes",
    }


# ---------------------------------------------------------------- token files read directly


def _file_workload(tmp_path, tokens: bytes, dtype: str = "uint16", meta: dict | None = None):
    path = tmp_path / "d.bin"
    path.write_bytes(b"\x01\x00" * 4096)  # a valid file while the spec is checked ...
    spec = parse_spec({"workload": {**TINY, "data": {"kind": "file", "path": str(path), "dtype": "uint16"}}})
    path.write_bytes(tokens)  # ... then what a caller that skips validation would hand over
    if meta is not None:
        (tmp_path / "d.bin.json").write_text(json.dumps(meta))
    spec.workload.data.dtype = dtype
    return spec.workload


def test_token_source_checks_the_dtype_its_metadata_names(tmp_path):
    w = _file_workload(tmp_path, b"\x01\x00" * 4096, "uint32", {"tokens": 4096, "dtype": "uint16", "vocab_size": 256})
    with pytest.raises(SpecError) as e:
        token_source(w, 256)
    assert e.value.field == "workload.data.dtype" and "says the file holds uint16 tokens" in e.value.reason


def test_token_source_checks_the_vocabulary_its_metadata_names(tmp_path):
    w = _file_workload(tmp_path, b"\x01\x00" * 4096, meta={"tokens": 4096, "dtype": "uint16", "vocab_size": 32000})
    with pytest.raises(SpecError, match="vocabulary of 32000"):
        token_source(w, 256)


def test_token_source_refuses_a_file_shorter_than_a_global_batch(tmp_path):
    w = _file_workload(tmp_path, b"\x01\x00" * 100)  # more than one sequence (33), less than a batch (132)
    with pytest.raises(SpecError, match="fewer than one global batch"):
        token_source(w, 256)


@pytest.mark.parametrize(
    "content, dtype, reason",
    [
        (b"\x01" * 4097, "uint16", "not a multiple of the data-type size"),
        (b"\x01\x00" * 4097, "uint32", "not a multiple of the data-type size"),
        (b"", "uint16", "empty file"),
    ],
    ids=["odd-bytes", "uint16-as-uint32", "empty"],
)
def test_token_file_read_with_the_wrong_dtype_is_a_spec_error(tmp_path, content, dtype, reason):
    path = tmp_path / "d.bin"
    path.write_bytes(content)
    with pytest.raises(SpecError) as e:
        TokenFile(str(path), dtype, 256, 32, 4)
    assert e.value.field == "workload.data.path" and f"cannot read it as {dtype} tokens" in e.value.reason
    assert reason in e.value.reason
