"""One precision policy for every run: a DeepSpeed config that would run another one is refused
before launch, naming every key at once. Configs only: nothing launched."""

import json
import os

import pytest
import yaml

from harness.errors import SpecError, SpecErrors
from harness.frameworks.deepspeed.config import build_config
from harness.frameworks.deepspeed.policy_keys import SECTIONS, SWITCHES
from harness.spec import parse_spec
from harness.testing.launches import shared_launch
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


# ------------------------------------------------------------------ the report: from each run's census


P = 2**20  # a stand-in parameter count


def census(params, grads, states, masters=None, buffers=None) -> dict:
    """A memory census in bytes per parameter (xP) by dtype."""
    out = {
        "parameters": {d: int(x * P) for d, x in params.items()},
        "gradients": {d: int(x * P) for d, x in grads.items()},
        "optimizer_states": {d: int(x * P) for d, x in states.items()},
        "master_parameters": {d: int(x * P) for d, x in (masters or {}).items()},
    }
    if buffers:
        out["buffers"] = buffers
    return out


MIXED = census({"bf16": 2}, {"fp32": 4}, {"fp32": 8}, masters={"fp32": 4})  # the own engine, the reference
FSDP_BF16 = census({"fp32": 2, "bf16": 2}, {"fp32": 2}, {"fp32": 4})  # shards + gathered copies, no masters
BF16_FULL = census({"bf16": 1}, {"bf16": 1}, {"bf16": 4, "fp32": 1e-4}, masters={"bf16": 1})  # bf16_full.json


def compared(tmp_path, runs: dict, precision: str = "bf16"):
    """run_comparison with a stand-in launcher: runs = {label: census, or an error text (a failed run)}."""
    from harness.compare.orchestrate import run_comparison
    from harness.compare.spec import parse_compare_spec
    from harness.report.compare import write_report

    layouts = {"own dp2": {"engine": "own"}, "FSDP2 reshard": {"engine": "fsdp"}}
    layouts.update({f"deepspeed ZeRO-{z}": {"engine": "deepspeed", "zero_stage": z} for z in (1, 2, 3)})
    raw = {
        "name": "t",
        "nproc": 2,
        "parity_steps": 2,
        "workload": {**WORKLOAD, "precision": precision},
        "runs": [{**layouts[label], "label": label} for label in runs if label in layouts],
    }

    def launch(spec, *, point_key, **kw):
        given = runs[point_key]
        failed = isinstance(given, str)
        rec = {"run_id": point_key, "status": "failed" if failed else "ok", "spec": spec, "fingerprint": {}}
        rec["error"] = given if failed else None
        rec["metrics"] = {} if failed else {"losses": [5.5, 5.4, 5.3], "memory_census": given, "parameter_count": P}
        return rec

    summary = run_comparison(
        parse_compare_spec(raw), store_path=str(tmp_path / "r.sqlite"), progress=False, launch_fn=launch
    )
    return summary, open(write_report(summary, str(tmp_path))["markdown"]).read()


REF = "reference (single device)"


def test_a_run_that_held_bf16_masters_fails_the_verdict_and_the_sentence_says_so(tmp_path):
    """What main reported for bf16_full.json: 'Precision policy, the same for every run: ... fp32
    master parameters and fp32 Adam states' and PASS. The census said otherwise."""
    summary, md = compared(tmp_path, {REF: MIXED, "own dp2": MIXED, "deepspeed ZeRO-3": BF16_FULL})
    assert summary["verdict"] == "FAIL" and summary["parity"]["verdict"] == "pass"
    assert "Precision policy, the same for every run" not in md
    assert (
        "Precision policy: the runs DIFFER. The workload's: bf16 parameters for compute, fp32 master parameters "
        "and fp32 Adam states" in md
    )
    assert (
        "these runs held another: deepspeed ZeRO-3: master weights bf16, gradients held at the optimizer step bf16, "
        "optimizer states bf16." in md
    )
    assert "**Verdict: FAIL** - runs differ in precision policy (deepspeed ZeRO-3); loss parity holds" in md


def test_the_same_policy_is_read_from_every_census(tmp_path):
    """FSDP2 keeps no masters of its own (its fp32 shards are) and, not resharded, bf16 gathered
    copies of the same size beside them: still the same policy, and the sentence says why."""
    summary, md = compared(tmp_path, {REF: MIXED, "own dp2": MIXED, "FSDP2 reshard": FSDP_BF16})
    assert summary["verdict"] == "pass"
    assert (
        "Precision policy, the same for every run (read from each run's memory census at its first optimizer "
        "step): bf16 parameters for compute, fp32 master weights, fp32 gradients held at the optimizer step and fp32 "
        "optimizer states; FSDP2 reshard held no separate bf16 copy at that step (their parameters are the fp32 "
        "masters). Configured, which no census shows: gradients accumulated over micro-batches and reduced "
        "across data-parallel ranks in fp32." in md
    )


