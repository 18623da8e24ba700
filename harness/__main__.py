"""`python -m harness`: the same as the `harness` command (and `python -m harness.cli`)."""

import runpy
import sys

try:  # a Ctrl-C while harness.cli loads exits 130 quietly, as one while the command runs (cli.main)
    runpy.run_module("harness.cli", run_name="__main__")
except KeyboardInterrupt:
    sys.exit(130)
