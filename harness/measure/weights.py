"""A fingerprint of a run's final weights, small enough for its record, for the comparison's parity check.

Per parameter (named as the plain Llama's: every engine's full_state_dict) two numbers in float64: its
L2 norm and its projection on a unit random vector seeded by the parameter's name (the same vector in
every run). Two runs' weights w and w' give |norm - norm'| <= ||w - w'|| and |proj - proj'| <= ||w - w'||,
so a difference above tol x ||w|| proves the weights differ by more than tol relatively; equal weights
give equal fingerprints up to float64 rounding. Not a hash: the engines' weights agree to a tolerance,
not bit for bit.
"""

from __future__ import annotations

import zlib

import torch

# Above this many parameters the runner gathers no full copy on one rank for a fingerprint (a 70B model
# does not fit one GPU's memory): said in the record instead.
MAX_PARAMETERS = 200_000_000


def weights_fingerprint(state: dict) -> dict[str, list[float]]:
    """{name: [L2 norm, projection on the name's unit random vector]} of a full state dict."""
    out = {}
    for name in sorted(state):
        x = state[name].detach().to(torch.float64).flatten().cpu()
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        r = torch.randn(x.numel(), generator=g, dtype=torch.float64)
        out[name] = [float(x.norm()), float(x @ (r / r.norm()))]
    return out


def fingerprint_rel_diff(mine: dict, ref: dict) -> tuple[float, str | None]:
    """(the largest difference of either number relative to the reference parameter's norm, its name);
    inf with the first name that one fingerprint lacks."""
    if set(mine) != set(ref):
        return float("inf"), sorted(set(mine) ^ set(ref))[0]
    worst, at = 0.0, None
    for name, (norm, proj) in ref.items():
        d = max(abs(mine[name][0] - norm), abs(mine[name][1] - proj)) / max(norm, 1e-30)
        if d != d:  # NaN
            return float("inf"), name
        if d > worst:
            worst, at = d, name
    return worst, at
