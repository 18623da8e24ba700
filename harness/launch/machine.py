"""Before the first launch (compare, a sweep under a local launcher): every run's kernels run on the device
its ranks will get on this machine, checked once per distinct need, so that a missing kernel is one line
before anything starts, not a failure in every rank."""

from __future__ import annotations

from harness.errors import SpecError
from harness.model.kernels import need_of, probe, probe_in_child
from harness.runtime import choose_device
from harness.spec import RunSpec


def check_machine(runs) -> None:
    """Before the first launch (compare, a sweep under a local launcher): every run's kernels run
    on the device its ranks get on this machine (preflight's check), else one SpecError naming the
    first run that needs them. `runs`: (name, RunSpec or spec dict) pairs.

    Each distinct need (kernels, device, precision, head size) is tried once: on CPU in this
    process; on CUDA in one short child process (kernels.probe_in_child), so that the launching
    process holds no CUDA context (on a GPU in exclusive-process mode its ranks could not get one,
    elsewhere it would take memory from rank 0 for the whole comparison or sweep)."""
    from harness.spec import parse_spec

    needs: dict[tuple, list[str]] = {}
    for name, spec in runs:
        spec = spec if isinstance(spec, RunSpec) else parse_spec(spec)
        device = choose_device(spec.workload.device, 0)  # a CUDA device the machine lacks: refused here
        needs.setdefault(need_of(spec, device.type), []).append(name)
    cuda = [n for n in needs if n[2] == "cuda"]
    failed = probe_in_child(cuda) if cuda else {}
    for need in needs:
        if need[2] == "cpu":
            try:
                probe(need)
            except SpecError as e:
                failed[need] = (e.field, e.reason)
    for need, names in needs.items():
        if need in failed:
            field, reason = failed[need]
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise SpecError(f"{field} ({names[0]}{more})", f"{reason.rstrip('.')}; nothing was launched")
