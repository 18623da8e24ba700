"""Published GPU training runs (baselines/published_runs/runs.csv) as planner samples.

Each row is a measured tokens/s per GPU at a stated layout. This module reads that format and
turns a row into what the planner predicts: a preset shape, a PlannerLayout, a Workload and a
profile, or says in one line why the planner cannot express the row. What a row leaves out is
filled by the rules below, the same for every row, each from the data's README or the source:

- sequence: torchtitan's tables omit it; its Llama 3 8B default is 8192.
- batch: torchtitan rows give the local batch per data-parallel rank (mbs), no accumulation, so
  the global batch is mbs x dp when not stated; a row with neither trains one sequence per rank.
  With a pipeline torchtitan splits the local batch into the row's pipeline_parallel_microbatches
  (at the 2024-12 benchmark's commit 9dec370 its default, the pp degree: pipelining_utils.py,
  build_pipeline_schedule; one sequence each without the setting); its sharding group is its fsdp column x cp (it shards
  over the dp_shard x cp mesh).
- recompute: empty means none (Megatron-Bridge's recipes set none for 70B/405B; its 8B FP8
  recipe recomputes 5 layers fully, which the planner cannot express: that row is planned without).
  torchtitan's and torchao's selective / per-op SAC are the planner's selective.
- kernels: NVIDIA's stacks (Megatron-Bridge, NeMo, the DGX Cloud recipes) run Transformer Engine:
  its fused attention (te_fused) and fused RMSNorm. torchtitan and torchao run SDPA (the flash
  backend on H100: sdpa) and the eager RMSNorm (rmsnorm torch); a row whose note names compile
  compiles its blocks (compile blocks: the planner's fused elementwise work, features.py).
- engine: NVIDIA's stacks run Megatron-core (engine megatron): its distributed optimizer (fsdp 0 or
  empty) at ZeRO-1, or Megatron-FSDP (fsdp > 0: use_megatron_fsdp, optim_grads_params) sharded over
  that group (fsdp true); torchtitan and torchao are engine fsdp (FSDP2). Every
  row overlaps its data-parallel collectives with compute (dp_overlap): NeMo's and Megatron-Bridge's
  recipes set Megatron's overlap_grad_reduce and overlap_param_gather, FSDP2 prefetches; and computes
  the loss vocabulary-parallel under tp (Megatron's cross-entropy, torchtitan's loss_parallel default).
- pipeline: vp > 1 is interleaved 1F1B; a torchtitan row whose note says "Interleaved" with no vp
  runs two stages per rank (its default for interleaved schedules).
- precision: BF16 is bf16; FP8 of every recipe (FP8-CS, Float8 tensorwise or rowwise) is fp8; a row
  whose precision is not stated is not planned.
- settings: what the row's recipe sets beyond its layout, each read from the recipe named in the data's
  README, in the source's own words (SETTINGS maps each to the planner's field, memory_recipes.py
  models it): Megatron's recompute_num_layers (recompute_method block), cpu_offloading_num_layers,
  fp8_param_gather (NeMo: fp8_params), grad_reduce_in_fp32 (NeMo: optim.grad_sync_dtype),
  bias_activation_fusion, cross_entropy_loss_fusion, account_for_embedding_in_pipeline_split,
  account_for_loss_in_pipeline_split, moe_router_force_load_balancing, moe_a2a_overlap; torchtitan's
  selective_ac_option, reshard_after_forward and pipeline_parallel_microbatches, torch.distributed.pipelining's
  return_outputs (step()'s, true until torchtitan passed false in 2025-10); Megatron's
  expert_tensor_parallel_size. A setting the recipe does not state
  is the planner's default.
- memory: the peak the source publishes, in its unit (torchtitan logs max reserved GiB; so do torchao's
  float8 rows, torchtitan runs whose README prints "GB" over the GiB its benchmark script parses from
  torchtitan's log: benchmarks/float8/training/parse_torchtitan_logs.py, the data's README).
- system: DGX-H100, H100 SXM and H100 are h100-sxm; DGX-H200, H200 SXM and H200 h200; DGX-B200 and
  B200 b200; DGX-GB200 and GB200 gb200 (a system with no profile, DGX-B300, is not planned); torchtitan's
  "H100 96GB HBM2e 500W" is h100-sxm with 96 GB (its peak is not published: SXM's is kept).
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from harness import resources
from harness.errors import SpecError
from harness.model.presets import PRESETS, Shape
from harness.parallel_dims import ParallelDims
from harness.planner.hardware import Profile, load_profile
from harness.planner.layout import PlannerLayout, Workload

RUNS_CSV = resources.path("baselines/published_runs/runs.csv")  # the repository's, or the installed package's copy
COLUMNS = ("source", "system", "model", "gpus", "precision", "tp", "pp", "tokens_per_s_per_gpu")
MODELS = {
    "LLAMA3_8B": "llama3-8b",
    "LLAMA3-8B": "llama3-8b",
    "LLAMA3.1_8B": "llama3-8b",
    "LLAMA3_70B": "llama3-70b",
    "LLAMA3-70B": "llama3-70b",
    "LLAMA3.1_405B": "llama3-405b",
    "LLAMA2-7B": "llama2-7b",
    "LLAMA2-13B": "llama2-13b",
    "LLAMA2-70B": "llama2-70b",
    "Qwen3_235B_a22B": "qwen3-235b-a22b",
    "LLAMA3.1_70B": "llama3-70b",  # Llama 3.1 70B is Llama 3 70B's shape
    "LLAMA2_7B": "llama2-7b",
    "LLAMA2_13B": "llama2-13b",
    "LLAMA2_70B": "llama2-70b",
    "Qwen3_30B_a3B": "qwen3-30b-a3b",
    "Mixtral_8x7B": "mixtral-8x7b",
}
SYSTEMS = {
    "DGX-H100": "h100-sxm",
    "H100 SXM": "h100-sxm",
    "H100": "h100-sxm",
    "DGX-H200": "h200",
    "H200 SXM": "h200",
    "H200": "h200",
    "DGX-B200": "b200",
    "B200": "b200",
    "DGX-GB200": "gb200",
    "GB200": "gb200",
}
MEMORY_GIB = {"H100 96GB HBM2e 500W": 96e9 / 2**30}  # torchtitan's H100 variant
NVIDIA = ("megatron-bridge", "nemo", "dgxc-benchmarking", "mlperf-nemo")  # mlperf-nemo: NVIDIA's NeMo implementation
BLACKWELL = ("b200", "gb200")  # FP8 GEMMs of any operand layout (memory_recipes: fp8_transpose)
DEFAULT_SEQ = 8192  # torchtitan's Llama 3 8B default
UNITS = {"GiB": 2**30, "GB": 1e9}


def _on(text: str) -> bool:
    return text.lower() in ("true", "1", "yes")


# A recipe's setting (the settings column, in the source's words) as the planner's layout fields.
SETTINGS = {
    "recompute_num_layers": lambda v: {"activation_checkpointing": "full", "recompute_layers": int(v)},
    "cpu_offloading_num_layers": lambda v: {"offload_layers": int(v)},
    "fp8_param_gather": lambda v: {"fp8_params": _on(v)},
    "fp8_params": lambda v: {"fp8_params": _on(v)},
    "grad_reduce_in_fp32": lambda v: {"main_grads": "fp32" if _on(v) else "bf16"},
    "grad_sync_dtype": lambda v: {"main_grads": v},
    "bias_activation_fusion": lambda v: {"fused_swiglu": _on(v)},
    "cross_entropy_loss_fusion": lambda v: {"loss_fusion": _on(v)},
    "selective_ac_option": lambda v: {"selective_policy": "per_op" if v == "op" else "megatron"},
    "reshard_after_forward": lambda v: {"reshard_after_forward": _on(v)},
    "expert_tensor_parallel_size": lambda v: {},  # read by from_row (layout.expert_tp: parallel folding)
    "pipeline_parallel_microbatches": lambda v: {},  # read by from_row: the local batch's micro-batch size
    "return_outputs": lambda v: {"pp_outputs_kept": _on(v)},
    "expandable_segments": lambda v: {"expandable_segments": _on(v)},  # PYTORCH_CUDA_ALLOC_CONF's
    "account_for_embedding_in_pipeline_split": lambda v: {"split_counts_embedding": _on(v)},
    "account_for_loss_in_pipeline_split": lambda v: {"split_counts_loss": _on(v)},
    "moe_router_force_load_balancing": lambda v: {"moe_balanced": _on(v)},
    "moe_a2a_overlap": lambda v: {"moe_a2a_overlap": _on(v)},
    "padded_vocab_size": lambda v: {},  # read by from_row: the row's tokenizer, not the preset's (MLPerf's Mixtral one)
}


def settings(row: dict) -> dict[str, str]:
    """The row's settings column as {name: value}."""
    pairs = [item.split("=", 1) for item in (row.get("settings") or "").split()]
    return {k: v for k, v in pairs}


