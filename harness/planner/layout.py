"""What the planner is asked about: one layout and one workload, as plain values.

The planner keeps its own small types (PlannerLayout, Workload) so it can describe layouts the
engines cannot run, such as the study's kernels (EXTRA_ATTENTION), but it names every field and
value as harness.spec does and converts to and from a spec layout in one place each
(PlannerLayout.from_spec, PlannerLayout.to_spec).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import asdict, dataclass, field

from harness import registry
from harness.model.presets import Shape
from harness.parallel_dims import DEGREES, ParallelDims
from harness.spec import ATTENTION_KERNELS, micro_batch_count
from harness.spec import Layout as SpecLayout
from harness.spec.schema import BF16_PRECISIONS

# Names the study's CSVs use for its kernels (attention, rmsnorm), and for checkpointing.
PAPER_KERNELS = {
    "torch": ("naive", "torch"),
    "fused": ("fused_softmax", "torch"),
    "flash_attention": ("flash1", "torch"),
    "flash_attentionv1.0.8": ("flash1", "torch"),
    "flash_attention2": ("flash2", "torch"),
    "flash_attention2 + RMS kernel": ("flash2", "fused"),
}
PAPER_CHECKPOINTING = {"disabled": "none", "every_layer": "full", "selective": "selective"}

# The study's attention kernels, slowest first: naive (its "torch"), fused_softmax (Megatron's
# fused scale-mask-softmax), flash1, flash2.
PAPER_ATTENTION = tuple(dict.fromkeys(attention for attention, _ in PAPER_KERNELS.values()))
# Kernels the published runs of Hopper and Blackwell use, which neither the study nor this harness
# runs: FlashAttention-3 (Shah et al. 2024; Hopper only) and Transformer Engine's fused attention
# (its cuDNN backend, as NeMo and Megatron-Bridge run it).
GPU_ATTENTION = ("flash3", "te_fused")
# The planner's own kernels, beyond those the harness runs (harness.spec.ATTENTION_KERNELS):
# the study's fused_softmax and flash1, and GPU_ATTENTION.
EXTRA_ATTENTION = tuple(k for k in PAPER_ATTENTION if k not in ATTENTION_KERNELS) + GPU_ATTENTION
# Every kernel the planner knows, in the order it lists them: the study's, then the harness's others,
# then GPU_ATTENTION.
ATTENTION = PAPER_ATTENTION + tuple(k for k in ATTENTION_KERNELS if k not in PAPER_ATTENTION) + GPU_ATTENTION
# Each kernel's cost class. "flash3" is the class of the kernels written for Hopper's asynchronous
# tensor cores (wgmma, TMA): FlashAttention-3 and cuDNN's fused attention, whether Transformer
# Engine (te_fused) or SDPA's cudnn backend calls it. SDPA's flash backend is FlashAttention-2; its
# default (sdpa) picks the flash backend first on CUDA (torch's sdp_utils priority order).
ATTENTION_CLASS = {
    "naive": "naive",
    "fused_softmax": "fused_softmax",
    "flash1": "flash1",
    "flash2": "flash2",
    "sdpa": "flash2",
    "sdpa_flash": "flash2",
    "sdpa_cudnn": "flash3",
    "sdpa_efficient": "mem_efficient",
    "flash3": "flash3",
    "te_fused": "flash3",
}
MATERIALISED = ("naive", "fused_softmax")  # keep the s x s score matrix
# The study's engine (Aleph Alpha's scaling library, as its sweeps ran): modelled, not run here.
PAPER = "paper"
PRECISIONS = BF16_PRECISIONS  # PlannerLayout.precision (the time model is bf16's or fp8's)


def planner_engines() -> tuple[str, ...]:
    """Whose memory the planner models (PlannerLayout.engine, `harness plan --engine`): the engines
    that declare it (harness.registry.planned), and the study's."""
    return registry.planned() + (PAPER,)


# A PlannerLayout holds every field of harness.spec.Layout, by the same name (a field added there reaches the
# planner, from_spec and to_spec as it is), but those the planner does not model: the own engine's pipeline
# transfers and DP buckets, DeepSpeed's config and model implementation, FSDP2's FP8 all-gather (assumed
# under fsdp with tensorwise FP8: fp8.py), and DeepSpeed's MoE layer (both hold E/ep experts a rank).
UNMODELLED = ("pipeline_p2p", "dp_bucket_mb", "ds_config", "model_impl", "fp8_all_gather", "ds_moe")
# Given by every caller, positionally in this order: the degrees a candidate is enumerated over.
REQUIRED = ("tp", "pp", "dp", "micro_batch_size")
# Where the planner's default is not the spec's: the study's engine (engine: whose memory the planner models,
# memory.py: paper, or one of the harness's engines, their precision policy, sharding and layer split as their
# code holds it), its kernels and its sharding of the optimizer states (ZeRO-1).
DEFAULTS = {"engine": PAPER, "attention": "flash2", "rmsnorm": "fused", "zero_stage": 1}


