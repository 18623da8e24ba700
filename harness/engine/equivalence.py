"""Run several engine layouts in one gloo process group and compare with the reference.

Used by the equivalence tests and by hand: one launch of N processes runs a list of cases
(each a small dict of workload/layout overrides) one after another, so process start-up and
group creation are paid once per world size rather than once per layout.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import time

import torch

BASE = {"workload": {"model": "tiny", "seq_len": 16, "global_batch_size": 8, "steps": 5, "warmup_steps": 0,
                     "precision": "fp32", "device": "cpu",
                     "optimizer": {"lr": 1.0, "eps": 1.0}},
        "layout": {"engine": "own"}}


def make_spec(case: dict):
    from harness.spec import parse_spec

    raw = {"workload": {**BASE["workload"], **case.get("workload", {})},  # "env": variables for the engine
           "layout": {**BASE["layout"], **case.get("layout", {})}}
    return parse_spec(raw)


def batches(spec, shape, steps: int):
    from harness.data import token_source

    src = token_source(spec.workload, shape.vocab)
    return [src.global_batch_at(i) for i in range(steps)]


def reference(case: dict, steps: int = 5):
    """Losses and final weights of the single-device engine on the same workload."""
    from harness.frameworks.single import SingleDeviceEngine
    from harness.model.presets import resolve_shape

    spec = make_spec({"workload": case.get("workload", {}),
                      "layout": {"engine": "single", "micro_batch_size": case.get("layout", {}).get("micro_batch_size", 1),
                                 "attention": case.get("layout", {}).get("attention", "sdpa")}})
    shape = resolve_shape(spec.workload.model, spec.workload.model_overrides)
    eng = SingleDeviceEngine(spec, shape, torch.device("cpu"))
    losses = [eng.train_step(b) for b in batches(spec, shape, steps)]
    return losses, eng.full_state_dict()


def _worker(rank: int, world: int, port: int, cases: list[dict], steps: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from harness.dist import RunContext
    from harness.frameworks.own import build
    from harness.model.presets import resolve_shape

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180))
    ctx = RunContext(rank, world, rank, torch.device("cpu"), "gloo")
    results = []
    try:
        for case in cases:
            os.environ.pop("HARNESS_P2P", None)
            os.environ.update(case.get("env", {}))
            spec = make_spec(case)
            shape = resolve_shape(spec.workload.model, spec.workload.model_overrides)
            eng = build(spec, shape, ctx)
            losses, comms = [], []
            for b in batches(spec, shape, steps):
                losses.append(eng.train_step(b))
                comms.append(eng.last_step_details()["comm"])
            state = eng.full_state_dict()
            details = eng.last_step_details()
            results.append({"case": case, "losses": losses, "state": state, "comm": comms[-1],
                            "comm_first": comms[0], "details": details, "coord": eng.mesh.coord})
            del eng
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cases: list[dict], world: int, steps: int = 5, timeout_s: float = 300) -> list[list[dict]]:
    """Spawn `world` gloo processes that run every case; returns per-rank result lists."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        context = mp.start_processes(_worker, args=(world, free_port(), cases, steps, d), nprocs=world,
                                     start_method="spawn", join=False)
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=2):
            if time.monotonic() > deadline:  # a hang (deadlock) must fail the test, not stall the suite
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world} processes did not finish {len(cases)} cases in {timeout_s} s")
        return [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def compare(result: dict, ref_losses, ref_state, rtol: float = 1e-5) -> list[str]:
    """Mismatches (empty when equal within rtol): losses per step and every final parameter."""
    bad = []
    for i, (a, b) in enumerate(zip(result["losses"], ref_losses)):
        if abs(a - b) > rtol * abs(b):
            bad.append(f"step {i}: loss {a!r} vs reference {b!r}")
    state = result["state"]
    if set(state) != set(ref_state):
        bad.append(f"parameter names differ: {sorted(set(state) ^ set(ref_state))[:5]}")
    for k in ref_state:
        if k in state:
            ref, got = ref_state[k], state[k]
            err = (got - ref).abs().max().item()
            scale = ref.abs().max().item()
            if got.shape != ref.shape or err > rtol * max(scale, 1e-12):
                bad.append(f"{k}: max abs diff {err:.3g} (scale {scale:.3g})")
    return bad


if __name__ == "__main__":  # python -m harness.engine.equivalence TP PP DP
    tp, pp, dp = (int(a) for a in sys.argv[1:4])
    case = {"layout": {"tp": tp, "pp": pp, "dp": dp}}
    res = launch([case], tp * pp * dp)
    ref = reference(case)
    print("losses", res[0][0]["losses"])
    print("reference", ref[0])
    print("mismatches", compare(res[0][0], *ref) or "none")
