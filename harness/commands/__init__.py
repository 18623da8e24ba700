"""Subcommands: each module has add_arguments(parser) and main(args); DESCRIPTION and EXAMPLES
(when present) are its --help text above and below the options. What several share: the arguments
below, --set overrides (overrides.py) and the check of where a command writes (outputs.py)."""


def add_set_argument(p, what: str) -> None:
    """`--set key.path=value` (repeatable): override the raw spec before it is checked."""
    p.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="KEY.PATH=VALUE",
        help=f"override a field of the {what} before it is checked, value as YAML "
        "(repeatable; e.g. --set workload.seq_len=256)",
    )


def add_tensorboard_argument(p, what: str) -> None:
    """`--tensorboard DIR`: rank 0 of every run streams its per-step metrics there."""
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help=f"rank 0 of {what} writes loss, step time, tokens/s, MFU and memory per step to "
        "TensorBoard under DIR (one folder per run; needs the tensorboard package); "
        "view with `tensorboard --logdir DIR`",
    )


def tensorboard_dir(args) -> str | None:
    """The --tensorboard folder (checked: the package is installed, the folder can be written), else
    None. compare and sweep hand it on to the runs they launch (measure.stream.TENSORBOARD_ENV)."""
    import os

    from harness.measure.stream import TENSORBOARD_ENV, check_tensorboard

    given = getattr(args, "tensorboard", None) or os.environ.get(TENSORBOARD_ENV) or None
    if given:
        check_tensorboard(given, "--tensorboard")
    return given


def add_profile_steps_argument(p, what: str) -> None:
    """`--profile-steps N`: N profiled steps after the measured ones (0: none)."""
    import argparse

    from harness.profiling import DEFAULT_STEPS

    def count(text: str) -> int:
        if not text.strip().isdigit():
            raise argparse.ArgumentTypeError(f"must be a whole number of steps (0 turns profiling off), got {text!r}")
        return int(text)

    p.add_argument(
        "--profile-steps",
        type=count,
        metavar="N",
        help=f"profile N extra steps of {what} after the measured ones (never counted in step-time "
        f"statistics) for the step breakdown and the kept traces; 0 turns it off "
        f"(default {DEFAULT_STEPS})",
    )
