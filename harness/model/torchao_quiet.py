"""torchao imported without its import-time noise (harness/model/float8.py and mxfp8.py import it through this):
on a CPU-only or older-torch machine it logs failed loads of its CUDA extensions, which the FP8 training paths
do not use, and torch's pytree deprecation notices."""

from __future__ import annotations

import contextlib
import logging
import warnings


@contextlib.contextmanager
def quiet():
    """torchao's import logs failed .so loads and torch's pytree deprecation notices: not errors of
    the FP8 path, kept out of the run's output."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
