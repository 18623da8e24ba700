"""Engine megatron: facts.py (what it runs, no torch import), adapter.py (build), and its heavy modules."""

import os

# megatron-core 0.17+ runs `git rev-parse` when it is imported (megatron/core/package_info.py), to append a
# commit to its version unless NO_VCS_VERSION is set: an installed wheel has no commit, and a process start
# inside an import is what the quick tier refuses. Every harness import of Megatron passes through here.
os.environ.setdefault("NO_VCS_VERSION", "1")
