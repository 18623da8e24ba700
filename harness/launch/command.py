"""The command line that starts the harness CLI on a run's ranks under each launcher (torchrun, the
deepspeed launcher, one direct process, srun), and the command as a record keeps it."""

from __future__ import annotations

import socket
import sys

from harness.errors import SpecError

LAUNCHERS = ("torchrun", "deepspeed", "direct", "srun")
LOCAL_LAUNCHERS = ("torchrun", "deepspeed", "direct")  # start every rank on this machine


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now; the launcher binds it a moment later (tiny race, accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_launcher(launcher: str, nproc: int, nnodes: int = 1, field: str = "launcher") -> None:
    """Whether `launcher` can start `nproc` processes on each of `nnodes` nodes: a SpecError line
    if not. Commands call it for every run before the first launch; build_command calls it too."""
    if launcher not in LAUNCHERS:
        raise SpecError(field, f"{launcher!r} is not one of {', '.join(LAUNCHERS)}")
    if not all(isinstance(n, int) and n >= 1 for n in (nproc, nnodes)):
        raise SpecError(field, f"needs a positive process and node count, got {nproc!r} and {nnodes!r}")
    if launcher == "direct" and nproc * nnodes != 1:
        raise SpecError(field, f"direct starts one process; this run needs {nproc * nnodes}: use torchrun or deepspeed")


def build_command(
    launcher: str,
    nproc: int,
    argv: list[str],
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    module: str = "harness.cli",
) -> list[str]:
    """The command line that starts `python -m <module> <argv>` on `nproc` ranks per node.

    `argv` are the harness CLI arguments (e.g. ["train", "spec.yaml", "--store", ...]).
    The deepspeed launcher is run as `python -m deepspeed.launcher.runner` (what the
    `deepspeed` script does) so that it uses this interpreter; `--num_gpus` is accepted on a
    CPU-only machine too, where it is the number of CPU ranks.
    """
    check_launcher(launcher, nproc, nnodes)
    port = master_port or free_port()
    py = sys.executable
    if launcher == "direct":
        return [py, "-m", module, *argv]
    if launcher == "torchrun":
        return [
            py,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--nnodes={nnodes}",
            f"--node_rank={node_rank}",
            f"--master_addr={master_addr}",
            f"--master_port={port}",
            "-m",
            module,
            *argv,
        ]
    if launcher == "deepspeed":
        cmd = [
            py,
            "-m",
            "deepspeed.launcher.runner",
            "--num_gpus",
            str(nproc),
            "--master_addr",
            master_addr,
            "--master_port",
            str(port),
        ]
        if nnodes > 1:  # one launcher per node, started by the caller (e.g. srun), no ssh
            cmd += ["--num_nodes", str(nnodes), "--node_rank", str(node_rank), "--no_ssh"]
        return cmd + ["--module", module, *argv]
    # srun: one task per rank; the runner maps SLURM_PROCID etc. itself
    return ["srun", f"--nodes={nnodes}", f"--ntasks-per-node={nproc}", "--kill-on-bad-exit=1", py, "-m", module, *argv]


def recorded_command(cmd: list[str]) -> list[str]:
    """A launch command as a record keeps it: this interpreter by its name, not its path on this
    machine (the fingerprint names the Python version; the run's log starts with the full line)."""
    return ["python", *cmd[1:]] if cmd and cmd[0] == sys.executable else list(cmd)
