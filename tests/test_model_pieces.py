"""The plain model's pieces serve every engine: a pipeline stage is the plain model holding some
of its modules, DeepSpeed's pipeline layers are such stages, the own engine's blocks reuse the
plain modules and math, the kernels are chosen at build time, and one function ties embeddings.
In process, no launcher."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.model.kernels import Kernels
from harness.model.llama import (
    Llama,
    ReferenceWeights,
    build_model,
    load_reference,
    rotary_tables,
    shape_rotary,
    tie_embeddings,
    token_positions,
)
from harness.model.presets import PRESETS

SHAPE = PRESETS["tiny-4l"]
SEED = 3


def _tokens(shape=SHAPE, batch=2, seq=16):
    return torch.randint(0, shape.vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


def _stage(layers: range, first: bool, last: bool, **kw) -> Llama:
    with torch.device("meta"):
        stage = Llama(SHAPE, layers=layers, first=first, last=last, **kw)
    return load_reference(stage, ReferenceWeights(SHAPE, SEED), "cpu")


def test_stages_are_the_plain_model_cut_apart():
    """Two stages hold disjoint pieces under the plain names, together all of them, and run in
    turn give the whole model's logits bit for bit."""
    model = build_model(SHAPE, SEED)
    first, last = _stage(range(0, 3), True, False), _stage(range(3, 4), False, True)
    assert first.norm is None and first.output is None and last.tok_embeddings is None
    names = [n for part in (first, last) for n, _ in part.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), model(tokens))


def test_a_stage_under_sequence_parallelism_takes_the_whole_sequence_positions():
    """seq_len: a stage whose input holds part of the sequence (seq / tp under sequence
    parallelism) makes its rotary tables for the whole of it; without seq_len, for the input's."""

    class Asked(Exception):
        pass

    def rotary(seq_len, device):
        raise Asked(seq_len)

    for seq_len, want in ((32, 32), (None, 8)):
        stage = _stage(range(1, 2), False, False, seq_len=seq_len)
        stage.rotary = rotary
        with pytest.raises(Asked) as asked:
            stage(torch.zeros(1, 8, SHAPE.hidden))
        assert asked.value.args == (want,)


def test_rotary_positions_come_from_token_positions():
    cos, sin = shape_rotary(SHAPE, 8, "cpu")
    want = rotary_tables(token_positions(8, "cpu"), SHAPE.hidden // SHAPE.heads, SHAPE.rope_theta, SHAPE.rope_scaling)
    assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])
    assert torch.equal(token_positions(4, "cpu"), torch.tensor([0.0, 1.0, 2.0, 3.0]))


def _counting(kernels: Kernels, counts: dict) -> Kernels:
    def rmsnorm(x, weight, eps):
        counts["rmsnorm"] = counts.get("rmsnorm", 0) + 1
        return kernels.rmsnorm(x, weight, eps)

    def attention(q, k, v):
        counts["attention"] = counts.get("attention", 0) + 1
        return kernels.attention(q, k, v)

    return Kernels(attention, rmsnorm)


def test_kernels_given_at_build_time_are_the_ones_the_model_runs():
    counts: dict = {}
    plain = build_model(SHAPE, SEED, attention="naive")
    model = build_model(SHAPE, SEED, kernels=_counting(Kernels.of("naive", "torch"), counts))
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))
    assert counts == {"rmsnorm": 2 * SHAPE.layers + 1, "attention": SHAPE.layers}


def test_kernels_of_the_layout():
    from harness.model.kernels import attention_fn, rmsnorm_fn, rmsnorm_torch

    k = Kernels.of("naive", "torch")
    assert k.attention is attention_fn("naive") and k.rmsnorm is rmsnorm_torch is rmsnorm_fn("torch")
    assert dataclasses.replace(k, rmsnorm=rmsnorm_fn("fused")).attention is k.attention


def _own_engine(kernels=None, model="tiny-4l"):
    from harness.engine.engine import Engine3D
    from harness.model.training import BuildOptions
    from harness.runtime import RunContext
    from harness.testing.equivalence import make_spec

    spec = make_spec({"workload": {"model": model}, "layout": {"micro_batch_size": 2, "attention": "naive"}})
    return spec, Engine3D(
        spec, spec.shape(), RunContext(0, 1, 0, torch.device("cpu"), None), options=BuildOptions(kernels=kernels)
    )


def test_the_own_engine_runs_the_kernels_it_is_built_with():
    from harness.testing.equivalence import batches

    counts: dict = {}
    spec, eng = _own_engine(_counting(Kernels.of("naive", "torch"), counts))
    _, plain = _own_engine()
    batch = batches(spec, spec.shape(), 1)[0]
    assert eng.train_step(batch) == plain.train_step(batch)
    micro = spec.workload.global_batch_size // spec.layout.micro_batch_size
    assert counts == {"rmsnorm": micro * (2 * SHAPE.layers + 1), "attention": micro * SHAPE.layers}


def test_the_own_engine_blocks_are_the_plain_modules():
    from harness.model.feed_forward import FeedForward
    from harness.model.llama import RMSNorm

    _, eng = _own_engine()
    block = eng.chunks[0].layers["0"]
    assert type(block.feed_forward) is FeedForward and type(block.attention_norm) is RMSNorm
    assert type(eng.chunks[0].norm) is RMSNorm


def test_one_function_ties_the_head_to_the_embedding():
    tied = dataclasses.replace(SHAPE, tie_embeddings=True)
    with torch.device("meta"):
        model = Llama(tied)
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" not in dict(model.named_parameters())
    with pytest.raises(ValueError, match="one pipeline stage"), torch.device("meta"):
        Llama(tied, layers=range(2), last=False)
    emb, head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False)
    tie_embeddings(SHAPE, emb, head)
    assert head.weight is not emb.weight  # untied shape: nothing to do
    tie_embeddings(tied, emb, head)
    assert head.weight is emb.weight


def test_deepspeed_pipeline_layers_are_plain_stages():
    """PipelineModule's layers (embedding, one block each, norm + head) chained give the plain
    model's logits; their names, less PipelineModule's index, are the plain names."""
    from harness.frameworks.deepspeed.pipe import PipeBlock, PipeLayer, plain_name

    args = (SHAPE, SEED, "sdpa", "torch", "none")
    layers = [PipeLayer(*args, layers=range(0), last=False)]
    layers += [PipeBlock(*args, layers=range(i, i + 1), first=False, last=False) for i in range(SHAPE.layers)]
    layers.append(PipeLayer(*args, layers=range(0), first=False))
    names = [plain_name(f"{i}.{n}") for i, layer in enumerate(layers) for n, _ in layer.named_parameters()]
    model = build_model(SHAPE, SEED)
    assert names == [n for n, _ in model.named_parameters()]
    tokens = h = _tokens()
    with torch.no_grad():
        for layer in layers:
            h = layer(h)
        assert torch.equal(h, model(tokens))


def test_full_checkpointing_goes_through_the_given_function():
    """Llama.set_checkpointing takes the engine's checkpoint function (DeepSpeed's) for `full`."""
    calls = []

    def checkpoint_fn(block, h, cos, sin):
        calls.append(block)
        return block(h, cos, sin)

    model = build_model(SHAPE, SEED)
    model.set_checkpointing("full", checkpoint_fn)
    model(_tokens()).sum().backward()
    assert calls == list(model.layers.values())
    with torch.no_grad():
        model(_tokens())
    assert len(calls) == SHAPE.layers
