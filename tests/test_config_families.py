"""config.json of the LLaMA family beyond llama (mistral, qwen2, qwen3, mixtral, qwen3_moe) read
faithfully: the plain model's logits against transformers' own class of each model_type on the same
weights, its parameter count against transformers', every new field honoured or refused in one line.

Tolerance 1e-5 (fp32), as tests/test_config_json.py's llama comparison: the same operations in a
different order (fused vs per-expert matmuls, [b,s,h,d] vs [b,h,s,d] layouts) differ by a few fp32
roundings per layer, ~1e-6 relative on logits of size ~1; a misread field (a missing bias, a norm,
a head width, a renormalisation) moves them by > 1e-3 (test_each_new_field_shows_in_the_logits)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.errors import SpecError
from harness.model.config_json import config_fields
from harness.model.llama import Llama, build_model
from harness.model.presets import PRESETS, Shape, param_count, resolve_shape
from harness.testing.hf_families import hf_config, hf_model

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}

# As published (mistralai/Mistral-7B-v0.1, Qwen/Qwen2-7B, Qwen/Qwen3-8B, mistralai/Mixtral-8x7B-v0.1,
# Qwen/Qwen3-30B-A3B config.json), sizes scaled down; every math-relevant field kept.
CONFIGS = {
    "mistral": {
        **SMALL,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    },
    "mistral-nemo-head-dim": {**SMALL, "model_type": "mistral", "head_dim": 32, "sliding_window": None},
    "qwen2": {
        **SMALL,
        "model_type": "qwen2",
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    "qwen2-tied": {**SMALL, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {
        **SMALL,
        "model_type": "qwen3",
        "head_dim": 32,  # apart from hidden / heads = 16, as Qwen3's 128
        "attention_bias": False,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
    },
    "qwen3-head-dim-default": {**SMALL, "model_type": "qwen3", "attention_bias": True},  # head_dim 128
    "mixtral": {
        **SMALL,
        "model_type": "mixtral",
        "max_position_embeddings": 32768,
        "num_experts_per_tok": 2,
        "num_local_experts": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        **SMALL,
        "model_type": "qwen3_moe",
        "head_dim": 32,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    },
    "qwen3_moe-defaults": {**SMALL, "model_type": "qwen3_moe", "num_experts": 16, "moe_intermediate_size": 32},
}


def write_config(folder, raw: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def perturbed_model(shape: Shape, seed: int = 3) -> Llama:
    """The plain model with every parameter perturbed (norms, q/k norms and biases too), so each shows."""
    model = build_model(shape, seed, attention="naive")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def logits_of(shape: Shape, model, tokens):
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_count_match_transformers(tmp_path, name):
    raw = CONFIGS[name]
    shape = resolve_shape(write_config(tmp_path, raw))
    model = perturbed_model(shape)
    hf = hf_model(raw, model.state_dict())
    assert param_count(shape) == hf.num_parameters() == sum(p.numel() for p in model.parameters())
    if not shape.moe:  # the planner's count of a whole stage (its MoE terms are not this test's)
        from harness.planner.memory import stage_params

        assert stage_params(shape, True, shape.layers, True, 1) == param_count(shape)
    tokens = torch.randint(0, shape.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    torch.testing.assert_close(logits_of(shape, model, tokens), theirs, rtol=1e-5, atol=1e-5)


def test_fields_read():
    def shape(name, **extra):
        return Shape(
            **__import__("harness.model.config_json", fromlist=["x"]).config_fields({**CONFIGS[name], **extra})
        )

    s = shape("mistral")
    assert s.sliding_window == 4096 and not s.qkv_bias and s.norm_eps == 1e-5
    assert shape("mistral-nemo-head-dim").head_dim == 32 and shape("mistral-nemo-head-dim").kv_channels == 32
    s = shape("qwen2")
    assert s.qkv_bias and not s.attention_bias and s.sliding_window == 0 and s.rope_theta == 1e6
    s = shape("qwen3-head-dim-default")
    assert s.qk_norm and s.head_dim == 128 and s.attention_bias and s.max_positions == 32768
    s = shape("mixtral")
    assert (s.experts, s.experts_per_token, s.moe_ffn, s.norm_topk, s.ffn) == (4, 2, 96, True, 96)
    s = shape("qwen3_moe-defaults")
    assert (s.experts, s.experts_per_token, s.moe_ffn, s.norm_topk, s.head_dim) == (16, 8, 32, False, 16)
    assert shape("qwen2", use_sliding_window=True, max_window_layers=1, sliding_window=64).sliding_window == 64
    assert shape("qwen2", use_sliding_window=True).sliding_window == 0  # max_window_layers 28 >= 2 layers


def config_dict_to_shape(raw: dict, where: str = "config.json", field: str = "workload.model") -> Shape:
    """A Hugging Face config.json (as a dict) as a Shape (harness/model/config_json.py reads it)."""
    return Shape(**config_fields(raw, where, field))


def config_to_shape(cfg) -> Shape:
    """A transformers config object as a Shape (through its dict, with the same checks)."""
    return config_dict_to_shape(cfg.to_dict(), where=type(cfg).__name__)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_transformers_config_objects_read_the_same(name):
    """transformers' config object of each file (its to_dict: every default filled in) is the same Shape."""
    assert config_to_shape(hf_config(CONFIGS[name])) == config_dict_to_shape(CONFIGS[name])


