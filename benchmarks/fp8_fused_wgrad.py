"""What fp8_recipe rowwise_with_gw_hp's fused weight gradient (harness.model.float8._FusedWeightGradient: the
weight gradient added in fp32 into the main gradient) costs against torchao's own backward (its bf16 weight
gradient added to the main gradient afterwards, as the engines' hooks do): one FP8 linear's forward and
backward, side by side, median of REPEATS, on this machine's backend (emulated on a CPU without
torch._scaled_mm: the FP8 GEMMs then run as upcast bf16/fp32 products, so the ratio is this machine's, not a
GPU's). The fused backward runs torchao's backward too (which forms the bf16 weight gradient it then drops)
plus one fp32 product: the ratio is that extra GEMM's price here.

    python benchmarks/fp8_fused_wgrad.py [tokens hidden ffn]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from harness.model import float8

REPEATS = 7


def _time(mm, x, g, fused: bool) -> list[float]:
    """REPEATS forward + backward passes of one linear, the main gradient filled fused or by the hook's add."""
    weight = torch.nn.Parameter(torch.randn(g.shape[-1], x.shape[-1], dtype=torch.bfloat16))
    main_grad = torch.zeros(weight.shape)
    if fused:
        weight.main_grad = main_grad
    out = []
    for _ in range(REPEATS):
        weight.grad = None
        xi = x.clone().requires_grad_()
        t0 = time.perf_counter()
        (mm(xi, weight) * g).sum().backward()
        if not fused:  # what the engines' hook does with torchao's bf16 gradient
            main_grad.add_(weight.grad)
        out.append(time.perf_counter() - t0)
    return out


def main(tokens: int = 512, hidden: int = 512, ffn: int = 1408) -> None:
    torch.manual_seed(0)
    mm = float8.matmul(float8.GW_HP, "cpu")
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    g = torch.randn(tokens, ffn, dtype=torch.bfloat16)
    times: dict[bool, list[float]] = {False: [], True: []}
    for fused in (False, True, False, True):  # interleaved, so that load drifts hit both
        times[fused] += _time(mm, x, g, fused)
    plain, fused = statistics.median(times[False]), statistics.median(times[True])
    print(f"backend {float8.backend('cpu')}; tokens {tokens}, in {hidden}, out {ffn}; forward + backward, median")
    print(f"torchao's bf16 weight gradient + add: {plain * 1e3:.1f} ms")
    print(f"fused fp32 weight gradient:           {fused * 1e3:.1f} ms")
    print(f"ratio fused / torchao's: {fused / plain:.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
