"""`python -m harness`: the same as the `harness` command (and `python -m harness.cli`)."""

import sys

try:  # a Ctrl-C while harness.cli loads exits 130 quietly, as one while the command runs (cli.main)
    from harness.cli import main
except KeyboardInterrupt:
    sys.exit(130)
sys.exit(main())
