"""torchtitan 0.3.0's own checks on every torchtitan export of the round-trip layouts (test_interop_roundtrip.CASES)
and of the export test's (test_plan_export.TORCHTITAN: tp with sequence parallel, pp interleaved, cp 4, compiled):
its ConfigManager loads the recipe as a launch does (`--module harness_plan --config harness_plan`, which runs
Trainer.Config's checks), ParallelDims builds its device meshes over a fake process group of the layout's world
size, the model config takes the run (update_from_config), the pipeline gets its stage count and split
(_get_pipeline_metadata: virtual stages divisible by pp, the first and last stage's less-layers counted), and with
cp the built model passes validate_config (cp needs flex attention, not varlen).

Runs where torchtitan 0.3.0 imports, else skipped with the reason. It is not a test extra: 0.3.0 pins
datasets<4.8, hence huggingface-hub<2, where transformers 5.25 needs >=2.4, and its models import triton. In a
scratch venv that sees the project's (all on PyPI; torch stays the CPU 2.13):
    /work/venv/bin/python -m venv /tmp/tt-venv
    echo /work/venv/lib/python3.11/site-packages > /tmp/tt-venv/lib/python3.11/site-packages/work-venv.pth
    /tmp/tt-venv/bin/pip install -c <(echo 'torch==2.13.0+cpu') torchtitan==0.3.0 triton==3.8.0
    PYTHONPATH=$PWD /tmp/tt-venv/bin/python -m pytest -q tests/test_torchtitan_own_checks.py
The checks need no GPU but two of torchtitan's: the recipes target an H100, so `has_cuda_capability`
(FlexAttention's flash backend, Float8) answers as an H100 does, and as a B200 for its MXFP8 converters (SM100
only); and a varlen model is not built here (VarlenAttention imports the flash_attn package, CUDA only): only cp
layouts' models are built, whose exports are flex (asserted on the config first). torchtitan's parallelize on the
meta model is not run: on CPU its meshes say cuda, and with them set to cpu FSDP's fully_shard stops on a plain
tensor under the spmd_types backend. Quick: no processes.
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
from test_interop_roundtrip import CASES, OPT
from test_plan_export import TORCHTITAN as PLAN_EXPORTS

from harness.interop.exports import EXPORTERS
from harness.interop.torchtitan_out import FUNCTION, TORCHTITAN
from harness.model.presets import PRESETS
from harness.planner.layout import Workload
from harness.spec import Optimizer

torch = pytest.importorskip("torch")
pytest.importorskip(
    "torchtitan.models.llama3",
    reason=f"torchtitan {TORCHTITAN} (and triton, which its models import) is not installed: see this file's docstring",
)
if importlib.metadata.version("torchtitan") != TORCHTITAN:
    pytest.skip(
        f"torchtitan {importlib.metadata.version('torchtitan')} here, the exports are for {TORCHTITAN}",
        allow_module_level=True,
    )

# id: (model, workload fields, layout, workload)
EXPORTS = {
    **{name: (c[1], c[2], c[3], Workload(4096, 64)) for name, c in CASES.items() if c[0] == "torchtitan"},
    **{
        f"plan-{name}": ("llama3-8b", {"precision": "bf16"}, lay, Workload(8192, 64))
        for name, lay in PLAN_EXPORTS.items()
    },
}


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    """Loads an export through torchtitan's ConfigManager on an H100 as torchtitan sees one (a B200 for its MX
    converters, which refuse compute capability below 10.0)."""
    import torchtitan.components.quantization.float8 as float8
    import torchtitan.components.quantization.mx as mx
    import torchtitan.tools.utils as utils
    from torchtitan.config import ConfigManager

    def h100(major: int, minor: int) -> bool:
        return (9, 0) >= (major, minor)

    def b200(major: int, minor: int) -> bool:
        return (10, 0) >= (major, minor)

    monkeypatch.setattr(utils, "has_cuda_capability", h100)
    monkeypatch.setattr(float8, "has_cuda_capability", h100)
    monkeypatch.setattr(mx, "has_cuda_capability", b200)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, FUNCTION, raising=False)

    def load(text: str):
        (tmp_path / f"{FUNCTION}.py").write_text(text)
        return ConfigManager().parse_args(["--module", FUNCTION, "--config", FUNCTION])

    yield load
    sys.modules.pop(FUNCTION, None)


@pytest.fixture
def fake_world():
    """A fake process group of the layout's world size in this process, as torchtitan's dry run has."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(EXPORTS))
