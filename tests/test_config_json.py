"""A Hugging Face config.json read faithfully: every field of the LLaMA family
that changes the math is honoured (rms_norm_eps, tie_word_embeddings, Llama 3.1 rope scaling,
attention_bias, GQA, rope_theta, head_dim, also apart from hidden/heads) or refused in one line; a model may be
named by a config.json, a folder holding one, or a hub id in the local Hugging Face cache.

The plain model's logits are compared with transformers' LlamaForCausalLM on the same weights,
for configs shaped like real checkpoints (their fields as published, their sizes scaled down)."""

from __future__ import annotations

import json

import pytest
import torch

from harness.errors import CapabilityError, SpecError
from harness.frameworks.deepspeed.hf_llama import to_hf_name
from harness.model.flops import flops_per_token
from harness.model.llama import Llama, build_model
from harness.model.presets import Shape, param_count, resolve_shape, shape_to_config
from harness.testing.equivalence import run_cases
from harness.testing.launches import shared_launch

SMALL = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 512,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# As published (meta-llama/*/config.json), sizes scaled down; every math-relevant field kept.
CONFIGS = {
    "llama2-7b": {
        **SMALL,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
    },
    # transformers writes rms_norm_eps 1e-6 by default (LLaMA 1 and many fine-tunes carry it)
    "llama-eps1e-6": {**SMALL, "model_type": "llama", "rms_norm_eps": 1e-06, "num_key_value_heads": 4},
    # no rms_norm_eps at all: transformers' default, 1e-6
    "llama-eps-default": {**SMALL, "model_type": "llama"},
    "llama3.1-8b": {
        **SMALL,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_SCALING,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": 32,
        "hidden_act": "silu",
    },
    "llama3.2-1b": {
        **SMALL,
        "model_type": "llama",
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "head_dim": 32,
        "rope_scaling": {**LLAMA3_SCALING, "factor": 32.0},
    },
    "attention-bias": {
        **SMALL,
        "model_type": "llama",
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "attention_bias": True,
    },
    # a head width apart from hidden_size / num_attention_heads (128 / 4 = 32)
    "llama-head-dim": {**SMALL, "model_type": "llama", "num_key_value_heads": 2, "head_dim": 48},
    # transformers >= 5 writes rope_theta and the scaling together as rope_parameters
    "llama3.1-rope-parameters": {
        **SMALL,
        "model_type": "llama",
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 131072,
        "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING},
    },
    # everything at once, the shape the engine equivalence test below trains
    "tied-bias-llama3": {
        **SMALL,
        "model_type": "llama",
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_SCALING,
        "tie_word_embeddings": True,
        "attention_bias": True,
    },
}


def write_config(folder, raw: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(raw))
    return str(path)


