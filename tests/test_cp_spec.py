"""layout.cp and layout.cp_impl: the degree, its checks against the sequence and the heads, its labels,
and the engines that refuse it in one line naming the field (quick: no processes)."""

import pytest

from harness.errors import SpecError
from harness.spec import layout_label, parse_spec


def _spec(layout, **workload):
    return {
        "workload": {"model": "tiny", "seq_len": 32, "global_batch_size": 4, "device": "cpu", **workload},
        "layout": layout,
    }


CASES = [
    (_spec({"engine": "own", "cp": 3}, seq_len=32), "layout.cp", "not divisible by 2 x cp = 6"),
    (_spec({"engine": "own", "cp": 0}), "layout.cp", "must be positive"),
    (_spec({"engine": "own", "cp": 2, "cp_impl": "p2p"}), "layout.cp_impl", "is not one of"),
    (
        _spec({"engine": "own", "cp": 2, "tp": 2, "cp_impl": "ulysses"}, model_overrides={"kv_heads": 2}),
        "layout.cp_impl",
        "ulysses needs KV heads (2) divisible by cp x tp = 2 x 2",
    ),
    (
        _spec(
            {"engine": "own", "cp": 2, "tp": 4, "sequence_parallel": True}, seq_len=36, model_overrides={"kv_heads": 4}
        ),
        "layout.sequence_parallel",
        "seq_len 36 / cp=2 is not divisible by tp=4",
    ),
    (_spec({"engine": "single", "cp": 2}), "layout.cp", "engine single is one process"),
    (_spec({"engine": "megatron", "cp": 2, "attention": "naive"}), "layout.cp", "Transformer Engine"),
]


@pytest.mark.parametrize("raw,field,reason", CASES, ids=[c[1] + ":" + c[2][:24] for c in CASES])
def test_a_cp_layout_that_cannot_run_names_the_field(raw, field, reason):
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert e.value.field == field and reason in e.value.reason


def test_labels_name_cp_and_its_implementation_only_when_it_is_used():
    assert layout_label({"engine": "own", "cp": 2, "dp": 2, "cp_impl": "ulysses"}, short=True) == "own cp2 dp2 ulysses"
    assert layout_label({"engine": "own", "tp": 2}, short=True) == "own tp2"
    assert layout_label({"engine": "own", "cp": 2}).startswith("own tp1 cp2 ring pp1 dp1")
    assert "cp" not in layout_label({"engine": "own", "tp": 2, "cp_impl": "allgather"})
