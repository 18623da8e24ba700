"""The own engine's memory census (metrics.memory_census) against its closed form, at dp=2.

Two gloo ranks, tiny LLaMA, one launch for every case. P is the rank's parameter count (at
dp=2 with tp=pp=1, the whole model's), d = 2. One DP bucket here (the default 25 MB), padded to
a multiple of d, so "P" below is P rounded up to even (padding: under 3%, here one element at
most). The forms follow harness/engine/data_parallel.py (Bucket, ModelStates):

  parameters         param_flat, in the compute dtype
  gradients          grad_flat (grad_accum dtype), whose shard view ZeRO-1 reduce-scatters into
                     (in place, nothing beside it); the fp32 copy the optimizer's gradients are
                     views of, where the reduced gradient is bf16 (P, or P/d under ZeRO-1); an
                     fp32 reduction copy of bf16 main gradients (ZeRO-0: it is the reduced
                     gradient, kept to the step; ZeRO-1: its shard is cloned, the copy dropped);
                     a bf16 reduction copy of fp32 main gradients is copied back and dropped
                     before the step
  master_parameters  bf16 only: fp32, P (ZeRO-0) or P/d (ZeRO-1)
  optimizer_states   AdamW exp_avg + exp_avg_sq, fp32, of what the optimizer updates: 8P or 8P/d
                     (padding excluded), plus a 4-byte step counter per parameter view

  precision  accum reduce  ZeRO  parameters  gradients                     master     Adam
  fp32       fp32  fp32    0     fp32 4P     fp32 4P                       -          fp32 8P
  fp32       fp32  fp32    1     fp32 4P     fp32 4P                       -          fp32 8P/d
  bf16       fp32  fp32    0     bf16 2P     fp32 4P                       fp32 4P    fp32 8P
  bf16       fp32  fp32    1     bf16 2P     fp32 4P                       fp32 4P/d  fp32 8P/d
  bf16       fp32  bf16    0     bf16 2P     fp32 4P                       fp32 4P    fp32 8P
  bf16       fp32  bf16    1     bf16 2P     fp32 4P                       fp32 4P/d  fp32 8P/d
  bf16       bf16  fp32    0     bf16 2P     bf16 2P, fp32 4P              fp32 4P    fp32 8P
  bf16       bf16  fp32    1     bf16 2P     bf16 2P, fp32 4P/d            fp32 4P/d  fp32 8P/d
  bf16       bf16  bf16    1     bf16 2P     bf16 2P, fp32 4P/d            fp32 4P/d  fp32 8P/d

(for example ZeRO-1 at dp=d in bf16 with fp32 accumulation: 2P, 4P, 4P/d, 8P/d: the gradients are
Megatron's distributed optimizer's 4P, not 4P + 4P/d.)
"""

from __future__ import annotations

import pytest

from harness.testing.launches import shared_launch

pytestmark = pytest.mark.slow  # starts two processes

D = 2


def form(parameters: dict, gradients: dict, master_parameters: dict, optimizer_states: dict) -> dict:
    """A closed form: bytes per dtype of each census category, in units of P."""
    return {
        "parameters": parameters,
        "gradients": gradients,
        "master_parameters": master_parameters,
        "optimizer_states": optimizer_states,
    }


CASES = [  # (precision, grad_accum_dtype, grad_reduce_dtype, zero_stage): closed form in units of P
    (("fp32", "fp32", "fp32", 0), form({"fp32": 4}, {"fp32": 4}, {}, {"fp32": 8})),
    (("fp32", "fp32", "fp32", 1), form({"fp32": 4}, {"fp32": 4}, {}, {"fp32": 8 / D})),
    (("bf16", "fp32", "fp32", 0), form({"bf16": 2}, {"fp32": 4}, {"fp32": 4}, {"fp32": 8})),
    (("bf16", "fp32", "fp32", 1), form({"bf16": 2}, {"fp32": 4}, {"fp32": 4 / D}, {"fp32": 8 / D})),
    (("bf16", "fp32", "bf16", 0), form({"bf16": 2}, {"fp32": 4}, {"fp32": 4}, {"fp32": 8})),
    (("bf16", "fp32", "bf16", 1), form({"bf16": 2}, {"fp32": 4}, {"fp32": 4 / D}, {"fp32": 8 / D})),
    (("bf16", "bf16", "fp32", 0), form({"bf16": 2}, {"bf16": 2, "fp32": 4}, {"fp32": 4}, {"fp32": 8})),
    (("bf16", "bf16", "fp32", 1), form({"bf16": 2}, {"bf16": 2, "fp32": 4 / D}, {"fp32": 4 / D}, {"fp32": 8 / D})),
    (("bf16", "bf16", "bf16", 1), form({"bf16": 2}, {"bf16": 2, "fp32": 4 / D}, {"fp32": 4 / D}, {"fp32": 8 / D})),
]


