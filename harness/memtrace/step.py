"""One traced step of one rank, whatever the engine: the spec it runs (traced_spec), the
counters beside the live one (live.py) and what they add up to (RankTrace). The per-engine tracers
(own.py, fsdp.py) build their engine and run its step through these.

  census        the engine's own census tensors (harness.measure.census.CensusAtStep's list) at the
                first optimizer step, by category and dtype, each storage once
  saved         bytes autograd saves for backward (saved-tensor hooks), parameters excluded,
                as harness.measure.census.SavedActivations counts them, and those of one forward

The traced step is a steady-state one: AdamW's states are created before it
(create_optimizer_states), as the previous step would have left them.
The micro-batches per step are cut to the fewest that reach the schedule's steady state (its
largest number of micro-batches in flight): every one for gpipe, min(m, pp - stage + 1) for
1F1B (stage s holds pp - s; one more passes through the steady state), min(m, 2 pp) for the
interleaved schedule, min(m, 2) without a pipeline (gradient accumulation). The model states,
buckets and reductions do not depend on the count, and one more micro-batch repeats the same
allocations in the same order. train_step's loss is a fake tensor, whose value nobody reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from harness.measure.census import storage_identity, tensor_census
from harness.memtrace.live import LiveTensors
from harness.memtrace.standins import traced_attention
from harness.model.training import StepHooks
from harness.spec import INTERLEAVED_SCHEDULES, V_SCHEDULES, micro_batches_per_step


def traced_micro_batches(lay, m: int, stage: int) -> int:
    """Micro-batches the trace runs on `stage` (module docstring): the fewest that reach the
    schedule's largest number in flight there, and pass through its steady state once."""
    if lay.pp == 1 and lay.virtual_stages == 1:
        return min(m, 2)
    if lay.pipeline_schedule == "gpipe":
        return m
    if lay.pipeline_schedule in (*INTERLEAVED_SCHEDULES, *V_SCHEDULES):
        # zbv: every rank reaches its peak (2 pp half-stage chunks) within 2 pp - 1 (the simulator's count);
        # 2 pp also meets torch's ScheduleDualPipeV (at least 2 pp) and ScheduleInterleavedZeroBubble (rounds)
        return min(m, 2 * lay.pp)
    return min(m, lay.pp - stage + 1)  # 1F1B: pp - stage in flight after the warm-up


def traced_spec(spec, stage: int = 0, full_micro: bool = False, micro_batches=traced_micro_batches):
    """The spec the trace runs: the substituted kernels, NCCL's transfers, fewer micro-batches
    (`micro_batches(lay, m, stage)`: traced_micro_batches, or an engine's own rule where its
    schedule differs). Each stage runs its own program only, so each may run its own count."""
    lay = spec.layout
    m = micro_batches_per_step(spec)
    m_run = m if full_micro else micro_batches(lay, m, stage)
    new_lay = dataclasses.replace(
        lay,
        attention=traced_attention(lay.attention),
        pipeline_p2p="grouped" if lay.pipeline_p2p == "auto" and lay.pp > 1 else lay.pipeline_p2p,
    )
    batch = spec.workload.global_batch_size // m * m_run  # m_run of the step's m micro-batches
    wl = dataclasses.replace(spec.workload, global_batch_size=batch, device="cpu")
    return dataclasses.replace(spec, layout=new_lay, workload=wl), m, m_run


@dataclass
class RankTrace:
    rank: int
    stage: int
    layers: list
    census: dict  # category -> dtype -> bytes, at the optimizer step
    states_bytes: int  # live bytes when the step starts (model states and buffers)
    live_peak_bytes: int  # the largest live bytes during the step
    peak_at: str  # where in the step it occurred
    forward_backward_peak_bytes: int
    optimizer_peak_bytes: int
    saved_bytes_step: int  # saved for backward over the step (each storage once while saved)
    saved_bytes_forward: int  # saved by the first forward of the step
    micro_batches: int  # per step in the workload
    micro_batches_traced: int
    seconds: float
    extra: dict = field(default_factory=dict)


def create_optimizer_states(optimizer) -> None:
    """What a previous step leaves behind: AdamW's states exist at the start of every step but
    the first. One AdamW step on zero gradients creates them (a parameter whose gradient is not
    attached until the step gets a zero one for it, then none again)."""
    lent = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                lent.append(p)
    optimizer.step()
    for p in lent:
        p.grad = None


class Phases(StepHooks):
    """The trace's StepHooks: the live counter's phase named as the engine says, what the first
    forward saves (saved, set once the engine exists), and the forward/backward peak, kept when
    the optimizer phase starts."""

    def __init__(self, live: LiveTensors):
        self.live, self.saved = live, None
        self.start, self.first_forward = 0, None
        self.fb, self.fb_at, self.ended = 0, "", False

    def forward(self, where: str) -> None:
        self.live.where = where
        self.start = self.saved.bytes

    def forward_end(self) -> None:
        if self.first_forward is None:
            self.first_forward = self.saved.bytes - self.start

    def backward(self, where: str) -> None:
        self.live.where = where

    def optimizer(self, where: str) -> None:
        if not self.ended:
            self.ended = True
            self.fb, self.fb_at = self.live.peak, self.live.peak_at
            self.live.where = where
            self.live.reset_peak()


def run_step(eng, batch, live, saved, phases: Phases) -> tuple[int, int, int, int, str]:
    """One traced train_step: (live bytes at its start, its peak, the forward/backward peak, the
    optimizer step's peak, where the peak fell). Its loss, a fake tensor, has no value to read."""
    live.where = "step start"
    live.reset_peak()
    base = live.bytes
    phases.saved = saved
    held = dict(live.live)
    live.record_events()
    with saved:
        eng.train_step(batch)
    phases.reserved = reserved_bytes(live.events, held)
    live.events = None
    peak_opt, peak_fb = live.peak, phases.fb
    where = live.peak_at if peak_opt > peak_fb else phases.fb_at
    return base, max(peak_fb, peak_opt), peak_fb, peak_opt, where


def reserved_bytes(events, held: dict) -> dict[str, int]:
    """The caching allocator's peak reserved bytes over steps that each run the traced step's allocations
    and frees (allocator.replay), with and without expandable segments; and the live peak it replays."""
    from harness.memtrace.allocator import replay

    plain, grown = replay(events, held), replay(events, held, expandable=True)
    return {"segments": plain.peak_reserved, "expandable": grown.peak_reserved, "allocated": plain.peak_allocated}


def census_at_step(optimizer, held) -> dict:
    """The census of what `held()` lists (the engine's census list, CensusAtStep's, by category),
    taken at the optimizer's first step, by storage identity (fake storages have no address)."""
    census: dict = {}

    def take(*args):
        if not census:
            census.update(tensor_census(held(), key=storage_identity))

    optimizer.register_step_post_hook(take)
    return census


def rank_trace(rank, stage, layers, census, step, saved, phases, m, m_run) -> RankTrace:
    """The RankTrace of a traced step: `step` is what run_step returns."""
    base, peak, peak_fb, peak_opt, where = step
    return RankTrace(
        rank=rank,
        stage=stage,
        layers=layers,
        census=census,
        states_bytes=base,
        live_peak_bytes=peak,
        peak_at=where,
        forward_backward_peak_bytes=peak_fb,
        optimizer_peak_bytes=peak_opt,
        saved_bytes_step=saved.bytes,
        saved_bytes_forward=phases.first_forward or 0,
        micro_batches=m,
        micro_batches_traced=m_run,
        seconds=0.0,
        extra={"reserved": getattr(phases, "reserved", {})},
    )
