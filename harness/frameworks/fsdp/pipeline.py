"""Pipeline parallelism for engine fsdp: torch.distributed.pipelining stages and schedules.

A stage is the plain model (harness/model/llama.py) holding only its pieces, torchtitan's way:
the blocks of a contiguous layer range (harness.engine.partition.rank_chunks, the same split as
the own engine), the embedding on the first stage, the final norm and LM head on the last, the
rest None; its forward is the plain model's. Parameter names are the plain Llama's
("layers.3.attention.wq.weight"), so weights load and gather by name. A rank holds one stage
(gpipe, 1f1b), virtual_stages of them (interleaved, zero_bubble: global stage c * pp + pp_rank, as
Megatron and torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble place them) or two
in a V (zbv, dualpipev: stages pp_rank and 2 pp - 1 - pp_rank, torch's "v" stage-to-rank mapping,
so the first rank holds the embedding and the LM head, and computes the loss).

Each stage's input and output shapes are given to PipelineStage up front (static metadata:
no inference forward/backward on the first step): tokens [mbs, seq] into the first stage,
the hidden state [mbs, seq / tp with sequence parallelism else seq, hidden] between stages
(each tp rank sends its local part to the same tp rank of the next stage), logits
[mbs, seq, vocab] out of the last; all in the policy's compute dtype (bf16 under bf16: the
stages send bf16 activations forward and bf16 gradients back, as the parameters FSDP2 gathers
are bf16; the receive buffers are allocated from this metadata).

Gradient accumulation: the schedules run every micro-batch's backward with FSDP2's gradient
sync off and reduce once after the last (PipelineStage.backward_maybe_with_nosync,
perform_reduce_grad), so FSDP2 accumulates in its reduce_dtype (the spec refuses pp with
grad_accum_dtype != grad_reduce_dtype: fsdp's ENGINE.precision_limits).

Loss: loss_fn is lm_loss / micro_batches with scale_grads=False, the reference's accumulation
(harness/frameworks/single/engine.py) term for term.
"""

from __future__ import annotations

import torch

from harness.engine.partition import rank_chunks
from harness.engine.schedules import Placement
from harness.model.llama import Llama, lm_loss
from harness.spec import model_chunks

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")  # the schedules that take one stage per rank, not a list


def _rank_plans(spec, shape, pp_rank: int):
    lay = spec.layout
    place = Placement.of(lay.pipeline_schedule, lay.pp, model_chunks(lay.pipeline_schedule, lay.virtual_stages))
    return rank_chunks(shape, place, pp_rank, spec.workload.seq_len)


def stage_table(spec, shape) -> list[dict]:
    """Every global stage: the pp rank holding it and its layers [start, stop), in stage order."""
    rows = [
        {"stage": p.stage, "pp_rank": r, "layers": [p.layers.start, p.layers.stop]}
        for r in range(spec.layout.pp)
        for p in _rank_plans(spec, shape, r)
    ]
    return sorted(rows, key=lambda row: row["stage"])


def split_model(spec, shape, pp_rank: int, **build):
    """This pp rank's stage models (Llama(shape, **build) holding the stage's pieces) and their
    plans (global stage index, layers, first/last). Each stage's rotary tables cover the whole
    sequence: under sequence parallelism its input holds seq / tp positions, but attention runs
    on the gathered sequence."""
    plans = _rank_plans(spec, shape, pp_rank)
    modules = [
        Llama(shape, layers=p.layers, first=p.first, last=p.last, seq_len=spec.workload.seq_len, **build) for p in plans
    ]
    return modules, plans


def _example_io(spec, shape, first: bool, last: bool, dtype: torch.dtype):
    """Meta tensors with the stage's local input and output shapes (see the module docstring)."""
    w, lay = spec.workload, spec.layout
    mbs = lay.micro_batch_size
    local_seq = w.seq_len // lay.tp if lay.sequence_parallel else w.seq_len
    hidden = torch.empty(mbs, local_seq, shape.hidden, dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty(mbs, w.seq_len, dtype=torch.long, device="meta")
    logits = torch.empty(mbs, w.seq_len, shape.vocab, dtype=dtype, device="meta", requires_grad=True)
    return (tokens if first else hidden), (logits if last else hidden)


class Pipeline:
    """This rank's PipelineStage objects and the schedule that runs them."""

    def __init__(self, modules, plans, spec, shape, pp_group, device, activation_dtype: torch.dtype):
        from torch.distributed import pipelining

        from harness.spec import micro_batches_per_step

        lay = spec.layout
        self.micro = micro_batches_per_step(spec)
        stages_total = lay.pp * len(plans)
        self.stages = []
        for module, plan in zip(modules, plans, strict=True):
            inputs, outputs = _example_io(spec, shape, plan.first, plan.last, activation_dtype)
            self.stages.append(
                pipelining.PipelineStage(
                    module, plan.stage, stages_total, device, input_args=inputs, output_args=outputs, group=pp_group
                )
            )
        self.has_first = any(p.first for p in plans)
        self.has_last = any(p.last for p in plans)
        cls = getattr(pipelining, SCHEDULES[lay.pipeline_schedule])
        micro = self.micro

        def loss_fn(logits, targets):
            return lm_loss(logits, targets) / micro

        stages = self.stages[0] if lay.pipeline_schedule in SINGLE_STAGE else self.stages
        self.schedule = cls(stages, n_microbatches=micro, loss_fn=loss_fn, scale_grads=False)
        self.name = cls.__name__
        self.table = stage_table(spec, shape)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One forward and backward of every micro-batch; the sum of the last stage's
        micro-batch losses (the local mean loss) there, zero elsewhere."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        if not losses:
            return torch.zeros((), device=inputs.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum()


def announce_phases(stage, hooks) -> None:
    """torch.distributed.pipelining's schedules run each micro-batch through the stage's public
    forward_one_chunk and backward_one_chunk and call nothing per micro-batch: wrapped here, on
    this stage only, to tell `hooks` (harness.model.training.StepHooks)."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(chunk, *args, **kwargs):
        hooks.forward(f"forward stage {stage.stage_index} micro-batch {chunk}")
        out = forward(chunk, *args, **kwargs)
        hooks.forward_end()
        return out

    def backward_one_chunk(chunk, *args, **kwargs):
        hooks.backward(f"backward stage {stage.stage_index} micro-batch {chunk}")
        return backward(chunk, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
