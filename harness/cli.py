"""The `harness` command line: the argument table; each subcommand lives in its own module
(harness/commands/), imported when used.

A subcommand module exposes `add_arguments(parser)` and `main(args) -> int`, and may set
DESCRIPTION and EXAMPLES (its --help text above and below the options). A SpecError
anywhere (a user mistake, a mistyped argument included) becomes one line `error: <field>:
<reason>` and exit code 2; a Ctrl-C at any moment, even while torch is still importing,
exits 130 without a traceback.
"""

from __future__ import annotations

import sys

try:  # the console script imports this module before main() runs: a Ctrl-C here is one too
    import argparse
    import difflib
    import errno
    import importlib
    import re

    from harness.errors import SpecError, StoreWriteError
except KeyboardInterrupt:
    sys.exit(130)

EX_IOERR = 74  # sysexits.h: an input/output fault (a full disk), not a mistake in the input (2)
_OUTPUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)

# what `harness --help` opens with
DESCRIPTION = (
    "Measure LLaMA training under several engines and parallel layouts, plan layouts before "
    "booking a cluster, and report which wins and why."
)

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
    "import": ("harness.commands.import", "a Megatron-LM, torchtitan or DeepSpeed launch config as a run spec"),
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


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that refuses in one line, `error: <flag>: <reason>` (a SpecError, so exit
    code 2 through main), not with a usage dump; --help still prints the usage. Every subparser,
    the commands' own (results export, data prepare) included, is one (add_subparsers' default)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("exit_on_error", False)  # an ArgumentError reaches parse_known_args whole
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, but an argument left over is refused here, where the (sub)command that
        did not take it is known; nothing in harness parses only part of its arguments."""
        try:
            namespace, extras = super().parse_known_args(args, namespace)
        except argparse.ArgumentError as e:
            raise self.refusal(e.argument_name, e.message) from None
        if extras:
            raise self.leftover(extras[0])
        return namespace, extras

    def error(self, message: str):
        """What argparse reports by message only (a missing argument, an ambiguous abbreviation)."""
        named = re.fullmatch(r"argument (.+?): (.*)", message, re.S)
        if named:
            raise self.refusal(named.group(1), named.group(2))
        missing = re.fullmatch(r"the following arguments are required: (.*)", message, re.S)
        if missing:
            first, *rest = missing.group(1).split(", ")
            action = next((a for a in self._actions if first in (a.dest, a.metavar, *a.option_strings)), None)
            also = f": one of {', '.join(action.choices)}" if action is not None and action.choices else ""
            also += f" (and {', '.join(rest)})" if rest else ""
            raise SpecError(_field(first), f"missing{also}; see {self.prog} --help")
        ambiguous = re.fullmatch(r"ambiguous option: (\S+?)(?:=\S*)? could match (.*)", message, re.S)
        if ambiguous:
            raise SpecError(ambiguous.group(1), f"ambiguous: could be {ambiguous.group(2)}")
        raise SpecError(self.prog, f"{message}; see {self.prog} --help")

    def refusal(self, name: str | None, message: str) -> SpecError:
        """One argument's refusal; an invalid choice lists the choices plainly, with the nearest."""
        choice = re.fullmatch(r"invalid choice: (.+?) \(choose from (.*)\)", message, re.S)
        if choice:
            value = choice.group(1)
            options = [c.strip().strip("'\"") for c in choice.group(2).split(",")]
            message = f"{value} is not one of {', '.join(options)}" + _nearest(value.strip("'\""), options, 0.6)
        return SpecError(_field(name) if name else self.prog, message)

    def leftover(self, arg: str) -> SpecError:
        """An argument no parser took: an unknown option, or one positional too many."""
        if arg.startswith("-") and len(arg) > 1:
            flag = arg.split("=", 1)[0]
            known = [o for o in self._option_string_actions if o.startswith("--")]
            return SpecError(flag, f"not an option of {self.prog}{_nearest(flag, known, 0.75)}; see {self.prog} --help")
        return SpecError(arg, f"one argument too many for {self.prog}; see {self.prog} --help")


def _field(name: str) -> str:
    """An argument's name as a refusal names it: `--seq-len`, `spec`; a metavar in capitals
    (COMMAND) in lower case."""
    return name.lower() if name.isupper() else name


def _nearest(value: str, options: list[str], cutoff: float) -> str:
    close = difflib.get_close_matches(value, options, n=1, cutoff=cutoff)
    return f" (did you mean {close[0]}?)" if close else ""


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object | None]:
    raw = argparse.RawDescriptionHelpFormatter
    parser = Parser(prog="harness", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=raw)
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
    try:
        return _main(argv)
    except KeyboardInterrupt:  # also during the heavy imports (torch takes seconds) a command starts with
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`harness plan ... | head`): what it read was whole lines
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141  # a shell's exit status for SIGPIPE


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The deepspeed launcher appends --local_rank=N; the environment already carries it.
    argv = [a for a in argv if not a.startswith("--local_rank")]
    try:
        parser, module = build_parser(argv)
        args = parser.parse_args(argv)
        if module is None:
            parser.print_help()
            return 2
        rc = int(module.main(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a full disk behind stdout is the error below
        return rc
    except StoreWriteError as e:  # the work is done and its record waits in a fallback file: a fault, not a mistake
        if first_to_say(f"error: {e}"):
            print(f"error: {e}", file=sys.stderr)
        return EX_IOERR
    except OSError as e:
        if e.errno not in _OUTPUT_FULL or not _stdout_broken():
            raise
        print(f"error: stdout: {e.strerror}: the output was not written whole", file=sys.stderr)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what stays buffered goes nowhere at exit
        return EX_IOERR
    except SpecError as e:  # one line per mistake (SpecErrors: several), whatever the message holds
        lines = [
            "error: " + "; ".join(ln.strip() for ln in str(one).splitlines() if ln.strip())
            for one in getattr(e, "errors", [e])
        ]
        if first_to_say("\n".join(lines)):  # every rank of a launch makes the same mistake: said once
            print("\n".join(lines), file=sys.stderr)
        return 2


def _stdout_broken() -> bool:
    """Whether stdout itself cannot take more (a full disk behind `> file`, /dev/full): a line end written
    and flushed tells (a failed write leaves nothing buffered to flush; where stdout is fine, the error came
    from elsewhere and is raised after this one blank line)."""
    try:
        sys.stdout.write("\n")
        sys.stdout.flush()
    except OSError:
        return True
    return False


def first_to_say(line: str, env=None) -> bool:
    """Whether this process prints `line`: always, unless it is one rank of several that a launcher
    started (torchrun, deepspeed, srun), where every rank reaches the same mistake (a world size the
    layout does not fit) and the line would repeat once per rank. Then the first rank of the launch
    on this machine to get there says it: the one that creates a marker named after the launch (its
    launcher process, port and run id) and the line."""
    import hashlib
    import os
    import tempfile

    env = os.environ if env is None else env
    if int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")) or 1) <= 1:
        return True
    launch = [str(os.getppid())] + [env.get(k, "") for k in ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID")]
    key = hashlib.sha256("\0".join([*launch, line]).encode()).hexdigest()[:16]
    try:
        os.close(os.open(os.path.join(tempfile.gettempdir(), f"harness-said-{key}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    except OSError:  # no marker can be written: better twice than never
        return True
    return True


if __name__ == "__main__":
    sys.exit(main())
