"""Pipeline schedules as pure per-rank instruction lists, and a simulator that checks them.

A schedule is first a compute order per rank (which forward F and backward B of which
(model chunk, micro-batch) comes next); `program` then inserts the transfers: a RECV right
before a compute that needs a neighbour's tensor, a SEND right after a compute that produces
one, and STEP at the end. Sends are non-blocking and each directed pair of ranks is a FIFO
channel, so a program is correct when `simulate` runs it to the end: every receive is
eventually satisfied (no deadlock), the messages of every pair arrive in a consistent order,
and every micro-batch passes forward and backward through every stage exactly once.

Chunk c of pipeline rank r holds global stage c * pp + r (Megatron's interleaving), so with
one chunk per rank stage == rank; the V schedules (zbv) place chunk 0 at stage r and chunk 1 at
stage 2pp - 1 - r (Placement). The zero-bubble schedules (zero_bubble, zbv, dualpipev) split the
backward: B computes the input gradient only (the one the previous stage waits for), W later the
weight gradients (harness/engine/zero_bubble.py); a (chunk, micro-batch) without a W has a whole B.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from harness.engine.zero_bubble import dualpipev_order, zbv_order, zero_bubble_order
from harness.spec import V_SCHEDULES


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B, STEP
    chunk: int = 0
    micro: int = 0
    peer: int = -1  # pipeline rank on the other end of a transfer
    stage: int = -1  # the global stage of (rank, chunk)

    def __str__(self):
        if self.kind == "STEP":
            return "STEP"
        peer = f"@{self.peer}" if self.peer >= 0 else ""
        return f"{self.kind}{self.chunk}.{self.micro}{peer}"


@dataclass(frozen=True)
class Placement:
    """Which global stage each (pipeline rank, chunk) holds: interleaved (stage c * pp + r) or a V
    (two chunks, stage r and 2pp - 1 - r: the first rank holds the first and the last stage)."""

    pp: int
    chunks: int = 1
    v: bool = False

    @classmethod
    def of(cls, schedule: str, pp: int, chunks: int = 1) -> Placement:
        v = schedule in V_SCHEDULES
        return cls(pp, 2 if v else chunks, v)

    @property
    def last(self) -> int:
        return self.pp * self.chunks - 1

    def stage(self, rank: int, chunk: int) -> int:
        return self.last - rank if self.v and chunk == 1 else chunk * self.pp + rank

    def rank(self, stage: int) -> int:
        return self.last - stage if self.v and stage >= self.pp else stage % self.pp


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
    if schedule == "zbv":
        return zbv_order(pp, rank, micro)
    if schedule == "zero_bubble":
        return zero_bubble_order(pp, rank, micro, chunks)
    if schedule == "dualpipev":
        return dualpipev_order(pp, rank, micro)
    raise ValueError(f"unknown schedule {schedule!r}")


# ------------------------------------------------------------------ programs


def program(schedule: str, pp: int, rank: int, micro: int, chunks: int = 1) -> list[Action]:
    """The instruction list of one pipeline rank."""
    place = Placement.of(schedule, pp, chunks)
    last_stage = place.last
    out: list[Action] = []
    for kind, c, m in compute_order(schedule, pp, rank, micro, chunks):
        stage = place.stage(rank, c)
        if kind == "F":
            if stage > 0:
                out.append(Action("RECV_F", c, m, place.rank(stage - 1), stage))
            out.append(Action("F", c, m, -1, stage))
            if stage < last_stage:
                out.append(Action("SEND_F", c, m, place.rank(stage + 1), stage))
        elif kind == "W":
            out.append(Action("W", c, m, -1, stage))
        else:
            if stage < last_stage:
                out.append(Action("RECV_B", c, m, place.rank(stage + 1), stage))
            out.append(Action("B", c, m, -1, stage))
            if stage > 0:
                out.append(Action("SEND_B", c, m, place.rank(stage - 1), stage))
    out.append(Action("STEP"))
    return out


def all_programs(schedule: str, pp: int, micro: int, chunks: int = 1) -> list[list[Action]]:
    return [program(schedule, pp, r, micro, chunks) for r in range(pp)]


def transfer_label(a: Action) -> tuple:
    """(direction, sending stage, micro): unique per message within a step."""
    stage = a.stage
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
    return [transfer_label(a) for a in programs[src] if a.kind.startswith("SEND") and a.peer == dst]


@dataclass
class Simulation:
    finish: float  # time of the last STEP with unit costs
    timeline: list[list[tuple]]  # per rank: (kind, chunk, micro, start, end)
    peak_in_flight: list[int]  # per rank: most (chunk, micro) activations held at once


def compute_cost(a: Action, split: bool, f_cost: float, b_cost: float, w_cost: float | None, costs=None) -> float:
    """F costs f_cost; b_cost is the whole backward, of which a split B (input gradient only) takes all
    but w_cost and its W the rest (w_cost None: half of it). `costs` ({(kind, stage): seconds}, e.g.
    measured) overrides them where it has the action's kind and stage."""
    if costs is not None and (a.kind, a.stage) in costs:
        return costs[(a.kind, a.stage)]
    w = b_cost / 2 if w_cost is None else w_cost
    if a.kind == "F":
        return f_cost
    if a.kind == "W":
        return w
    return b_cost - w if split else b_cost


