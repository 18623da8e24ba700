"""What the benchmarks share: the options of the workload they train (a model preset, its sizes, measured
steps after warm-up), one definition; each benchmark adds its own after them."""

from __future__ import annotations

import argparse


def workload_parser(doc: str, model: str, steps: int, warmup: int, **sizes: int) -> argparse.ArgumentParser:
    """--model (default `model`), then each of `sizes` as an int option in the order given (seq_len=128 is
    --seq-len, default 128), then --steps (measured) and --warmup (steps before them); the description is
    the first line of the benchmark's docstring."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=model)
    for name, default in sizes.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=warmup)
    return p
