"""Stale build locks of torch's JIT extensions (DeepSpeed's deepspeed_shm_comm on CPU, its other ops).

torch.utils.cpp_extension builds an extension under a FileBaton: `<build dir>/lock`, created with
O_EXCL, held open by the builder and removed when it is done. Every later load of the extension
waits while that file exists, with no timeout. A builder killed with SIGKILL (a killed comparison,
a run past its timeout) leaves the file behind, and every later DeepSpeed run then hangs until its
own timeout, with no output. So before a run is launched, a lock that no live process holds open
is removed, with a one-line warning. Found without torch: the launching process stays light.

Two virtual environments building into one folder (torch's default, ~/.cache/torch_extensions)
rebuild each other's extension at every run: torch keeps one build per name and rebuilds when the
sources, flags or include paths (the environment's) differ. So a run started by harness gets a
folder of its environment's own (environment_dir), unless TORCH_EXTENSIONS_DIR says otherwise.
"""

from __future__ import annotations

import glob
import os
import sys
import time

from harness.errors import SpecError

SETTLE_S = 0.2  # a lock seen without a holder is looked at again after this, in case it was being released


def environment_dir() -> str:
    """This environment's own extensions folder, below torch's default root: named after the
    environment (sys.prefix) and keyed by its path and its torch and deepspeed versions, so that
    environments, or versions, never share a build."""
    import hashlib
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "-"

    ident = "\0".join([os.path.realpath(sys.prefix), version("torch"), version("deepspeed")])
    name = os.path.basename(os.path.realpath(sys.prefix)) or "python"
    return os.path.join(_default_root(), f"{name}-{hashlib.sha256(ident.encode()).hexdigest()[:12]}")


def use_environment_dir(env=None) -> str:
    """TORCH_EXTENSIONS_DIR in `env` (default: this process's, which the ranks it starts inherit):
    as set, else this environment's own folder (environment_dir). Returns it."""
    env = os.environ if env is None else env
    return env.setdefault("TORCH_EXTENSIONS_DIR", environment_dir())


def _default_root() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")  # torch._appdirs on Linux
    return os.path.realpath(os.path.join(cache, "torch_extensions"))


def extensions_root() -> tuple[str, int]:
    """Where torch builds JIT extensions, and how deep below it the build folders are: its
    TORCH_EXTENSIONS_DIR as given (build folders right below), else its cache folder with one
    folder per Python and accelerator tag (py311_cpu, py311_cu124, ...; every tag is looked at).
    As torch.utils.cpp_extension._get_build_directory decides it."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given is not None:
        return given, 1
    return _default_root(), 2  # environment_dir's folders are at that depth too


def build_locks(root: str | None = None, depth: int | None = None) -> list[str]:
    """Every build lock under the extensions root, held or not."""
    if root is None:
        root, depth = extensions_root()
    return sorted(glob.glob(os.path.join(root, *["*"] * (depth or 1), "lock")))


def holders(path: str) -> list[int]:
    """The processes that hold `path` open (Linux: /proc/<pid>/fd); a FileBaton's owner does."""
    target = os.path.realpath(path)
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's (whose lock this is not: see clear_stale)
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def stale_locks(root: str | None = None, depth: int | None = None) -> list[str]:
    """The build locks no process holds: left by a builder that was killed. One without a holder
    is looked at again SETTLE_S later, since a FileBaton closes the file just before removing it."""
    if not os.path.isdir("/proc"):  # no way to tell a live builder from a dead one here
        return []
    seen = {}
    for path in build_locks(root, depth):
        try:
            if not holders(path):
                seen[path] = os.stat(path).st_ino
        except OSError:
            continue
    if seen:
        time.sleep(SETTLE_S)
    stale = []
    for path, inode in seen.items():
        try:
            if os.stat(path).st_ino == inode and not holders(path):
                stale.append(path)
        except OSError:  # released meanwhile
            continue
    return stale


def clear_stale(root: str | None = None, depth: int | None = None, echo=None) -> list[str]:
    """Remove every stale build lock, saying so in one line each; returns the paths removed. One
    created by another user cannot be told from a held one (their processes are not ours to look
    at): that is refused in one line, naming the file."""
    echo = echo or (lambda line: print(line, file=sys.stderr))
    removed = []
    for path in stale_locks(root, depth):
        try:
            owner = os.stat(path).st_uid
        except OSError:
            continue
        if owner != os.geteuid() and os.geteuid() != 0:
            raise SpecError(
                path,
                "a torch extension build lock of another user, which a build of theirs may hold; "
                f"every run that loads this extension waits on it: remove it (rm {path}) once "
                "no build is running",
            )
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise SpecError(
                path,
                f"a stale torch extension build lock (no process holds it) that cannot be "
                f"removed ({e.strerror}); every run that loads this extension waits on it: "
                f"remove it (rm {path})",
            ) from None
        removed.append(path)
        echo(
            f"warning: removed a stale torch extension build lock {path} (no process holds it: a killed build "
            "left it, and the next DeepSpeed run would have waited on it until its timeout)"
        )
    return removed