@dataclass(frozen=True)
class PlannerOwn:
    """The planner's own fields, beyond a spec layout's (PlannerLayout's last)."""

    fsdp: bool = False  # engine fsdp (PyTorch FSDP full sharding): memory like ZeRO-3
    # "bf16" or "fp8": the linear layers' GEMMs in FP8 as the engines run it (harness/planner/fp8.py),
    # parameters bf16, masters and Adam fp32; a spec holds it as workload.precision.
    precision: str = "bf16"
    # Engine fsdp: the ranks of one sharding group. 0: every replica rank (dp x cp), full sharding;
    # 0 < dp_shard < dp x cp: hybrid sharding (HSDP; torchtitan's data_parallel_shard_degree inside
    # data_parallel_replicate_degree, Megatron-FSDP's sharding group): states sharded within a group
    # of dp_shard ranks, innermost in the flattened dp x cp mesh, replicated across the others.
    dp_shard: int = 0
    # Whether the data-parallel collectives overlap compute: FSDP2's prefetched all-gathers and
    # reduce-scatters in their own stream (engine fsdp, torchtitan), Megatron-LM's
    # --overlap-grad-reduce/--overlap-param-gather (as NeMo and Megatron-Bridge run it; the harness's
    # megatron engine runs without). The study's engine and the own engine reduce after the backward.
    # None: the engine's (fsdp overlaps; the others do not).
    dp_overlap: bool | None = None
    # Whether the LM head's cross-entropy runs vocabulary-parallel under tp > 1 (Megatron's
    # vocab_parallel_cross_entropy, torchtitan's loss_parallel): its memory is the logits' 1/tp.
    # None: the engine's (registry.MemoryModel.vocab_parallel_loss).
    vocab_parallel_loss: bool | None = None
    # The memory settings the published recipes name (memory_engines.py models each; the defaults are the
    # harness's engines as they run):
    # What activation_checkpointing "selective" keeps: "megatron", Megatron's selective recomputation (the
    # attention core recomputed, the rest kept); "per_op", torchtitan's op-level policy (selective_ac_option
    # "op": the outputs of every other matmul and of the attention kernel kept, the rest recomputed).
    selective_policy: str = "megatron"
    # Under activation_checkpointing "full": the layers of each pipeline chunk recomputed (Megatron's
    # recompute_method block, recompute_num_layers), the others keeping everything; 0: every layer.
    recompute_layers: int = 0
    # Layers whose saved activations wait in host memory (Megatron's cpu_offloading_num_layers).
    offload_layers: int = 0
    # The linear weights held in fp8 only, no bf16 copy (Megatron's fp8_param_gather: Transformer Engine's
    # fp8 primary weights, gathered in fp8 by the distributed optimizer).
    fp8_params: bool = False
    # The dtype of Megatron's main-gradient buffer: "bf16" under grad_reduce_in_fp32 False (the fp32 shard
    # the optimizer steps with is made at the step, when the activations are gone).
    main_grads: str = "fp32"
    # SwiGLU as one fused op that saves only its input (Megatron's bias_activation_fusion).
    fused_swiglu: bool = False
    # Whether Transformer Engine keeps each fp8 weight's transpose beside it: Hopper's FP8 GEMMs take one
    # operand layout only (TN), Blackwell's any, where it keeps none (memory_recipes).
    fp8_transpose: bool = True
    # The cross-entropy fused and run in the logits' dtype (Megatron's cross_entropy_loss_fusion): no fp32 copy.
    loss_fusion: bool = False
    # Megatron's expert_tensor_parallel_size: 0, the layout's tp (its default); 1, the MoE layers' experts
    # whole, the tp ranks holding different experts (parallel folding: Megatron's expert-parallel group of
    # ep x tp ranks spans tp x dp; feedforward.py).
    expert_tp: int = 0
    # Transformer Engine's DotProductAttention (the NVIDIA recipes' layer spec): grouped-query k and v kept as
    # they are, not repeated to every head, and under cp its own ring (AttnFuncWithCPAndKVP2P: the local q, k,
    # v, output and log-sum-exp saved, the k/v chunks passed round again in backward), not the own engine's.
    te_attention: bool = False
    # torch.distributed.pipelining's last stage keeping every micro-batch's output (the logits) to the step's
    # end for the step's return (stage.output_chunks): schedule.step() without return_outputs=False, as
    # torchtitan ran until 2025-10 (e5ef99a, "Update PP to release memory earlier"); the harness passes False.
    pp_outputs_kept: bool = False
    # PyTorch's caching allocator under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (torchtitan's
    # run_llama_train.sh sets it): a pool is one segment whose free tail grows by what a request lacks, so the
    # pipeline's merged outputs take no segment of their own (memory_reserve.py).
    expandable_segments: bool = False
    # Megatron's account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split: the embedding
    # (the loss) takes one layer's slot of the even split, so the first (last) pipeline chunk builds one layer
    # fewer (transformer_config.py, get_num_layers_to_build): how 94 layers split over 8 x 4 chunks.
    split_counts_embedding: bool = False
    split_counts_loss: bool = False
    # Megatron's moe_router_force_load_balancing (the NVIDIA MoE benchmark recipes set it): every expert the
    # same tokens, so no rank is the busiest (feedforward.IMBALANCE not applied).
    moe_balanced: bool = False
    # Megatron's overlap_moe_expert_parallel_comm (Megatron-Bridge's moe_a2a_overlap): the interleaved schedule
    # runs one more warm-up micro-batch so that each 1F1B step's forward and backward are independent
    # (pipeline_parallel/schedules.py, get_pp_rank_microbatches): one chunk more in flight. Its hiding of the
    # expert all-to-all behind the other micro-batch's compute is not in the time model.
    moe_a2a_overlap: bool = False


