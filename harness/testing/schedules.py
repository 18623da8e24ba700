"""What the schedule tests use to look at the own engine's pipeline programs (harness.engine.schedules):
a simulated timeline drawn as text."""

from __future__ import annotations

from harness.engine.schedules import Simulation


def draw(sim: Simulation, width_per_unit: int = 1) -> str:
    """ASCII chart of a simulated timeline: one row per rank, F as micro-batch digits, B as letters, W as
    capitals."""
    rows = []
    for r, events in enumerate(sim.timeline):
        line = [" "] * int(sim.finish * width_per_unit)
        for kind, _chunk, micro, start, end in events:
            ch = str(micro % 10) if kind == "F" else ("abcdefghij" if kind == "B" else "ABCDEFGHIJ")[micro % 10]
            for t in range(int(start * width_per_unit), int(end * width_per_unit)):
                line[t] = ch
        rows.append(f"rank {r}: " + "".join(line))
    return "\n".join(rows)
