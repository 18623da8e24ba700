"""Why a step takes what it takes: a few profiled steps after the measured ones, their trace
broken down (compute, optimizer, exposed communication per axis, bubble, other) and kept.

annotate.py names collectives in the trace, trace.py records and keeps it, analysis.py (with
intervals.py) reads the breakdown and the collectives from it, record.py puts them in a record.
This file stays free of torch: compare and sweep read ENV.
"""

import os

DEFAULT_STEPS = 2
ENV = "HARNESS_PROFILE_STEPS"  # how compare and sweep hand --profile-steps to the ranks they launch


def default_steps() -> int:
    """--profile-steps when not given: the launcher's choice (ENV), else DEFAULT_STEPS."""
    value = os.environ.get(ENV, "").strip()
    return int(value) if value.isdigit() else DEFAULT_STEPS