def test_torchtitan_takes_the_export(name, recipe, fake_world):
    from torchtitan.distributed import ParallelDims, pipeline_parallel
    from torchtitan.distributed.full_dtensor import validate_config
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    from torchtitan.models.common.linear import Linear

    model, fields, lay, wl = EXPORTS[name]
    shape = PRESETS[model]
    kw = {"fp8_recipe": fields["fp8_recipe"]} if "fp8_recipe" in fields else {}
    text, _ = EXPORTERS["torchtitan"](shape, lay, wl, Optimizer(**OPT), 0.5, **kw)
    config = recipe(text)  # Trainer.Config's checks: CUDA graphs, pp micro-batches
    model_config = config.model_spec.model
    assert len(model_config.layers) == shape.layers

    dims = ParallelDims.from_config(config.parallelism, lay.gpus)  # degrees multiply to the world size
    fake_world(lay.gpus)
    dims.build_mesh()
    assert (dims.pp, dims.tp, dims.cp, dims.ep) == (lay.pp, lay.tp, lay.cp, lay.ep)
    batch = dims.get_mesh("batch").size() if dims.dp_enabled else 1
    assert batch == lay.dp  # the data-parallel ranks read their own sequences; the cp ranks share theirs
    if lay.ep > 1:
        assert dims.get_mesh("ep").size() == lay.ep
    # trainer.py's batch check and accumulation count (inline in Trainer.__init__), against the plan's
    local = config.training.local_batch_size
    assert config.training.global_batch_size % (local * batch) == 0
    accumulation = config.training.global_batch_size // (local * batch)
    assert accumulation == (1 if lay.pp > 1 else wl.micro_batches(lay))

    model_config.update_from_config(config=config)  # heads and kv heads over tp, RoPE over seq_len
    if lay.pp > 1:
        stages, layers, first, last = pipeline_parallel._get_pipeline_metadata(dims, config.parallelism, model_config)
        assert stages == lay.pp * lay.virtual_stages
        parts = pipeline_parallel._generate_llm_fqn_per_model_part(stages, layers, first, last)
        per_stage = [sum(f.startswith("layers.") for f in part) for part in parts]
        assert per_stage == [shape.layers // stages] * stages, per_stage  # the plan's even split
    inner = {type(c.attention.inner_attention) for c in model_config.layers}
    if lay.cp > 1:
        assert inner == {FlexAttention.Config}
        with torch.device("meta"):
            validate_config(dims, model_config.build())  # raises for varlen or sdpa under cp
    else:
        assert inner <= {FlexAttention.Config, VarlenAttention.Config}
    if lay.precision == "fp8":
        from torchtitan.components.quantization.float8 import Float8Linear
        from torchtitan.components.quantization.mx import MXFP8Linear
        from torchtitan.models.common.moe import GroupedExperts

        mx = fields["fp8_recipe"] == "mxfp8"
        fp8_linear = (MXFP8Linear if mx else Float8Linear).Config
        converted = {fqn for fqn, c, _, _ in model_config.traverse(Linear.Config) if isinstance(c, fp8_linear)}
        linears = {fqn for fqn, _, _, _ in model_config.traverse(Linear.Config)}
        # every linear but the LM head (and a MoE's router gate), as the harness runs FP8
        kept = {f for f in linears if f == "lm_head" or (shape.moe and f.endswith(".moe.router.gate"))}
        assert linears - converted == kept
        experts = [(c, parent) for _, c, parent, _ in model_config.traverse(GroupedExperts.Config)]
        assert len(experts) == (shape.layers if shape.moe else 0)
        # the experts' grouped GEMMs in FP8 (mxfp8: RCEIL scales), their token groups padded to whole blocks (the
        # harness's 32 under mxfp8; Float8's 16, zero rows that change no rowwise scale)
        assert all(type(c)._owner.__name__ == ("MXFP8" if mx else "Float8") + "GroupedExperts" for c, _ in experts)
        assert {getattr(c, "recipe_name", "mxfp8_rceil") for c, _ in experts} <= {"mxfp8_rceil"}
        assert {routed.token_dispatcher.pad_multiple for _, routed in experts} <= {32 if mx else 16}
