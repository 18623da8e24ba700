"""Text or JSONL -> a flat token file (uint16/uint32 .bin), as nanoGPT and Megatron store them.

With a local tokenizer.json (the `tokenizers` library, no network) the text is encoded by it;
without one, a byte-level fallback maps each UTF-8 byte to its value (vocabulary 256).
Documents are separated by an end-of-text id (the tokenizer's, or 0 for bytes); empty documents
are skipped.

Every input mistake is a SpecError naming the file (and line) before or while reading: a file that
is not UTF-8, a JSONL line that is not an object or whose text is not a string, an input holding no
text, a tokenizer file the tokenizers library cannot read. The .bin and its .bin.json are written
to temporary files beside them and renamed into place only when both are complete, so a failed
run leaves nothing half-written (an earlier token file of that name stays as it was); an --out
that exists and is not a regular file (a device, a FIFO, a folder) is refused (harness.files.atomic).
"""

from __future__ import annotations

import json
import os

import numpy as np

from harness.errors import SpecError
from harness.files.atomic import Together, check_target

JSONL_SUFFIXES = (".jsonl", ".json")


def _decode(raw: bytes, where: str, offset: int = 0) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            where,
            f"not UTF-8 text (byte 0x{raw[e.start]:02x} at byte offset {offset + e.start}); "
            "convert it first, e.g. iconv -f latin1 -t utf-8",
        ) from None


def iter_documents(path: str, text_key: str):
    """The documents of one input: each JSONL line's `text_key`, or the whole text file."""
    try:
        if path.endswith(JSONL_SUFFIXES):
            with open(path, "rb") as f:
                offset = 0
                for n, raw in enumerate(f, 1):
                    line = _decode(raw, f"{path}:{n}", offset)
                    offset += len(raw)
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SpecError(f"{path}:{n}", f"not valid JSON: {e.msg}") from None
                    if not isinstance(obj, dict):
                        raise SpecError(
                            f"{path}:{n}", f"a JSON {type(obj).__name__}, not an object with a {text_key!r} field"
                        )
                    if text_key not in obj:
                        raise SpecError(f"{path}:{n}", f"no {text_key!r} field (--text-key names it)")
                    if not isinstance(obj[text_key], str):
                        raise SpecError(f"{path}:{n}", f"{text_key!r} must be a string, got {obj[text_key]!r:.60}")
                    yield obj[text_key]
        else:
            with open(path, "rb") as f:
                yield _decode(f.read(), path)
    except OSError as e:
        raise SpecError(path, f"cannot read it: {e.strerror or e}") from None


def _check_inputs(inputs: list[str], out: str) -> None:
    for p in inputs:
        if os.path.isdir(p):
            raise SpecError("input", f"{p!r} is a folder; give .txt or .jsonl files")
        if not os.path.isfile(p):
            raise SpecError("input", f"{p!r} does not exist")
        for written in (out, out + ".json"):
            if os.path.exists(written) and os.path.samefile(p, written):
                raise SpecError("--out", f"{written!r} is also an input; it would be overwritten")


def _tokenizer(tokenizer_path: str | None):
    """(encode, vocabulary size, end-of-text id)."""
    if not tokenizer_path:
        return (lambda text: list(text.encode("utf-8"))), 256, 0
    if not os.path.isfile(tokenizer_path):
        raise SpecError("--tokenizer", f"{tokenizer_path!r} does not exist")
    try:
        from tokenizers import Tokenizer  # comes with transformers
    except ImportError:
        raise SpecError("--tokenizer", "needs the tokenizers package (pip install tokenizers)") from None
    try:
        tok = Tokenizer.from_file(tokenizer_path)
    except Exception as e:  # the Rust library raises plain Exception for any malformed file
        why = (str(e).strip().splitlines() or ["unreadable"])[0]
        raise SpecError(
            "--tokenizer", f"{tokenizer_path}: not a tokenizer.json the tokenizers library reads ({why})"
        ) from None
    vocab = tok.get_vocab_size()
    if vocab < 1:
        raise SpecError("--tokenizer", f"{tokenizer_path}: its vocabulary is empty")
    eot = next((tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>") if tok.token_to_id(t) is not None), 0)
    return (lambda text: tok.encode(text).ids), vocab, eot


def prepare(inputs: list[str], out: str, tokenizer_path: str | None = None, text_key: str = "text") -> dict:
    for target in (out, out + ".json"):  # a device, FIFO or folder there is refused: never renamed over
        check_target(target, "--out")
    _check_inputs(inputs, out)
    encode, vocab, eot = _tokenizer(tokenizer_path)
    dtype = np.uint16 if vocab <= 65536 else np.uint32
    count = 0
    with Together("--out") as files:
        with open(files.path(out), "wb") as f:
            for path in inputs:
                docs = 0
                for doc in iter_documents(path, text_key):
                    if not doc.strip():
                        continue
                    ids = np.asarray(list(encode(doc)) + [eot], dtype=dtype)
                    f.write(ids.tobytes())
                    count += len(ids)
                    docs += 1
                if docs == 0:
                    raise SpecError(
                        path,
                        "holds no text"
                        + (f" (no non-empty {text_key!r} field)" if path.endswith(JSONL_SUFFIXES) else ""),
                    )
        meta = {
            "tokens": count,
            "dtype": np.dtype(dtype).name,
            "vocab_size": vocab,
            "tokenizer": tokenizer_path or "bytes",
        }
        files.write(out + ".json", json.dumps(meta, indent=2))
    return meta
