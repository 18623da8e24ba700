"""What the schedule tests use to look at the own engine's pipeline programs (harness.engine.schedules):
a simulated timeline drawn as text, and the grouped programs run to their finish time."""

from __future__ import annotations

from harness.engine.schedules import Action, Simulation, grouped_programs, run_grouped


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


def simulate_grouped(
    programs: list[list[Action]], f_cost: float = 1.0, b_cost: float = 2.0, w_cost: float | None = None
) -> float:
    """Finish time of the grouped programs under strict group semantics (raises on deadlock)."""
    finish, stuck = run_grouped(grouped_programs(programs), f_cost, b_cost, w_cost)
    if stuck is not None:
        raise AssertionError(f"grouped deadlock: {stuck}")
    return finish
