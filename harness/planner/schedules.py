"""Pipeline schedules in the planner: model chunks per rank, the bubble, activations in flight.

One owner for what a schedule changes, read by timing (the bubble), features (the sends),
memory_terms (the in-flight activations) and candidates (which schedules and virtual stages a
layout may take). Notation of the DualPipe README's table (deepseek-ai/DualPipe), per micro-batch
of one chunk: F forward, B the whole backward, W its weight-gradient part (what the zero-bubble
schedules defer). 1F1B's bubble is (p - 1)(F + B); in units of a stage's time per micro-batch
t = F + B, the planner's bubble is (stages other than the slowest) x `bubble_factor`:

- gpipe, 1f1b: 1.
- interleaved (Narayanan et al. 2021): 1 / v with v chunks per rank.
- zero_bubble (torch's ScheduleInterleavedZeroBubble: ZB-H1 per chunk, Qi et al. 2024): (F + B - 2W)
  / (F + B) / v: the deferred W fills part of the bubble, at 1F1B's memory.
- zbv (torch's ScheduleZBVZeroBubble, two chunks in a V): max(2/3 (1 - g), 1/3 - g/6) with g below,
  whatever p (from 2 micro-batches per rank on): what its order leaves in the own engine's simulator
  (harness/engine/schedules.py runs torch's order, zero_bubble.py), exactly. The ZB-V paper's ideal
  (no bubble at F = B = W) is not what torch's order reaches: at g = 1 it keeps 1/6 of 1F1B's bubble.
- dualpipev (torch's ScheduleDualPipeV): no closed form here; the simulator's factor for torch's order
  (its overlapped forward-backward pairs run one after the other: a dense model has no all-to-all to
  hide), cached per p and g on a grid of 1/24, at 4p micro-batches (its steady state).

The split of a stage's time: F = t / 3 and B = 2t / 3 (backward twice the forward), W = g t / 3
where g is the share of the stage's time in GEMMs (the weight gradient is one of a linear's three
GEMMs; attention's backward has none). Recomputation is in B. The V schedules place chunk 0 of rank
r at stage r and chunk 1 at stage 2p - 1 - r; the planner's time keeps the split of p stages (the
slowest rank's layers as the even split gives them), its memory the V placement (memory_engines).
"""

from __future__ import annotations

import functools

from harness import spec
from harness.spec import INTERLEAVED_SCHEDULES as INTERLEAVED  # chunks per rank: virtual_stages (at least 2)
from harness.spec import V_SCHEDULES, model_chunks  # V: two chunks per rank, the first rank the first and last

# The schedules modelled here (bubble_factor, in_flight): the spec's through dualpipev, so one the spec adds
# later is not planned until modelled; listed (`harness plan --pipeline-schedule`) with the candidates' own
# first, 1F1B and interleaved (candidates.schedules_of).
SCHEDULES = tuple(sorted(spec.through(spec.SCHEDULES, "dualpipev"), key=lambda s: s not in ("1f1b", "interleaved")))
# In-flight micro-batches beyond 1F1B's: DualPipeV holds p + 1 (its README's table).
EXTRA_IN_FLIGHT = {"dualpipev": 1}


SHORT = {"interleaved": "vp", "zero_bubble": "zb", "dualpipev": "dpv"}


def schedule_label(lay) -> str:
    """The schedule in a table's five characters: 1f1b, gpipe, vp4 (interleaved, 4 chunks per rank),
    zb2 (zero_bubble), zbv, dpv (dualpipev); - without a pipeline."""
    if lay.pp == 1:
        return "-"
    name = SHORT.get(lay.pipeline_schedule, lay.pipeline_schedule)
    return f"{name}{lay.virtual_stages}" if lay.pipeline_schedule in INTERLEAVED else name


def chunks(schedule: str, virtual_stages: int) -> int:
    """Model chunks per pipeline rank (the spec's rule, harness.spec.model_chunks)."""
    return model_chunks(schedule, virtual_stages)


