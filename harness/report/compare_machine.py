"""What else shaped a comparison's step times: per run, the cores it could use, its processes on one host
and the threads each ran, and whether those threads outnumbered the cores (oversubscribed). An
oversubscribed run's step times measure CPU contention as much as its layout, so no ranking, Why sentence
or time verdict uses them; its losses still count for parity."""

from __future__ import annotations

from dataclasses import dataclass

from harness.report.sections import Table


@dataclass(frozen=True)
class Threads:
    """One run's share of its machine: usable cores, processes on one host, threads per process."""

    cores: int | None
    procs: int
    threads: int | None
    device: str  # the fingerprint's device_type ('cpu', 'cuda'), '' where unknown (not judged)

    @property
    def busy(self) -> int | None:
        return None if self.threads is None else self.procs * self.threads

    @property
    def oversubscribed(self) -> bool:
        """More busy threads than usable cores, on a CPU run (a GPU run's host threads mostly wait)."""
        return self.device == "cpu" and None not in (self.cores, self.busy) and self.busy > self.cores


def _int(v) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def run_threads(run: dict, summary: dict) -> Threads:
    """A run's cores (its fingerprint's affinity count, else the comparison's), processes per host (its
    process count over its hosts) and threads (OMP_NUM_THREADS its ranks saw, else the comparison's)."""
    fp = run.get("fingerprint") or {}
    hosts = max(1, len(fp.get("hosts") or []) or 1)
    nproc = _int(run.get("nproc")) or _int(fp.get("world_size")) or 1
    threads = _int((fp.get("env") or {}).get("OMP_NUM_THREADS")) or _int(summary.get("threads_per_process"))
    cores = _int(fp.get("cpu_cores")) or _int(summary.get("cpu_cores"))
    device = str(fp.get("device_type") or "")  # no fingerprint (a failed run): not judged
    return Threads(cores, -(-nproc // hosts), threads, device)


def oversubscribed(run: dict, summary: dict) -> bool:
    return run_threads(run, summary).oversubscribed


def timed_runs(summary: dict) -> list[dict]:
    """The runs whose step times may rank and explain: finished, not the reference, not oversubscribed."""
    return [
        r
        for r in summary["runs"]
        if not r.get("is_reference") and r.get("status") == "ok" and not oversubscribed(r, summary)
    ]


OVERSUBSCRIBED = "oversubscribed"
SKIPPED_TEXT = (
    "Not ranked or explained (oversubscribed: more busy threads than cores, so their step times measure "
    "CPU contention as much as the layout; their losses still count for parity): {labels}."
)
THREADS_TEXT = (
    "Threads per process: {n} (OMP_NUM_THREADS), the same for every run, the single-device reference "
    "included: cores divided by the comparison's process count, so that step times compare layouts rather "
    "than thread counts."
)
OVER_TEXT = (
    "Threads per process: {n} (OMP_NUM_THREADS), the same for every run. {labels} ran more busy threads "
    "(processes x threads) than the machine's usable cores: marked oversubscribed, their step times are "
    "not used to rank, explain or check against a baseline; their losses still count for parity."
)


def skipped_sentence(summary: dict) -> list[str]:
    """The sentence naming the finished runs left out of ranking and Why, or nothing."""
    labels = [r["label"] for r in summary["runs"] if r.get("status") == "ok" and oversubscribed(r, summary)]
    return [SKIPPED_TEXT.format(labels=", ".join(labels))] if labels else []


def machine_table(summary: dict) -> Table:
    """Per run: cores, processes on one host, threads per process, busy threads, and the mark."""
    rows = []
    for r in summary["runs"]:
        t = run_threads(r, summary)
        rows.append(
            [
                r["label"],
                "-" if t.cores is None else str(t.cores),
                str(t.procs),
                "-" if t.threads is None else str(t.threads),
                "-" if t.busy is None else str(t.busy),
                OVERSUBSCRIBED if t.oversubscribed else "no",
            ]
        )
    return Table(["run", "usable cores", "processes (per host)", "threads per process", "busy threads", "mark"], rows)


def machine_text(summary: dict) -> list:
    """The threads per process, the per-run table, and the machine's load: what else shaped the step times.
    The sentence that threads compare layouts rather than thread counts only where no run is oversubscribed."""
    n = summary.get("threads_per_process")
    over = [r["label"] for r in summary["runs"] if oversubscribed(r, summary)]
    out: list = []
    if n:
        out.append(OVER_TEXT.format(n=n, labels=", ".join(over)) if over else THREADS_TEXT.format(n=n))
    out.append(machine_table(summary))
    load = summary.get("load_average") or {}
    if load.get("before"):
        cores = {run_threads(r, summary).cores for r in summary["runs"]} - {None}
        where = f" ({', '.join(map(str, sorted(cores)))} usable cores)" if cores else ""
        out.append(
            f"Machine load average (1/5/15 min) before the runs: {load['before']}, after: {load.get('after')}"
            f"{where}; a load above the core count means other work shared the machine and widened the "
            "step-time intervals."
        )
    return out
