"""One precision policy for every run: a DeepSpeed config that would run another one is refused
before launch, naming every key at once (issue 30, item 1). Configs only: nothing launched."""

import json
import os

import pytest
import yaml

from harness.errors import SpecError, SpecErrors
from harness.frameworks.deepspeed.config import build_config
from harness.frameworks.deepspeed.policy_keys import SECTIONS, SWITCHES
from harness.spec import parse_spec
from harness.testing.workloads import tiny_workload

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ds_configs")
WORKLOAD = tiny_workload(steps=5, warmup_steps=0)


def spec(ds_config: str, stage: int, precision: str = "bf16"):
    return parse_spec(
        {
            "workload": {**WORKLOAD, "precision": precision},
            "layout": {
                "engine": "deepspeed",
                "dp": 2,
                "micro_batch_size": 2,
                "zero_stage": stage,
                "ds_config": ds_config,
            },
        }
    )


def refused_keys(ds_config: str, stage: int, precision: str = "bf16") -> list[str]:
    with pytest.raises(SpecError) as e:
        build_config(spec(ds_config, stage, precision), device_type="cpu")
    errors = getattr(e.value, "errors", [e.value])
    return [err.field.split(": ", 1)[1] for err in errors]


def copy_of(tmp_path, name: str, edit=None) -> str:
    with open(os.path.join(DATA, name)) as f:
        cfg = json.load(f)
    if edit:
        edit(cfg)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_bf16_master_weights_and_states_refused(tmp_path, precision):
    """DeepSpeedExamples' bf16_master_weight/configs/bf16_full.json, with torch_autocast removed as
    the first refusal asked: main accepted it under bf16 and reported fp32 masters and Adam states."""
    path = copy_of(tmp_path, "bf16_full.json", lambda c: c.pop("torch_autocast"))
    keys = refused_keys(path, 3, precision)
    assert "bf16.bf16_master_weights_and_grads" in keys and "bf16.bf16_optimizer_states" in keys
    assert ("bf16.enabled" in keys) == (precision == "fp32")


def test_every_mismatch_listed_at_once():
    """The whole bf16_full.json: three policy keys in one refusal, not one per try."""
    assert refused_keys(os.path.join(DATA, "bf16_full.json"), 3) == [
        "bf16.bf16_master_weights_and_grads",
        "bf16.bf16_optimizer_states",
        "torch_autocast.enabled",
    ]


def test_zenflow_refused_with_the_other_mismatches():
    """ZenFlow's zf_config.json: main let it launch, and DeepSpeed handed optimizer.params (the
    harness's torch_adam included) to torch's AdamW: TypeError in the run. Now every mismatch,
    the zenflow section among them, before launch."""
    keys = refused_keys(os.path.join(DATA, "zf_config.json"), 2)
    assert keys == [
        "gradient_accumulation_steps",
        "zero_optimization.zenflow",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.weight_decay",
    ]


def test_torch_adam_written_only_where_it_is_true():
    """The key the harness injects reaches no optimizer that does not take it: false is DeepSpeed's
    own default (FusedAdam, or CPUAdam with offload) and is left out."""
    cfg, _, _ = build_config(spec("ds_configs/zero3_offload.json", 3), device_type="cpu")
    assert "torch_adam" not in cfg["optimizer"]["params"]
    cfg, _, _ = build_config(spec("", 2), device_type="cpu")
    assert cfg["optimizer"]["params"]["torch_adam"] is True


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, key = dotted.split(".")
    for part in parents:
        cfg = cfg.setdefault(part, {})
    cfg[key] = value


POLICY_KEYS = (
    [(k, True) for k in SWITCHES]
    + [(k, {}) for k in SECTIONS if k != "amp"]
    + [
        ("amp", {"enabled": True}),
        ("data_types.buffer_dtype", "bf16"),
        ("optimizer.params.fp32_optimizer_states", False),
    ]
)


@pytest.mark.parametrize("key,value", POLICY_KEYS, ids=[k for k, _ in POLICY_KEYS])
def test_each_policy_key_refused(tmp_path, key, value):
    """Each of DeepSpeed's keys that change a dtype, alone in an otherwise accepted bf16 config."""
    path = copy_of(
        tmp_path,
        "bf16_full.json",
        lambda c: [c.pop("torch_autocast"), c.update(bf16={"enabled": True}), _set(c, key, value)],
    )
    assert refused_keys(path, 3) == [key]


def test_auto_on_a_switch_means_false(tmp_path):
    path = copy_of(
        tmp_path,
        "bf16_full.json",
        lambda c: [
            c.pop("torch_autocast"),
            c["bf16"].update(bf16_master_weights_and_grads="auto", bf16_optimizer_states=False),
        ],
    )
    cfg, _, filled = build_config(spec(path, 3), device_type="cpu")
    assert cfg["bf16"]["bf16_master_weights_and_grads"] is False
    assert "bf16.bf16_master_weights_and_grads" in filled


def test_compare_cli_prints_one_line_per_mismatch(no_launch, capsys):
    """`harness compare` with ZenFlow's config: exit 2 and one `error:` line per key, before any launch."""
    from harness.cli import main

    cmp = {
        "workload": {**WORKLOAD, "precision": "bf16"},
        "nproc": 2,
        "runs": [{"engine": "deepspeed", "zero_stage": 2, "ds_config": os.path.join(DATA, "zf_config.json")}],
    }
    (no_launch / "cmp.yaml").write_text(yaml.safe_dump(cmp))
    assert main(["compare", "cmp.yaml", "--store", "r.sqlite", "--out", "out"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5 and all(ln.startswith("error: ") and "zf_config.json: " in ln for ln in lines), lines
    assert "zero_optimization.zenflow: not supported" in lines[1]
    assert not os.path.exists(no_launch / "r.sqlite")


def test_spec_errors_str_is_one_line_each():
    e = SpecErrors([SpecError("a.json: x", "first"), SpecError("a.json: y", "second")])
    assert str(e).splitlines() == ["a.json: x: first", "a.json: y: second"]
    assert (e.field, e.reason) == ("a.json: x", "first")