def perturbed_model(shape: Shape, seed: int = 3) -> Llama:
    """The plain model with every parameter perturbed (norm weights and biases too, which the
    reference initialisation leaves at one and zero), so each one shows in the logits."""
    model = build_model(shape, seed, attention="naive")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def hf_logits(raw: dict, model: Llama, tokens):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "eager"
    hf = LlamaForCausalLM(cfg).eval()
    state = {to_hf_name(k): v for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == bool(
        raw.get("tie_word_embeddings")
    )
    with torch.no_grad():
        return hf(tokens).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    raw = CONFIGS[name]
    shape = resolve_shape(write_config(tmp_path / name, raw))
    model = perturbed_model(shape)
    assert (model.output.weight is model.tok_embeddings.weight) == bool(raw.get("tie_word_embeddings"))
    tokens = torch.randint(0, shape.vocab, (2, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = model(tokens)
    theirs = hf_logits(raw, model, tokens)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name,field,value",
    [
        ("llama-eps1e-6", "norm_eps", 1e-5),  # the old forced epsilon
        ("llama3.1-8b", "rope_factor", 1.0),  # rope scaling ignored
        ("llama3.2-1b", "rope_factor", 1.0),
        ("llama3.1-rope-parameters", "rope_theta", 10000.0),
    ],
)
def test_each_field_shows_in_the_logits(tmp_path, name, field, value):
    """The comparison above is sharp: reading the field wrongly moves the logits far beyond 1e-5."""
    raw = CONFIGS[name]
    shape = resolve_shape(write_config(tmp_path, raw))
    model = perturbed_model(shape)
    tokens = torch.randint(0, shape.vocab, (2, 256), generator=torch.Generator().manual_seed(0))
    theirs = hf_logits(raw, model, tokens)
    wrong = Shape(**{**shape.__dict__, field: value})
    other = Llama(wrong)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (other(tokens) - theirs).abs().max() > 1e-3


def test_fields_are_read():
    shape = resolve_shape("tiny")
    assert (shape.norm_eps, shape.tie_embeddings, shape.attention_bias, shape.rope_scaling) == (
        1e-5,
        False,
        False,
        None,
    )


def test_shape_fields_from_config(tmp_path):
    s = resolve_shape(write_config(tmp_path / "a", CONFIGS["llama3.2-1b"]))
    assert s.tie_embeddings and not s.attention_bias and s.norm_eps == 1e-5 and s.kv_heads == 2
    assert s.rope_theta == 500000.0 and s.rope_scaling == (32.0, 1.0, 4.0, 8192)
    s = resolve_shape(write_config(tmp_path / "b", CONFIGS["llama-eps-default"]))
    assert s.norm_eps == 1e-6 and s.kv_heads == 4 and s.rope_scaling is None
    s = resolve_shape(write_config(tmp_path / "c", CONFIGS["attention-bias"]))
    assert s.attention_bias and s.norm_eps == 1e-6


def test_round_trip_through_transformers_config(tmp_path):
    """shape_to_config (model_impl hf) carries every field; its to_dict reads back to the same shape."""
    for name in ("llama3.2-1b", "tied-bias-llama3", "llama2-7b", "llama-head-dim"):
        shape = resolve_shape(write_config(tmp_path / name, CONFIGS[name]))
        cfg = shape_to_config(shape)
        assert cfg.rms_norm_eps == shape.norm_eps and cfg.attention_bias == shape.attention_bias
        assert cfg.tie_word_embeddings == shape.tie_embeddings
        again = resolve_shape(write_config(tmp_path / (name + "-hf"), shape_to_config(shape).to_dict()))
        assert again == shape, name


def test_model_overrides_take_the_new_fields():
    from harness.spec import parse_spec

    spec = parse_spec(
        {
            "workload": {
                "model": "tiny",
                "model_overrides": {"tie_embeddings": True, "attention_bias": True, "norm_eps": 1e-6, "rope_factor": 8},
            }
        }
    )
    shape = spec.shape()
    assert shape.tie_embeddings and shape.attention_bias and shape.norm_eps == 1e-6
    assert shape.rope_scaling == (8.0, 1.0, 4.0, 8192)
    for bad in ({"tie_embeddings": 1}, {"norm_eps": 0}, {"rope_high_freq_factor": 0.5}):
        with pytest.raises(SpecError):
            parse_spec({"workload": {"model": "tiny", "model_overrides": {"rope_factor": 8, **bad}}})


# ---------------------------------------------------------------- refusals


REFUSED = [
    ({"hidden_act": "gelu"}, "hidden_act gelu is not supported"),
    ({"hidden_act": "relu"}, "hidden_act relu is not supported"),
    ({"model_type": "gemma"}, "model_type gemma is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type linear is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type dynamic is not supported"),
    (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}},
        "rope_type yarn is not supported",
    ),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 lacks low_freq_factor, high_freq_factor"),
    ({"mlp_bias": True}, "mlp_bias true is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1 is not supported"),
    ({"head_dim": 0}, "head_dim must be a positive integer"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a positive number"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
]


@pytest.mark.parametrize("extra,reason", REFUSED, ids=[r for _, r in REFUSED])
def test_unsupported_fields_are_refused(tmp_path, extra, reason):
    path = write_config(tmp_path, {**CONFIGS["llama2-7b"], **extra})
    with pytest.raises(SpecError) as e:
        resolve_shape(path)
    assert e.value.field == "workload.model"
    assert reason in e.value.reason and "\n" not in str(e.value)


def run_cli(capsys, *argv) -> tuple[int, str]:
    from harness.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().err


def test_cli_refuses_gelu_in_one_line(tmp_path, capsys):
    path = write_config(tmp_path / "gelu", {**CONFIGS["llama2-7b"], "hidden_act": "gelu"})
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"workload: {{model: {path}, seq_len: 16, global_batch_size: 2, steps: 1}}\n")
    code, err = run_cli(capsys, "train", str(spec), "--no-progress")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: workload.model: hidden_act gelu is not supported"), err


# ---------------------------------------------------------------- where a model comes from


