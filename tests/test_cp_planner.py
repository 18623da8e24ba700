"""The planner knows context parallelism: its candidates, its memory terms (activations on seq / cp
tokens, the K/V in flight, allgather's gathered K/V), its time terms (the exchange and what the ring
hides of it), the plan's line when only cp fits, and the exports that carry it (quick: no processes)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from harness.cli import main as cli
from harness.model.presets import PRESETS
from harness.planner import context
from harness.planner.candidates import layouts
from harness.planner.hardware import load_profile
from harness.planner.layout import PlannerLayout, Workload
from harness.planner.memory_engines import engine_layer_bytes, engine_stage_memory, loss_bytes
from harness.planner.output import spec_layout
from harness.planner.timing import step_time

L8 = PRESETS["llama3-8b"]
MHA = dataclasses.replace(L8, kv_heads=L8.heads)  # no grouped-query attention: K/V as wide as q
# the literature constants: the figures below are worked out with them, not with a fit that moves
H100 = dataclasses.replace(load_profile("h100-sxm"), calibrated={})


def run(capsys, *argv):
    code = cli(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def own(**kw) -> PlannerLayout:
    return PlannerLayout(
        **{"tp": 1, "pp": 1, "dp": 1, "micro_batch_size": 1, "attention": "flash2", "engine": "own", **kw}
    )


# ---------------------------------------------------------------- acceptance


def test_llama3_8b_at_128k_tokens_on_64_h100_puts_a_cp_layout_on_top(capsys):
    # the command a user with this question runs (the llama3-8b preset is Llama 3.1 8B's config: 131,072 positions)
    code, out, _ = run(
        capsys,
        *(
            "plan --model llama3-8b --seq-len 131072 --global-batch-size 64 --gpus 64 --hardware h100-sxm --format "
            "json --top 1"
        ).split(),
    )
    assert code == 0
    top = json.loads(out)[0]
    assert top["fits"] and top["cp"] > 1 and top["cp_impl"] in context.engine_impls("own")


def test_where_nothing_fits_without_cp_the_plan_proposes_cp_and_says_so(capsys):
    argv = [
        *(
            "plan --model llama3-8b --seq-len 262144 --global-batch-size 8 --gpus 16 --hardware h100-sxm "
            "--max-positions 262144 --attention flash2 --rmsnorm fused --top 3"
        ).split()
    ]
    code, out, _ = run(capsys, *argv, "--format", "json")
    rows = json.loads(out)
    assert code == 0 and rows[0]["fits"] and rows[0]["cp"] > 1
    code, out, _ = run(capsys, *argv, "--cp", "1", "--format", "json")
    assert code == 0 and not any(r["fits"] for r in json.loads(out))  # no layout fits without it
    code, out, _ = run(capsys, *argv)
    line = next(ln for ln in out.splitlines() if ln.startswith("no layout fits without context parallelism"))
    assert f"the plan proposes cp {rows[0]['cp']} {rows[0]['cp_impl']}" in line


# ---------------------------------------------------------------- candidates


def _cands(engine, seq=65536, gpus=16, **kw):
    return list(
        layouts(
            L8,
            Workload(seq, 32),
            gpus,
            8,
            attention=["flash2"],
            rmsnorm=["fused"],
            micro_batch_sizes=[1],
            checkpointing=["none"],
            sequence_parallel=[False, True],
            zero_stage=1,
            engine=engine,
            **kw,
        )
    )


def test_candidates_range_over_cp_powers_of_two_and_the_engines_implementations():
    got = _cands("own")
    assert {c.cp for c in got} == {1, 2, 4, 8, 16}  # 65536 / 16 = 4096 tokens per rank at least
    for c in got:
        assert c.gpus == 16 and 65536 % (2 * c.cp) == 0
        assert c.cp == 1 or (c.cp_impl != "ulysses" or L8.kv_heads % (c.cp * c.tp) == 0)
    impls = {(c.tp, c.cp): {x.cp_impl for x in got if (x.tp, x.cp) == (c.tp, c.cp)} for c in got if c.cp > 1}
    assert impls[(1, 8)] == {"ring", "allgather", "ulysses"}
    assert impls[(2, 8)] == {"ring", "allgather"}  # 8 KV heads do not divide by cp x tp = 16
    assert {c.cp_impl for c in _cands("deepspeed") if c.cp > 1} == {"ulysses"}
    assert {c.cp for c in _cands("megatron", pp_values=[1, 2])} == {1}  # needs Transformer Engine
    assert {c.cp for c in _cands("own", seq=2048)} == {1}  # below 4096 tokens a rank: only when asked
    assert {c.cp for c in _cands("own", seq=2048, cp_values=[1, 2])} == {1, 2}
    assert {c.cp_impl for c in _cands("own", cp_values=[4], cp_impls=["allgather"])} == {"allgather"}


def test_megatron_plan_says_why_it_has_no_cp(capsys):
    """Unasked, the plan says why it offers no cp > 1; asked for cp 2 (or an implementation the engine does
    not run), it refuses in one line before planning (the reason from the engine's facts)."""
    args = (
        *"plan --model llama3-8b --seq-len 8192 --global-batch-size 16 --gpus 8 --hardware h100-sxm --top 1".split(),
    )
    code, out, _ = run(capsys, *args, "--engine", "megatron")
    assert code == 0 and "no cp > 1 candidates under engine megatron: " in out and "Transformer Engine" in out
    code, out, err = run(capsys, *args, "--engine", "megatron", "--cp", "1,2")
    assert (code, out) == (2, "") and err.startswith("error: --cp: ") and "Transformer Engine" in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, *args, "--engine", "fsdp", "--cp-impl", "ulysses")
    assert (code, out, err) == (2, "", "error: --cp-impl: engine fsdp runs ring, allgather, not ulysses\n")