def test_a_failed_run_says_run_failed_with_its_cause_never_a_parity_figure(tmp_path):
    """main: 'parity FAIL, max pairwise relative loss difference 0.00e+00' for ZenFlow's TypeError."""
    from harness.report.policy import verdict_text

    cause = "TypeError: AdamW.__init__() got an unexpected keyword argument 'torch_adam'"
    fp32 = census({"fp32": 4}, {"fp32": 4}, {"fp32": 8})
    summary, md = compared(
        tmp_path, {REF: fp32, "deepspeed ZeRO-2": f"{cause}\nTraceback (most recent call last):"}, "fp32"
    )
    assert summary["parity"]["max_pairwise_rel_diff"] is None  # one finished run: no difference to give
    lead = f"deepspeed ZeRO-2: run failed: {cause}; loss parity not checked: 1 run(s) finished, two are needed"
    assert verdict_text(summary).startswith(f"FAIL - {lead}")
    assert f"**Verdict: FAIL** - {lead}; fingerprints identical." in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| deepspeed ZeRO-2 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert f"run failed: {cause}" in cells and "pass" not in cells and "0" not in cells
    assert "0.00e+00" not in md and "within tolerance" not in md
    assert "Precision policy, the same for every run with a census (none for deepspeed ZeRO-2) (read" in md


def test_buckets_are_a_census_category_of_their_own():
    """DeepSpeed ZeRO-3's 5e7-element reduce bucket: main counted it as gradients, 1600.83P for a
    0.12M-parameter model. Now a column of its own, in elements (its size is the config's)."""
    from harness.planner.memory_engines import model_states
    from harness.report.compare_steps import census_rows, census_text

    bucket = {"fp32": 4 * 50_000_000}
    run = {
        "label": "deepspeed ZeRO-3",
        "metrics": {
            "parameter_count": P,
            "memory_census": census({"fp32": 2}, {"fp32": 4}, {"fp32": 4}, masters={"fp32": 2}, buffers=bucket),
        },
    }
    plain = {"label": "own dp2", "metrics": {"parameter_count": P, "memory_census": MIXED}}
    header, rows = census_rows({"runs": [run, plain]})
    assert header[5] == "communication buffers"
    assert rows[0][2] == "fp32 4.00 MiB (4.00P)" and rows[0][5] == "fp32 190.73 MiB (50,000,000 elements)"
    assert rows[1][5] == "-"
    assert len(census_text({"runs": [run]})) == 2 and len(census_text({"runs": [plain]})) == 1
    states = model_states(1e5, "deepspeed", 3, "fp32", 2, reduce_bucket_elements=5e7)
    assert states["buffers"] == {"fp32": 2e8} and states["gradients"] == {"fp32": 4e5}


# ------------------------------------------------------------------ real DeepSpeed runs (2 gloo processes)


def _censuses(ctx, runs: list[dict]) -> list[dict]:
    """Each run's rank-0 census after one step. The second run's config would be refused: its refusal
    is switched off here, in these processes only, to see what such a run holds (what main ran)."""
    from harness.frameworks.deepspeed import config
    from harness.run import Trainer

    switches, config.policy_switches = config.policy_switches, lambda f, cfg: None
    out = []
    try:
        for raw in runs:
            spec = parse_spec(raw)
            trainer = Trainer(spec, ctx, spec.shape(), progress=False)
            trainer.step(0)
            out.append(trainer.engine.memory_census())
            del trainer
    finally:  # the processes may run other tests' jobs next (harness.testing.launches)
        config.policy_switches = switches
    return out


def _census_runs(folder: str) -> tuple:
    """zero3.json as shipped, and with bf16_full.json's keys (written to folder)."""
    from harness.frameworks.deepspeed.config import DS_CONFIG_DIR

    with open(os.path.join(DS_CONFIG_DIR, "zero3.json")) as f:
        cfg = json.load(f)
    cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    full = os.path.join(folder, "bf16_full_keys.json")
    with open(full, "w") as f:
        f.write(json.dumps(cfg))
    return ([spec("", 3).to_dict(), spec(full, 3).to_dict()],)


real_censuses = shared_launch("deepspeed", 2, _censuses, prepare=_census_runs, timeout_s=400)


@pytest.mark.slow
def test_real_censuses_tell_the_policy_and_the_bucket(real_censuses):
    """DeepSpeed ZeRO-3 under bf16 on zero3.json as shipped (a 5e7-element reduce bucket), and on
    bf16_full.json's keys: the first reads as the workload's policy with its bucket a buffer, the
    second as bf16 master weights and optimizer states."""
    from harness.compare.policy import census_policy

    plain, bf16_full = real_censuses
    assert plain["buffers"] == {"fp32": 4 * 50_000_000}  # zero3.json's reduce_bucket_size, communication_data_type
    assert sum(plain["gradients"].values()) < 4 * 50_000_000 / 100  # the bucket is not a gradient any more
    runs = [
        {"label": label, "status": "ok", "metrics": {"memory_census": c}}
        for label, c in (("a", plain), ("b", bf16_full))
    ]
    policy = census_policy(runs, "bf16")
    assert policy["facts"]["masters"] == {"fp32": ["a"], "bf16": ["b"]}
    assert dict(policy["differ"]["b"])["optimizer_states"] == "bf16" and "a" not in policy["differ"]