@pytest.mark.parametrize(
    "name,field,value", [("qwen2", "qkv_bias", False), ("qwen3", "qk_norm", False), ("qwen3_moe", "norm_topk", False)]
)
def test_each_new_field_shows_in_the_logits(tmp_path, name, field, value):
    """The comparison above is sharp: reading the field wrongly moves the logits far beyond 1e-5."""
    raw = CONFIGS[name]
    shape = resolve_shape(write_config(tmp_path, raw))
    model = perturbed_model(shape)
    tokens = torch.randint(0, shape.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf_model(raw, model.state_dict())(tokens).logits
    wrong = Shape(**{**shape.__dict__, field: value})
    other = build_model(wrong, 3, attention="naive")
    other.load_state_dict({k: v for k, v in model.state_dict().items() if k in other.state_dict()}, strict=False)
    with torch.no_grad():
        assert (other(tokens) - theirs).abs().max() > 1e-3


def test_presets_count_as_transformers_does():
    """The MoE presets' parameter counts are transformers' for their published config.json fields."""
    fields = {
        "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                              rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6),
        "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1e6,
                             max_position_embeddings=32768, rms_norm_eps=1e-5),
    }  # fmt: skip
    from transformers import AutoModelForCausalLM

    for preset, raw in fields.items():
        assert PRESETS[preset].qk_norm == (raw["model_type"] == "qwen3_moe")
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(hf_config(raw))
        assert param_count(PRESETS[preset]) == hf.num_parameters(), preset


# ---------------------------------------------------------------- refusals


