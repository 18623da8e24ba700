"""engine: deepspeed with pp > 1 - the same LLaMA as a deepspeed.pipe.PipelineModule, trained by
DeepSpeed's PipelineEngine.train_batch() (its TrainSchedule: 1F1B), with ZeRO stage 0 or 1.

The pipeline's layers are the plain model (harness/model/llama.py) holding one piece each
(Llama's layers/first/last, as a pipeline stage of engine fsdp), each built on the stage that
holds it with its reference weights (by the plain names, bit-identical); their forward is the
plain model's:

  0            PipeLayer, the embedding                      tokens [b, s] -> h [b, s, hidden]
  1 .. L       PipeBlock, block i-1; rotary tables made once in fp32 for h.shape[1] and cast
               to the activation's dtype in its forward (bf16.enabled casts parameters, not
               buffers, so the tables are no buffers)
  L + 1        PipeLayer, the final norm and LM head         h -> logits [b, s, vocab]

and the loss is lm_loss(logits, targets) per micro-batch on the last stage. DeepSpeed divides
each micro-batch's loss by the micro-batch count and train_batch() returns their mean averaged
over data-parallel ranks and broadcast to every stage: the reference's loss.

Partition: the own engine's (harness.engine.partition.balanced_partition: contiguous blocks
minimising the costliest stage, the embedding on the first and the head on the last stage),
handed to PipelineModule as explicit layer boundaries - DeepSpeed's own methods ("uniform",
"parameters", "type:") count layers or parameters, not FLOPs.

Activation checkpointing: `full` is PipelineModule's own (activation_checkpoint_interval 1 over
the blocks, which it tells by their class, PipeBlock; deepspeed.checkpointing.checkpoint);
`selective` the model's attention-core recomputation inside each block.
"""

from __future__ import annotations

import functools

import torch

from harness.frameworks import gather_on_rank0
from harness.frameworks.deepspeed.common import DeepSpeedBase, configure_checkpointing, fp32_copy
from harness.model.llama import Llama, ReferenceWeights, lm_loss, load_reference, shape_rotary

PARTITION = "harness.engine.partition.balanced_partition (the own engine's), as explicit layer boundaries"


class PipeLayer(Llama):
    """One entry of PipelineModule's layer list: the plain model holding one piece (pieces:
    Llama's layers/first/last), built where DeepSpeed places it, with its reference weights."""

    def __init__(self, shape, seed: int, attention: str, rmsnorm_kind: str, checkpointing: str, **pieces):
        with torch.device("meta"):
            super().__init__(shape, attention, rmsnorm_kind, checkpointing, **pieces)
        load_reference(self, ReferenceWeights(shape, seed), "cpu")


@functools.lru_cache(maxsize=16)
def _rotary(shape, seq_len: int, device: str):
    return shape_rotary(shape, seq_len, torch.device(device))


class PipeBlock(PipeLayer):
    """A PipeLayer holding one block: what activation_checkpoint_interval checkpoints. Its rotary
    tables are made once per sequence length and device, and cast to the activation's dtype once
    per forward (each block is a forward of its own here, so the plain model's per-forward tables
    would be made, and kept for backward, once per block)."""

    def rotary(self, seq_len: int, device):
        return _rotary(self.shape, seq_len, str(device))

    def run_layers(self, h, cos, sin):
        return super().run_layers(h, cos.to(h.dtype), sin.to(h.dtype))


def _pipeline_module(layers, num_stages: int, parts: list[int], **kwargs):
    """A PipelineModule whose stage boundaries are `parts` (layer indices, len num_stages + 1)."""
    from deepspeed.pipe import PipelineModule

    class ExplicitlyPartitioned(PipelineModule):
        def _partition_layers(self, method="uniform"):
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return ExplicitlyPartitioned(layers=layers, num_stages=num_stages, partition_method="explicit", **kwargs)


