"""The SwiGLU feed-forward: a dense block's MLP (harness/model/llama.py) and each routed expert of a
mixture (harness/model/moe.py), one module below both so that neither model imports the other for it."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). `ffn` is the width held (a tensor-parallel rank's slice)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
