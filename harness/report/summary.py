"""The few lines a person reads at the end of a run."""

from __future__ import annotations

from harness.measure.stats import coverage_text, median_coverage


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if n is not None else "n/a"


def _coverage(st: dict) -> float | None:
    """The step-time interval's coverage: as recorded, else from the step count (records before it)."""
    return st["ci_coverage"] if st.get("ci_coverage") is not None else median_coverage(st["n"]) if st.get("n") else None


def _schedule(lay: dict) -> str:
    virtual = int(lay.get("virtual_stages") or 1)
    return (lay.get("pipeline_schedule") or "1f1b") + (f" v{virtual}" if virtual > 1 else "")


def summary_lines(record: dict, store_path: str) -> list[str]:
    m, lay = record.get("metrics") or {}, record["spec"]["layout"]
    w = record["spec"]["workload"]
    st = m.get("step_time_s") or {}
    lines = [
        f"run {record['run_id']}: {record['status']}",
        f"  workload: {w['model']} seq {w['seq_len']} global batch {w['global_batch_size']} {w['precision']}",
        f"  layout:   engine {lay['engine']} tp {lay['tp']} "
        + (f"cp {lay['cp']} {lay.get('cp_impl') or 'ring'} " if (lay.get("cp") or 1) > 1 else "")
        + f"pp {lay['pp']} "
        + (f"{_schedule(lay)} " if (lay.get("pp") or 1) > 1 else "")  # no schedule without a pipeline
        + f"dp {lay['dp']} "
        f"mbs {lay['micro_batch_size']} ckpt {lay['activation_checkpointing']} attn {lay['attention']} "
        f"rmsnorm {lay['rmsnorm']}",
    ]
    if st:
        lines.append(
            f"  step time: median {st['median'] * 1e3:.1f} ms (interval of the median {st['ci95_low'] * 1e3:.1f}-"
            f"{st['ci95_high'] * 1e3:.1f} at {coverage_text(_coverage(st))}, "
            f"p10 {st['p10'] * 1e3:.1f}, p90 {st['p90'] * 1e3:.1f}, "
            f"n={st['n']})"
        )
        lines.append(
            f"  throughput: {m['tokens_per_s']:,.0f} tokens/s ({m['tokens_per_s_per_device']:,.0f} per device)"
        )
        if m.get("mfu"):
            mfu = m["mfu"]
            lines.append(
                f"  MFU: palm {100 * mfu['palm']:.1f}% | causal {100 * mfu['palm_causal']:.1f}% | "
                f"megatron {100 * mfu['megatron']:.1f}% | HFU {100 * mfu['hardware']:.1f}% "
                f"(peak {m['peak_tflops']} TFLOP/s, {m['peak_tflops_source']})"
            )
        if m.get("mfu_vs_measured_matmul"):
            lines.append(
                f"  vs measured matmul peak {m['measured_matmul_tflops']:.2f} TFLOP/s: "
                f"{100 * m['mfu_vs_measured_matmul']['palm']:.1f}% (palm convention)"
            )
        lines.append(f"  peak memory: {_gib(m.get('peak_memory_bytes'))} ({m.get('memory_kind')})")
        losses = m.get("losses") or []
        if losses:
            lines.append(f"  loss: first {losses[0]:.4f} last {losses[-1]:.4f}")
    if record.get("error"):
        lines.append("  error: " + record["error"].splitlines()[0])
    if record.get("tensorboard_dir"):
        lines.append(f"  TensorBoard: {record['tensorboard_dir']} (tensorboard --logdir {record['tensorboard_dir']})")
    lines.append(f"  record written to {store_path}")
    return lines
