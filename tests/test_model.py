"""The plain model against transformers' LlamaForCausalLM, and every kernel/checkpointing mode
against the naive/torch/none reference (losses and gradients)."""

import json

import pytest
import torch

from harness.errors import SpecError
from harness.frameworks.deepspeed.hf_llama import to_hf_name  # the harness's own name mapping
from harness.model.kernels import check_kernels
from harness.model.llama import build_model, lm_loss, reference_state_dict
from harness.model.presets import PRESETS, param_count, resolve_shape, shape_to_config


def test_logits_match_transformers():
    from transformers import LlamaForCausalLM

    shape = PRESETS["tiny"]
    ours = build_model(shape, seed=7, attention="naive")
    hf = LlamaForCausalLM(shape_to_config(shape)).eval()
    sd = {to_hf_name(k): v for k, v in reference_state_dict(shape, 7).items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    tokens = torch.randint(0, shape.vocab, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
        mine = ours(tokens)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=2e-5)


def test_local_config_json_is_a_model(tmp_path):
    cfg = shape_to_config(PRESETS["tiny-4l"]).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert resolve_shape(str(path)) == PRESETS["tiny-4l"]


def test_presets_have_published_shapes():
    # LLaMA 13B/30B/65B parameter counts as published, and the paper-* variants.
    assert abs(param_count(PRESETS["llama-13b"]) / 1e9 - 13.0) < 0.1
    assert abs(param_count(PRESETS["llama-30b"]) / 1e9 - 32.5) < 0.1
    assert abs(param_count(PRESETS["llama-65b"]) / 1e9 - 65.2) < 0.1
    assert abs(param_count(PRESETS["llama2-70b"]) / 1e9 - 69.0) < 0.1
    assert abs(param_count(PRESETS["llama3-8b"]) / 1e9 - 8.03) < 0.01
    assert PRESETS["paper-30b"].ffn == 17888 and PRESETS["paper-13b"].vocab == 128000


def loss_and_grads(attention="naive", rmsnorm="torch", checkpointing="none", dtype=torch.float32):
    shape = PRESETS["tiny"]
    model = build_model(shape, 3, attention, rmsnorm, checkpointing)
    tokens = torch.randint(0, shape.vocab, (2, 65), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = lm_loss(logits, tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads()


@pytest.mark.parametrize(
    "attention,rmsnorm,checkpointing",
    [
        ("sdpa", "torch", "none"),
        ("sdpa_flash", "torch", "none"),
        ("naive", "torch", "full"),
        ("naive", "torch", "selective"),
        ("sdpa", "torch", "selective"),
        ("sdpa_flash", "torch", "full"),
        pytest.param("naive", "fused", "none", marks=pytest.mark.slow),  # torch.compile runs a C++ compiler
    ],
)
def test_kernels_and_checkpointing_match_reference(reference, attention, rmsnorm, checkpointing):
    ref_loss, ref_grads = reference
    loss, grads = loss_and_grads(attention, rmsnorm, checkpointing)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_autocast_stays_close_to_fp32(reference):
    loss, _ = loss_and_grads("sdpa", dtype=torch.bfloat16)
    assert loss == pytest.approx(reference[0], rel=2e-2)


def test_kernel_probe_refuses_what_cannot_run():
    cpu = torch.device("cpu")
    check_kernels("sdpa_flash", "torch", cpu, torch.float32, 16)
    for kernel in ("sdpa_cudnn", "sdpa_efficient", "flash2"):
        with pytest.raises(SpecError) as e:
            check_kernels(kernel, "torch", cpu, torch.float32, 16)
        assert e.value.field == "layout.attention"
