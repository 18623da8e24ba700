"""The op DeepSpeed compiles when its communication starts (on CPU its shared-memory collectives,
deepspeed_shm_comm), said on the console: the first run in an environment waits minutes for the
compiler, silently otherwise (DeepSpeed loads it with verbose=False). The lines are `note:` lines,
which a launching command (compare, sweep) passes from the run's log to its console
(harness/launch/relay.py)."""

from __future__ import annotations

import contextlib
import os
import time


def jit_op() -> str | None:
    """The name of the op deepspeed.init_distributed will JIT-build (its build_shm_op's conditions):
    None where the accelerator has none, it is incompatible here, or it was installed prebuilt."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return None if installed_ops.get(builder.name, False) else builder.name


def _built(folder: str, name: str) -> float | None:
    try:
        return os.stat(os.path.join(folder, f"{name}.so")).st_mtime
    except OSError:
        return None


@contextlib.contextmanager
def announce_build(ctx):
    """Around deepspeed.init_distributed: when the op is not built yet, the first local rank says that
    it is being built and where; when a build happened (the library is new), how long it took."""
    name = jit_op()
    if name is None or ctx.local_rank != 0:
        yield
        return
    from torch.utils.cpp_extension import _get_build_directory  # the folder torch's load() builds in

    folder = _get_build_directory(name, verbose=False)
    before, start = _built(folder, name), time.monotonic()
    if before is None:
        print(
            f"note: building DeepSpeed's {name} op in {folder} (once for this environment; minutes on a small CPU)",
            flush=True,
        )
    yield
    if _built(folder, name) != before:
        print(f"note: built DeepSpeed's {name} op in {time.monotonic() - start:.0f} s ({folder})", flush=True)
