"""Assemble a report: records -> rows -> sections -> files. The one entry point for callers."""

from __future__ import annotations

from harness.report import analysis as an
from harness.report import published_figures
from harness.report.breakdown import breakdown
from harness.report.data import choose_metric, shared_matmul_peaks, to_row, with_shared_peak
from harness.report.ranking import uses_cp, uses_ep
from harness.report.recommend import recommendations
from harness.report.render import write
from harness.spec.schema import BF16_PRECISIONS

# What names a run besides the axis an ablation varies (ablation_why pairs a run with its twin on these).
_NAMES = (
    "variant",
    "tp",
    "context",
    "expert",
    "pp",
    "dp",
    "micro_batch_size",
    "activation_checkpointing",
    "sequence_parallel",
    "kernel",
    "precision",
    "compiled",
    "schedule",
)


def _rest(*axes: str):
    names = tuple(n for n in _NAMES if n not in axes)
    return lambda r: tuple(getattr(r, n) for n in names)


def sections_for(
    records: list[dict], baselines_dir: str | None = None, timeline_run: str | None = None
) -> list[an.Section]:
    peaks = shared_matmul_peaks(records)  # one peak per device for every run's "MFU vs measured matmul"
    rows = [with_shared_peak(to_row(r), r, peaks) for r in records]
    m = choose_metric(rows)
    return [
        an.overview(rows, m, peaks),
        an.best_layouts(rows, m),
        an.axis_section(
            rows,
            m,
            "micro-batch",
            "MFU against micro-batch size",
            lambda r: r.micro_batch_size,
            "micro-batch",
            "The best layout for each micro-batch size (all other settings free), as in the study's figures.",
            plot="lines",
            rest=_rest("micro_batch_size"),
        ),
        an.tp_pp(rows, m),
        an.axis_section(
            rows,
            m,
            "kernels",
            "Kernel ablation",
            lambda r: r.kernel,
            "attention+rmsnorm",
            "The best layout for each attention and RMSNorm kernel combination.",
        ),
        an.axis_section(
            rows,
            m,
            "checkpointing",
            "Activation checkpointing ablation",
            lambda r: r.activation_checkpointing,
            "checkpointing",
            "The best layout per checkpointing mode; the run counts show which modes ran out of memory.",
            rest=_rest("activation_checkpointing"),
        ),
        an.axis_section(
            rows,
            m,
            "sequence-parallel",
            "Sequence parallelism ablation",
            lambda r: "on" if r.sequence_parallel else "off",
            "sequence parallel",
            "Only layouts with tp > 1, where sequence parallelism applies.",
            subset=lambda r: r.tp > 1,
        ),
        *(
            [
                an.axis_section(
                    rows,
                    m,
                    "context-parallel",
                    "Context parallelism ablation",
                    lambda r: r.context,
                    "context parallel",
                    "The best layout per context-parallel degree and implementation "
                    "(cp1: none); with the GPUs fixed, dp shrinks as cp grows. Shown only where a run uses "
                    "context parallelism.",
                    rest=_rest("context", "dp"),  # the GPUs fixed: dp shrinks as cp grows
                )
            ]
            if uses_cp(rows)
            else []
        ),
        *(
            [
                an.axis_section(
                    rows,
                    m,
                    "expert-parallel",
                    "Expert parallelism ablation",
                    lambda r: r.expert,
                    "expert parallel",
                    "The best layout per expert-parallel degree (ep1: every rank holds every expert). ep is carved "
                    "from the data-parallel ranks, so the GPUs and dp stay; what moves is the experts' memory per "
                    "rank against the all-to-all of tokens to their experts and back (exposed ep communication in "
                    "the breakdown) and the wait for the most loaded expert. Shown only where a run uses it.",
                    rest=_rest("expert"),
                )
            ]
            if uses_ep(rows)
            else []
        ),
        an.axis_section(
            rows,
            m,
            "fp8",
            "FP8 ablation",
            lambda r: r.precision,
            "precision",
            "The best layout per precision policy where a sweep ran bf16 and fp8 (workload.precision: the linear "
            "layers' GEMMs in FP8 through torchao, their casts and scales included in the step).",
            subset=lambda r: r.precision in BF16_PRECISIONS,
            rest=_rest("precision"),
        ),
        an.axis_section(
            rows,
            m,
            "compile",
            "torch.compile ablation",
            lambda r: r.compiled,
            "compile",
            "The best layout with and without torch.compile (layout.compile: blocks compiles each transformer "
            "block; compilation happens in the warm-up steps and is recorded apart, never in a step time).",
            rest=_rest("compiled"),
        ),
        an.axis_section(
            rows,
            m,
            "schedules",
            "Pipeline schedule ablation",
            lambda r: r.schedule,
            "schedule",
            "The best layout per pipeline schedule, among layouts with a pipeline (pp > 1): the bubble is what a "
            "schedule moves.",
            subset=lambda r: r.pp > 1,
            rest=_rest("schedule"),
        ),
        an.axis_section(
            rows,
            m,
            "frameworks",
            "Framework comparison",
            lambda r: r.variant,
            "engine",
            "The best layout per engine (own 3D engine, DeepSpeed ZeRO stages, FSDP2 modes) "
            "on the same workload and machines.",
        ),
        breakdown(rows, m),
        an.pipeline(rows, m, timeline_run),
        an.failures(rows),
        an.quoted(rows, m, published_figures.load(baselines_dir)),
        recommendations(rows, m),
    ]


def build_report(
    records: list[dict],
    out_dir: str,
    *,
    title: str = "Layout sweep report",
    baselines_dir: str | None = None,
    timeline_run: str | None = None,
) -> dict[str, str]:
    return write(out_dir, title, sections_for(records, baselines_dir, timeline_run))
