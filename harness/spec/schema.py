"""What to run: a Workload (the same for every engine) and a Layout (how it is parallelised),
with the values their fields take (the kernels, checkpointing modes, CP implementations and
schedules every view shares) and the bounds beyond which a number is a typo.

This is the one vocabulary: each choice field's values are one tuple here, and everything else that
names them (an engine's facts, the planner, the memory trace) names a subset of it (subset, through), checked
when its module is built. A new value goes at the end of its tuple: an engine's facts run a field's values
`through` the last one they were written for (harness/spec/honours.py), so every engine refuses a value added
later until one opts in.

Each field says how the builder (build.py) reads it; what the fields mean together is checked in
checks.py and capabilities.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from harness import registry
from harness.errors import SpecError, shown
from harness.model.presets import Shape, resolve_shape
from harness.spec.build import coerce, in_range, spec_field


def subset(values: tuple, *names) -> tuple:
    """`names`, each one of `values` (a tuple of this vocabulary), in the order given: a named subset that
    fails when its module is built on a typo or on a value the vocabulary no longer has."""
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"{', '.join(map(repr, missing))} not among {', '.join(map(str, values))}")
    return tuple(names)


def through(values: tuple, last) -> tuple:
    """The values of `values` up to and including `last`, in the vocabulary's order: those known when `last`
    was the newest (values are appended), not those added after it."""
    return values[: values.index(subset(values, last)[0]) + 1]


PRECISIONS = ("fp32", "bf16", "fp8")
# the precisions whose parameters, activations and collectives are bf16 (fp8: bf16's policy with FP8 GEMMs)
BF16_PRECISIONS = subset(PRECISIONS, "bf16", "fp8")
GRAD_DTYPES = ("fp32", "bf16")  # grad_accum_dtype, grad_reduce_dtype
DEVICES = ("auto", "cpu", "cuda")
DATA_KINDS = ("synthetic", "file", "markov")
TOKEN_DTYPES = ("uint16", "uint32")  # a token file's
ATTENTION_KERNELS = ("naive", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flash2")
RMSNORM_KERNELS = ("torch", "fused")
# selective_op: torchtitan's per-op policy (every other matmul's output saved, the rest recomputed)
CHECKPOINTING = ("none", "full", "selective", "selective_op")
CP_IMPLS = ("ring", "allgather", "ulysses")  # K/V blocks passed round a ring, K/V all-gathered, heads all-to-all
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv", "dualpipev")
PIPELINE_P2P = ("auto", "async", "grouped")
MODEL_IMPLS = ("own", "hf")  # the harness's model, transformers' LlamaForCausalLM
# engine deepspeed's MoE layer: deepspeed.moe.layer.MoE, or AutoEP's (its expert_parallel config section)
DS_MOE = ("layer", "autoep")
COMPILE = ("none", "blocks")  # torch.compile: nothing, or each transformer block (torchtitan's apply_compile)
# torchao's Float8LinearConfig.from_recipe_name; mxfp8: torchao's MXFP8 linear (harness/model/mxfp8.py)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
# muon: torch.optim.Muon on the transformer blocks' 2-D weights, AdamW on the rest (harness/model/muon.py)
OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn
# Two model chunks per pipeline rank in a V (rank r holds stages r and 2pp-1-r: the first rank the first and last).
V_SCHEDULES = subset(SCHEDULES, "zbv", "dualpipev")
# virtual_stages chunks per rank, stage c * pp + r (Megatron's interleaving); zero_bubble: torch's
# ScheduleInterleavedZeroBubble.
INTERLEAVED_SCHEDULES = subset(SCHEDULES, "interleaved", "zero_bubble")


def model_chunks(schedule: str, virtual_stages: int) -> int:
    """Model chunks (pipeline stages) per pipeline rank."""
    if schedule in V_SCHEDULES:
        return 2
    return virtual_stages if schedule in INTERLEAVED_SCHEDULES else 1


def _choices(*values, **kw):
    return field(metadata={"choices": values}, **kw)


# Bounds beyond which a number is a typo (`steps: 1e30`), not a run.
MAX_STEPS = 100_000  # a record keeps every step's loss, time and breakdown
MAX_DEVICES = 2**20  # more devices than any cluster has
MAX_SEED = 2**32 - 1  # what every generator takes (numpy's limit; torch's is larger)


def _betas(value, name: str) -> tuple[float, float]:
    betas = coerce(value, tuple[float, float], name)
    for i, b in enumerate(betas):
        if not 0 <= b < 1:
            raise SpecError(f"{name}[{i}]", f"must be in [0, 1), got {shown(value[i])}")
    return betas


@dataclass
class Optimizer:
    """The optimizer and its hyperparameters; every engine gets exactly these. name muon: torch.optim.Muon
    (nesterov, 5 Newton-Schulz steps, its coefficients) with lr, weight_decay, muon_momentum and
    muon_adjust_lr on the blocks' 2-D weights, and AdamW with all of these but the muon_ ones on the rest."""

    lr: float = spec_field(3e-4, check=in_range(float, 0, above=True))
    betas: tuple[float, float] = spec_field((0.9, 0.95), check=_betas)
    eps: float = spec_field(1e-8, check=in_range(float, 0, above=True))
    weight_decay: float = spec_field(0.1, check=in_range(float, 0))
    name: str = spec_field("adamw", choices=OPTIMIZERS)
    muon_momentum: float = spec_field(0.95, check=in_range(float, 0), applies=("name", "muon"))
    muon_adjust_lr: str = spec_field("original", choices=MUON_ADJUST_LR, applies=("name", "muon"))


