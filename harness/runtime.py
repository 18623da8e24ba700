"""Process setup that works the same under torchrun, the deepspeed launcher and srun."""

from __future__ import annotations

import contextlib
import glob
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.errors import SpecError


@dataclass
class RunContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.backend is not None:
            dist.barrier()


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[003-005,007],cpu01' -> 'gpu003'."""
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        return prefix + rest.rstrip("]").split(",")[0].split("-")[0]
    return head


def adopt_slurm_env() -> None:
    """Map srun's variables onto the torch.distributed ones when no launcher set them."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = _first_slurm_host(os.environ.get("SLURM_JOB_NODELIST", "127.0.0.1"))
    os.environ.setdefault("MASTER_PORT", str(slurm_master_port()))


# MASTER_PORT of a Slurm job: unprivileged and below Linux's ephemeral range (32768-60999).
SLURM_PORT_BASE, SLURM_PORT_SPAN = 10000, 22768


def slurm_master_port(env=None) -> int:
    """The rendezvous port of a Slurm job, derived from its job id and array task id so that two
    jobs, or two tasks of one job array, sharing a node do not collide on one fixed port; every
    rank of the job derives the same one. 29500 outside a job.

    In an array: SLURM_ARRAY_JOB_ID (the same for every task) + SLURM_ARRAY_TASK_ID, so the tasks
    of one array get consecutive, distinct ports; otherwise SLURM_JOB_ID."""
    import zlib

    env = os.environ if env is None else env

    def number(name: str) -> int | None:
        x = str(env.get(name, "")).strip()
        return None if not x else int(x) if x.isdigit() else zlib.crc32(x.encode())

    array, task, job = number("SLURM_ARRAY_JOB_ID"), number("SLURM_ARRAY_TASK_ID"), number("SLURM_JOB_ID")
    if array is not None and task is not None:
        key = array + task
    elif job is not None:
        key = job + (task or 0)
    else:
        return 29500
    return SLURM_PORT_BASE + key % SLURM_PORT_SPAN


def set_cpu_threads(local_world: int) -> None:
    """The deepspeed launcher leaves OMP_NUM_THREADS unset: N ranks x all cores thrash the CPU."""
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // max(1, local_world))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def choose_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SpecError("workload.device", "cuda requested but no CUDA device is visible")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def launched(env=None) -> bool:
    """Whether init forms a process group: a launcher (torchrun, deepspeed, srun) set this rank's
    variables, or WORLD_SIZE asks for more than one process."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    return world > 1 or "MASTER_ADDR" in env and "RANK" in env or "SLURM_PROCID" in env


def check_launched(engine: str) -> None:
    """An engine that needs a process group (its facts' process_group), started without a launcher:
    one line naming how to start it, before anything is built."""
    from harness import registry

    if registry.known(engine) and registry.facts(engine).process_group and not launched():
        raise SpecError(
            "layout.engine",
            f"engine {engine} needs a process group, even for one process: start harness train under a launcher, "
            "e.g. `torchrun --nproc-per-node 1 -m harness.cli train SPEC`, or run it with harness compare",
        )


def init(requested_device: str = "auto") -> RunContext:
    adopt_slurm_env()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(requested_device, local_rank)
    if device.type == "cpu":
        set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    else:
        torch.cuda.set_device(device)
    backend = None
    if launched():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            kwargs = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend=backend, rank=rank, world_size=world, **kwargs)
    return RunContext(rank, world, local_rank, device, backend)


# How long a finished rank waits at the end for its peers (gloo only; NCCL's barrier has no
# per-call timeout). The record is written before this point, so a peer that never arrives
# costs nothing measured; it must not keep this rank, and its launcher, alive for the group's
# 30-minute default timeout.
END_BARRIER_TIMEOUT_S = 120


# DeepSpeed's CPU communication (its shared-memory allreduce, deepspeed/ops/csrc/cpu/comm/shm.cpp) puts
# one workspace per rank in /dev/shm, named by uid, master address, master port and rank, and never
# unlinks it (its shared_close is never called): ~69 MB per rank and run, held in memory until the
# machine restarts. The rank that made its workspace unlinks it at teardown (every peer mapped it at
# initialisation, so the mappings stay valid); a launcher removes what killed ranks left.
SHM_DIR = "/dev/shm"


def deepspeed_shm_buffers(addr: str, port, rank="*", shm_dir: str = SHM_DIR) -> list[str]:
    """The paths of DeepSpeed's CPU allreduce workspaces of one run (one rank's, or every rank's)."""
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{glob.escape(str(addr))}_{glob.escape(str(port))}_{rank}"
    return glob.glob(os.path.join(shm_dir, name))


def remove_deepspeed_shm_buffers(addr: str, port, rank="*", shm_dir: str = SHM_DIR) -> int:
    """Unlink them; how many were there."""
    paths = deepspeed_shm_buffers(addr, port, rank, shm_dir)
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return len(paths)


def teardown(ctx: RunContext, barrier: bool = True) -> None:
    """End of a run: every rank reaches the barrier, then the group is destroyed. A gloo rank
    whose peers do not arrive in END_BARRIER_TIMEOUT_S says which and leaves the group as is.
    Either way the rank's DeepSpeed shared-memory workspace, if it made one, is unlinked."""
    if ctx.backend is None or not dist.is_initialized():
        return
    try:
        _end_group(ctx, barrier)
    finally:
        if "MASTER_PORT" in os.environ:
            remove_deepspeed_shm_buffers(os.environ.get("MASTER_ADDR", ""), os.environ["MASTER_PORT"], ctx.rank)


def _end_group(ctx: RunContext, barrier: bool) -> None:
    if barrier and ctx.backend == "gloo":
        from datetime import timedelta

        try:
            dist.monitored_barrier(timeout=timedelta(seconds=END_BARRIER_TIMEOUT_S), wait_all_ranks=True)
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or ["no reason given"])[0]
            print(f"rank {ctx.rank}: peers missing at the end barrier, leaving without it: {first}", flush=True)
            return
    elif barrier:
        try:
            dist.barrier()
        except BaseException:
            dist.destroy_process_group()
            raise
    dist.destroy_process_group()
