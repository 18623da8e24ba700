"""A run's profile as its record keeps it: every rank's breakdown, their mean, the collectives,
the trace files of rank 0 and of the slowest rank, and the own engine's counters beside them.

record["metrics"]: breakdown_ms (the mean over ranks of each rank's mean over the profiled
steps), breakdown_ms_by_rank, breakdown_source ("profiler", or "instrumented" when profiling is
off and the engine counts its own time), collectives (rank 0's, per step), compute_host_gaps_ms
(the profiled steps' host time between ops, the Python of a forward: their 'unattributed' component since
compute became the operators' time; before, a part of compute outside the sum), and,
for engines that count their own time, breakdown_instrumented_ms over the same profiled steps
(the reference the profiler is checked against); breakdown_measured_ms (counters.py: the median
measured step's, the mean over ranks; what the report explains with), its _by_rank, the step
indices it is of (breakdown_measured_steps) and the most clocked calls a measured step made
(breakdown_measured_calls_per_step); profile_wall_s, what the profiled steps, their trace's
export and its analysis took on the slowest rank. record["traces"]: [{"rank", "path", "role"}].
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict

import torch.distributed as dist

from harness.profiling import trace as trace_files
from harness.profiling.analysis import AXES, ONE_RANK, mean_step
from harness.profiling.counters import P2P


def from_instrumented(breakdown_s: dict, pp: int | None = None) -> dict:
    """The own engine's counters (seconds: compute, tp_comm, cp_comm under context parallelism, ep_comm
    under expert parallelism, dp_comm, bubble, optimizer, total) in the breakdown's shape, in ms; what
    they leave of the step is unattributed (no clock covers it: the report shows it apart, no component;
    negative where clocks overlap). With `pp` 1 the engine's 'bubble' (its wait at the world-wide
    reduction) is 'wait'."""
    ms = {k: v * 1e3 for k, v in breakdown_s.items()}
    cp = {a: ms[f"{a}_comm"] for a in ("cp", "ep") if f"{a}_comm" in ms}  # only where the run has them
    out = {
        "compute": ms.get("compute", 0.0),
        "optimizer": ms.get("optimizer", 0.0),
        # no pp: the engine counts its transfers' waits in its bubble, so no pp figure rather than a 0
        "exposed_comm": {"tp": ms.get("tp_comm", 0.0), **cp, "dp": ms.get("dp_comm", 0.0)},
        "bubble": ms.get("bubble", 0.0),
        "step": ms.get("total", 0.0),
    }
    out["unattributed"] = (
        out["step"] - out["compute"] - out["optimizer"] - out["bubble"] - sum(out["exposed_comm"].values())
    )
    if pp == 1:
        out = {("wait" if k == "bubble" else k): v for k, v in out.items()}
    return out


def _gather(mine, ctx) -> list:
    if ctx.backend is None:
        return [mine]
    everyone: list = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


ORDER = ("compute", "optimizer", "exposed_comm", "bubble", "wait", "unattributed", "other", "step")


def every_rank_in_one(axis: str) -> bool:
    """Whether every rank belongs to one group of `axis`: a layout axis, or axes together ('pp+dp', whose
    groups partition the world), or the calls on one-rank groups; not a part of an axis's group (annotate.
    other: 'part of dp (2 of 4 ranks)') nor a group of some stages (Megatron's embedding group)."""
    return axis == ONE_RANK or all(p in AXES for p in str(axis).split("+"))


def _mean_over_ranks(rows: list[dict], ranks: bool = True) -> dict:
    """Component by component, the mean of breakdowns (of ranks, or of one rank's steps: `ranks` False); a
    component some rows lack counts 0 there, except, over ranks, a group's exposed communication where not
    every rank belongs to one (every_rank_in_one): averaged over the ranks that have it (its members), their
    count under group_members ({axis: [members, ranks]}) where fewer than all."""
    seen = {a for r in rows for a in r["exposed_comm"]}
    axes = [a for a in AXES if a in seen] + sorted(seen - set(AXES))  # an axis no row has: not shown ('-')
    n = len(rows)
    keys = [k for k in ORDER if any(k in r for r in rows)]
    out = {k: sum(r.get(k, 0.0) for r in rows) / n for k in keys if k != "exposed_comm"}
    members = {a: n if every_rank_in_one(a) or not ranks else sum(a in r["exposed_comm"] for r in rows) for a in axes}
    out["exposed_comm"] = {a: sum(r["exposed_comm"].get(a, 0.0) for r in rows) / members[a] for a in axes}
    out = {k: out[k] for k in keys}
    fewer = {a: [m, n] for a, m in members.items() if m < n}
    return {**out, "group_members": fewer} if fewer else out


def middle(times: list[float]) -> list[int]:
    """The measured step(s) whose time is the median: the middle one, or the middle two (the
    median is their mean), ranked by time (each step the slowest rank's, as the statistics take it)."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    n = len(order)
    return [] if not n else [order[n // 2]] if n % 2 else sorted(order[n // 2 - 1 : n // 2 + 1])


def _in_window(row: dict, step_s: float) -> dict:
    """A rank's breakdown of a measured step as the statistics time it, the slowest rank's `step_s`:
    what of it this rank spent outside its own step (it started later or finished sooner) is other."""
    return {**row, "other": row.get("other", 0.0) + max(0.0, 1e3 * step_s - row["step"]), "step": 1e3 * step_s}


def _posts(row: dict) -> dict:
    """A step's pp sends and receives as their peers need them: (kind, peer) -> post times, in order."""
    out: dict = {}
    for e in row.get(P2P) or []:
        out.setdefault((e["kind"], e["peer"]), []).append(e["post"])
    return out


def split_transfers(row: dict, rank: int, posts: list[dict] | None, waiting: str) -> dict:
    """A measured step's pp transfers apart from its bubble. The k-th send from rank i to rank j is the
    k-th receive at j from i; a send or receive that blocked before its peer posted the other side was
    waiting for the peer (bubble), after it the transfer itself (exposed pp communication). `posts`:
    every rank's _posts of the same step, on one clock (one host: perf_counter is the host's monotonic
    clock), or None (ranks on several hosts: not split, the pp component left out)."""
    events = row.get(P2P) or []
    out = {k: v for k, v in row.items() if k != P2P}
    if posts is None or not events:
        return out
    seen: dict = defaultdict(int)
    transfer = 0.0
    for e in events:
        key = (e["kind"], e["peer"])
        k, seen[key] = seen[key], seen[key] + 1
        theirs = (posts[e["peer"]] if isinstance(e["peer"], int) and 0 <= e["peer"] < len(posts) else {}).get(
            ("recv" if e["kind"] == "send" else "send", rank), []
        )
        ready = theirs[k] if k < len(theirs) else None
        for a, b in e["blocked"]:
            transfer += max(0.0, b - max(a, ready)) if ready is not None else 0.0  # unmatched: waiting, as before
    ms = min(transfer * 1e3, out.get(waiting, 0.0))
    out["exposed_comm"] = {**out["exposed_comm"], "pp": ms}
    out[waiting] = out.get(waiting, 0.0) - ms
    return out


def measured_metrics(counted: list[dict], times: list[float], calls: float, ctx) -> dict:
    """The measured steps' breakdown (counters.Counters): per rank, the mean of its median step(s)
    (middle()), its pp transfers split from its bubble (split_transfers, the ranks' post times gathered
    once), each as long as its slowest rank's (_in_window), then the mean over ranks; so its sum is the
    measured median. Every rank calls it (collective)."""
    picked = middle(times)
    ok = picked and len(counted) == len(times)
    mine_posts = {"host": socket.gethostname(), "posts": [_posts(counted[i]) for i in picked] if ok else []}
    everyone_posts = _gather(mine_posts, ctx)
    one_host = len({e["host"] for e in everyone_posts}) == 1 and all(e["posts"] for e in everyone_posts)
    rank = ctx.rank if ctx.backend is not None else 0
    rows_here = []
    for n, i in enumerate(picked if ok else []):
        posts = [e["posts"][n] for e in everyone_posts] if one_host else None
        waiting = "bubble" if "bubble" in counted[i] else "wait"
        rows_here.append(_in_window(split_transfers(counted[i], rank, posts, waiting), times[i]))
    mine = _mean_over_ranks(rows_here, ranks=False) if ok else None
    everyone = _gather({"breakdown": mine, "calls": calls}, ctx)
    rows = [e["breakdown"] for e in everyone]
    if not all(rows):
        return {}
    return {
        "breakdown_measured_ms": _mean_over_ranks(rows),
        "breakdown_measured_ms_by_rank": rows,
        "breakdown_measured_steps": picked,
        "breakdown_measured_calls_per_step": max(e["calls"] for e in everyone),
    }


def profile_metrics(profile: dict | None, ctx, trace_dir: str | None, trace_name: str) -> tuple[dict, list]:
    """(metrics, traces) from this rank's profile: {"trace", "analysis", "instrumented": [breakdown_s per
    step]} or None when profiling was off. Collective: every rank calls it."""
    if profile is None:
        return {}, []
    analysis = profile.get("analysis")
    mine = {
        "breakdown": mean_step(analysis["steps"]) if analysis else None,
        "collectives": analysis["collectives"] if analysis else None,
        "error": profile.get("error"),
        "wall_s": profile.get("wall_s", 0.0),
        "host_gaps": (
            sum(st.get("host_gaps", 0.0) for st in analysis["steps"]) / len(analysis["steps"]) if analysis else None
        ),
        "instrumented": [from_instrumented(s) for s in profile.get("instrumented") or []],
        "fp8_cast": (
            sum(st["fp8_cast"] for st in analysis["steps"]) / len(analysis["steps"])
            if analysis and all("fp8_cast" in st for st in analysis["steps"])
            else None
        ),
    }
    everyone = _gather(mine, ctx)
    metrics: dict = {
        "profile_steps": len(analysis["steps"]) if analysis else None,
        "profile_wall_s": max(e["wall_s"] for e in everyone),
    }
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e["error"]]
    if errors:
        metrics["breakdown_error"] = "; ".join(errors)[:500]
    rows = [e["breakdown"] for e in everyone]
    if all(rows):
        metrics.update(
            breakdown_ms=_mean_over_ranks(rows),
            breakdown_ms_by_rank=rows,
            breakdown_source="profiler",
            collectives=everyone[0]["collectives"],
            compute_host_gaps_ms=sum(e["host_gaps"] for e in everyone) / len(everyone),
        )
        if all(e["fp8_cast"] is not None for e in everyone):
            metrics["compute_fp8_cast_ms"] = sum(e["fp8_cast"] for e in everyone) / len(everyone)
    if all(e["instrumented"] for e in everyone):
        per_rank = [_mean_over_ranks(e["instrumented"], ranks=False) for e in everyone]
        metrics.update(breakdown_instrumented_ms=_mean_over_ranks(per_rank), breakdown_instrumented_ms_by_rank=per_rank)
    traces = []
    if all(rows) and trace_dir is not None:
        slowest = max(range(len(rows)), key=lambda r: rows[r]["step"])
        roles = {0: "rank 0"}
        roles.setdefault(slowest, "slowest rank")
        for r, role in roles.items():
            traces.append(
                {"rank": r, "path": os.path.join(trace_dir, f"{trace_name}.rank{r}.trace.json.gz"), "role": role}
            )
        for t in traces:
            if t["rank"] == ctx.rank:
                trace_files.write(profile["trace"], t["path"])
    return metrics, traces
