"""Compute orders of the zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"), whose
backward is split in two: B computes only the gradient of the stage's input (what the previous stage waits
for), W later the gradients of the stage's weights (which nothing downstream waits for, so it fills bubbles).

zbv (the paper's ZB-V, Section 6): two model chunks per rank in a V, chunk 0 of rank r is stage r, chunk 1
is stage 2pp - 1 - r, so the first rank holds the first stage (the embedding) and the last one (the head
and the loss). The order is torch.distributed.pipelining's ScheduleZBVZeroBubble
(_calculate_single_rank_operations) as a list of (kind, chunk, micro-batch): the same schedule as engine
fsdp runs, here on the own engine's executor. Like torch, it plans max(2pp - 1, m) micro-batches and drops
the ones beyond m, so any m >= 1 runs. zero_bubble (torch's ScheduleInterleavedZeroBubble, interleaved
chunks) and dualpipev (torch's ScheduleDualPipeV, a V) follow torch's orders the same way.
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


def zero_bubble_rounds(pp: int, micro: int) -> int:
    """Rounds of torch's ScheduleInterleavedZeroBubble: micro-batches go through the chunks in rounds of
    micro / rounds, which must divide evenly."""
    return max(1, micro // pp)


def zero_bubble_order(pp: int, rank: int, micro: int, chunks: int) -> list[Op]:
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble (ZB-H1 per chunk, interleaved chunks:
    chunk c is stage c * pp + rank): _get_warmup_ops and _get_1f1b_rank_ops with enable_zero_bubble, without
    the idle slots torch pads its table with (here a rank waits on its receives instead)."""
    rounds = zero_bubble_rounds(pp, micro)
    if micro % rounds:
        raise ValueError(f"zero_bubble needs micro-batches ({micro}) divisible by its rounds ({rounds})")
    per_round = micro // rounds
    warmup = min((chunks - 1) * per_round + (pp - 1 - rank), micro * chunks)
    steady = micro * chunks - warmup
    total = warmup + steady + warmup

    def fwd_chunk(step):
        return (step // per_round) % chunks

    def bwd_chunk(step):
        return chunks - 1 - ((step - warmup) // per_round) % chunks

    count = {("F", c): 0 for c in range(chunks)} | {("B", c): 0 for c in range(chunks)}
    count |= {("W", c): 0 for c in range(chunks)}
    ops: list[Op] = []

    def add(kind, chunk):
        ops.append((kind, chunk, count[(kind, chunk)]))
        count[(kind, chunk)] += 1

    backward_steps: list[int] = []
    weights = 0
    for step in range(total):
        if step < warmup + steady:
            add("F", fwd_chunk(step))
        if step >= warmup:
            add("B", bwd_chunk(step))
            backward_steps.append(step)
            if step - warmup >= rank:  # the first `rank` weight gradients wait for the cool-down
                add("W", bwd_chunk(backward_steps[weights]))
                weights += 1
    while weights < len(backward_steps):
        add("W", bwd_chunk(backward_steps[weights]))
        weights += 1
    return ops


def dualpipev_order(pp: int, rank: int, micro: int) -> list[Op]:
    """torch.distributed.pipelining's ScheduleDualPipeV (DeepSeek's DualPipe folded into a V, chunk 0 at
    stage rank, chunk 1 at 2pp - 1 - rank; _calculate_single_rank_operations). Its overlapped forward and
    backward pairs (F of one chunk with the whole backward of the other, to hide MoE all-to-alls) run here one
    after the other, forward first; a whole backward is B with no W. Needs m >= 2 pp."""
    if micro < 2 * pp:
        raise ValueError(f"dualpipev needs at least 2 x pp = {2 * pp} micro-batches, got {micro}")
    ops: list[Op] = []
    count: dict[tuple[str, int], int] = {}
    weights: list[tuple[int, int]] = []  # (chunk, micro) whose W is pending, oldest first

    def add(kind: str, chunk: int, whole: bool = False):
        key = ("B" if kind == "B" else kind, chunk)
        m = count.get(key, 0)
        count[key] = m + 1
        ops.append((kind, chunk, m))
        if kind == "B" and not whole:
            weights.append((chunk, m))

    def weight():
        if weights:
            chunk, m = weights.pop(0)
            ops.append(("W", chunk, m))

    for _ in range((pp - rank - 1) * 2):  # 1: F0
        add("F", 0)
    for _ in range(rank + 1):  # 2: F0 F1
        add("F", 0)
        add("F", 1)
    for _ in range(pp - rank - 1):  # 3: I1 W1 F1
        add("B", 1)
        weight()
        add("F", 1)
    for _ in range(micro - 2 * pp + rank + 1):  # 4: F0 B1, F1 B0 (overlapped pairs)
        add("F", 0)
        add("B", 1, whole=True)
        add("F", 1)
        add("B", 0, whole=True)
    for _ in range(pp - rank - 1):  # 5: B1, F1 B0
        add("B", 1, whole=True)
        add("F", 1)
        add("B", 0, whole=True)
    split = False
    for i in range(rank + 1):  # 6: B1 B0, the second half split
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        add("B", 1, whole=not split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        add("B", 0, whole=not split)
    for _ in range(pp - rank - 1):  # 7: W0 B0
        weight()
        add("B", 0, whole=not split)
    for _ in range(rank + 1):  # 8: W0
        weight()
    while weights:
        weight()
    return ops