def bubble_factor(schedule: str, virtual_stages: int, pp: int, gemm_share: float) -> float:
    """The bubble as a fraction of 1F1B's (module docstring), `gemm_share` the GEMMs' share of the
    stage's time."""
    w = max(0.0, min(1.0, gemm_share)) / 3  # W / (F + B)
    if schedule == "interleaved":
        return 1.0 / virtual_stages
    if schedule == "zero_bubble":
        return (1.0 - 2 * w) / virtual_stages
    if schedule == "zbv":
        return max(2 * (1 - 3 * w) / 3, 1 / 3 - 3 * w / 6)
    if schedule == "dualpipev":
        return simulated_factor(schedule, pp, round(3 * w * GRID)) if pp > 1 else 0.0
    return 1.0


GRID = 24  # simulated_factor's steps of the GEMM share g


@functools.cache
def simulated_factor(schedule: str, pp: int, g_steps: int) -> float:
    """The bubble of torch's `schedule` order over 1F1B's, simulated (harness.engine.schedules: pure
    Python, no torch) with two chunks per rank, F = 1/6, the whole backward 1/3 and W = g/6 of a stage's
    time (g = g_steps / GRID), at 4pp micro-batches."""
    from harness.engine.schedules import all_programs, simulate

    m, g = 4 * pp, g_steps / GRID
    base = simulate(all_programs("1f1b", pp, m), 1 / 3, 2 / 3).finish - m
    return (simulate(all_programs(schedule, pp, m, 2), 1 / 6, 1 / 3, g / 6).finish - m) / base


def in_flight(schedule: str, virtual_stages: int, pp: int, stage: int, m: int, extra_warmup: int = 0) -> float:
    """Micro-batches (in units of the rank's layers) whose activations rank `stage` holds at peak;
    `extra_warmup` chunks more in an interleaved warm-up (Megatron's under overlap_moe_expert_parallel_comm)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in INTERLEAVED and virtual_stages > 1:
        v = virtual_stages  # Megatron's warm-up count, in chunks of 1/v of the stage's layers
        return min(2 * (pp - stage - 1) + (v - 1) * pp + 1 + extra_warmup, m * v) / v
    if schedule in V_SCHEDULES:  # every rank as 1F1B's first: p micro-batches (DualPipeV p + 1)
        return float(min(pp + EXTRA_IN_FLIGHT.get(schedule, 0), m))
    return float(min(pp - stage, m))  # 1F1B (Narayanan et al. 2021, Sec. 2.2)


def chunk_in_flight(virtual_stages: int, pp: int, stage: int, m: int, chunk: int) -> float:
    """torch's ScheduleInterleaved1F1B in one round (m < 2 pp: number_of_rounds = max(1, m // pp) = 1,
    microbatches_per_round = m): rank `stage` runs its backwards chunk by chunk, the last chunk's m first
    (backward_stage_index), after min((v - 1) m + 2 (pp - 1 - stage), m v) warm-up forwards
    (_get_warmup_ops); at `chunk`'s first backward it holds the forwards done less the backwards done,
    in units of the rank's layers (a chunk-forward is 1/v of them)."""
    v = virtual_stages
    warmup = min((v - 1) * m + 2 * (pp - 1 - stage), m * v)
    done = (v - 1 - chunk) * m  # backwards of the later chunks before this chunk's first
    return (min(warmup + 1 + done, m * v) - done) / v


def sends_per_micro_batch(schedule: str, virtual_stages: int, pp: int, stage: int) -> int:
    """Activations a rank sends and receives per micro-batch (each a forward tensor and, backward,
    its gradient): once per chunk boundary it holds; a V's turn at the last rank stays local."""
    if pp == 1:
        return 0
    edge = (1 if stage < pp - 1 else 0) + (1 if stage > 0 else 0)
    if schedule in V_SCHEDULES:
        return 2 * edge
    return edge * chunks(schedule, virtual_stages)


def virtual_stage_choices(layers: int, pp: int, asked: list[int] | None, even: bool) -> list[int]:
    """The virtual stages (chunks per rank, >= 2) an interleaved candidate at this pp takes: those
    asked (`--virtual-stages`) that split the layers (evenly when the engine needs it: Megatron-core),
    else every v >= 2 with pp x v dividing the layers."""
    if pp == 1:
        return []
    values = asked if asked is not None else [v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
    return [v for v in values if v >= 2 and pp * v <= layers and (not even or layers % (pp * v) == 0)]
