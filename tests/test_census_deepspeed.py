"""DeepSpeed under the workload's precision policy (CPU, 2 gloo processes, one launch for all):
the memory census of ZeRO-1, 2 and 3 at dp=2 in fp32 and bf16 against its closed form, derived
from DeepSpeed 0.19.8's source and written beside each case, and bf16 parity with the bf16
single-device reference at the compare tool's default bf16 tolerance.

P is the model's parameter count, d = 2 the data-parallel degree, B the ZeRO-3 reduce bucket
(zero_optimization.reduce_bucket_size, in elements). The closed forms hold up to alignment
padding (flat buffers padded to a multiple of 2d elements, ZeRO-3 partitions to d), the
optimizer's step counters and, under ZeRO-3, the parameters kept whole below
stage3_param_persistence_threshold (the RMSNorm weights): within 3%.

The ZeRO-3 runs take a copy of ds_configs/zero3.json with a reduce bucket of 20,000 elements
(the largest tiny parameter has 16,384): the bucket is held for the whole run, and zero3.json's
5e7 elements (200 MB in fp32) would dwarf every other term of a 125k-parameter model.
(tests/test_deepspeed.py runs bf16 ZeRO-3 on zero3.json as it is against the same reference.)
"""

import functools
import json
import os

import pytest

from harness.compare.spec import DEFAULT_TOLERANCE
from harness.frameworks.deepspeed.config import DS_CONFIG_DIR
from harness.model.presets import PRESETS, param_count
from harness.model.training import precision_policy
from harness.spec import parse_spec
from harness.testing.launches import shared_launch
from harness.testing.reference import reference_run
from harness.testing.workloads import tiny_workload

STEPS = 5
D = 2
P = param_count(PRESETS["tiny"])
SMALL_BUCKET = 20_000
WORKLOAD = tiny_workload(steps=STEPS, warmup_steps=0)
BF16 = {"precision": "bf16", "grad_accum_dtype": "fp32", "grad_reduce_dtype": "fp32"}  # the policy's defaults
BF16_ACCUM = {"precision": "bf16", "grad_accum_dtype": "bf16", "grad_reduce_dtype": "bf16"}
# Muon (DeepSpeed's MuonWithAuxAdam over the workload's split, harness/frameworks/deepspeed/muon.py) at lr 0.02
BF16_MUON = {**BF16, "optimizer": {"name": "muon", "lr": 0.02}}


def _muon_elements() -> tuple[int, int]:
    """(elements of the Muon matrices, of the AdamW tensors) of tiny (harness.model.muon.muon_matrix)."""
    from harness.model.llama import build_model
    from harness.model.muon import muon_matrix

    model = build_model(PRESETS["tiny"], 0, "sdpa", "torch", "none", device="meta")
    named = [(n, p.shape, p.numel()) for n, p in model.named_parameters()]
    m = sum(k for n, shape, k in named if muon_matrix(n, shape))
    return m, P - m


def partitioned_master(parameters: dict, gradients: dict, buffers: dict | None = None) -> dict:
    """A census whose master parameters (fp32 4P/d) and AdamW states (fp32 8P/d) are this rank's
    partition, as every case here has them."""
    return {
        "parameters": parameters,
        "buffers": buffers or {},
        "gradients": gradients,
        "master_parameters": {"fp32": 4 * P / D},
        "optimizer_states": {"fp32": 8 * P / D},
    }


