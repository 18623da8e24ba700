"""The live progress line a run prints on rank 0 (stderr), apart from what it measures."""

from __future__ import annotations

import sys
import time


class Progress:
    """A live line on rank 0: step, tokens/s, MFU, loss, elapsed time and ETA (the mean step so
    far times the steps left); at most every `every` seconds."""

    def __init__(self, enabled: bool, total: int, every: float = 2.0):
        self.enabled, self.total, self.every, self.last = enabled, total, every, 0.0
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()

    @staticmethod
    def clock(seconds: float) -> str:
        """Elapsed or remaining time as m:ss, or h:mm:ss from an hour."""
        s = int(round(seconds))
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"

    def update(self, step: int, seconds: float, tokens: int, loss: float, mfu: float | None, force=False):
        now = time.monotonic()
        if not self.enabled or (now - self.last < self.every and not force):
            return
        self.last = now
        mfu_text = f" | MFU {100 * mfu:5.1f}%" if mfu else ""
        elapsed = now - self.start
        eta = elapsed / (step + 1) * (self.total - step - 1)
        line = (
            f"step {step + 1}/{self.total} | {tokens / seconds:,.0f} tok/s{mfu_text} | loss {loss:.4f}"
            f" | {self.clock(elapsed)} elapsed, ETA {self.clock(eta)}"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self):
        if self.enabled and self.tty:
            print(file=sys.stderr)