_SPEC_FIELDS = [f for f in dataclasses.fields(SpecLayout) if f.name not in UNMODELLED]
_CAST = {"int": int, "float": float, "bool": bool, "str": str}  # a spec field's value, by its type


class _remembered:
    """functools.cached_property without its lock (Python 3.11's takes one on every first access): the
    value is written to the instance's __dict__ (a frozen dataclass allows that: it refuses only
    setattr), where it answers every later access at C speed (a non-data descriptor)."""

    def __init__(self, fn):
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


class _Planned:
    """PlannerLayout's methods (its fields: _SPEC_FIELDS, then PlannerOwn's)."""

    # dims, gpus and replicas are remembered on the instance (_remembered): a plan asks them several times
    # of each of thousands of layouts; the dataclass's eq, hash, repr, asdict and replace read the fields only.
    @_remembered
    def dims(self) -> ParallelDims:
        return _dims(*_DEGREES_OF(self))

    @_remembered
    def gpus(self) -> int:
        return _world(self.dims)

    @_remembered
    def replicas(self) -> int:
        """How many ranks hold each parameter shard (dp x cp: harness.parallel_dims.REPLICA_AXES)."""
        return _replicas(self.dims)

    @property
    def shard_group(self) -> int:
        """How many ranks share the sharding of the states: dp_shard, or every replica rank when it is
        0 (ZeRO and full FSDP shard over dp x cp)."""
        return self.dp_shard or self.replicas

    @property
    def overlaps_dp(self) -> bool:
        """Whether the data-parallel collectives overlap compute (dp_overlap, else the engine's)."""
        return self.fsdp if self.dp_overlap is None else self.dp_overlap

    @property
    def norm_kernel(self) -> str:
        """The RMSNorm that runs: a compiled block's norm is one fused kernel, whatever `rmsnorm` says."""
        return "fused" if self.compile == "blocks" else self.rmsnorm

    @property
    def sharding_stage(self) -> int:
        """The ZeRO stage whose sharding this layout has: FSDP counts as 3."""
        return 3 if self.fsdp else self.zero_stage

    def __post_init__(self) -> None:
        # the spec's selective_op (harness/model/op_checkpoint.py) is torchtitan's per-op policy, which the planner
        # models as activation_checkpointing "selective" with selective_policy "per_op" (memory_recipes.py)
        if self.activation_checkpointing == "selective_op":
            object.__setattr__(self, "activation_checkpointing", "selective")
            object.__setattr__(self, "selective_policy", "per_op")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_spec(cls, layout: dict, precision: str = "bf16") -> PlannerLayout:
        """The planner's view of a spec layout (a harness.spec.Layout as a dict, as records keep
        it): a missing, null or empty field takes the spec's default; engine single is one GPU (every
        degree 1); the engine itself is not carried (whose memory is modelled is the caller's choice, the
        study's by default), fsdp is whether it is engine fsdp. `precision`: the workload's (fp8 is the
        planner's fp8, anything else its bf16 time model)."""
        spec = asdict(SpecLayout())
        lay = {**spec, **{k: v for k, v in layout.items() if v not in (None, "")}}
        given = {f.name: _CAST[f.type](lay[f.name]) for f in _SPEC_FIELDS if f.name != "engine"}
        if lay["engine"] == "single":
            given.update(dict.fromkeys(DEGREES, 1))
        return cls(**given, fsdp=lay["engine"] == "fsdp", precision="fp8" if precision == "fp8" else "bf16")

    def to_spec(self) -> dict:
        """This layout as a spec layout dict (engine own, or fsdp), the fields the planner has,
        in harness.spec.Layout's order. The spec checks it when it is run: the planner also
        describes layouts no engine runs (EXTRA_ATTENTION, ZeRO-2/3 without fsdp)."""
        engine = "fsdp" if self.fsdp else (self.engine if registry.known(self.engine) else "own")
        mine = {**asdict(self), "engine": engine}
        if self.activation_checkpointing == "selective" and self.selective_policy == "per_op":
            mine["activation_checkpointing"] = "selective_op"  # the spec's name of torchtitan's per-op policy
        return {f.name: mine[f.name] for f in dataclasses.fields(SpecLayout) if f.name in mine}


