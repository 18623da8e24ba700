"""The planner's model states against the measured memory census, term by term (category and
dtype), for every engine at dp=2 under the bf16 policy: own ZeRO-0/1, DeepSpeed ZeRO-1/2/3,
FSDP2. One launch of two gloo ranks builds each engine in turn and takes one step."""

from __future__ import annotations

import pytest

from harness.model.presets import param_count, resolve_shape
from harness.planner.memory_engines import model_states
from harness.testing.launches import shared_launch
from harness.testing.workloads import tiny_workload

pytestmark = pytest.mark.slow  # starts two processes

WORKLOAD = tiny_workload(model="tiny-256", steps=1, warmup_steps=0, precision="bf16")
LAYOUTS = [
    {"engine": "own", "zero_stage": 0},
    {"engine": "own", "zero_stage": 1},
    {"engine": "deepspeed", "zero_stage": 1},
    {"engine": "deepspeed", "zero_stage": 2},
    {"engine": "deepspeed", "zero_stage": 3},
    {"engine": "fsdp"},
]


def _census_of_each(ctx, layouts):
    from harness.run import Trainer
    from harness.spec import parse_spec

    out = []
    for lay in layouts:
        spec = parse_spec({"workload": WORKLOAD, "layout": {"dp": 2, "micro_batch_size": 2, **lay}})
        trainer = Trainer(spec, ctx, spec.shape(), progress=False)
        trainer.step(0)
        bucket = (trainer.engine.describe().get("ds_config") or {}).get("zero_optimization", {})
        out.append({"census": trainer.engine.memory_census(), "reduce_bucket": bucket.get("reduce_bucket_size", 0)})
        del trainer
    return out


measured = shared_launch("deepspeed", 2, _census_of_each, LAYOUTS, timeout_s=400)


@pytest.mark.parametrize(
    "index", range(len(LAYOUTS)), ids=[f"{lay['engine']}-z{lay.get('zero_stage', 0)}" for lay in LAYOUTS]
)
def test_prediction_equals_census_term_by_term(measured, index):
    lay, got = LAYOUTS[index], measured[index]
    P = param_count(resolve_shape(WORKLOAD["model"]))
    predicted = model_states(
        P, lay["engine"], lay.get("zero_stage", 0), "bf16", 2, reduce_bucket_elements=float(got["reduce_bucket"] or 0)
    )
    census = got["census"]
    for category in ("parameters", "buffers", "gradients", "master_parameters", "optimizer_states"):
        want, have = predicted.get(category, {}), census.get(category, {})
        assert set(want) == set(have), (category, want, have)
        for dtype, nbytes in want.items():  # 3%: Adam's step counters, alignment padding
            assert abs(have[dtype] - nbytes) <= 0.03 * nbytes, (category, dtype, have[dtype], nbytes)