def closed_form(case: str) -> dict:
    """Bytes per category and dtype that rank 0 holds at its first optimizer step."""
    p, d = P, D
    return {
        # fp32, ZeRO-1 and ZeRO-2: DeepSpeedZeroOptimizer (runtime/zero/stage_1_and_2.py).
        #   parameters: fp32 4P - the module's parameters are views of bit16_groups_flat (__init__,
        #     flatten_dense_tensors_aligned + _update_model_bit16_weights: the flat buffer holds the
        #     model's dtype, fp32 here)
        #   gradients: fp32 4P/d - step() frees every .grad (free_grad_in_param_list) and hands the
        #     basic optimizer this rank's flat partition, single_partition_of_fp32_groups[i].grad
        #   master_parameters: fp32 4P/d - single_partition_of_fp32_groups, a clone of this rank's
        #     partition (__init__: .detach().clone().to(master_weights_and_grads_dtype)), even in fp32
        #   optimizer_states: fp32 8P/d - AdamW's exp_avg and exp_avg_sq of that partition
        "zero1-fp32": partitioned_master({"fp32": 4 * p}, {"fp32": 4 * p / d}),
        "zero2-fp32": partitioned_master({"fp32": 4 * p}, {"fp32": 4 * p / d}),
        # fp32, ZeRO-3: DeepSpeedZeroOptimizer_Stage3 (runtime/zero/stage3.py).
        #   parameters: fp32 4P/d - lp_param_buffer, the defragmented ds_tensor partitions
        #     (_create_fp16_partitions_with_defragmentation); the full parameters are released
        #     (_partition_all_parameters at the start of step())
        #   gradients: fp32 4P/d + 4P/d - grad_partitions_flat_buffer in gradient_accumulation_dtype
        #     (_setup_for_real_optimizer), the master's .grad, a flattened copy of the averaged
        #     gradients (_prepare_fp32_grad_for_sub_group)
        #   buffers: fp32 4B - the ipg bucket of reduce_bucket_size elements in communication_data_type,
        #     allocated in _setup_for_real_optimizer and kept (a category of its own: its size is the
        #     config's, not the model's)
        #   master_parameters: fp32 4P/d - _create_fp32_partitions clones the partition (the branch
        #     that would reuse an fp32 partition compares a torch.device with a device-name string
        #     and is not taken)
        #   optimizer_states: fp32 8P/d
        "zero3-fp32": partitioned_master({"fp32": 4 * p / d}, {"fp32": 8 * p / d}, {"fp32": 4 * SMALL_BUCKET}),
        # bf16, grad_accum fp32, ZeRO-1: BF16_Optimizer (runtime/engine.py _do_optimizer_sanity_check:
        # bf16 parameters, fp32 accumulation, stage 1, no offload -> BFLOAT16; runtime/bf16_optimizer.py).
        #   parameters: bf16 2P - bf16_groups_flat (_setup_for_real_optimizer)
        #   gradients: bf16 2P + fp32 4P - every parameter's bf16 .grad, which backward_prologue
        #     zeroes (clear_lp_grads, set_to_none False) but never frees, beside fp32_groups_gradients_flat,
        #     the fp32 accumulation buffer of the whole model (zeros_like(bf16 flat, grad_acc_dtype)),
        #     all-reduced, not partitioned; the master's .grad is a view of it (step())
        #   master_parameters: fp32 4P/d - fp32_groups_flat_partition
        #   optimizer_states: fp32 8P/d
        "zero1-bf16": partitioned_master({"bf16": 2 * p}, {"bf16": 2 * p, "fp32": 4 * p}),
        # bf16, grad_accum fp32, ZeRO-2: DeepSpeedZeroOptimizer with gradient_accumulation_dtype fp32.
        #   parameters: bf16 2P (bit16_groups_flat)
        #   gradients: fp32 4P/d - each micro-batch's reduced partition is added into an fp32 flat
        #     partition (_build_compact_grad_partition_buffer, _add_full_reduction_to_compact_grad_partition);
        #     step() passes it to the master as .grad without a copy (.to(fp32) of an fp32 tensor)
        #   master_parameters: fp32 4P/d; optimizer_states: fp32 8P/d
        "zero2-bf16": partitioned_master({"bf16": 2 * p}, {"fp32": 4 * p / d}),
        # bf16, grad_accum fp32, ZeRO-3: as fp32 ZeRO-3 with bf16 partitions: parameters bf16 2P/d;
        # gradients fp32 4P/d (accumulation buffer) + 4P/d (the master's .grad); buffers 4B (the bucket
        # in communication_data_type fp32); master fp32 4P/d; Adam 8P/d.
        "zero3-bf16": partitioned_master({"bf16": 2 * p / d}, {"fp32": 8 * p / d}, {"fp32": 4 * SMALL_BUCKET}),
        # bf16, grad_accum bf16, ZeRO-1: DeepSpeedZeroOptimizer (not BF16_Optimizer): .grad accumulates
        # in bf16 and step() frees it after flattening this rank's partition, whose fp32 copy is the
        # master's .grad: parameters bf16 2P, gradients fp32 4P/d, master 4P/d, Adam 8P/d - no
        # whole-model buffer.
        "zero1-bf16-accum-bf16": partitioned_master({"bf16": 2 * p}, {"fp32": 4 * p / d}),
        # Muon under bf16 ZeRO-1: BF16_Optimizer as zero1-bf16, its optimizer states Muon's momentum_buffer
        # (fp32, the masters' partition layout: _prepare_muon_updates) on the Muon matrices' M elements and
        # AdamW's two moments on the other P - M: 4M/d + 8(P - M)/d
        "zero1-bf16-muon": {
            **partitioned_master({"bf16": 2 * p}, {"bf16": 2 * p, "fp32": 4 * p}),
            "optimizer_states": {"fp32": (4 * _muon_elements()[0] + 8 * _muon_elements()[1]) / d},
        },
    }[case]


CASES = {  # case -> (stage, workload overrides, reduce bucket of a copy of zero3.json or None)
    "zero1-fp32": (1, {}, None),
    "zero2-fp32": (2, {}, None),
    "zero3-fp32": (3, {}, SMALL_BUCKET),
    "zero1-bf16": (1, BF16, None),
    "zero2-bf16": (2, BF16, None),
    "zero3-bf16": (3, BF16, SMALL_BUCKET),
    "zero1-bf16-accum-bf16": (1, BF16_ACCUM, None),
    "zero1-bf16-muon": (1, BF16_MUON, None),
}
PARITY = ["zero1-bf16", "zero2-bf16", "zero3-bf16", "zero1-bf16-accum-bf16", "zero1-bf16-muon"]


@functools.cache
def reference_losses(overrides: str) -> list[float]:
    return reference_run({**WORKLOAD, **json.loads(overrides)}, STEPS, micro_batch_size=2)[0]


