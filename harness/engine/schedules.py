"""Pipeline schedules as pure per-rank instruction lists, and a simulator that checks them.

A schedule is first a compute order per rank (which forward F and backward B of which
(model chunk, micro-batch) comes next); `program` then inserts the transfers: a RECV right
before a compute that needs a neighbour's tensor, a SEND right after a compute that produces
one, and STEP at the end. Sends are non-blocking and each directed pair of ranks is a FIFO
channel, so a program is correct when `simulate` runs it to the end: every receive is
eventually satisfied (no deadlock), the messages of every pair arrive in a consistent order,
and every micro-batch passes forward and backward through every stage exactly once.

Chunk c of pipeline rank r holds global stage c * pp + r (Megatron's interleaving), so with
one chunk per rank stage == rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str          # F, B, SEND_F, RECV_F, SEND_B, RECV_B, STEP
    chunk: int = 0
    micro: int = 0
    peer: int = -1     # pipeline rank on the other end of a transfer

    def __str__(self):
        if self.kind == "STEP":
            return "STEP"
        peer = f"@{self.peer}" if self.peer >= 0 else ""
        return f"{self.kind}{self.chunk}.{self.micro}{peer}"


# ------------------------------------------------------------------ compute orders


def gpipe_order(pp: int, rank: int, micro: int) -> list[tuple[str, int, int]]:
    return [("F", 0, m) for m in range(micro)] + [("B", 0, m) for m in range(micro)]


def one_f_one_b_order(pp: int, rank: int, micro: int) -> list[tuple[str, int, int]]:
    """PipeDream-flush: pp-rank-1 warm-up forwards, then alternate, then drain backwards."""
    warmup = min(pp - rank - 1, micro)
    order = [("F", 0, m) for m in range(warmup)]
    for i in range(micro - warmup):
        order += [("F", 0, warmup + i), ("B", 0, i)]
    order += [("B", 0, m) for m in range(micro - warmup, micro)]
    return order


def interleaved_order(pp: int, rank: int, micro: int, chunks: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B: micro-batches advance in groups of pp through the chunks."""
    if micro % pp:
        raise ValueError(f"interleaved needs micro-batches ({micro}) divisible by pp ({pp})")
    total = micro * chunks

    def fwd(k):
        return ("F", (k // pp) % chunks, (k // (pp * chunks)) * pp + k % pp)

    def bwd(k):
        return ("B", chunks - 1 - (k // pp) % chunks, (k // (pp * chunks)) * pp + k % pp)

    warmup = min((pp - rank - 1) * 2 + (chunks - 1) * pp, total)
    order = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [fwd(warmup + i), bwd(i)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def compute_order(schedule: str, pp: int, rank: int, micro: int, chunks: int = 1):
    if schedule == "gpipe":
        return gpipe_order(pp, rank, micro)
    if schedule == "1f1b":
        return one_f_one_b_order(pp, rank, micro)
    if schedule == "interleaved":
        return interleaved_order(pp, rank, micro, chunks)
    raise ValueError(f"unknown schedule {schedule!r}")


# ------------------------------------------------------------------ programs


def program(schedule: str, pp: int, rank: int, micro: int, chunks: int = 1) -> list[Action]:
    """The instruction list of one pipeline rank."""
    last_stage = pp * chunks - 1
    out: list[Action] = []
    for kind, c, m in compute_order(schedule, pp, rank, micro, chunks):
        stage = c * pp + rank
        if kind == "F":
            if stage > 0:
                out.append(Action("RECV_F", c, m, (stage - 1) % pp))
            out.append(Action("F", c, m))
            if stage < last_stage:
                out.append(Action("SEND_F", c, m, (stage + 1) % pp))
        else:
            if stage < last_stage:
                out.append(Action("RECV_B", c, m, (stage + 1) % pp))
            out.append(Action("B", c, m))
            if stage > 0:
                out.append(Action("SEND_B", c, m, (stage - 1) % pp))
    out.append(Action("STEP"))
    return out


def all_programs(schedule: str, pp: int, micro: int, chunks: int = 1) -> list[list[Action]]:
    return [program(schedule, pp, r, micro, chunks) for r in range(pp)]


def _label(rank: int, a: Action, pp: int) -> tuple:
    """(direction, sending stage, micro): unique per message within a step."""
    stage = a.chunk * pp + rank
    if a.kind == "SEND_F":
        return ("F", stage, a.micro)
    if a.kind == "SEND_B":
        return ("B", stage, a.micro)
    if a.kind == "RECV_F":
        return ("F", stage - 1, a.micro)
    if a.kind == "RECV_B":
        return ("B", stage + 1, a.micro)
    raise ValueError(a)


def send_order(programs: list[list[Action]], src: int, dst: int) -> list[tuple]:
    """Labels that pipeline rank src sends to dst, in order: the FIFO a receiver drains."""
    pp = len(programs)
    return [_label(src, a, pp) for a in programs[src] if a.kind.startswith("SEND") and a.peer == dst]


@dataclass
class Simulation:
    finish: float                         # time of the last STEP with unit costs
    timeline: list[list[tuple]]           # per rank: (kind, chunk, micro, start, end)
    peak_in_flight: list[int]             # per rank: most (chunk, micro) activations held at once


def simulate(programs: list[list[Action]], f_cost: float = 1.0, b_cost: float = 2.0) -> Simulation:
    """Run the programs with non-blocking sends and FIFO channels; raise on any inconsistency."""
    pp = len(programs)
    channels: dict[tuple[int, int], deque] = {}
    early: dict[tuple[int, int], dict] = {}
    pc = [0] * pp
    clock = [0.0] * pp
    timeline: list[list[tuple]] = [[] for _ in range(pp)]
    held = [set() for _ in range(pp)]
    peak = [0] * pp
    seen: dict[tuple, int] = {}
    while True:
        progressed = False
        for r in range(pp):
            while pc[r] < len(programs[r]):
                a = programs[r][pc[r]]
                if a.kind.startswith("RECV"):
                    want = _label(r, a, pp)
                    key = (a.peer, r)
                    buf = early.setdefault(key, {})
                    chan = channels.setdefault(key, deque())
                    while want not in buf and chan:
                        label, t = chan.popleft()
                        buf[label] = t
                    if want not in buf:
                        break  # blocked
                    clock[r] = max(clock[r], buf.pop(want))
                elif a.kind.startswith("SEND"):
                    channels.setdefault((r, a.peer), deque()).append((_label(r, a, pp), clock[r]))
                elif a.kind in ("F", "B"):
                    item = (a.chunk, a.micro)
                    if a.kind == "F":
                        if item in held[r]:
                            raise AssertionError(f"rank {r}: forward {item} twice")
                        held[r].add(item)
                        peak[r] = max(peak[r], len(held[r]))
                    else:
                        if item not in held[r]:
                            raise AssertionError(f"rank {r}: backward {item} before its forward")
                        held[r].remove(item)
                    k = (a.kind, a.chunk * pp + r, a.micro)
                    seen[k] = seen.get(k, 0) + 1
                    cost = f_cost if a.kind == "F" else b_cost
                    timeline[r].append((a.kind, a.chunk, a.micro, clock[r], clock[r] + cost))
                    clock[r] += cost
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(programs[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = {r: str(programs[r][pc[r]]) for r in range(pp) if pc[r] < len(programs[r])}
            raise AssertionError(f"deadlock: blocked at {stuck}")
    leftovers = {k: v for k, v in channels.items() if v} or {k: v for k, v in early.items() if v}
    if leftovers:
        raise AssertionError(f"messages sent but never received: {leftovers}")
    bad = {k: n for k, n in seen.items() if n != 1}
    if bad:
        raise AssertionError(f"computed more than once: {bad}")
    for r in range(pp):
        if held[r]:
            raise AssertionError(f"rank {r}: forwards without backward {sorted(held[r])}")
    return Simulation(max(clock), timeline, peak)


def draw(sim: Simulation, width_per_unit: int = 1) -> str:
    """ASCII chart of a simulated timeline: one row per rank, F as micro-batch digits, B as letters."""
    rows = []
    for r, events in enumerate(sim.timeline):
        line = [" "] * int(sim.finish * width_per_unit)
        for kind, chunk, micro, start, end in events:
            ch = str(micro % 10) if kind == "F" else "abcdefghij"[micro % 10]
            for t in range(int(start * width_per_unit), int(end * width_per_unit)):
                line[t] = ch
        rows.append(f"rank {r}: " + "".join(line))
    return "\n".join(rows)
