"""Engine deepspeed's AutoEP path (layout.ds_moe autoep, harness/frameworks/deepspeed/autoep*.py), quick tier:
the expert_parallel section the config writes, read by DeepSpeed 0.19.8's own DeepSpeedConfig and AutoEP's
validate_autoep_config; what the facts refuse, in one line each; AutoEP's detection and replacement of the
harness's MoE block (its own AutoEP.ep_parser and replace_moe_layers, ep_size 1 in this process) giving the
reference layer's output, input and weight gradients (fp32: the same products summed in another order,
relative 1e-6) and its router statistics exactly; the names mapped back to the reference's. The 2-rank
parity (ep2, ZeRO-1, against the single-device reference) is in tests/test_deepspeed_moe.py's launch.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from harness.errors import SpecError, SpecErrors  # noqa: E402
from harness.frameworks.deepspeed.config import build_config  # noqa: E402
from harness.spec import parse_spec  # noqa: E402

MOE = {"model": "tiny-moe", "seq_len": 16, "steps": 3, "device": "cpu"}
AUTOEP = {"engine": "deepspeed", "zero_stage": 1, "dp": 2, "ep": 2, "ds_moe": "autoep"}


def _spec(workload=None, **layout):
    return parse_spec({"workload": {**MOE, **(workload or {})}, "layout": {**AUTOEP, **layout}})


def _config_file(tmp_path, edit) -> str:
    import json

    from harness.frameworks.deepspeed.config import load_raw, resolve_path

    cfg = load_raw(resolve_path("", 1))
    edit(cfg)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("overrides", [{}, {"experts_per_token": 3, "norm_topk": False}])
def test_section_is_read_by_deepspeeds_own_parser(monkeypatch, overrides):
    import deepspeed.runtime.config as dsc
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config

    spec = _spec({"model_overrides": overrides})
    shape = spec.shape()
    cfg, _, filled = build_config(spec, shape, dp=2, device_type="cpu")
    assert "expert_parallel.autoep_size" in filled
    monkeypatch.setattr(dsc.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dsc.dist, "get_world_size", lambda *a, **k: 2)
    ep = dsc.DeepSpeedConfig(cfg).expert_parallel_config
    assert (ep.enabled, ep.autoep_size, ep.top_k, ep.route_norm) == (True, 2, shape.experts_per_token, shape.norm_topk)
    assert (ep.score_func, ep.score_apply, ep.route_scale, ep.use_grouped_mm) == ("softmax", "post", 1.0, True)
    assert ep.preset_model is None and ep.moe_layer_pattern == r"layers\.\d+\.feed_forward"
    validate_autoep_config(ep, 2, 1, 1, 1, zero_stage=1)  # AutoEP's own check: raises if wrong
    assert "expert_parallel" not in build_config(_spec(ds_moe="layer"), dp=2, device_type="cpu")[0]


REFUSED = [  # (workload, layout, field, words)
    ({"precision": "bf16"}, {}, "workload.precision", "runs precision fp32"),
    ({}, {"tp": 2}, "workload.model", "set tp=pp=cp=1"),
    ({"model": "tiny"}, {"ep": 1}, "workload.model", "this model has none"),
    ({}, {"engine": "own"}, "layout.ds_moe", "for engine deepspeed"),
    ({}, {"compile": "blocks"}, "workload.model", "compile none"),
]


@pytest.mark.parametrize("workload,layout,field,words", REFUSED, ids=["bf16", "tp2", "dense", "own", "compile"])
def test_refused_before_launch(workload, layout, field, words):
    with pytest.raises(SpecError) as e:
        _spec(workload, **layout)
    assert e.value.field == field and words in e.value.reason, (e.value.field, e.value.reason)


def test_any_top_k_either_normalisation_runs_under_autoep_not_the_moe_layer():
    three = {"model_overrides": {"experts_per_token": 3, "norm_topk": False}}
    _spec(three)
    with pytest.raises(SpecError, match="experts_per_token 2 with norm_topk true"):
        _spec(three, ds_moe="layer")


@pytest.mark.parametrize(
    "edit,key",
    [
        (lambda c: c.update(expert_parallel={"top_k": 1}), "expert_parallel.top_k"),
        (lambda c: c.update(expert_parallel={"score_apply": "pre"}), "expert_parallel.score_apply"),
        (lambda c: c.update(expert_parallel={"preset_model": "mixtral"}), "expert_parallel.preset_model"),
        (lambda c: c.update(expert_parallel={"num_expert_groups": 2}), "expert_parallel.num_expert_groups"),
    ],
    ids=["top_k", "score_apply", "preset", "groups"],
)
def test_a_section_contradicting_the_model_is_refused(tmp_path, edit, key):
    spec = _spec(ds_config=_config_file(tmp_path, edit))
    with pytest.raises((SpecError, SpecErrors)) as e:
        build_config(spec, dp=2, device_type="cpu")
    assert key in str(e.value), str(e.value)


def test_autoep_enabled_in_a_file_needs_ds_moe_autoep(tmp_path):
    path = _config_file(tmp_path, lambda c: c.update(expert_parallel={"enabled": True, "autoep_size": 2}))
    with pytest.raises((SpecError, SpecErrors), match="set ds_moe: autoep"):
        build_config(_spec(ds_config=path, ds_moe="layer"), dp=2, device_type="cpu")


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("overrides", [{}, {"experts_per_token": 1, "norm_topk": False}, {"experts_per_token": 3}])
def test_autoeps_layer_is_the_reference_layer(overrides, grouped_mm):
    """AutoEP detects the harness's block by the section's pattern and replaces it; its layer (ep_size 1: every
    expert here) computes the reference's function with the reference's router statistics and losses, its
    experts through torch._grouped_mm (DeepSpeed's default) or its sequential loop."""
    import torch
    import torch.nn as nn
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    from harness.frameworks.deepspeed.autoep import hand_over, plain_entries, take_stats, tap
    from harness.model.moe import MoEFeedForward, set_router_losses

    spec = _spec({"model_overrides": overrides}, dp=1, ep=1)
    shape = spec.shape()
    cfg, _, _ = build_config(spec, shape, dp=1, device_type="cpu")
    cfg["expert_parallel"]["use_grouped_mm"] = grouped_mm
    torch.manual_seed(0)
    ref, mine = MoEFeedForward(shape), MoEFeedForward(shape)
    mine.load_state_dict(ref.state_dict())
    set_router_losses(ref, 0.1, 0.01, 2)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Module()})
    model.layers["0"].feed_forward = mine
    hand_over(model)
    auto = AutoEP(model, parse_autoep_config(cfg["expert_parallel"]))
    specs = auto.ep_parser()
    assert [(s.moe_module_name, s.top_k, s.route_norm, s.expert_storage) for s in specs] == [
        ("layers.0.feed_forward", shape.experts_per_token, shape.norm_topk, "module_list")
    ]
    auto.replace_moe_layers(specs, ep_size=1, ep_rank=0)
    taps = tap(model, 0.1, 0.01, 2)
    layer = model.layers["0"].feed_forward
    x = torch.randn(4, 16, shape.hidden)
    outs = []
    for m in (ref, layer):
        xi = x.clone().requires_grad_()
        y = m(xi)
        (y * y).sum().backward()
        outs.append((y.detach(), xi.grad))
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6 * a.abs().max().item())
    grads = {}
    for name, p in layer.named_parameters():
        grads.update(plain_entries(f"layers.0.feed_forward.{name}", p.grad, shape, 1, 0))
    for name, p in ref.named_parameters():
        g = grads.pop(f"layers.0.feed_forward.{name}")
        assert torch.allclose(g, p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max().item()), name
    assert not grads
    assert take_stats(taps) == {"layers.0.feed_forward": ref.stats.take()}