def census_runs(ctx, runs: list[dict], steps: int) -> list[dict]:
    """Each run through the harness's own loop (harness.run.Trainer), as a record gets it: its
    losses, rank 0's census, describe() and the activations saved per micro-batch."""
    from harness.run import Trainer

    out = []
    for raw in runs:
        spec = parse_spec(raw)
        trainer = Trainer(spec, ctx, spec.shape(), progress=False)
        for step in range(steps):
            trainer.step(step)
        m = trainer.metrics(measure_matmul=False)
        out.append(
            {
                "losses": m["losses"],
                "census": m["memory_census"],
                "describe": m["engine"],
                "census_by_rank": m["memory_census_by_rank"],
                "activations": m["activations_saved_bytes"],
            }
        )
        del trainer
    return out


def _runs(folder: str) -> tuple:
    """The cases' runs (the small-bucket ZeRO-3 config written to folder) and the steps."""
    with open(f"{DS_CONFIG_DIR}/zero3.json") as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["reduce_bucket_size"] = SMALL_BUCKET
    small = os.path.join(folder, "zero3_small_bucket.json")
    with open(small, "w") as f:
        f.write(json.dumps(cfg))
    runs = [
        {
            "workload": {**WORKLOAD, **overrides},
            "layout": {
                "engine": "deepspeed",
                "dp": D,
                "micro_batch_size": 2,
                "zero_stage": stage,
                "ds_config": small if bucket else "",
            },
        }
        for stage, overrides, bucket in CASES.values()
    ]
    return runs, STEPS


launched = shared_launch("deepspeed", D, census_runs, prepare=_runs, keys=CASES)


def within(measured: dict, expected: dict, rel: float = 0.03) -> list[str]:
    bad = []
    for category in ("parameters", "buffers", "gradients", "master_parameters", "optimizer_states"):
        got, want = measured.get(category, {}), expected.get(category, {})
        for dtype in sorted(set(got) | set(want)):
            g, w = got.get(dtype, 0), want.get(dtype, 0)
            if abs(g - w) > rel * w:
                bad.append(f"{category} {dtype}: {g} bytes, closed form {w:.0f} ({g / P:.3f}P vs {w / P:.3f}P)")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_census_matches_closed_form(launched, case):
    """Every rank's census (ZeRO's partitions are the same size on each rank, up to padding on
    the last); the record's memory_census is rank 0's."""
    result = launched[case]
    assert result["census"] == result["census_by_rank"][0]
    for rank, census in enumerate(result["census_by_rank"]):
        bad = within(census, closed_form(case))
        assert not bad, f"{case}, rank {rank}:\n  " + "\n  ".join(bad)


@pytest.mark.slow
def test_census_is_not_vacuous(launched):
    """BF16_Optimizer's whole-model fp32 buffer and kept bf16 .grad show at ZeRO-1 (grad_accum
    fp32), and are gone with bf16 accumulation (DeepSpeedZeroOptimizer): the census sees the
    difference the wrapper makes."""
    fp32_accum = launched["zero1-bf16"]["census"]["gradients"]
    bf16_accum = launched["zero1-bf16-accum-bf16"]["census"]["gradients"]
    assert fp32_accum["fp32"] > 3.9 * P and fp32_accum["bf16"] > 1.9 * P
    assert "bf16" not in bf16_accum and bf16_accum["fp32"] < 2.1 * P
    assert launched["zero1-bf16"]["describe"]["optimizer_wrapper"] == "BF16_Optimizer"
    assert launched["zero1-bf16-accum-bf16"]["describe"]["optimizer_wrapper"] == "DeepSpeedZeroOptimizer"


@pytest.mark.slow
@pytest.mark.parametrize("case", PARITY)
def test_bf16_parity_with_reference(launched, case):
    """The bf16 reference runs the same policy (bf16 parameters, fp32 masters, accumulation and
    reduction as the workload says): losses agree within the compare default for bf16
    (measured on this workload: at most 8.6e-8 with fp32 accumulation, 1.6e-5 with bf16). Under Muon both
    run Newton-Schulz in bf16 (torch's fused addmm iteration, DeepSpeed's unfused one), at the same bound."""
    ref = reference_losses(json.dumps(CASES[case][1], sort_keys=True))
    losses = launched[case]["losses"]
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
    assert rel <= DEFAULT_TOLERANCE["bf16"], (case, losses, ref)


@pytest.mark.slow
def test_describe_states_the_policy_and_the_config(launched):
    d = launched["zero1-bf16"]["describe"]
    assert (
        d["precision_policy"]
        == precision_policy(
            parse_spec({"workload": {**WORKLOAD, **BF16}, "layout": {"engine": "single"}}).workload
        ).describe()
    )
    assert "precision_note" not in d
    assert d["precision_config"] == (
        "bf16.enabled true, data_types.grad_accum_dtype fp32, communication_data_type "
        "fp32, bf16.check_grad_overflow false -> BF16_Optimizer"
    )
    assert launched["zero1-fp32"]["describe"]["precision_policy"].startswith("fp32 throughout")
