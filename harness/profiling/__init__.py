"""Why a step takes what it takes: the measured steps clocked as they run (counters.py: compute,
optimizer, exposed communication per axis, bubble or waiting for other ranks, of the median
measured step), and a few profiled steps after them whose trace is broken down the same way,
counts the collectives and is kept (the profiler's own cost makes its steps longer than the
measured ones, so the report explains with the counters and sets either sum against the median).

annotate.py names collectives (in the trace, or for the counters), trace.py records and keeps the
trace, analysis.py (with intervals.py) reads the breakdown and the collectives from it, record.py
puts both breakdowns in a record.
This file stays free of torch: compare and sweep read ENV.
"""

import os

DEFAULT_STEPS = 2
MEASURED_SOURCE = "measured steps"  # a breakdown clocked during the measured steps themselves (counters.py)
ENV = "HARNESS_PROFILE_STEPS"  # how compare and sweep hand --profile-steps to the ranks they launch


def default_steps() -> int:
    """--profile-steps when not given: the launcher's choice (ENV), else DEFAULT_STEPS."""
    value = os.environ.get(ENV, "").strip()
    return int(value) if value.isdigit() else DEFAULT_STEPS