REFUSED = [
    ("mixtral", {"router_jitter_noise": 0.01}, "router_jitter_noise 0.01 is not supported"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
    ("mixtral", {"num_experts": 6}, "num_local_experts and num_experts differ"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers [0] is not supported"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types names sliding_attention"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("qwen3", {"model_type": "gemma"}, "model_type gemma is not supported"),
]


@pytest.mark.parametrize("name,extra,reason", REFUSED, ids=[r for _, _, r in REFUSED])
def test_unsupported_fields_are_refused(tmp_path, name, extra, reason):
    with pytest.raises(SpecError) as e:
        resolve_shape(write_config(tmp_path, {**CONFIGS[name], **extra}))
    assert e.value.field == "workload.model" and reason in e.value.reason and "\n" not in str(e.value)


def spec_of(model: str, seq_len: int = 16, **layout):
    from harness.spec import parse_spec

    return parse_spec(
        {"workload": {"model": model, "seq_len": seq_len, "global_batch_size": 4, "steps": 1}, "layout": layout}
    )


def test_a_sliding_window_shorter_than_the_sequence_is_refused(tmp_path):
    """A window >= seq_len is causal attention (run); a shorter one names workload.seq_len."""
    path = write_config(tmp_path, {**CONFIGS["mistral"], "sliding_window": 16})
    assert spec_of(path, 16).shape().sliding_window == 16
    with pytest.raises(SpecError) as e:
        spec_of(path, 32)
    assert e.value.field == "workload.seq_len" and "sliding_window 16" in e.value.reason
    qwen = write_config(tmp_path / "q", {**CONFIGS["qwen2"], "use_sliding_window": True, "max_window_layers": 1})
    with pytest.raises(SpecError, match="sliding_window 131072"):
        spec_of(qwen, 131073 + 7)


def test_cli_refuses_a_short_sliding_window_in_one_line(tmp_path, capsys):
    from harness.cli import main

    path = write_config(tmp_path / "mistral", CONFIGS["mistral"])  # Mistral 7B v0.1's window, 4096
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"workload: {{model: {path}, seq_len: 8192, global_batch_size: 2, steps: 1}}\n")
    code = main(["train", str(spec), "--no-progress"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: workload.seq_len: 8192 is longer than the model's sliding_window 4096")


@pytest.mark.parametrize(
    "name,layout,what",
    [
        ("qwen3", {"engine": "deepspeed", "tp": 2, "zero_stage": 1}, "qk_norm"),
        ("qwen3", {"engine": "deepspeed", "zero_stage": 1, "model_impl": "hf"}, "qk_norm"),
        ("qwen2", {"engine": "deepspeed", "zero_stage": 1, "model_impl": "hf"}, "qkv_bias"),
    ],
)
def test_engines_refuse_what_they_do_not_build(tmp_path, name, layout, what):
    from harness.errors import CapabilityError

    raw = {**CONFIGS[name], "tie_word_embeddings": False}
    with pytest.raises(CapabilityError) as e:
        spec_of(write_config(tmp_path, raw), **layout)
    assert e.value.field == "workload.model" and e.value.reason.startswith(f"{what}: ")


@pytest.mark.parametrize(
    "layout",
    [
        {"engine": "own", "tp": 2},
        {"engine": "fsdp", "tp": 1, "dp": 2},
        {"engine": "deepspeed", "dp": 2, "zero_stage": 1},
        {"engine": "megatron", "attention": "naive", "tp": 2},
    ],
)
def test_engines_take_what_they_build(tmp_path, layout):
    for name in ("qwen2", "qwen3"):
        spec_of(write_config(tmp_path / name, {**CONFIGS[name], "tie_word_embeddings": False}), **layout)


@pytest.mark.slow
def test_harness_train_takes_a_mixtral_and_a_qwen3_moe_config_json(tmp_path, cli):
    """`harness train` (engine single, 2 steps) on each MoE config.json: the run is ok and its record's
    parameter count is transformers' own model's."""
    from transformers import AutoModelForCausalLM

    for name in ("mixtral", "qwen3_moe"):
        folder = tmp_path / name
        path = write_config(folder, CONFIGS[name])
        spec = folder / "spec.yaml"
        spec.write_text(
            f"store: {folder / 'results.sqlite'}\n"
            f"workload: {{model: {path}, seq_len: 16, global_batch_size: 2, steps: 2, warmup_steps: 0}}\n"
            "layout: {engine: single}\n"
        )
        r = cli("train", str(spec), "--no-progress", cwd=folder)
        assert r.returncode == 0, r.stderr
        rec = json.loads(cli("results", "export", "--format", "jsonl", cwd=folder).stdout.splitlines()[-1])
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(hf_config(CONFIGS[name]))
        assert rec["status"] == "ok" and rec["metrics"]["parameter_count"] == hf.num_parameters(), name


@pytest.mark.slow
def test_fsdp_and_deepspeed_reproduce_the_reference_with_qk_norms_and_qkv_biases(tmp_path):
    """One gloo launch of 2 ranks: Qwen3 (q/k norms, head_dim apart) with Qwen2's q/k/v biases under
    FSDP2 (tp2: the q/k norms SequenceParallel over the heads, their partial gradients reduced;
    tp2 with SP; dp2) and DeepSpeed (ZeRO-3 dp2), and Qwen2 (q/k/v biases, none on o) under DeepSpeed's
    AutoTP tp2, each against the single-device reference: losses and final weights within 1e-5 (fp32:
    the same math in another order)."""
    from harness.testing.reference import assert_matches_reference, reference_run
    from harness.testing.spawn import run_losses, spawn

    steps = 3
    workload = {
        "model": write_config(tmp_path, {**CONFIGS["qwen3"], "head_dim": 32}),
        "model_overrides": {"qkv_bias": True},
        "seq_len": 16,
        "global_batch_size": 8,
        "steps": steps,
        "warmup_steps": 0,
        "device": "cpu",
        "precision": "fp32",
        "optimizer": {"lr": 1.0, "eps": 1.0},
    }
    layouts = [
        {"engine": "fsdp", "tp": 2},
        {"engine": "fsdp", "tp": 2, "sequence_parallel": True},
        {"engine": "fsdp", "dp": 2},
        # DeepSpeed keeps process-wide state: last (as tests/test_config_json.py's launch)
        {"engine": "deepspeed", "dp": 2, "zero_stage": 3},
    ]
    qwen2 = {**workload, "model": write_config(tmp_path / "qwen2", CONFIGS["qwen2"]), "model_overrides": {}}
    runs = [{"workload": workload, "layout": {"micro_batch_size": 2, **lay}} for lay in layouts]
    runs.append({"workload": qwen2, "layout": {"micro_batch_size": 2, "engine": "deepspeed", "tp": 2, "zero_stage": 1}})
    results = spawn(run_losses, 2, runs, steps, True, timeout_s=300)
    ref = reference_run(workload, steps, micro_batch_size=2)
    assert "layers.0.attention.q_norm.weight" in ref[1] and "layers.0.attention.wq.bias" in ref[1]
    for lay, result in zip(layouts, results[:-1], strict=True):
        assert_matches_reference(result, *ref, f"qwen3 {lay}")
    ref2 = reference_run(qwen2, steps, micro_batch_size=2)
    assert "layers.0.attention.wv.bias" in ref2[1] and "layers.0.attention.wo.bias" not in ref2[1]
    assert_matches_reference(results[-1], *ref2, "qwen2 deepspeed AutoTP tp2")