def _in_place_collectives(ctx) -> list[tuple]:
    """gloo's reduce-scatter with the output aliasing the input's shard, and its all-gather with the
    input aliasing the output's shard (what ZeRO-1 does), against out-of-place ones: (op, dtype,
    elements, equal) per case, odd sizes and bucket-sized ones."""
    import torch
    import torch.distributed as dist

    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (2, 1002, 2**20 + 6):
            x = torch.randn(n, generator=torch.Generator().manual_seed(ctx.rank)).to(dtype)
            lo, hi = ctx.rank * n // D, (ctx.rank + 1) * n // D
            ref = torch.empty(n // D, dtype=dtype)
            dist.reduce_scatter_tensor(ref, x.clone())
            dist.reduce_scatter_tensor(x[lo:hi], x, async_op=True).wait()
            out.append(("reduce_scatter", str(dtype), n, torch.equal(x[lo:hi], ref)))
            gathered = torch.empty(n, dtype=dtype)
            dist.all_gather_into_tensor(gathered, x[lo:hi].clone())
            dist.all_gather_into_tensor(x, x[lo:hi])
            out.append(("all_gather", str(dtype), n, torch.equal(x, gathered)))
    return out


def _censuses(ctx, cases):
    """On each rank: every case's census at its first step, and the saved activations of a step
    with and without the engine's exclusions (the parameters); then the in-place collectives'
    check."""
    from harness.data.source import token_source
    from harness.engine.adapter import build
    from harness.measure.census import SavedActivations
    from harness.spec import parse_spec

    out = []
    for precision, accum, reduce, zero in cases:
        spec = parse_spec(
            {
                "workload": {
                    "model": "tiny",
                    "seq_len": 16,
                    "global_batch_size": 4,
                    "steps": 2,
                    "precision": precision,
                    "grad_accum_dtype": accum,
                    "grad_reduce_dtype": reduce,
                    "device": "cpu",
                },
                "layout": {"engine": "own", "dp": D, "zero_stage": zero},
            }
        )
        shape = spec.shape()
        eng = build(spec, shape, ctx)
        src = token_source(spec.workload, shape.vocab)
        with SavedActivations(eng.activation_exclusions()) as excluded:
            eng.train_step(src.global_batch_at(0))
        with SavedActivations([]) as everything:
            eng.train_step(src.global_batch_at(1))
        out.append(
            {
                "census": eng.memory_census(),
                "numel": sum(p.numel() for p in eng.params),
                "padded": sum(b.padded for b in eng.model_states.buckets),
                "param_bytes": sum(b.param_flat.untyped_storage().nbytes() for b in eng.model_states.buckets),
                "saved": (excluded.bytes, everything.bytes),
            }
        )
        del eng
    return {"cases": out, "in_place": _in_place_collectives(ctx)}


measured = shared_launch("torch", D, _censuses, [c for c, _ in CASES], timeout_s=120, threads=1, every_rank=True)


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, c)) for c, _ in CASES])
def test_census_matches_the_closed_form(measured, index):
    (precision, *_), form = CASES[index]
    for rank, per_rank in enumerate(measured):
        got = per_rank["cases"][index]
        census, p = got["census"], got["numel"]
        assert census is not None, f"rank {rank}: no census"
        assert got["padded"] - p < D  # one bucket, padded to a multiple of d
        for category, by_dtype in form.items():
            held = census.get(category, {})
            assert set(held) == set(by_dtype), f"rank {rank} {category}: {held} vs {by_dtype} x P"
            for dtype, units in by_dtype.items():
                expected = units * p
                assert abs(held[dtype] - expected) <= 0.03 * expected, (
                    f"rank {rank} {category} {dtype}: {held[dtype]} B vs {units} x P = {expected:.0f} B"
                )
        assert set(census) <= set(form)
        # the parameters are not activations: without the engine's exclusions, saved views of the
        # parameters' flat buffer (not Parameters themselves, which are always skipped) count
        excluded, everything = got["saved"]
        assert everything - excluded >= got["param_bytes"]
        assert got["param_bytes"] == (2 if precision == "bf16" else 4) * got["padded"]


def test_bf16_zero1_holds_megatrons_4p_of_gradients(measured):
    """ZeRO-1 reduce-scatters into its shard of the fp32 main gradients: 4P of gradients in all, as
    Megatron's distributed optimizer, not 4P + 4P/d (6P at d=2) with a separate reduce-scatter output."""
    index = [c for c, _ in CASES].index(("bf16", "fp32", "fp32", 1))
    for rank, per_rank in enumerate(measured):
        got = per_rank["cases"][index]
        held = sum(got["census"]["gradients"].values())
        assert abs(held - 4 * got["padded"]) <= 64, f"rank {rank}: {held} B of gradients vs 4P = {4 * got['padded']} B"


def test_gloo_in_place_reduce_scatter_and_all_gather_equal_out_of_place(measured):
    for rank, per_rank in enumerate(measured):
        assert per_rank["in_place"] and all(equal for *_, equal in per_rank["in_place"]), (rank, per_rank["in_place"])
