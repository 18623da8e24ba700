"""Text or JSONL -> a flat token file (uint16/uint32 .bin), as nanoGPT and Megatron store them.

With a local tokenizer.json (the `tokenizers` library, no network) the text is encoded by it;
without one, a byte-level fallback maps each UTF-8 byte to its value (vocabulary 256).
Documents are separated by an end-of-text id (the tokenizer's, or 0 for bytes).
"""

from __future__ import annotations

import json
import os

import numpy as np

from harness.errors import SpecError


def iter_documents(path: str, text_key: str):
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpecError(f"{path}:{n}", f"not valid JSON: {e.msg}") from None
                if text_key not in obj:
                    raise SpecError(f"{path}:{n}", f"no {text_key!r} field")
                yield obj[text_key]
    else:
        with open(path, encoding="utf-8") as f:
            yield f.read()


def prepare(inputs: list[str], out: str, tokenizer_path: str | None = None, text_key: str = "text") -> dict:
    for p in inputs:
        if not os.path.isfile(p):
            raise SpecError("input", f"{p!r} does not exist")
    if tokenizer_path:
        if not os.path.isfile(tokenizer_path):
            raise SpecError("--tokenizer", f"{tokenizer_path!r} does not exist")
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tokenizer_path)
        vocab = tok.get_vocab_size()
        eot = next((tok.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>") if tok.token_to_id(t) is not None), 0)

        def encode(text):
            return tok.encode(text).ids
    else:
        vocab, eot = 256, 0

        def encode(text):
            return list(text.encode("utf-8"))

    dtype = np.uint16 if vocab <= 65536 else np.uint32
    count = 0
    with open(out, "wb") as f:
        for path in inputs:
            for doc in iter_documents(path, text_key):
                ids = np.asarray(encode(doc) + [eot], dtype=dtype)
                f.write(ids.tobytes())
                count += len(ids)
    meta = {"tokens": count, "dtype": np.dtype(dtype).name, "vocab_size": vocab,
            "tokenizer": tokenizer_path or "bytes"}
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=2)
    return meta