def test_a_folder_holding_config_json(tmp_path):
    folder = tmp_path / "Llama-3.2-1B"
    write_config(folder, CONFIGS["llama3.2-1b"])
    assert resolve_shape(str(folder)) == resolve_shape(str(folder / "config.json"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SpecError, match="holds no config.json") as e:
        resolve_shape(str(empty))
    assert e.value.field == "workload.model"


def fake_hub_cache(root, repo_id: str, raw: dict, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/config.json}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    write_config(repo / "snapshots" / commit, raw)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub_cache(tmp_path / "hf" / "hub", "meta-llama/Llama-3.2-1B", CONFIGS["llama3.2-1b"])
    shape = resolve_shape("meta-llama/Llama-3.2-1B")
    assert shape.tie_embeddings and shape.rope_scaling == (32.0, 1.0, 4.0, 8192)
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "other"))
    fake_hub_cache(tmp_path / "other", "meta-llama/Llama-2-7b-hf", CONFIGS["llama2-7b"])
    assert resolve_shape("meta-llama/Llama-2-7b-hf").norm_eps == 1e-5


def test_a_hub_id_missing_from_the_cache_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(SpecError) as e:
        resolve_shape("meta-llama/Llama-2-7b-hf")
    assert e.value.field == "workload.model" and "not in the local Hugging Face cache" in e.value.reason
    assert "\n" not in str(e.value)
    spec = tmp_path / "spec.yaml"
    spec.write_text("workload: {model: meta-llama/Llama-2-7b-hf}\n")
    code, err = run_cli(capsys, "train", str(spec), "--no-progress")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: workload.model: "), err


def test_presets_and_typos_still_say_so():
    with pytest.raises(SpecError, match="unknown preset 'tinyy'"):
        resolve_shape("tinyy")
    with pytest.raises(SpecError, match="does not exist"):
        resolve_shape("./nowhere/config.json")


# ---------------------------------------------------------------- counting


@pytest.mark.parametrize("name", ["llama2-7b", "llama3.2-1b", "tied-bias-llama3"])
def test_parameter_count_counts_a_tied_head_once(tmp_path, name):
    from harness.planner.memory import stage_params as planner_stage_params

    shape = resolve_shape(write_config(tmp_path, CONFIGS[name]))
    model = build_model(shape, 0)
    held = sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
    assert param_count(shape) == held
    assert planner_stage_params(shape, True, shape.layers, True, 1) == held
    untied = Shape(**{**shape.__dict__, "tie_embeddings": False})
    if shape.tie_embeddings:
        assert param_count(untied) - param_count(shape) == shape.vocab * shape.hidden
        f, g = flops_per_token(shape, 128), flops_per_token(untied, 128)
        assert g["palm"] - f["palm"] == 6 * shape.vocab * shape.hidden
        assert f["megatron"] == g["megatron"]  # the head's matmul runs either way