def split_items(program: list[Action]) -> set[tuple[int, int]]:
    """The (chunk, micro) whose backward the program splits into B and W."""
    return {(a.chunk, a.micro) for a in program if a.kind == "W"}


def simulate(
    programs: list[list[Action]],
    f_cost: float = 1.0,
    b_cost: float = 2.0,
    w_cost: float | None = None,
    costs: dict | None = None,
) -> Simulation:
    """Run the programs with non-blocking sends and FIFO channels; raise on any inconsistency.

    Checked: no deadlock, every message received, every (stage, micro-batch) forward and backward
    exactly once, each backward after its forward and each W after its B. An item's activations are
    held from its F to its B, or to its W where the backward is split (W needs the saved inputs)."""
    pp = len(programs)
    splits = [split_items(p) for p in programs]
    waiting_w = [set() for _ in range(pp)]
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
                    want = transfer_label(a)
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
                    channels.setdefault((r, a.peer), deque()).append((transfer_label(a), clock[r]))
                elif a.kind in ("F", "B", "W"):
                    item = (a.chunk, a.micro)
                    split = item in splits[r]
                    if a.kind == "F":
                        if item in held[r]:
                            raise AssertionError(f"rank {r}: forward {item} twice")
                        held[r].add(item)
                        peak[r] = max(peak[r], len(held[r]))
                    elif a.kind == "B":
                        if item not in held[r] or item in waiting_w[r]:
                            raise AssertionError(f"rank {r}: backward {item} before its forward")
                        (waiting_w[r].add if split else held[r].remove)(item)
                    else:
                        if item not in waiting_w[r]:
                            raise AssertionError(f"rank {r}: weight gradient {item} before its input gradient")
                        waiting_w[r].remove(item)
                        held[r].remove(item)
                    k = (a.kind, a.stage, a.micro)
                    seen[k] = seen.get(k, 0) + 1
                    cost = compute_cost(a, split, f_cost, b_cost, w_cost, costs)
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
    stages = 1 + max((k[1] for k in seen), default=-1)
    micro = 1 + max((k[2] for k in seen), default=-1)
    missing = [(k, s, m) for k in "FB" for s in range(stages) for m in range(micro) if (k, s, m) not in seen]
    if missing:
        raise AssertionError(f"never computed: {missing[:8]}")
    for r in range(pp):
        if held[r]:
            raise AssertionError(f"rank {r}: forwards without backward {sorted(held[r])}")
    return Simulation(max(clock), timeline, peak)


# ------------------------------------------------------------------ grouped transfers (NCCL)


@dataclass(frozen=True)
class Transfer:
    op: str  # send | recv
    peer: int
    label: tuple  # (direction, sending stage, micro)


def grouped_program(programs: list[list[Action]], rank: int) -> list:
    """The rank's program with the transfers between two computes merged into one group.

    Items are Actions (F, B, STEP) or lists of Transfers. Receives are issued in the sender's
    order (earlier messages first, kept until needed), so each directed pair is a FIFO on both
    ends. A group is posted at once (batch_isend_irecv) and completes as a whole: NCCL needs
    this, because a lone blocking send to a rank that is itself sending to us deadlocks.
    """
    pp = len(programs)
    order = {p: send_order(programs, p, rank) for p in range(pp) if p != rank}
    nxt = {p: 0 for p in order}
    have: set = set()
    out: list = []
    group: list[Transfer] = []
    for a in programs[rank]:
        if a.kind.startswith("SEND"):
            if a.peer != rank:
                group.append(Transfer("send", a.peer, transfer_label(a)))
        elif a.kind.startswith("RECV"):
            want = transfer_label(a)
            if a.peer != rank and want not in have:
                while True:
                    label = order[a.peer][nxt[a.peer]]
                    nxt[a.peer] += 1
                    group.append(Transfer("recv", a.peer, label))
                    have.add(label)
                    if label == want:
                        break
            have.discard(want)
        else:
            if group:
                out.append(group)
                group = []
            out.append(a)
    if group:
        out.insert(len(out) - 1, group)  # trailing sends go before STEP
    return out