@dataclass
class Data:
    """`synthetic`: seeded uniform tokens (the loss stays near ln vocab); `file`: a memory-mapped token
    file (.bin); `markov`: a seeded Markov chain of low entropy (harness.data.source.MarkovTokens), a loss
    that falls within a few steps, for parity that proves training."""

    kind: str = _choices(*DATA_KINDS, default="synthetic")
    path: str = spec_field("", applies=("kind", "file"))
    dtype: str = spec_field("uint16", choices=TOKEN_DTYPES, applies=("kind", "file"))


@dataclass
class Workload:
    model: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    seq_len: int = spec_field(128, check=in_range(int, 1))  # at most the model's max_positions (check_tokens)
    global_batch_size: int = spec_field(8, check=in_range(int, 1))  # sequences per step
    steps: int = spec_field(10, check=in_range(int, 1, MAX_STEPS))
    warmup_steps: int = spec_field(2, check=in_range(int, 0, MAX_STEPS))
    # fp8: bf16's policy with the linear layers' GEMMs in FP8 (torchao, harness/model/float8.py)
    precision: str = _choices(*PRECISIONS, default="fp32")
    fp8_recipe: str = spec_field("tensorwise", choices=FP8_RECIPES, applies=("precision", "fp8"))
    # bf16 and fp8: gradients are summed over micro-batches in grad_accum_dtype and reduced across
    # data-parallel ranks in grad_reduce_dtype (harness/model/training.py, PrecisionPolicy)
    grad_accum_dtype: str = _choices(*GRAD_DTYPES, default="fp32")
    grad_reduce_dtype: str = _choices(*GRAD_DTYPES, default="fp32")
    optimizer: Optimizer = field(default_factory=Optimizer)
    grad_clip: float = spec_field(1.0, check=in_range(float, 0, why=" (0 disables clipping)"))
    seed: int = spec_field(1234, check=in_range(int, 0, MAX_SEED))
    data: Data = field(default_factory=Data)
    # mixture of experts (harness/model/moe.py): the load-balancing loss (Switch/GShard, Megatron's
    # normalisation: 1 when balanced) and the router z-loss (ST-MoE), each per micro-batch, times these
    moe_aux_loss_coeff: float = spec_field(0.0, check=in_range(float, 0))
    moe_z_loss_coeff: float = spec_field(0.0, check=in_range(float, 0))
    device: str = _choices(*DEVICES, default="auto")


@dataclass
class Layout:
    engine: str = field(default="single", metadata={"choices": registry.ENGINES})  # the registry's, as it is now
    tp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    pp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    dp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    # context parallelism: each sequence split over cp ranks (load-balanced chunks i and 2cp-1-i), and
    # how their attention meets the other ranks' keys and values
    cp: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    cp_impl: str = _choices(*CP_IMPLS, default="ring")
    # expert parallelism: a MoE's experts shared out over ep ranks carved from the dp x cp ranks
    # (harness/parallel_dims.py), tokens sent to their experts and back by all-to-all
    ep: int = spec_field(1, check=in_range(int, 1, MAX_DEVICES))
    micro_batch_size: int = spec_field(1, check=in_range(int, 1))
    activation_checkpointing: str = _choices(*CHECKPOINTING, default="none")
    sequence_parallel: bool = False
    attention: str = _choices(*ATTENTION_KERNELS, default="sdpa")
    rmsnorm: str = _choices(*RMSNORM_KERNELS, default="torch")
    compile: str = _choices(*COMPILE, default="none")  # blocks: compiled in warm-up, recompiling after it fails
    # own engine
    pipeline_schedule: str = _choices(*SCHEDULES, default="1f1b")
    virtual_stages: int = spec_field(1, check=in_range(int, 1))
    # how pipeline stages exchange activations: grouped (batch_isend_irecv, what NCCL needs) or
    # async (isend/irecv); auto picks grouped on NCCL and async on gloo
    pipeline_p2p: str = _choices(*PIPELINE_P2P, default="auto")
    zero_stage: int = spec_field(0, check=in_range(int, 0, 3, says="0, 1, 2 or 3 (ZeRO's stages)"))
    dp_bucket_mb: float = spec_field(25.0, check=in_range(float, 0, above=True))
    # deepspeed
    ds_config: str = ""
    model_impl: str = _choices(*MODEL_IMPLS, default="own")
    ds_moe: str = _choices(*DS_MOE, default="layer")
    # fsdp
    reshard_after_forward: bool = True
    # FSDP2 all-gathers the FP8 linears' weights in FP8 (torchao's enable_fsdp_float8_all_gather; precision fp8,
    # fp8_recipe tensorwise)
    fp8_all_gather: bool = False


@dataclass
class RunSpec:
    workload: Workload = field(default_factory=Workload)
    layout: Layout = field(default_factory=Layout)
    name: str = ""
    store: str = "results.sqlite"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def shape(self) -> Shape:
        """The model's shape (parse_spec has checked the layout against it)."""
        return resolve_shape(self.workload.model, self.workload.model_overrides)


def micro_batches_per_step(spec: RunSpec) -> int:
    return micro_batch_count(spec.workload.global_batch_size, spec.layout.dp, spec.layout.micro_batch_size)


def micro_batch_count(global_batch_size: int, dp: int, micro_batch_size: int) -> int:
    """Micro-batches each data-parallel rank runs per optimizer step."""
    return global_batch_size // (dp * micro_batch_size)
