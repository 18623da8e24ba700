"""Sweeps: one workload, a grid of layouts, every point run in its own fenced process tree.

Why it is shaped like this: the reference study swept about a thousand layouts and half of
them ran out of memory. So expansion decides up front which points are invalid and says why
(those never launch), each point is identified by a stable key (a hash of its full,
normalised workload + layout) so that a re-run skips what already has a record, and every
record is committed to the store when its run ends, so killing the sweep loses nothing.

One job a file (import each name from the file that defines it; nothing is re-exported here):

    spec.py     the sweep spec: its YAML format, SweepSpec, SWEEP_LAUNCHERS, parse_sweep, load_sweep
    expand.py   the grid into points: Point, Drop (a dropped combination and why), point_key,
                expand, describe (the dry-run listing), pending (what is left to run)
    execute.py  local execution: run_sweep (progress, resume, retry) and sweep_id
    slurm.py    Slurm: write_slurm (the job array), submit_slurm, collect (merge and classify)
"""