def _count_every_stage_in_clipping(module) -> None:
    """ZeRO-0 under the pipeline engine clips fp32 gradients with deepspeed.runtime.utils.
    clip_grad_norm_(mpu=grid), which sums squares over the stages (the grid's model-parallel
    group) but counts a parameter only on model-parallel rank 0 - the first stage - unless it is
    marked model-parallel: the norm would be the first stage's alone and the gradients
    wrongly scaled (measured: weights off by up to 30% with clipping active). Every stage holds
    its own parameters, none replicated, so each is marked as such. (ZeRO-1 counts them right.)"""
    for param in module.parameters():
        param.model_parallel = True


def layer_boundaries(shape, pp: int, seq_len: int) -> list[int]:
    """PipelineModule layer indices where each stage starts (embedding = 0, block i = i + 1,
    head = L + 1), from the own engine's balanced partition of the blocks; then L + 2."""
    from harness.engine.partition import balanced_partition

    ranges = balanced_partition(shape, pp, seq_len)
    return [0] + [r.start + 1 for r in ranges[1:]] + [shape.layers + 2]


def plain_name(name: str) -> str:
    """PipelineModule's '<layer index>.<name>' as the plain Llama's parameter name (<name>)."""
    return name.split(".", 1)[1]


class DeepSpeedPipelineEngine(DeepSpeedBase):
    def __init__(self, spec, shape, ctx):
        super().__init__(spec, shape, ctx)
        import deepspeed
        from deepspeed.pipe import LayerSpec

        w, lay = spec.workload, spec.layout
        ckpt = lay.activation_checkpointing
        args = (shape, w.seed, lay.attention, lay.rmsnorm, "selective" if ckpt == "selective" else "none")
        layers = [LayerSpec(PipeLayer, *args, layers=range(0), last=False)]
        layers += [
            LayerSpec(PipeBlock, *args, layers=range(i, i + 1), first=False, last=False) for i in range(shape.layers)
        ]
        layers.append(LayerSpec(PipeLayer, *args, layers=range(0), first=False))
        self.parts = layer_boundaries(shape, lay.pp, w.seq_len)
        kwargs = {}
        if ckpt == "full":
            kwargs = {"activation_checkpoint_interval": 1, "checkpointable_layers": [PipeBlock.__name__]}
        module = _pipeline_module(layers, lay.pp, self.parts, loss_fn=lm_loss, **kwargs)
        if self.stage == 0:
            _count_every_stage_in_clipping(module)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module, model_parameters=[p for p in module.parameters() if p.requires_grad], config=self.config
        )
        self.after_initialize()
        if ckpt == "full":
            configure_checkpointing(self.config, None)  # no tensor parallelism under the pipeline
        self.dp_rank = self.engine.grid.get_data_parallel_rank()

    def train_step(self, global_batch: torch.Tensor) -> torch.Tensor:
        micro = self.local_micro_batches(global_batch, self.dp_rank)
        # the mean over micro-batches and data-parallel ranks, broadcast from the last stage
        loss = self.engine.train_batch(data_iter=iter(micro))
        self.check_step_applied()
        return loss

    def full_state_dict(self):
        """fp32 master weights of every stage on global rank 0 (None elsewhere); collective."""
        mine = {plain_name(n): fp32_copy(p) for n, p in self.engine.module.named_parameters()}
        return gather_on_rank0(mine if self.dp_rank == 0 else None)

    def router_stats(self) -> dict:
        return {}  # no MoE: the facts refuse MoE with pp

    def describe(self) -> dict:
        lay = self.spec.layout
        d = self.describe_common()
        bounds = self.parts
        d["pipeline"] = {
            "engine": "deepspeed.pipe.PipelineEngine.train_batch (TrainSchedule, 1F1B)",
            "micro_batches": self.config["gradient_accumulation_steps"],
            "partition": PARTITION,
            "stage_layers": [f"[{bounds[s]}, {bounds[s + 1]})" for s in range(lay.pp)],
            "layers": "0 embedding, 1..L blocks, L+1 norm + LM head",
        }
        d["activation_checkpointing"] = {
            "none": "none",
            "full": "PipelineModule activation_checkpoint_interval 1 over the blocks (deepspeed.checkpointing)",
            "selective": "model's attention-core recomputation (torch checkpoint) in each block",
        }[lay.activation_checkpointing]
        return d
