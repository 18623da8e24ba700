"""Argument parsing only: each subcommand lives in its own module, imported when used.

A subcommand module exposes `add_arguments(parser)` and `main(args) -> int`. A SpecError
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
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    parser = argparse.ArgumentParser(prog="harness", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    module = None
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (modname, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:  # import only the module that runs: `harness plan` must not pay for torch
            module = importlib.import_module(modname)
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
