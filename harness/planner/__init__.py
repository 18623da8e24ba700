"""The planner: predict memory, out-of-memory and step time of layouts before running them.

Modules, one job each: hardware (profiles), layout (what a layout is), memory (bytes per GPU),
timing (seconds per step), candidates (every valid layout), predict (the two together),
calibrate (fit efficiency constants from measurements), paper (the published sweeps). The
command is harness/commands/plan.py. Nothing here imports torch: a plan must answer in about
a second.
"""

from harness.planner.predict import Prediction, predict  # noqa: F401


def __getattr__(name: str):
    """calibrate_from_records, imported when first used: calibration needs numpy, a plan does not."""
    if name == "calibrate_from_records":
        from harness.planner.calibrate import calibrate_from_records

        return calibrate_from_records
    raise AttributeError(f"module 'harness.planner' has no attribute {name!r}")
