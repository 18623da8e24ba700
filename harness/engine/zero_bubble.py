"""Compute orders of the zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"), whose
backward is split in two: B computes only the gradient of the stage's input (what the previous stage waits
for), W later the gradients of the stage's weights (which nothing downstream waits for, so it fills bubbles).

zbv (the paper's ZB-V, Section 6): two model chunks per rank in a V, chunk 0 of rank r is stage r, chunk 1
is stage 2pp - 1 - r, so the first rank holds the first stage (the embedding) and the last one (the head
and the loss). The order is torch.distributed.pipelining's ScheduleZBVZeroBubble
(_calculate_single_rank_operations) as a list of (kind, chunk, micro-batch): the same schedule as engine
fsdp runs, here on the own engine's executor. Like torch, it plans max(2pp - 1, m) micro-batches and drops
the ones beyond m, so any m >= 1 runs.
"""

from __future__ import annotations

Op = tuple[str, int, int]  # (F | B | W, chunk, micro-batch)


def zbv_order(pp: int, rank: int, micro: int) -> list[Op]:
    n = max(2 * pp - 1, micro)
    ops: list[Op] = []
    f0 = f1 = b0 = b1 = 0

    def add(kind, chunk, m):
        ops.append((kind, chunk, m))

    for _ in range(2 * (pp - rank) - 1):  # warm-up: forwards down the V's first arm
        add("F", 0, f0)
        f0 += 1
    for _ in range(rank):
        add("F", 1, f1)
        f1 += 1
        add("F", 0, f0)
        f0 += 1
    for _ in range(pp - rank):  # the turn: the second arm's forward, its input and weight gradients
        add("F", 1, f1)
        f1 += 1
        add("B", 1, b1)
        add("W", 1, b1)
        b1 += 1
    while f1 < f0 or f0 < n:  # steady state: one F, B and W of each chunk
        if f0 < n:
            add("F", 0, f0)
            f0 += 1
        add("B", 0, b0)
        add("W", 0, b0)
        b0 += 1
        add("F", 1, f1)
        f1 += 1
        add("B", 1, b1)
        add("W", 1, b1)
        b1 += 1
    w0, w1 = b0, b1  # cool-down: input gradients first, the deferred weight gradients fill the tail
    for _ in range(rank):
        add("B", 0, b0)
        b0 += 1
        add("B", 1, b1)
        b1 += 1
    for _ in range(pp - rank):
        add("B", 0, b0)
        b0 += 1
        add("W", 0, w0)
        w0 += 1
    while w1 < b1:
        add("W", 1, w1)
        w1 += 1
    while w0 < b0:
        add("W", 0, w0)
        w0 += 1
    if not (w0 == b0 == f0 and w1 == b1 == f1):
        raise AssertionError(f"zbv order of rank {rank}: F, B and W counts differ")
    return [op for op in ops if op[2] < micro]
