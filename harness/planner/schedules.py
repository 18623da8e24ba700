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
- zbv (ScheduleZBVZeroBubble, two chunks in a V): max(0, F + B - 3W) / (F + B) / 2: zero when F, B's
  input part and W take the same time.
- dualpipev (ScheduleDualPipeV): (p/2 - 1) / (p - 1) x max(0, F + 2B - 3W) / (F + B) / 2, with the
  README's F&B (one chunk's forward overlapped with another's backward) taken as F + B: no
  communication to hide in a dense model.

The split of a stage's time: F = t / 3 and B = 2t / 3 (backward twice the forward), W = g t / 3
where g is the share of the stage's time in GEMMs (the weight gradient is one of a linear's three
GEMMs; attention's backward has none). Recomputation is in B. The V schedules place chunk 0 of rank
r at stage r and chunk 1 at stage 2p - 1 - r; the planner's time keeps the split of p stages (the
slowest rank's layers as the even split gives them), its memory the V placement (memory_engines).
"""

from __future__ import annotations

from harness.spec import INTERLEAVED_SCHEDULES as INTERLEAVED  # chunks per rank: virtual_stages (at least 2)
from harness.spec import V_SCHEDULES, model_chunks  # V: two chunks per rank, the first rank the first and last

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zero_bubble", "zbv", "dualpipev")
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
        return max(0.0, 1.0 - 3 * w) / 2
    if schedule == "dualpipev":
        return (pp / 2 - 1) / (pp - 1) * max(0.0, 5 / 3 - 3 * w) / 2 if pp > 1 else 0.0
    return 1.0


def in_flight(schedule: str, virtual_stages: int, pp: int, stage: int, m: int) -> float:
    """Micro-batches (in units of the rank's layers) whose activations rank `stage` holds at peak."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule in INTERLEAVED and virtual_stages > 1:
        v = virtual_stages  # Megatron's warm-up count, in chunks of 1/v of the stage's layers
        return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v) / v
    if schedule in V_SCHEDULES:  # every rank as 1F1B's first: p micro-batches (DualPipeV p + 1)
        return float(min(pp + EXTRA_IN_FLIGHT.get(schedule, 0), m))
    return float(min(pp - stage, m))  # 1F1B (Narayanan et al. 2021, Sec. 2.2)


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
