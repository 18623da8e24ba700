"""Assemble a report: records -> rows -> sections -> files. The one entry point for callers."""

from __future__ import annotations

from harness.report import analysis as an
from harness.report import baselines
from harness.report.breakdown import breakdown
from harness.report.data import choose_metric, to_row
from harness.report.ranking import uses_cp
from harness.report.recommend import recommendations
from harness.report.render import write


def sections_for(
    records: list[dict], baselines_dir: str | None = None, timeline_run: str | None = None
) -> list[an.Section]:
    rows = [to_row(r) for r in records]
    m = choose_metric(rows)
    return [
        an.overview(rows, m),
        an.best_layouts(rows, m),
        an.axis_section(
            rows,
            m,
            "micro-batch",
            "MFU against micro-batch size",
            lambda r: r.mb,
            "micro-batch",
            "The best layout for each micro-batch size (all other settings free), as in the study's figures.",
            plot="lines",
            rest=lambda r: (r.variant, r.tp, r.context, r.pp, r.dp, r.ckpt, r.sp, r.kernel),
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
            lambda r: r.ckpt,
            "checkpointing",
            "The best layout per checkpointing mode; the run counts show which modes ran out of memory.",
            rest=lambda r: (r.variant, r.tp, r.context, r.pp, r.dp, r.mb, r.sp, r.kernel),
        ),
        an.axis_section(
            rows,
            m,
            "sequence-parallel",
            "Sequence parallelism ablation",
            lambda r: "on" if r.sp else "off",
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
                    rest=lambda r: (r.variant, r.tp, r.pp, r.mb, r.ckpt, r.sp, r.kernel),
                )
            ]
            if uses_cp(rows)
            else []
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
        an.quoted(rows, m, baselines.load(baselines_dir)),
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
