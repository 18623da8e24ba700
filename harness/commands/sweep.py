"""`harness sweep SPEC.yaml` and `harness sweep collect SPEC.yaml`: argument handling only.

The work is in harness/sweep/ (spec, expand, execute, slurm) and harness.launch (one run).
Exit codes: 0 when the sweep ran to its end (failed points are results, not errors),
2 for a user mistake, 130 when interrupted (records so far are kept; run again to resume).
"""

from __future__ import annotations

import os
import signal
import sys

from harness.commands import add_profile_steps_argument, add_set_argument, add_tensorboard_argument, tensorboard_dir
from harness.commands.outputs import check_output_path
from harness.commands.overrides import parse_with_overrides
from harness.errors import SpecError, StoreWriteError
from harness.spec import check_positive, read_yaml
from harness.store import STATUSES, ResultsStore, check_store
from harness.sweep.execute import run_sweep
from harness.sweep.expand import check_grid_values, check_some_point, describe, drop_summary, expand, pending
from harness.sweep.slurm import collect, submit_slurm, write_slurm
from harness.sweep.spec import SWEEP_LAUNCHERS, parse_sweep

DESCRIPTION = """\
Run a grid of layouts (every point its own launcher process) that survives OOMs, crashes and
hangs: a failed point is a result, and running the same command again resumes where it
stopped. With `--launcher slurm` it writes (and submits) a Slurm job array instead; `harness
sweep collect SPEC.yaml` gathers its records. Exit code 0 when the sweep ran to its end, 2 for
a mistake in the spec, 130 when interrupted (every finished point is kept)."""

EXAMPLES = """\
examples:
  harness sweep sweeps/cpu-demo.yaml --dry-run          # the points, and the combinations dropped
  harness sweep sweeps/cpu-demo.yaml --set workload.steps=3 --set timeout_s=300
  harness sweep sweeps/cpu-demo.yaml --retry failed,timeout
  harness sweep sweeps/cpu-demo.yaml --launcher slurm --no-submit && harness sweep collect sweeps/cpu-demo.yaml"""


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def add_arguments(p) -> None:
    p.add_argument(
        "target",
        nargs="+",
        metavar="SPEC.yaml",
        help="a sweep spec, or `collect SPEC.yaml` to gather a Slurm job array's records",
    )
    add_set_argument(p, "sweep spec")
    p.add_argument("--dry-run", action="store_true", help="print the points and the dropped combinations")
    p.add_argument(
        "--launcher", choices=SWEEP_LAUNCHERS, help="how each point starts (default: the spec's, else torchrun)"
    )
    p.add_argument("--timeout", type=float, metavar="S", help="per-point timeout in seconds")
    p.add_argument("--store", help="results store (default: the spec's store)")
    p.add_argument(
        "--retry",
        default="",
        metavar="STATUSES",
        help="comma-separated statuses to run again, e.g. failed,timeout (default: none)",
    )
    p.add_argument("--logs", help="directory for the points' logs (default: <store dir>/harness-logs/<sweep name>)")
    p.add_argument(
        "--job-dir",
        help="Slurm: where the job array and its task stores live (default: <store dir>/harness-slurm/<sweep name>)",
    )
    p.add_argument("--no-submit", action="store_true", help="Slurm: write the job script, do not sbatch it")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_tensorboard_argument(p, "every point")
    add_profile_steps_argument(p, "every point")


def main(args) -> int:
    if args.target[0] == "collect":
        if len(args.target) != 2:
            raise SpecError("collect", "usage: harness sweep collect SPEC.yaml [--store PATH] [--job-dir DIR]")
        spec = _load(args.target[1], args.overrides)
        store = args.store or spec.store
        counts = collect(spec, _job_dir(args, spec, store), store)
        print(
            f"collected {spec.name}: {counts['merged']} records merged, {counts['classified']} "
            f"classified from logs, {counts['pending']} still pending"
        )
        return 0
    if len(args.target) != 1:
        raise SpecError("sweep", "give one sweep spec")
    spec = _load(args.target[0], args.overrides)
    store = args.store or spec.store
    launcher = args.launcher or spec.launcher
    timeout = check_positive(args.timeout, "--timeout") if args.timeout is not None else spec.timeout_s
    retry = tuple(s for s in args.retry.split(",") if s)
    bad = [s for s in retry if s not in STATUSES]
    if bad:
        raise SpecError("--retry", f"unknown status {bad[0]!r}")
    if not (args.dry_run and not os.path.exists(store)):
        check_store(store, write=not args.dry_run)
    if args.logs:
        check_output_path(args.logs, "--logs", directory=True)
    points, drops = expand(spec)
    tensorboard = tensorboard_dir(args)  # checked before anything launches
    if tensorboard:  # every run this command launches inherits it (harness train reads it)
        from harness.measure.stream import TENSORBOARD_ENV

        os.environ[TENSORBOARD_ENV] = tensorboard
    done = ResultsStore(store).completed_points(spec.name) if os.path.exists(store) else {}
    if args.dry_run:
        print(describe(points, drops, {k: v for k, v in done.items() if v not in retry}))
    check_some_point(points, drops)
    check_grid_values(spec, points, drops)
    if args.dry_run:
        return 0
    for line in drop_summary(points, drops):
        print(line, file=sys.stderr)
    if launcher == "slurm":
        todo = pending(points, done, retry)
        script = write_slurm(spec, todo, _job_dir(args, spec, store), timeout_s=timeout)
        print(f"wrote {script} ({len(todo)} array tasks)")
        if args.no_submit:
            return 0
        print(submit_slurm(script))
        return 0
    from harness.launch.machine import check_machine  # torch: only where points run here

    # the points run on this machine: their kernels are tried here first (under slurm each node checks its own)
    check_machine([(f"point {p.label()!r}", p.spec) for p in pending(points, done, retry)])
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` or a scheduler: clean up like Ctrl-C
    try:
        counts = run_sweep(
            spec,
            launcher=launcher,
            store_path=store,
            timeout_s=timeout,
            retry=retry,
            log_dir=args.logs,
            progress=not args.no_progress,
            profile_steps=args.profile_steps,
        )
    except KeyboardInterrupt:
        print("\ninterrupted: every finished point is in the store; run the same command to resume")
        return 130
    except StoreWriteError as e:  # a full disk: stop, with every finished point kept
        raise StoreWriteError(
            f"{e.reason}; the sweep stopped: run the same command to resume once the store "
            "can be written (it merges that file back)"
        ) from None
    print("done: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f"  (store {store})")
    return 0


def _load(path: str, overrides: list[str]):
    """The sweep spec at `path` (named after the file unless it says), with the --set overrides."""
    name = os.path.splitext(os.path.basename(path))[0]
    return parse_with_overrides(
        read_yaml(path, field="sweep"), overrides, lambda raw: parse_sweep(raw, name), prefix="sweep."
    )


def _job_dir(args, spec, store) -> str:
    return args.job_dir or os.path.join(os.path.dirname(os.path.abspath(store)), "harness-slurm", spec.name)
