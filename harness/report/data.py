"""Flatten stored records into rows the report can sort, group and plot.

Optional metrics (breakdown, timeline, MFU on a machine without a known peak) may be
missing; every accessor here returns None rather than failing, so one odd record cannot
break a report of two thousand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.spec import engine_variant, layout_label


@dataclass
class Row:
    run_id: str
    sweep: str
    status: str
    engine: str
    variant: str  # engine and sharding mode (spec.engine_variant)
    label: str  # spec.layout_label
    model: str
    seq_len: int | None
    global_batch_size: int | None
    precision: str | None
    gpus: int | None
    tp: int
    pp: int
    dp: int
    mb: int | None
    ckpt: str
    sp: bool
    attention: str
    rmsnorm: str
    zero: int | None
    step_median: float | None = None
    step_ci: tuple | None = None
    steps: int | None = None
    tokens_per_s: float | None = None
    tokens_per_s_dev: float | None = None
    mfu: dict = field(default_factory=dict)
    mfu_measured: dict = field(default_factory=dict)
    peak_memory: int | None = None
    memory_kind: str | None = None
    breakdown: dict | None = None
    timeline: list | None = None
    error: str = ""
    error_line: str = ""  # the run's first `error:` line (launch.first_error_line), if it printed one
    device: str = ""
    hosts: tuple = ()
    versions: tuple = ()

    @property
    def kernel(self) -> str:
        return f"{self.attention}+{self.rmsnorm}"

    @property
    def reason(self) -> str:
        if self.error_line:
            return self.error_line[:160]
        lines = [ln.strip() for ln in (self.error or "").splitlines() if ln.strip()]
        return lines[0][:160] if lines else ""


def to_row(rec: dict) -> Row:
    spec = rec.get("spec") or {}
    w, lay = spec.get("workload") or {}, spec.get("layout") or {}
    m, fp = rec.get("metrics") or {}, rec.get("fingerprint") or {}
    tp, pp, dp = int(lay.get("tp") or 1), int(lay.get("pp") or 1), int(lay.get("dp") or 1)
    st = m.get("step_time_s") or {}
    ci = (st.get("ci95_low"), st.get("ci95_high")) if st.get("ci95_low") is not None else None
    versions = tuple(f"{k} {fp.get(k)}" for k in ("torch", "cuda", "nccl", "deepspeed") if fp.get(k))
    return Row(
        run_id=rec.get("run_id", "?"), sweep=rec.get("sweep") or "(no sweep)", status=rec.get("status", "?"),
        engine=lay.get("engine") or "?", variant=engine_variant(lay), label=layout_label(lay), model=str(w.get("model")),
        seq_len=w.get("seq_len"), global_batch_size=w.get("global_batch_size"), precision=w.get("precision"),
        gpus=fp.get("world_size") or tp * pp * dp, tp=tp, pp=pp, dp=dp, mb=lay.get("micro_batch_size"),
        ckpt=lay.get("activation_checkpointing") or "none", sp=bool(lay.get("sequence_parallel")),
        attention=lay.get("attention") or "?", rmsnorm=lay.get("rmsnorm") or "?", zero=lay.get("zero_stage"),
        step_median=st.get("median"), step_ci=ci, steps=st.get("n"), tokens_per_s=m.get("tokens_per_s"),
        tokens_per_s_dev=m.get("tokens_per_s_per_device"), mfu=dict(m.get("mfu") or {}),
        mfu_measured=dict(m.get("mfu_vs_measured_matmul") or {}), peak_memory=m.get("peak_memory_bytes"),
        memory_kind=m.get("memory_kind"), breakdown=m.get("breakdown_s") or None,
        timeline=m.get("pipeline_timeline") or None, error=rec.get("error") or "",
        error_line=rec.get("error_line") or "",
        device=str(fp.get("device_name") or ""), hosts=tuple(sorted(set(fp.get("hosts") or []))),
        versions=versions,
    )


@dataclass
class Metric:
    """The number layouts are ranked by: MFU where a peak is known, else the best substitute."""

    key: str
    title: str
    percent: bool
    short: str = "MFU"

    def of(self, r: Row) -> float | None:
        if self.key == "mfu":
            return r.mfu.get("palm")
        if self.key == "mfu_measured":
            return r.mfu_measured.get("palm")
        return r.tokens_per_s_dev

    def fmt(self, v: float | None) -> str:
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if self.percent else f"{v:,.0f}"


def choose_metric(rows: list[Row]) -> Metric:
    """MFU against the datasheet peak where the runs know one; else tokens/s per device.

    Not MFU against the measured matmul peak: each run measures its own peak, and on a shared
    or throttled machine that figure moves from run to run, which would rank layouts by the
    noise of the microbenchmark. Within a sweep the workload is identical, so tokens/s per
    device ranks the same way MFU would.
    """
    ok = [r for r in rows if r.status == "ok"]
    if ok and any(r.mfu.get("palm") is not None for r in ok):
        return Metric("mfu", "MFU (PaLM FLOPs, vs the device's datasheet dense bf16 peak)", True, "MFU")
    return Metric("tokens_per_s_dev", "tokens/s per device (no datasheet peak is known for this machine, "
                                      "so no MFU)", False, "tokens/s per device")


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def fmt_s(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"
