"""`harness train [SPEC.yaml]`: one run, on every rank, under any launcher."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from harness.commands import add_profile_steps_argument, add_set_argument, add_tensorboard_argument, tensorboard_dir
from harness.errors import SpecError

DESCRIPTION = """\
Run one training measurement from a spec, on every rank, under any launcher (direct,
torchrun, deepspeed, srun). Rank 0 shows a live progress line (step, tokens/s, MFU, loss,
elapsed time and ETA) and writes one record to the results store. Exit code 0 when the run
finished, 1 when it failed (the failure is recorded), 2 for a mistake in the spec."""

EXAMPLES = """\
examples:
  harness train                                    # the embedded default: tiny model, this machine
  harness train examples/tiny.yaml --set workload.seq_len=256 --set layout.attention=naive
  torchrun --nproc-per-node 2 -m harness.cli train spec.yaml --store results.sqlite"""


def add_arguments(p):
    p.add_argument("spec", nargs="?", help="YAML spec; without it, the embedded default (tiny model, this machine)")
    add_set_argument(p, "run spec")
    p.add_argument("--store", help="results SQLite file (default: the spec's `store`)")
    # Set by the launchers (harness.launch) so they can find and group the record: not for users.
    p.add_argument("--run-id", help=argparse.SUPPRESS)
    p.add_argument("--sweep", help=argparse.SUPPRESS)
    p.add_argument("--point-key", help=argparse.SUPPRESS)
    p.add_argument("--peak-tflops", type=float, help="per-device peak for MFU, overriding the datasheet table")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    add_tensorboard_argument(p, "the run")
    add_profile_steps_argument(p, "the run")


def main(args) -> int:
    from harness import registry
    from harness.commands.overrides import parse_with_overrides
    from harness.spec import check_positive, parse_spec, read_yaml
    from harness.store import check_store

    spec = parse_with_overrides({} if args.spec is None else read_yaml(args.spec), args.overrides, parse_spec)
    if args.peak_tflops is not None:
        check_positive(args.peak_tflops, "--peak-tflops")
    check_store(args.store or spec.store)  # before the process group forms: nothing has started
    facts = registry.facts(spec.layout.engine)
    if facts.preflight is not None:  # the spec's own mistakes (a ds_config that contradicts it) before how it started
        facts.preflight(spec)
    # torch only now: a refused spec's one line comes without its import (a second a process, every rank's)
    from harness import runtime
    from harness.launch.build_lock import use_environment_dir
    from harness.report.summary import summary_lines
    from harness.run import run

    runtime.check_launched(spec.layout.engine)
    use_environment_dir()  # before DeepSpeed builds an op: this environment's folder, whatever the launcher
    tensorboard = tensorboard_dir(args)
    ctx = runtime.init(spec.workload.device)
    try:
        record = run(
            spec,
            ctx,
            store_path=args.store,
            run_id=args.run_id,
            sweep=args.sweep,
            point_key=args.point_key,
            peak_tflops=args.peak_tflops,
            progress=not args.no_progress,
            tensorboard_dir=tensorboard,
            profile_steps=args.profile_steps,
            trace_dir=_trace_dir(args),
        )
    except SpecError:
        runtime.teardown(ctx, barrier=False)
        raise
    except BaseException:
        # The failure record is written. Peers may be stuck in a collective with this rank, so
        # do not wait for them in a barrier: leave now and let the launcher end the others.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if ctx.is_main:
        print("\n".join(summary_lines(record, args.store or spec.store)))
    runtime.teardown(ctx)
    return 0 if record["status"] == "ok" else 1


def _trace_dir(args) -> str | None:
    """Where the kept traces go: beside a launched run's log and spec (the launcher writes the spec
    into its log folder), else harness-traces beside the store (run's default)."""
    if args.run_id and args.spec:
        return os.path.dirname(args.spec)
    return None
