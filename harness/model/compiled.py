"""torch.compile as a layout variable (layout.compile): `blocks` compiles each transformer block, as
torchtitan's apply_compile does, and CompileWatch counts what dynamo did so that a record says it.

A block is compiled in place (nn.Module.compile), not wrapped in an OptimizedModule, so parameter
names stay the plain model's (no `_orig_mod.`) and hooks a framework puts on the block's children
still run. Identical blocks share one graph: dynamo inlines nn.Modules and guards on their
parameters as inputs (torch 2.13: inline_inbuilt_nn_modules is always on), so one compiled block's
code serves every layer of its shape; CompileWatch's `graphs` shows it.

Compilation happens in the first step. The spec requires a warm-up step under compile (checks.py),
so no measured step pays it; CompileWatch records the time apart (compile_s) and, once armed after
warm-up, makes any recompilation an error (dynamo's error_on_recompile): a measured step that
recompiles would time the compiler, not the layout, so the run fails and is recorded failed.
"""

from __future__ import annotations

import typing

import torch

from harness.spec import COMPILE


def compile_blocks(blocks: typing.Iterable[torch.nn.Module], mode: str) -> int:
    """Compile every block in place when mode is `blocks` (inductor, not fullgraph: a block that holds
    a collective breaks its graph there, and the break is counted, not refused); the count compiled."""
    if mode not in COMPILE:
        raise ValueError(f"layout.compile {mode!r} is not one of {COMPILE}")
    if mode == "none":
        return 0
    n = 0
    for block in blocks:
        block.compile()
        n += 1
    return n


def _counts() -> dict:
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        # inductor's on-disk FX graph cache (shared by every process of this user): hits are graphs not compiled again
        "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
    }


def _seconds() -> float:
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


class CompileWatch:
    """What torch.compile did in one run: compile time (dynamo's and inductor's own wall time, on
    this process), graphs, graph breaks, frames compiled in warm-up; after arm(), a recompilation
    raises (dynamo's RecompileError, which the run records as its failure). Inert when the layout compiles nothing."""

    def __init__(self, mode: str):
        self.enabled = mode != "none"
        self.armed, self.saved = False, None
        if self.enabled:
            self.start, self.start_s = _counts(), _seconds()

    def arm(self) -> None:
        """Warm-up is over: from now on a recompilation is an error (restored by close())."""
        if not self.enabled or self.armed:
            return
        import torch._dynamo.config as config

        self.armed, self.saved = True, config.error_on_recompile
        self.at_arm, self.at_arm_s = _counts(), _seconds()
        config.error_on_recompile = True

    def close(self) -> None:
        if self.armed and self.saved is not None:
            import torch._dynamo.config as config

            config.error_on_recompile, self.saved = self.saved, None

    def metrics(self, max_over_ranks=lambda xs: xs) -> dict:
        """The record's compile fields (the slowest rank's compile time); none when nothing was compiled."""
        if not self.enabled:
            return {}
        now = _counts()
        at_arm = self.at_arm if self.armed else now
        seconds = self.at_arm_s if self.armed else _seconds()
        compile_s, breaks, graphs, hits, misses = max_over_ranks(
            [seconds - self.start_s]
            + [float(at_arm[k] - self.start[k]) for k in ("graph_breaks", "graphs", "cache_hits", "cache_misses")]
        )
        return {
            "compile": {
                "compile_s": compile_s,
                "graphs": int(graphs),
                "graph_breaks": int(breaks),
                "frames_compiled": at_arm["frames"] - self.start["frames"],
                "inductor_cache_hits": int(hits),
                "inductor_cache_misses": int(misses),
                "recompiles_after_warmup": now["frames"] - at_arm["frames"],
            }
        }