def published_memory_gib(row: dict) -> float | None:
    """The peak memory the source publishes, in GiB (the memory column), or None."""
    text = (row.get("memory") or "").split()
    return float(text[0]) * UNITS[text[1]] / 2**30 if len(text) == 2 else None


@dataclass
class PublishedRun:
    """One row: what the planner is asked (shape, layout, workload, profile) and what was measured;
    `why_not` says why the planner cannot express it (then the rest may be None) or why the row is left
    out of fits and the dense checks (a mixture of experts: expressed, checked apart)."""

    row: dict
    label: str
    tokens_per_s_per_gpu: float
    shape: Shape | None = None
    layout: PlannerLayout | None = None
    workload: Workload | None = None
    profile: Profile | None = None
    why_not: str = ""
    # a layout the planner predicts in place of one it cannot express (Megatron's folded expert parallelism)
    stand_in: str = ""

    @property
    def step_time_s(self) -> float:
        """The measured seconds per optimizer step: the global batch's tokens at the measured rate."""
        wl, lay = self.workload, self.layout
        return wl.global_batch_size * wl.seq_len / (self.tokens_per_s_per_gpu * lay.gpus)


def _int(row: dict, key: str, default: int) -> int:
    text = (row.get(key) or "").strip()
    return int(float(text)) if text else default


