"""torchtitan's published memory is the caching allocator's reserved peak (torchtitan 9dec370, metrics.py:
reserved_bytes.all.peak; train.py logs it as "memory"), not the bytes of live tensors the planner predicts. This
traces a rank of engine fsdp at the layout of a torchtitan row on fake tensors at full size (`harness memory`'s
trace) with torchtitan's head, replays its allocations and frees through the caching allocator's rules over steps
(harness/memtrace/allocator.py), and prints the traced live peak (allocated), the replayed reserved peak with the
allocator's default segments and with expandable_segments:True (torchtitan's run_llama_train.sh sets it; its
multinode_trainer.slurm does not), the published figure and the planner's prediction; and, to check the planner's
reserve (harness/planner/memory_reserve.py) against the replay, the blocks of at least 1 GiB the replay leaves free
at its reserved peak beside the blocks the planner names (its allocator_reserve of the traced stage).

torchtitan's head, as 9dec370 runs it and engine fsdp does not (stand-ins of this script only):
  - under tp the LM head is ColwiseParallel with output_layouts Shard(-1) (loss_parallel: each rank's n x V/t
    logits), and loss_fn = cross_entropy(pred.flatten(0, 1).float(), labels) runs under torch's loss_parallel:
    its _log_softmax and _nll_loss_and_log_softmax_backward (torch/distributed/tensor/parallel/loss.py) allocate
    inside DTensor's dispatch, where a TorchDispatchMode does not see them, so the same ops run here on the local
    shard (LossParallel; the all-reduces of n-element maxima and sums left out);
  - the train step deletes pred before loss.backward() (here: the logits' storage freed after the loss);
  - eager and bf16 (the rows run torch.compile and Float8: their transients differ, not traced).
With --pp, the 405B rows of Table 5 too (FSDP8 TP8 PP8, 8 micro-batches of 4, all traced, on the first and the
last stage's rank): the pipeline's loss the same (no `del pred` there: 9dec370 deletes it only without
pipelining) and torch.distributed.pipelining's step(return_outputs=True), the default torchtitan then took
(the last stage keeps every micro-batch's logits). A stage takes minutes.

    python benchmarks/torchtitan_reserved.py [--pp]
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import harness.frameworks.fsdp.engine as fsdp_engine
import harness.frameworks.fsdp.tp as fsdp_tp
from harness.memtrace.trace import trace_rank
from harness.planner.published import load, memory_check
from harness.spec import parse_spec
from harness.testing.workloads import tiny_workload

GIB = 2**30
ROWS = {  # label fragment of the published row: (model, global batch, layout)
    "LLAMA3_70B 256 GPUs Float8 (2D FSDP32": (
        "llama3-70b",
        512,
        {"dp": 32, "tp": 8, "sequence_parallel": True, "micro_batch_size": 16, "activation_checkpointing": "full"},
    ),
    "LLAMA3_8B 8 GPUs BF16 (FSDP)": ("llama3-8b", 16, {"dp": 8, "micro_batch_size": 2}),
    "torchao torch 2.7.0a0 ao 0.10.0 H100 LLAMA3_8B 8 GPUs BF16": ("llama3-8b", 8, {"dp": 8, "micro_batch_size": 1}),
}
_TP = [1]  # the traced layout's tp (loss_fn reads it)
PP_ROWS = {  # the 405B rows of Table 5: schedule, virtual stages
    "405B 512 GPUs Float8 (1F1B)": ("1f1b", 1),
    "405B 512 GPUs Float8 (Interleaved 1F1B)": ("interleaved", 2),
}
PP = {"tp": 8, "pp": 8, "dp": 8, "sequence_parallel": True, "micro_batch_size": 4, "activation_checkpointing": "full"}
BASE = {"engine": "fsdp", "activation_checkpointing": "selective_op", "attention": "sdpa", "rmsnorm": "torch"}


class LossParallel(torch.autograd.Function):
    """torch's loss_parallel cross-entropy on a rank's n x V/t fp32 logits, op for op as loss.py allocates:
    forward x - max, exp, sum, the log-softmax kept; backward zeros_like, the -1 at the targets, exp(x),
    the sum and the product with grad_output."""

    @staticmethod
    def forward(ctx, x, target):
        shifted = x - torch.amax(x, 1, keepdim=True)
        result = shifted - torch.log(torch.sum(torch.exp(shifted), 1, keepdim=True))
        del shifted
        ctx.save_for_backward(result, target)
        return -torch.gather(result, 1, target.clamp(0, x.shape[1] - 1).unsqueeze(1)).mean()

    @staticmethod
    def backward(ctx, grad_output):
        x, target = ctx.saved_tensors
        grad_input = torch.zeros_like(x)
        grad_input[torch.arange(x.shape[0]), target.clamp(0, x.shape[1] - 1)] = -1.0
        return (grad_input + torch.exp(x)) * (grad_output / target.numel()), None


def _outer_plan(plain):
    def outer_plan(module, sequence_parallel):
        plan = plain(module, sequence_parallel)
        if "output" in plan:  # torchtitan's head under loss_parallel: the logits stay sharded on the vocabulary
            seq = fsdp_tp._sequence_layout(sequence_parallel)
            plan["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1))
        return plan

    return outer_plan


def loss_fn(pred, labels):
    """torchtitan's loss_fn (under loss_parallel where tp > 1), then its `del pred` (the bf16 logits freed
    before backward)."""
    x = pred.flatten(0, 1).float()
    loss = (LossParallel.apply if _TP[0] > 1 else F.cross_entropy)(x, labels.flatten(0, 1))
    del x
    pred.untyped_storage().resize_(0)
    return loss


def pipelined_loss(pred, labels):
    """The pipeline's loss_fn under loss_parallel (torchtitan deletes no pred there), over its micro-batches."""
    return LossParallel.apply(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def _returning_outputs(plain):
    def step(self, *args, **kwargs):
        kwargs["return_outputs"] = True  # torch's default, which torchtitan passed until e5ef99a (2025-10)
        return plain(self, *args, **kwargs)

    return step


_EVENTS = {}  # the last traced step's events and what it held (step.reserved_bytes, wrapped in main)


def _print(run, tr, where: str, t: float, stage: int = 0) -> None:
    from harness.memtrace.allocator import replay
    from harness.planner import memory_reserve
    from harness.planner.memory import stage_memory

    got, check = tr.extra["reserved"], memory_check(run)
    print(
        f"{(run.label + where)[:60]:60} {tr.live_peak_bytes / GIB:9.2f} {got['segments'] / GIB:9.2f} "
        f"{got['expandable'] / GIB:8.2f} {check.published_gib:9.2f} {check.predicted_gib:8.2f}"
        f"  peak at {tr.peak_at}; traced in {time.perf_counter() - t:.0f} s",
        flush=True,
    )
    free = sorted((b for b in replay(*_EVENTS["step"]).free_at_peak if b >= GIB), reverse=True)
    more = f" and {len(free) - 6} more" if len(free) > 6 else ""
    lay, wl, shape = run.layout, run.workload, run.shape
    has_head = stage == lay.pp - 1
    shards = lay.tp if lay.tp > 1 else 1  # torchtitan's loss_parallel
    n = lay.micro_batch_size * wl.local(lay).seq_len
    kept = lay.pp_outputs_kept * (lay.pp > 1) * wl.micro_batches(lay) * n * shape.vocab / shards * wl.dtype_bytes
    named = {
        "logits freed before the loss's backward": memory_reserve.logits_block(shape, lay, wl, has_head, shards),
        "merged outputs": memory_reserve.merged_outputs_block(shape, lay, wl, stage == 0, has_head, kept, shards),
    }
    part = stage_memory(shape, lay, wl, stage).get("allocator_reserve", 0.0)
    grown = stage_memory(shape, dataclasses.replace(lay, expandable_segments=True), wl, stage)
    print(
        f"    replay: free at its reserved peak {', '.join(f'{b / GIB:.2f}' for b in free[:6]) or 'none'}{more} GiB "
        "(blocks >= 1 GiB); "
        f"planner: {'; '.join(f'{k} {v / GIB:.2f}' for k, v in named.items() if v) or 'no block'} GiB "
        f"(allocator_reserve {part / GIB:.2f} GiB at its stage {stage}; under expandable_segments its stage "
        f"{grown['total'] / GIB:.2f} GiB)",
        flush=True,
    )


def main() -> None:
    import torch.distributed.pipelining.schedules as schedules

    import harness.frameworks.fsdp.pipeline as fsdp_pipeline
    import harness.memtrace.step as step
    from harness.memtrace.trace import stage_ranks

    plain = step.reserved_bytes

    def keeping(events, held):
        _EVENTS["step"] = (list(events), dict(held))
        return plain(events, held)

    step.reserved_bytes = keeping
    fsdp_tp.outer_plan = _outer_plan(fsdp_tp.outer_plan)
    fsdp_engine.lm_loss = loss_fn
    fsdp_pipeline.lm_loss = pipelined_loss
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):  # 1F1B's and the interleaved
        cls.step = _returning_outputs(cls.step)
    runs = load()
    print(f"{'row':60} {'allocated':>9} {'reserved':>9} {'expand.':>8} {'published':>9} {'planner':>8}  (GiB)")
    for part, (model, gbs, lay) in ROWS.items():
        run = next(r for r in runs if part in r.label)
        raw = {**tiny_workload(model=model, seq_len=8192, steps=2, warmup_steps=0), "global_batch_size": gbs}
        _TP[0] = lay.get("tp", 1)
        spec = parse_spec({"workload": {**raw, "precision": "bf16"}, "layout": {**BASE, **lay}})
        t = time.perf_counter()
        _print(run, trace_rank(spec, spec.shape(), 0), "", t)
    if "--pp" not in sys.argv:
        return
    _TP[0] = 8
    for part, (schedule, v) in PP_ROWS.items():
        run = next(r for r in runs if part in r.label)
        raw = {**tiny_workload(model="llama3-405b", seq_len=8192, steps=2, warmup_steps=0), "global_batch_size": 256}
        lay = {**BASE, **PP, "pipeline_schedule": schedule, "virtual_stages": v, "reshard_after_forward": False}
        spec = parse_spec({"workload": {**raw, "precision": "bf16"}, "layout": lay})
        for stage in (0, 7):
            t = time.perf_counter()
            tr = trace_rank(spec, spec.shape(), stage_ranks(spec.layout)[stage], full_micro=True)
            _print(run, tr, f" stage {stage}", t, stage)


if __name__ == "__main__":
    main()