# ---------------------------------------------------------------- memory terms


def test_activations_are_those_of_seq_over_cp_tokens_and_the_ring_keeps_only_its_own_kv():
    s = 65536
    for cp in (2, 4, 8):
        ring = engine_layer_bytes(MHA, own(cp=cp, dp=1), Workload(s, 8))
        plain = engine_layer_bytes(MHA, own(), Workload(s // cp, 8))
        # q, k, v, out, lse of the rank's tokens; the blocks' merged output kept in fp32 beside wo's input
        assert ring["layer"] == plain["layer"] + s // cp * MHA.hidden * 4
        # the loss and logits of the rank's tokens
        assert loss_bytes(L8, own(cp=cp), Workload(s, 8)) == loss_bytes(L8, own(), Workload(s // cp, 8))


def test_the_own_engines_blocks_keep_no_s_squared_tensor_and_ulysses_keeps_its_all_to_all_output():
    s, cp, B = 65536, 4, 2
    d = L8.hidden // L8.heads
    kv, hq = L8.kv_heads * d, L8.hidden
    n = s // cp
    own_ring = context.cp_attention_bytes(L8, own(cp=cp, attention="naive"), n, 1, B)
    own_gather = context.cp_attention_bytes(L8, own(cp=cp, attention="naive", cp_impl="allgather"), n, 1, B)
    flash_ring = context.cp_attention_bytes(L8, own(cp=cp), n, 1, B)
    # q, the local K/V, the fp32 output and LSE, wo's input, whatever the blocks run
    assert own_ring["kept"] == own_gather["kept"] == flash_ring["kept"]
    rot = 4 * n * 128 * B  # cos and sin for q and k, in bf16
    assert own_ring["kept"] == n * hq * B + 2 * n * kv * B + n * hq * 4 + 4 * L8.heads * n + n * hq * B + rot
    # backward: allgather holds every rank's K/V and their fp32 gradient where the ring has two blocks
    assert own_gather["backward"] - own_ring["backward"] == cp * 2 * n * kv * (B + 4) - 2 * 2 * n * kv * B
    scores = 4 * L8.heads * n * n  # one fp32 s x s score tensor of the rank's own block
    assert own_ring["backward"] > 4 * scores > flash_ring["backward"]  # the flash blocks keep none
    ulysses = engine_layer_bytes(L8, own(cp=cp, cp_impl="ulysses"), Workload(s, 8))["layer"]
    plain = engine_layer_bytes(L8, own(), Workload(s // cp, 8))["layer"]
    assert ulysses - plain == n * (hq + 2 * kv) * B  # the head shard's q/k/v (flash keeps q, a view of it)


def test_model_states_are_sharded_over_dp_x_cp():
    wl = Workload(65536, 8)
    a = engine_stage_memory(L8, own(dp=2, cp=2), wl, 0)
    b = engine_stage_memory(L8, own(dp=4), wl, 0)
    assert a["optimizer"] == b["optimizer"] and a["weights"] == b["weights"]


# ---------------------------------------------------------------- time terms


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
def test_exchange_bytes_are_the_counted_communications(impl, ckpt):
    from harness.engine.comm_model import SIZE, cp_attention_calls

    s, cp, tp, B = 65536, 4, 2, 2
    lay = own(cp=cp, tp=tp, cp_impl=impl, activation_checkpointing=ckpt, micro_batch_size=2)
    mine = context.exchange_bytes(L8, lay, s, B)["calls"]
    counted: dict = {}
    for op, count, elems, dtype in cp_attention_calls(
        impl,
        cp,
        2,
        L8.heads // tp,
        L8.kv_heads // tp,
        s // cp,
        L8.hidden // L8.heads,
        "bf16",
        2 if ckpt == "full" else 1,
    ):
        if op != "recv":
            counted[op] = counted.get(op, 0) + count * elems * SIZE[dtype]
    assert mine == counted


def test_the_ring_hides_its_transfers_behind_long_blocks_allgather_hides_nothing():
    wl = Workload(131072, 8)
    _, ring = step_time(L8, own(cp=8), wl, H100)  # 16384 tokens a block, NVLink: compute-bound
    assert ring["cp_exchange_s"] > 0 and ring["cp_exposed_s"] == 0
    _, short = step_time(L8, own(cp=8, tp=8), Workload(16384, 8), H100)  # 2048-token blocks across nodes
    assert 0 < short["cp_exposed_s"] < short["cp_exchange_s"]
    _, gathered = step_time(L8, own(cp=8, cp_impl="allgather"), wl, H100)
    assert gathered["cp_exposed_s"] == gathered["cp_exchange_s"] > 0
    assert gathered["cp_sent_gb"] < ring["cp_sent_gb"]  # the ring's sends: every hop, K/V and fp32 dK/dV


def test_a_cp_group_across_nodes_prices_the_internode_link():
    wl = Workload(131072, 8)
    inside = step_time(L8, own(cp=8, cp_impl="allgather"), wl, H100)[1]["cp_exchange_s"]
    across = step_time(L8, own(cp=8, tp=2, cp_impl="allgather"), wl, H100)[1]["cp_exchange_s"]
    assert across > inside  # half the bytes per rank (tp 2), on InfiniBand instead of NVLink


# ---------------------------------------------------------------- what the plan hands on


def test_a_sweep_point_carries_cp():
    lay = spec_layout(own(cp=4, cp_impl="ulysses", dp=2))
    assert lay["cp"] == 4 and lay["cp_impl"] == "ulysses" and lay["engine"] == "own"


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses"])
def test_from_spec_reads_cp(impl):
    lay = PlannerLayout.from_spec({"engine": "own", "cp": 2, "cp_impl": impl, "dp": 2})
    assert (lay.cp, lay.cp_impl, lay.gpus) == (2, impl, 4)


def test_an_emitted_sweep_carries_cp_and_the_harness_takes_it(tmp_path, capsys, monkeypatch):
    import yaml

    out = tmp_path / "cp.yaml"
    code, _, _ = run(
        capsys,
        *(
            "plan --model tiny --seq-len 64 --global-batch-size 8 --gpus 4 --hardware cpu --rmsnorm torch "
            "--attention naive --cp 2 --top 4 --emit-sweep"
        ).split(),
        str(out),
    )
    assert code == 0
    points = yaml.safe_load(out.read_text())["points"]
    assert points and all(p["cp"] == 2 and p["cp_impl"] in ("ring", "allgather", "ulysses") for p in points)
    monkeypatch.chdir(tmp_path)
    code, text, _ = run(capsys, "sweep", str(out), "--dry-run")
    assert code == 0 and f"{len(points)} points, 0 dropped" in text
