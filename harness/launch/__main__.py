"""`python -m harness.launch MODULE ARGS...`: run MODULE fenced (harness.launch.processes.fenced)."""

import sys

from harness.launch.processes import fenced

fenced(sys.argv[1:])