def test_names_are_the_references():
    """The router's gate is the reference's router; row j of an expert tensor on expert-parallel rank r is
    expert r * E / ep + j."""
    import torch

    from harness.frameworks.deepspeed.autoep import is_expert, plain_entries
    from harness.model.presets import resolve_shape

    shape = resolve_shape("tiny-moe", {})
    prefix = "layers.1.feed_forward."
    assert plain_entries(prefix + "router.gate.weight", torch.zeros(1), shape, 2, 1)[0][0] == prefix + "router.weight"
    w2 = torch.arange(4.0).view(4, 1, 1).expand(4, 2, 3)
    entries = plain_entries(prefix + "experts.w2", w2, shape, 2, 1)
    assert [n for n, _ in entries] == [prefix + f"experts.{e}.w2.weight" for e in range(4, 8)]
    assert [float(t[0, 0]) for _, t in entries] == [0.0, 1.0, 2.0, 3.0]
    assert is_expert(prefix + "experts.w1") and not is_expert(prefix + "router.gate.weight")
    assert plain_entries("norm.weight", w2, shape, 2, 1)[0][0] == "norm.weight"


def test_label_names_autoep():
    from harness.spec import layout_label

    assert layout_label(_spec().layout, short=True).startswith("deepspeed ZeRO-1 AutoEP")
    assert "AutoEP" not in layout_label(_spec(ds_moe="layer").layout, short=True)
