"""Argument parsing only: each subcommand lives in its own module, imported when used.

A subcommand module exposes `add_arguments(parser)` and `main(args) -> int`, and may set
DESCRIPTION and EXAMPLES (its --help text above and below the options). A SpecError
anywhere (a user mistake) becomes one line `error: <field>: <reason>` and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from harness.errors import SpecError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("harness.commands.train", "run one training measurement from a spec (any launcher)"),
    "env": ("harness.commands.env", "print the hardware and software fingerprint"),
    "data": ("harness.commands.data", "prepare memory-mapped token files"),
    "results": ("harness.commands.results", "export the results store"),
    "compare": ("harness.commands.compare", "one workload under several engines, with a parity check"),
    "sweep": ("harness.commands.sweep", "run a grid of layouts that survives failures"),
    "report": ("harness.commands.report", "write a Markdown + HTML report from the results store"),
    "plan": ("harness.commands.plan", "predict memory and speed of every layout"),
    "memory": ("harness.commands.memory", "trace a spec's memory per GPU at full size, on this CPU"),
}


EXAMPLES = """\
examples:
  harness train --set workload.steps=5             # one run of the tiny default on this machine
  harness compare                                  # every engine on this machine, parity-checked
  harness plan --model paper-13b --seq-len 2048 --global-batch-size 2048 --gpus 64
  harness COMMAND --help                           # a command's options and examples"""


def version() -> str:
    """The installed distribution's version (whatever the distribution is named), else the source's."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get("harness", []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return sys.modules["harness"].__version__  # the package this module is in: loaded already


class _Version(argparse.Action):
    """--version, looked up only when asked for."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kw.get("help"))

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"harness {version()}")
        parser.exit()


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0], epilog=EXAMPLES,
                                     formatter_class=raw)
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    module = None
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (modname, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=raw)
        if name == wanted:  # import only the module that runs: `harness plan` must not pay for torch
            module = importlib.import_module(modname)
            p.description = getattr(module, "DESCRIPTION", help_text)
            p.epilog = getattr(module, "EXAMPLES", None)
            module.add_arguments(p)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher appends --local_rank=N; the environment already carries it.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    try:
        parser, module = build_parser(argv)
        args = parser.parse_args(argv)
        if module is None:
            parser.print_help()
            return 2
        return int(module.main(args) or 0)
    except SpecError as e:  # one line, whatever the message holds
        print("error: " + "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