def load(path: str | Path = RUNS_CSV, field: str = "--calibrate-csv") -> list[PublishedRun]:
    """Every row of a runs.csv-format file, in order."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(field, f"{path} does not exist")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in COLUMNS if rows and c not in rows[0]]
    if missing:
        raise SpecError(field, f"{path}: no column {', '.join(missing)} (the published runs' format)")
    return [from_row(row, i + 2) for i, row in enumerate(rows)]


def is_published_format(path: str | Path) -> bool:
    """Whether a CSV has the published runs' header (else it is one of the study's sweeps)."""
    with Path(path).open(newline="") as f:
        header = next(csv.reader(f), [])
    return "tokens_per_s_per_gpu" in header


_profiles: dict[tuple, Profile] = {}


def _profile(system: str) -> Profile:
    key = (system,)
    if key not in _profiles:
        prof = load_profile(SYSTEMS.get(system, "h100-sxm"))
        if system in MEMORY_GIB:
            prof = dataclasses.replace(prof, memory_gib=MEMORY_GIB[system])
        _profiles[key] = prof
    return _profiles[key]


def from_row(row: dict, line: int = 0) -> PublishedRun:
    """A PublishedRun from one CSV row (the module docstring's rules)."""
    row = {k: (v or "").strip() for k, v in row.items()}
    system, note = row["system"], row.get("note", "")
    label = f"{row['source']} {row.get('version', '')} {system} {row['model']} {row['gpus']} GPUs {row['precision']}"
    if row.get("seq"):
        label += f" seq {row['seq']}"
    if row["source"] not in NVIDIA and note:  # torchtitan's rows differ by what their note says (compile, ...)
        label += f" ({note.split(';')[0]})"
    run = PublishedRun(row, " ".join(label.split()), float(row["tokens_per_s_per_gpu"]))
    model = MODELS.get(row["model"])
    if model is None:
        run.why_not = f"no preset for {row['model']}"
        return run
    if system not in SYSTEMS and system not in MEMORY_GIB:
        run.why_not = f"no profile for system {system!r}"
        return run
    precision = row["precision"].upper()
    if precision.startswith(("FP8", "FLOAT8")):
        precision = "fp8"
    elif precision == "BF16":
        precision = "bf16"
    else:
        run.why_not = f"precision {row['precision']!r}: not planned"
        return run
    gpus, tp, pp, cp = int(row["gpus"]), _int(row, "tp", 1), _int(row, "pp", 1), _int(row, "cp", 1)
    dims = ParallelDims.derive(gpus, "gpus", tp=tp, pp=pp, cp=cp)
    ep = _int(row, "ep", 1)
    expert_tp = _int(settings(row), "expert_tensor_parallel_size", 0)
    if expert_tp == 1 and tp > 1 and ep % tp == 0 and dims.replicas() % (ep // tp) == 0:
        ep //= tp  # Megatron's parallel folding: its ep group of ep x tp ranks over tp x dp (layout.expert_tp)
    elif dims.replicas() % ep:  # a stand-in for a folding the planner does not express
        ep = max(e for e in range(1, ep) if ep % e == 0 and dims.replicas() % e == 0)
        run.stand_in = f"ep{_int(row, 'ep', 1)} as ep{ep} x tp{tp}, experts split over tp"
    dims = ParallelDims(tp=tp, pp=pp, cp=cp, dp=dims.dp, ep=ep)
    dp = dims.dp
    vp = _int(row, "vp", 2 if "interleaved" in note.lower() else 1)
    nvidia = row["source"] in NVIDIA
    mbs = _int(row, "mbs", 1)
    gbs = _int(row, "gbs", mbs * dp)
    if pp > 1 and not nvidia:  # torchtitan splits the local batch into pipeline_parallel_microbatches
        mbs = max(1, mbs // _int(settings(row), "pipeline_parallel_microbatches", mbs))
    shard = _int(row, "fsdp", 0)
    if shard and not nvidia:
        shard *= cp  # torchtitan shards over its dp_shard x cp mesh
    recompute = row.get("recompute", "").lower()
    ckpt = "full" if recompute == "full" else ("selective" if recompute in ("selective", "per-op sac") else "none")
    fields = {
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "cp": cp,
        "cp_impl": "ring",
        "micro_batch_size": mbs,
        "activation_checkpointing": ckpt,
        "sequence_parallel": tp > 1,
        "attention": "te_fused" if nvidia else "sdpa",
        "rmsnorm": "fused" if nvidia else "torch",
        "compile": "blocks" if "compile" in note.lower() else "none",
        "zero_stage": 1,
        "pipeline_schedule": "interleaved" if vp > 1 and pp > 1 else "1f1b",
        "virtual_stages": vp if pp > 1 else 1,
        "engine": "megatron" if nvidia else "fsdp",  # a sharding group under NVIDIA's stacks: Megatron-FSDP
        "fsdp": bool(shard or not nvidia),
        "precision": precision,
        "dp_shard": shard if 0 < shard < dims.replicas() else 0,
        "dp_overlap": True,  # NeMo's and Megatron-Bridge's overlapped reduction and gather; FSDP2's prefetch
        "vocab_parallel_loss": True,  # Megatron's vocab-parallel cross-entropy, torchtitan's loss_parallel default
        "ep": dims.ep,
        "expert_tp": expert_tp,
        "te_attention": nvidia,  # Transformer Engine's layer spec (memory_engines: GQA, its cp ring)
    }
    for name, value in settings(row).items():
        if name not in SETTINGS:
            raise SpecError("--calibrate-csv", f"line {line}: unknown setting {name!r} (known: {', '.join(SETTINGS)})")
        fields.update(SETTINGS[name](value))
    if nvidia and SYSTEMS.get(system) in BLACKWELL:  # Transformer Engine keeps no fp8 transpose there
        fields["fp8_transpose"] = False
    run.shape = PRESETS[model]
    vocab = _int(settings(row), "padded_vocab_size", 0)
    if vocab:
        run.shape = dataclasses.replace(run.shape, vocab=vocab)
    run.layout = PlannerLayout(**fields)
    run.workload = Workload(_int(row, "seq", DEFAULT_SEQ), gbs)
    run.profile = _profile(system)
    if run.shape.moe:  # one row: predicted and judged apart (tests/test_planner_moe.py), fitting no constant
        run.why_not = "mixture of experts: expressed and checked apart, not fitted on or held to the dense target"
    return run


def unmodelled(run: PublishedRun) -> str:
    """What the planner lacks for a row it predicts not to fit though it trained, or whose published peak
    it misses by more than 10%: the row's `unmodelled` column, naming the term and its size as far as it
    is found (the data's README); empty where nothing is named."""
    return run.row.get("unmodelled", "")


@dataclass
class MemoryCheck:
    """A row's predicted peak against what it ran on and what its source publishes."""

    predicted_gib: float
    device_gib: float
    published_gib: float | None

    @property
    def fits(self) -> bool:
        return self.predicted_gib <= self.device_gib

    @property
    def error(self) -> float | None:
        """Predicted over published, less one; None without a published peak."""
        return None if self.published_gib is None else self.predicted_gib / self.published_gib - 1


def memory_check(run: PublishedRun) -> MemoryCheck:
    """The worst stage's predicted memory of a planned row (memory.py) against its device and source."""
    from harness.planner.memory import worst_stage_memory

    total = worst_stage_memory(run.shape, run.layout, run.workload)[1]["total"] / 2**30
    return MemoryCheck(total, run.profile.memory_gib, published_memory_gib(run.row))