def run_grouped(progs: list[list], f_cost: float, b_cost: float, w_cost: float | None = None):
    """Strict group semantics: a group finishes only when every transfer in it meets its
    partner (posted by the peer, now or earlier), and its rank waits for it before going on.
    Returns (finish time, None) or (None, {rank: (item index, transfers still unmatched)})."""
    pp = len(progs)
    pc = [0] * pp
    clock = [0.0] * pp
    posted: dict[tuple, float] = {}  # (op, src, dst, label) -> time posted

    def key(r, t):
        return ("send", r, t.peer, t.label) if t.op == "send" else ("recv", t.peer, r, t.label)

    splits = [{(a.chunk, a.micro) for a in prog if isinstance(a, Action) and a.kind == "W"} for prog in progs]

    def partner(k):
        return ("recv" if k[0] == "send" else "send",) + k[1:]

    while True:
        progressed = False
        for r in range(pp):
            while pc[r] < len(progs[r]):
                item = progs[r][pc[r]]
                if isinstance(item, list):
                    keys = [key(r, t) for t in item]
                    for k in keys:
                        posted.setdefault(k, clock[r])
                    if not all(partner(k) in posted for k in keys):
                        break
                    clock[r] = max([clock[r]] + [posted[partner(k)] for k in keys])
                elif item.kind in ("F", "B", "W"):
                    clock[r] += compute_cost(item, (item.chunk, item.micro) in splits[r], f_cost, b_cost, w_cost)
                pc[r] += 1
                progressed = True
        if all(pc[r] == len(progs[r]) for r in range(pp)):
            return max(clock), None
        if not progressed:
            stuck = {}
            for r in range(pp):
                if pc[r] < len(progs[r]):
                    item = progs[r][pc[r]]
                    stuck[r] = (pc[r], [t for t in item if partner(key(r, t)) not in posted])
            return None, stuck


def grouped_programs(programs: list[list[Action]]) -> list[list]:
    """Every rank's grouped program, with sends deferred where strict groups would deadlock.

    Interleaved schedules make two neighbours each send the other a message the other does
    not want yet (Megatron fuses the transfers of a forward and a backward into one group for
    this reason). Here the simulator finds each such cycle and moves the blocking sends (and
    later sends to the same peer, keeping the FIFO) into the rank's next group, until the
    whole step runs. A send is never deferred past STEP. (Pulling the receives earlier
    instead was tried: it makes receivers wait longer and the step slower.)
    """
    pp = len(programs)
    progs = [grouped_program(programs, r) for r in range(pp)]
    for _ in range(1_000_000):
        _, stuck = run_grouped(progs, 1.0, 2.0)
        if stuck is None:
            return [[item for item in prog if not (isinstance(item, list) and not item)] for prog in progs]
        moved = False
        for r, (i, missing) in stuck.items():
            blocked = [t for t in missing if t.op == "send"]
            if not blocked:
                continue
            group = progs[r][i]
            cut: dict[int, int] = {}
            for k, t in enumerate(group):
                if t in blocked and t.peer not in cut:
                    cut[t.peer] = k
            defer = [t for k, t in enumerate(group) if t.op == "send" and t.peer in cut and k >= cut[t.peer]]
            j = i + 1  # the next compute; the deferred sends join the group right after it
            while j < len(progs[r]) and isinstance(progs[r][j], list):
                j += 1
            if j >= len(progs[r]) or progs[r][j].kind == "STEP":
                raise AssertionError(f"grouped deadlock at rank {r}: cannot defer {defer} past STEP")
            if j + 1 < len(progs[r]) and isinstance(progs[r][j + 1], list):
                progs[r][j + 1] = defer + progs[r][j + 1]
            else:
                progs[r].insert(j + 1, defer)
            progs[r][i] = [t for t in group if t not in defer]
            moved = True
        if not moved:
            raise AssertionError(f"grouped deadlock with only receives blocked: {stuck}")
    raise AssertionError("grouping did not converge")