PlannerLayout = dataclasses.make_dataclass(
    "PlannerLayout",
    [(name, next(f.type for f in _SPEC_FIELDS if f.name == name)) for name in REQUIRED]
    + [(f.name, f.type, field(default=DEFAULTS.get(f.name, f.default))) for f in _SPEC_FIELDS if f.name not in REQUIRED]
    + [(f.name, f.type, field(default=f.default)) for f in dataclasses.fields(PlannerOwn)],
    bases=(_Planned,),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": """The planner's description of one layout (a candidate, a record's layout, a row of the study):
    harness.spec.Layout's fields (but UNMODELLED; the planner's DEFAULTS) and PlannerOwn's, values from
    harness.spec's lists, attention also from EXTRA_ATTENTION; unlike a spec layout it may describe
    layouts no engine runs.""",
    },
)


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch_size: int  # sequences per optimizer step
    dtype_bytes: int = 2  # bf16 mixed precision (2) or fp32 (4)
    optimizer: str = "adamw"  # workload.optimizer.name: muon keeps one state per block-matrix element (memory_terms)

    def micro_batches(self, lay: PlannerLayout) -> int:
        """Micro-batches per step per data-parallel replica (gradient accumulation x pipeline); the cp
        ranks of a replica share its sequences."""
        return micro_batch_count(self.global_batch_size, lay.dp, lay.micro_batch_size)

    def local(self, lay: PlannerLayout) -> Workload:
        """The workload one rank of the layout sees: seq_len / cp tokens of every sequence (its
        load-balanced chunks, harness.model.llama.cp_token_index)."""
        return self if lay.cp == 1 else _local_workload(self, lay.cp)


@functools.lru_cache(maxsize=256)
def _local_workload(wl: Workload, cp: int) -> Workload:
    return dataclasses.replace(wl, seq_len=wl.seq_len // cp)


@functools.lru_cache(maxsize=4096)
def _world(dims: ParallelDims) -> int:
    return dims.world


@functools.lru_cache(maxsize=4096)
def _replicas(dims: ParallelDims) -> int:
    return dims.replicas()


_DEGREES_OF = operator.attrgetter(*DEGREES)


@functools.lru_cache(maxsize=4096)  # a plan asks each layout's degrees many times
def _dims(*degrees: int) -> ParallelDims:
    return ParallelDims(**dict(zip(DEGREES, degrees, strict=True)))


def stage_items(shape: Shape, pp: int) -> list[tuple[bool, int, bool]]:
    """(has_embedding, layers, has_lm_head) per stage.

    A uniform split of the items [embedding, layer_1..layer_L, final norm, LM head], the first
    stages taking one more when it does not divide (Aleph Alpha scaling's `pipe_partition_uniform`,
    DeepSpeed's `partition_uniform`): the split the study's ranks used. The study and its
    published sweeps: baselines/paper_sweeps/README.md.
    """
    return list(item_split(shape.layers, pp))


@functools.lru_cache(maxsize=4096)
def item_split(n_layers: int, pp: int) -> tuple[tuple[bool, int, bool], ...]:
    """stage_items by layer count, as a tuple, cached: timing asks it per stage of every layout."""
    n_items = n_layers + 3
    base, extra = divmod(n_items, pp)
    out, start = [], 0
    for i in range(pp):
        size = base + (1 if i < extra else 0)
        end = start + size  # items [start, end); layers are items 1..n_layers
        layers = max(0, min(end, n_layers + 1) - max(start, 1))
        out.append((start == 0 and size > 0, layers, start <= n_items - 1 < end))
        start = end
    return tuple(out)
