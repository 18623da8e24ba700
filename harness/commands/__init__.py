"""Subcommands: each module has add_arguments(parser) and main(args); DESCRIPTION and EXAMPLES
(when present) are its --help text above and below the options."""


def add_set_argument(p, what: str) -> None:
    """`--set key.path=value` (repeatable): override the raw spec before it is checked."""
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY.PATH=VALUE",
                   help=f"override a field of the {what} before it is checked, value as YAML "
                        "(repeatable; e.g. --set workload.seq_len=256)")
