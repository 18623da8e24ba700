"""The own engine's layouts run in one gloo launch per world size, against the reference.

A launch of N processes runs a list of cases (each a small dict of workload/layout overrides)
one after another, so process start-up and group creation are paid once per world size rather
than once per layout. Every rank returns its losses, weights, communication counts and details.
"""

from __future__ import annotations

from harness.testing.launches import shared_launches
from harness.testing.reference import reference_run
from harness.testing.spawn import spawn

# bf16 parity tolerances (relative, on losses and on the final fp32 masters): measured over the own
# engine's bf16 cases (tests/test_engine_equivalence.py's docstring says where the largest came from)
BF16_LOSS_RTOL, BF16_WEIGHTS_RTOL = 1e-4, 1e-2
# fp8 (torchao's e4m3 casts over bf16): bf16's x sqrt(2^5), e4m3's amplification of bf16's rounding
# differences (one e4m3 step, 2^5 bf16 steps, taken with probability 2^-5: 2^5 times the variance), the
# derivation of the comparison's default fp8 tolerance (tests/test_fp8.py)
FP8_LOSS_RTOL, FP8_WEIGHTS_RTOL = BF16_LOSS_RTOL * 2**2.5, BF16_WEIGHTS_RTOL * 2**2.5
# mxfp8 (e4m3 elements, one e8m0 scale per block of 32): fp8's x sqrt(1 + 2^-4). Its elements amplify bf16's
# differences as fp8's do (variance 2^-5 s^2 per element, s one e4m3 step); its scale is a power of two, so
# where a block's amax sits within one bf16 step below a power of two and moves up (probability 2^-8) the
# block's 32 elements are cast at twice the step, each then one step s off with probability 1/2: 2^-9 s^2
# more per element, 2^-4 of the first term; variances add
MXFP8_LOSS_RTOL, MXFP8_WEIGHTS_RTOL = FP8_LOSS_RTOL * (1 + 2**-4) ** 0.5, FP8_WEIGHTS_RTOL * (1 + 2**-4) ** 0.5

BASE = {
    "workload": {
        "model": "tiny",
        "seq_len": 16,
        "global_batch_size": 8,
        "steps": 5,
        "warmup_steps": 0,
        "precision": "fp32",
        "device": "cpu",
        "optimizer": {"lr": 1.0, "eps": 1.0},
    },
    "layout": {"engine": "own"},
}


def workload_of(case: dict) -> dict:
    return {**BASE["workload"], **case.get("workload", {})}


def make_spec(case: dict):
    from harness.spec import parse_spec

    return parse_spec({"workload": workload_of(case), "layout": {**BASE["layout"], **case.get("layout", {})}})


def batches(spec, shape, steps: int):
    from harness.data.source import token_source

    src = token_source(spec.workload, shape.vocab)
    return [src.global_batch_at(i) for i in range(steps)]


def reference(case: dict, steps: int = 5):
    """Losses and final weights of the single-device engine on the case's workload."""
    lay = case.get("layout", {})
    return reference_run(
        workload_of(case),
        steps,
        micro_batch_size=lay.get("micro_batch_size", 1),
        attention=lay.get("attention", "sdpa"),
    )


def run_cases(ctx, cases: list[dict], steps: int) -> list[dict]:
    """On one rank: build the own engine for each case in turn and train `steps` steps."""
    from harness.engine.adapter import build
    from harness.model.presets import resolve_shape

    results = []
    for case in cases:
        spec = make_spec(case)
        shape = resolve_shape(spec.workload.model, spec.workload.model_overrides)
        eng = build(spec, shape, ctx)
        losses, comms = [], []
        for b in batches(spec, shape, steps):
            losses.append(float(eng.train_step(b)))
            comms.append(eng.last_step_details()["comm"])
        results.append(
            {
                "case": case,
                "losses": losses,
                "state": eng.full_state_dict(),
                "comm": comms[-1],
                "comm_first": comms[0],
                "details": eng.last_step_details(),
                "coord": eng.mesh.coord,
                "router": eng.router_stats(),  # a MoE's routing over all the steps ({} without one)
            }
        )
        del eng
    return results


def launch(cases: list[dict], world: int, steps: int = 5, timeout_s: float = 300) -> list[list[dict]]:
    """`world` gloo processes, one thread each, run every case; returns per-rank result lists."""
    return spawn(run_cases, world, cases, steps, timeout_s=timeout_s, threads=1, every_rank=True)


def shared(by_world: dict[int, list[dict]], steps: int = 5, timeout_s: float = 300):
    """A module fixture: get(world) -> launch(by_world[world], world, steps)'s per-rank results, each world's
    cases in the session's "torch" launch at that world size (harness.testing.launches)."""
    args = {world: (cases, steps) for world, cases in by_world.items()}
    return shared_launches("torch", args, run_cases, every_rank=True, timeout_s=timeout_s, threads=1)