def test_own_engine_stage_params_name_the_plain_models_parameters(tmp_path):
    from harness.engine.model import rank_params
    from harness.engine.parallel import ParallelContext
    from harness.engine.partition import ChunkPlan
    from harness.parallel_dims import ParallelDims

    shape = resolve_shape(write_config(tmp_path, CONFIGS["tied-bias-llama3"]))
    names = [n for n, _ in build_model(shape, 0).named_parameters()]
    for tp in (1, 2):
        plan = ChunkPlan(0, 0, range(shape.layers), True, True)
        specs = rank_params(shape, [plan], ParallelContext.unconnected(ParallelDims(tp=tp)))
        assert [s.name for s in specs] == names
        by = {s.name: s for s in specs}
        assert by["layers.0.attention.wq.bias"].local == (128 // tp,)
        assert by["layers.0.attention.wo.bias"].shard_dim is None  # added once, after the reduction


# ---------------------------------------------------------------- engines: honoured or refused


def spec_with(model: str, **layout):
    from harness.spec import parse_spec

    return parse_spec(
        {"workload": {"model": model, "seq_len": 16, "global_batch_size": 8, "steps": 2}, "layout": layout}
    )


@pytest.mark.parametrize(
    "layout,refused",
    [
        ({"engine": "own", "pp": 2}, True),
        ({"engine": "own", "pp": 2, "pipeline_schedule": "interleaved", "virtual_stages": 1}, True),
        ({"engine": "own", "tp": 2, "dp": 2}, False),
        ({"engine": "own", "tp": 2, "sequence_parallel": True}, False),
        ({"engine": "deepspeed", "pp": 2, "zero_stage": 1}, True),
        ({"engine": "deepspeed", "dp": 2, "zero_stage": 1}, False),
        ({"engine": "fsdp", "tp": 2}, False),
        ({"engine": "deepspeed", "tp": 2, "zero_stage": 1}, False),
        ({"engine": "fsdp", "pp": 2}, True),
        ({"engine": "fsdp", "dp": 2}, False),
    ],
)
def test_tied_embeddings_refused_where_an_engine_would_untie_them(tmp_path, layout, refused):
    path = write_config(tmp_path, CONFIGS["tied-bias-llama3"])
    if refused:
        with pytest.raises(CapabilityError) as e:
            spec_with(path, **layout)
        assert e.value.field == "workload.model" and e.value.reason.startswith("tie_word_embeddings: ")
    else:
        spec_with(path, **layout)
    untied = write_config(tmp_path / "untied", {**CONFIGS["tied-bias-llama3"], "tie_word_embeddings": False})
    spec_with(untied, **layout)  # the rest of the architecture every engine builds


def test_the_planner_proposes_no_layout_an_engine_refuses_for_a_tied_model(tmp_path):
    """A tied model under own, deepspeed or fsdp gets no pp > 1 candidates (each adapter's ENGINE.model_limits
    refuses them); megatron (its embedding group) and the study's engine (paper) split them over stages."""
    from harness.planner.candidates import layouts
    from harness.planner.layout import Workload

    shape = resolve_shape(write_config(tmp_path, {**CONFIGS["llama3.2-1b"], "num_hidden_layers": 4}))
    wl = Workload(seq_len=16, global_batch_size=8)
    common = dict(
        attention=["sdpa"],
        rmsnorm=["torch"],
        micro_batch_sizes=[1],
        checkpointing=["none"],
        sequence_parallel=[False],
        zero_stage=1,
    )
    for engine in ("own", "deepspeed", "fsdp"):
        pps = {lay.pp for lay in layouts(shape, wl, 8, 8, engine=engine, **common)}
        assert pps == {1}, engine
    for engine in ("paper", "megatron"):
        assert max(lay.pp for lay in layouts(shape, wl, 8, 8, engine=engine, **common)) > 1, engine


# Qwen3's per-head q/k norms and free head width, with Qwen2's q/k/v biases (no o bias) on top
QWEN3_QKV_BIAS = (
    {**SMALL, "model_type": "qwen3", "num_key_value_heads": 2, "head_dim": 48, "rms_norm_eps": 1e-6},
    {"qkv_bias": True},
)


@pytest.mark.parametrize("which", ["tied-bias-llama3", "qwen3-qkv-bias"])
def test_own_engine_in_process_matches_the_reference(tmp_path, which):
    """World 1: the own engine's chunk (Weight/RMSNorm/ParallelBlock, tied head, o-bias after the
    region; q/k norms and q/k/v biases without o's) against the plain model."""
    from harness.engine.adapter import build
    from harness.runtime import RunContext
    from harness.testing.equivalence import BASE, batches, make_spec
    from harness.testing.reference import assert_matches_reference, reference_run

    raw, overrides = (CONFIGS[which], {}) if which in CONFIGS else QWEN3_QKV_BIAS
    path = write_config(tmp_path, raw)
    case = {"workload": {"model": path, "model_overrides": overrides}, "layout": {"micro_batch_size": 2}}
    spec = make_spec(case)
    shape = spec.shape()
    eng = build(spec, shape, RunContext(0, 1, 0, torch.device("cpu"), None))
    losses = [float(eng.train_step(b)) for b in batches(spec, shape, 3)]
    workload = {**BASE["workload"], "model": path, "model_overrides": overrides}
    ref_losses, ref_state = reference_run(workload, 3, micro_batch_size=2)
    assert_matches_reference({"losses": losses, "state": eng.full_state_dict()}, ref_losses, ref_state, "own w1")
    if which == "qwen3-qkv-bias":
        assert (
            shape.qk_norm and shape.qkv_bias and shape.head_dim == 48 and "layers.0.attention.wo.bias" not in ref_state
        )
        assert (ref_state["layers.0.attention.q_norm.weight"] - 1).abs().max() > 0
        assert ref_state["layers.0.attention.wk.bias"].abs().max() > 0
    else:
        assert "output.weight" not in ref_state and ref_state["layers.0.attention.wo.bias"].abs().max() > 0


QK_NORM_STEPS = 3


def _qk_norm_cases(folder: str) -> tuple:
    """The own engine's cases on the Qwen3 + q/k/v-bias config (written to folder), and the steps."""
    from pathlib import Path

    raw, overrides = QWEN3_QKV_BIAS
    workload = {"model": write_config(Path(folder), raw), "model_overrides": overrides}
    layouts = [{"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"dp": 2, "zero_stage": 1}]
    return [{"workload": workload, "layout": {"micro_batch_size": 2, **lay}} for lay in layouts], QK_NORM_STEPS


# in the session's 2-rank launch (harness.testing.launches), as harness.testing.equivalence's cases run
qk_norm_runs = shared_launch("torch", 2, run_cases, prepare=_qk_norm_cases, threads=1, every_rank=True)


@pytest.mark.slow
def test_own_engine_sums_the_qk_norms_gradients_over_tp(qk_norm_runs):
    """In the session's 2-rank launch: the Qwen3 + q/k/v-bias config under the own engine at tp2 (the q/k
    norms' gradients, partial over each rank's heads, summed over TP), tp2 with SP and dp2, each
    against the single-device reference (losses and final weights, q/k norms included), and each
    rank's counted communication equal to the closed form's (comm_model: the q/k norms' all-reduce)."""
    from harness.engine.comm_model import rank_comm
    from harness.testing import equivalence as E
    from harness.testing.reference import assert_matches_reference

    per_rank = qk_norm_runs
    cases = [result["case"] for result in per_rank[0]]  # the config's path: the launch's folder
    assert len(cases) == 3 and cases[0]["workload"]["model"].endswith("config.json")
    ref = E.reference(cases[0], QK_NORM_STEPS)
    for index, case in enumerate(cases):
        assert_matches_reference(per_rank[0][index], *ref, f"qwen3 {case['layout']}")
        spec = E.make_spec(case)
        w = spec.workload
        for r in range(2):
            expected = rank_comm(spec.shape(), spec.layout, w.seq_len, w.global_batch_size, r)
            assert per_rank[r][index]["comm"] == expected, f"rank {r} {case['layout']}"
    assert per_rank[0][0]["comm"]["tp"]["all_reduce"]["count"] > 0


@pytest.mark.slow
def test_engines_reproduce_the_reference_on_two_processes(tmp_path):
    """One gloo launch of 2 ranks: the tied + bias + llama3 config under the own engine (tp2, tp2
    with SP, dp2 ZeRO-1), FSDP2 (tp2: the DTensor plan re-tied; dp2), DeepSpeed (AutoTP tp2,
    ZeRO-3 dp2), and untied under pipelines (own, DeepSpeed and torch pp2), each against the
    single-device reference (losses and final weights, biases and the tied head included)."""
    from harness.testing.reference import assert_matches_reference, reference_run
    from harness.testing.spawn import run_losses, spawn

    steps = 3
    paths = {
        "tied": write_config(tmp_path / "tied", CONFIGS["tied-bias-llama3"]),
        "untied": write_config(tmp_path / "untied", {**CONFIGS["tied-bias-llama3"], "tie_word_embeddings": False}),
    }

    def workload(which):
        return {
            "model": paths[which],
            "seq_len": 16,
            "global_batch_size": 8,
            "steps": steps,
            "warmup_steps": 0,
            "device": "cpu",
            "precision": "fp32",
            "optimizer": {"lr": 1.0, "eps": 1.0},
        }

    layouts = [
        ("tied", {"engine": "own", "tp": 2}),
        ("tied", {"engine": "own", "tp": 2, "sequence_parallel": True}),
        ("tied", {"engine": "own", "dp": 2, "zero_stage": 1}),
        ("untied", {"engine": "own", "pp": 2}),
        ("tied", {"engine": "fsdp", "tp": 2}),
        ("tied", {"engine": "fsdp", "dp": 2}),
        ("untied", {"engine": "fsdp", "pp": 2}),
        # DeepSpeed keeps process-wide state (its tensor-parallel groups, the pipeline's grid): a
        # data-parallel engine built after either fails in its own initialize, so these go last, in this order
        ("tied", {"engine": "deepspeed", "dp": 2, "zero_stage": 3}),
        ("tied", {"engine": "deepspeed", "dp": 2, "zero_stage": 2, "model_impl": "hf"}),  # LlamaForCausalLM
        ("tied", {"engine": "deepspeed", "tp": 2, "zero_stage": 1}),
        ("untied", {"engine": "deepspeed", "pp": 2, "zero_stage": 1}),
    ]
    runs = [{"workload": workload(which), "layout": {"micro_batch_size": 2, **lay}} for which, lay in layouts]
    results = spawn(run_losses, 2, runs, steps, True, timeout_s=400)
    refs = {which: reference_run(workload(which), steps, micro_batch_size=2) for which in paths}
    assert "output.weight" not in refs["tied"][1] and "output.weight" in refs["untied"][1]
    for (which, lay), result in zip(layouts, results, strict=True):
        assert_matches_reference(result, *refs[which], f"{which} {lay}")
