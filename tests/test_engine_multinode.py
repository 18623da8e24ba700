"""Two 'nodes' on loopback: two torchrun invocations (node rank 0 and 1) run `harness train`.

The layout puts one TP group on each node (tp=2, 2 processes per node) and the pipeline
across the nodes, as on a real cluster. The record written by the runner must say ok and its
losses must equal the single-device reference's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from harness.launch import free_port
from harness.store import ResultsStore

pytestmark = pytest.mark.slow  # every test here starts processes

SPEC = textwrap.dedent("""
    name: two-node-sim
    workload: {model: tiny, seq_len: 16, global_batch_size: 4, steps: 3, warmup_steps: 1, precision: fp32,
               device: cpu}
    layout: {engine: own, tp: 2, pp: 2, dp: 1, sequence_parallel: true, micro_batch_size: 1}
""")


# The run takes ~10 s. The bound is above torchrun's 300 s exit barrier between the two launchers
# (a launcher whose peer is late waits that long and then exits with its workers' status) and
# the harness's own 120 s end barrier, so a slow shutdown is told apart from a hung run.
LAUNCHER_TIMEOUT_S = 420


def test_two_node_run_on_loopback(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    store = tmp_path / "results.sqlite"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "harness.cli",
            "train",
            str(spec),
            "--store",
            str(store),
            "--run-id",
            "two-node",
            "--no-progress",
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        )  # its own group: a kill ends its workers too
    outs, timed_out = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=None if timed_out else LAUNCHER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            timed_out = True  # end both launchers, then show what each printed
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, _ = p.communicate()
        outs.append(out)
    assert not timed_out and all(p.returncode == 0 for p in procs), "\n\n".join(
        f"node {i} (rc {p.returncode}):\n{o[-3000:]}" for i, (p, o) in enumerate(zip(procs, outs, strict=True))
    )
    record = ResultsStore(str(store)).get("two-node")
    assert record is not None and record["status"] == "ok", record and record.get("error")
    m = record["metrics"]
    assert m["engine"]["mesh"] == {"tp": 2, "cp": 1, "pp": 2, "dp": 1, "order": "pp, dp, cp, tp (tp innermost)"}
    nodes = {(r["rank"], r["node"]) for r in m["engine"]["rank_map"]}
    assert nodes == {(0, 0), (1, 0), (2, 1), (3, 1)}  # each TP pair on one node
    assert set(m["breakdown_s"]) >= {"compute", "tp_comm", "bubble", "dp_comm", "optimizer"}
    assert m["comm"]["pp"]["send"]["count"] > 0

    from harness.testing.reference import mismatches, reference_run

    ref, _ = reference_run(
        {
            "model": "tiny",
            "seq_len": 16,
            "global_batch_size": 4,
            "steps": 3,
            "warmup_steps": 1,
            "precision": "fp32",
            "device": "cpu",
        },
        steps=4,
    )
    assert not mismatches({"losses": m["losses"]}, ref, None)
