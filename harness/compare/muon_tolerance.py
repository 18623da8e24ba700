"""What a comparison can check of Muon's matrices where Newton-Schulz runs in bf16 (workload.optimizer.name
muon under precision bf16 or fp8: harness.model.muon.newton_schulz, DeepSpeed's zeropower_via_newtonschulz5):
the bound on two runs' final difference in each Muon matrix, scaled by the reference's final norm of it.

The bound. Newton-Schulz divides its input by its Frobenius norm (so the gradient's scale does not matter)
and applies p(s) = a s + b s^3 + c s^5 five times to the singular values. From [0, 1] the iterates never
leave [0, s_max], s_max = 1.2024 for torch's coefficients (quintic_max), so an m x n update O has
||O||_F <= s_max sqrt(min(m, n)), and two runs' updates differ per step by at most

    ||O - O'||_F <= 2 s_max sqrt(min(m, n)).

No much smaller bound holds whatever the gradient: p^5 has slope a^5 = 485 at 0 (ns_lipschitz), so one bf16
rounding of the normalised input (u = 2^-8 of it, where two runs' fp32 sums of the same micro-batches
differ by 1e-7 and round apart) moves the output by up to 2 u a^5 = 3.8 in Frobenius norm along a gradient's
small singular directions, a fifth of the bound on a 64 x 64 matrix; the iterations' own roundings add to it.
Measured on the tiny model's bf16 gradients perturbed by 1e-7: 3-4 u of ||O||_F per step on attention.wq,
9-15 u on attention.wo, whose gradient has condition number 1e4 - above the 2 x 5 steps x u that rounding
each iterate once would give (tests/test_muon_tolerance.py measures the same on matrices built like them).
Muon moves the matrix by lr_adjusted * O per step (weight decay only shrinks a difference), so after T steps,
each fingerprint number (a norm, a projection on a unit vector: harness.measure.weights) of two runs differs
by at most

    B = T * lr_adjusted * 2 * s_max * sqrt(min(m, n)),   relatively B / ||W||, ||W|| the reference's final norm.

Where B / ||W|| >= 1 (the tiny model at lr 0.02: every matrix) the bound is the weights' own scale and the
matrix's final weights cannot be compared: the comparison says so (parity.py) instead of a tolerance that no
difference could exceed or one tuned to pass. Below 1 (large matrices, small lr, few steps) B / ||W|| is
added to the precision's tolerance. Losses, gradient norms and AdamW's tensors keep the precision's.
"""

from __future__ import annotations

import math

BF16_UNIT_ROUNDOFF = 2.0**-8  # bf16's 8 significand bits (7 stored): round-to-nearest's relative error bound


def _p(coefficients: tuple[float, float, float], s: float) -> float:
    a, b, c = coefficients
    return a * s + b * s**3 + c * s**5


def quintic_max(coefficients: tuple[float, float, float], ns_steps: int) -> float:
    """The largest singular value any Newton-Schulz iterate can have: p iterated ns_steps times from [0, 1]
    (the input divided by its Frobenius norm), the maximum over each interval an iterate reaches (p's critical
    points: the roots of a + 3b x + 5c x^2, x = s^2)."""
    a, b, c = coefficients
    disc = 9 * b * b - 20 * a * c
    roots = [] if disc < 0 or c == 0 else [(-3 * b + k * math.sqrt(disc)) / (10 * c) for k in (-1, 1)]
    top = 1.0
    for _ in range(ns_steps):
        points = [0.0, top] + [math.sqrt(x) for x in roots if 0 < x < top * top]
        top = max(top, max(abs(_p(coefficients, s)) for s in points))
    return top


def ns_lipschitz(coefficients: tuple[float, float, float], ns_steps: int) -> float:
    """The slope of p iterated ns_steps times at 0, a^ns_steps: how much a rounding of the normalised input
    along a small singular direction can grow (the largest slope on [0, 1]: tests/test_muon_tolerance.py)."""
    return coefficients[0] ** ns_steps


def matrix_bounds(shape, workload) -> dict[str, float]:
    """{name: B} for every Muon matrix of the model `shape` (a harness.model Shape) under `workload` (a spec
    Workload): the bound above on two runs' final difference, in weight units; {} where Newton-Schulz runs in
    fp32 (the fp32 policy: the runs then differ by fp32 sums, within fp32's tolerance) or under AdamW."""
    o = workload.optimizer
    if o.name != "muon" or workload.precision == "fp32":
        return {}
    from torch.optim._muon import DEFAULT_NS_STEPS, _adjust_lr

    from harness.model.llama import _parameter_table
    from harness.model.muon import COEFFICIENTS, muon_matrix

    steps = workload.warmup_steps + workload.steps
    s_max = quintic_max(COEFFICIENTS, DEFAULT_NS_STEPS)
    return {
        name: steps * _adjust_lr(o.lr, o.muon_adjust_lr, size) * 2 * s_max * math.sqrt(min(size[:2]))
        for name, (_, size) in _parameter_table(shape).items()
        if muon_matrix(name, tuple(size))
    }


def relative_bounds(bounds: dict[str, float], anchor_fingerprint) -> dict[str, float]:
    """{name: B / ||W||}, ||W|| the anchor's final norm of the matrix (its weights fingerprint); {} without one."""
    if not bounds or not isinstance(anchor_fingerprint, dict):
        return {}
    return {n: b / max(anchor_fingerprint[n][0], 1e-30) for n, b in bounds.items() if n in anchor_fingerprint}
