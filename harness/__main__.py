"""`python -m harness`: the same as the `harness` command (and `python -m harness.cli`)."""

import runpy

runpy.run_module("harness.cli", run_name="__main__")
