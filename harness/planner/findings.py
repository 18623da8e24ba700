"""The reference study's findings, as the planner predicts them for one model, workload, cluster and
hardware profile: so that one can see which findings move with the GPU generation.

Each finding is read off one plan (the candidate layouts `harness plan` enumerates and ranks, and
their predictions): it compares the best layout predicted to fit (it fits in memory and its kernel
is available; best = highest predicted MFU, which on the same GPUs and tokens is the shortest step)
that has a property ("with") against the best one predicted to fit that has not ("without"). The
verdict follows from those two predictions alone: "yes" when with's MFU is higher, "no" when lower,
"tie" when equal. A finding with no fitting layout on one side is "not judged", saying which side.

The findings (the study's wording in DESIGN.md, "Reference study"):
  micro_batch_1        "micro-batch size 1 is usually best": with micro_batch_size 1, without:
                       micro_batch_size > 1.
  no_checkpointing     "avoid activation checkpointing where memory allows": with
                       activation_checkpointing none, without: full or selective.
  flash_attention      "FlashAttention-2 helps a lot": with a FlashAttention kernel (its cost class
                       flash1, flash2 or a later flash*: FlashAttention-1, -2 and the SDPA backends
                       that run it, harness.planner.layout.ATTENTION_CLASS), without: every other
                       kernel (naive, fused_softmax, sdpa_efficient). The gain is with's MFU / without's.
  pipeline_over_tensor "pipeline parallelism beats tensor parallelism": with pp > tp, without
                       tp > pp (the split the report's recommendations compare,
                       harness/report/recommend.py; tp == pp, no model parallelism included, is
                       neither).
  sequence_parallel    "sequence parallelism pays for models above 30B or sequences above 2k": for
                       each tp > 1 at which a layout with sequence parallelism fits, smallest first,
                       the best fitting layout at that tp with sp on against the best with sp off.
                       The answer is the smallest tp at which sp on wins, or nothing fits with sp
                       off; "never" when no tp does (the comparison shown is then at the largest tp).
  best_mfu             the best layout predicted to fit and its MFU; its verdict is the layout.
Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.planner.layout import ATTENTION_CLASS, PlannerLayout
from harness.planner.predict import Prediction
from harness.spec import engine_variant, layout_label


@dataclass
class Finding:
    """What one plan says of one finding."""

    key: str
    verdict: str  # yes | no | tie | tp<N> | never | the best layout's label | not judged
    judged: bool
    with_: Prediction | None = None  # the best fitting layout with the property
    without: Prediction | None = None  # the best fitting layout without it
    why: str = ""  # why it is not judged
    at_tp: int | None = None  # sequence_parallel: the tp the shown comparison is at

    def cell(self) -> str:
        """The table cell: the verdict and the two compared layouts' distinguishing values and MFUs."""
        if not self.judged:
            return f"not judged: {self.why}"
        if self.key == "best_mfu":
            lay = self.with_.layout
            cp = f" cp{lay.cp}" if lay.cp > 1 else ""
            return f"{self.with_.mfu:.3f} tp{lay.tp}{cp} pp{lay.pp} dp{lay.dp} mb{lay.micro_batch_size}"
        show = SHOW[self.key]
        head = self.verdict
        if self.key == "flash_attention":
            head += f" x{self.with_.mfu / self.without.mfu:.2f}"
        if self.key == "sequence_parallel" and self.verdict == "never":
            head += f" (tp{self.at_tp})"
        other = f"{show(self.without.layout)} {self.without.mfu:.3f}" if self.without else "off: none fits"
        return f"{head}: {show(self.with_.layout)} {self.with_.mfu:.3f} vs {other}"

    def to_dict(self) -> dict:
        out = {"verdict": self.verdict, "judged": self.judged}
        if not self.judged:
            out["why"] = self.why
        for name, p in (("with", self.with_), ("without", self.without)):
            if p is not None:
                out[name] = {
                    "label": label(p.layout),
                    "layout": p.layout.to_dict(),
                    "memory_gib": round(p.memory_gib, 2),
                    "step_time_s": round(p.step_time_s, 4),
                    "mfu": round(p.mfu, 4),
                }
        if self.key == "flash_attention" and self.judged:
            out["mfu_ratio"] = round(self.with_.mfu / self.without.mfu, 4)
        if self.at_tp is not None:
            out["tp"] = self.at_tp
        return out


def label(lay: PlannerLayout) -> str:
    """The layout's label (harness.spec.layout_label) without the engine, which one plan shares."""
    spec = lay.to_spec()
    return layout_label(spec)[len(engine_variant(spec)) :].strip()


def _flash(lay: PlannerLayout) -> bool:
    """A FlashAttention kernel: its cost class is flash1, flash2 or a later flash* one."""
    return ATTENTION_CLASS[lay.attention].startswith("flash")


# key -> (question, with, without, what each side is called when no fitting layout has it)
PAIRED = {
    "micro_batch_1": (
        "micro-batch 1 best?",
        lambda lay: lay.micro_batch_size == 1,
        lambda lay: lay.micro_batch_size > 1,
        "mb 1",
        "mb > 1",
    ),
    "no_checkpointing": (
        "checkpointing avoided?",
        lambda lay: lay.activation_checkpointing == "none",
        lambda lay: lay.activation_checkpointing != "none",
        "checkpointing none",
        "checkpointing",
    ),
    "flash_attention": (
        "flash kernel gain?",
        _flash,
        lambda lay: not _flash(lay),
        "a flash kernel",
        "a non-flash kernel",
    ),
    "pipeline_over_tensor": (
        "pipeline over tensor parallel?",
        lambda lay: lay.pp > lay.tp,
        lambda lay: lay.tp > lay.pp,
        "pp > tp",
        "tp > pp",
    ),
}
QUESTIONS = {
    **{k: v[0] for k, v in PAIRED.items()},
    "sequence_parallel": "sequence parallel pays from",
    "best_mfu": "best MFU",
}
# What a cell names of each compared layout: the property's value.
SHOW = {
    "micro_batch_1": lambda lay: f"mb{lay.micro_batch_size}",
    "no_checkpointing": lambda lay: lay.activation_checkpointing,
    "flash_attention": lambda lay: lay.attention,
    "pipeline_over_tensor": lambda lay: f"tp{lay.tp} pp{lay.pp}",
    "sequence_parallel": lambda lay: "on" if lay.sequence_parallel else "off",
}


def _best(preds: list[Prediction], keep) -> Prediction | None:
    """The fitting prediction with the highest MFU among those `keep` accepts (the first of equals)."""
    best = None
    for p in preds:
        if p.fits and p.available and keep(p.layout) and (best is None or p.mfu > best.mfu):
            best = p
    return best


def _verdict(a: Prediction, b: Prediction) -> str:
    return "yes" if a.mfu > b.mfu else "no" if a.mfu < b.mfu else "tie"


def _paired(key: str, preds: list[Prediction]) -> Finding:
    _, has, lacks, with_name, without_name = PAIRED[key]
    a, b = _best(preds, has), _best(preds, lacks)
    if a is None or b is None:
        missing = with_name if a is None else without_name
        return Finding(key, "not judged", False, a, b, why=f"no fitting layout with {missing}")
    return Finding(key, _verdict(a, b), True, a, b)


def _sequence_parallel(preds: list[Prediction]) -> Finding:
    tps = sorted({p.layout.tp for p in preds if p.fits and p.available and p.layout.sequence_parallel})
    if not tps:
        return Finding("sequence_parallel", "not judged", False, why="no fitting layout with sequence parallelism")
    for tp in tps:
        on = _best(preds, lambda lay, tp=tp: lay.tp == tp and lay.sequence_parallel)
        off = _best(preds, lambda lay, tp=tp: lay.tp == tp and not lay.sequence_parallel)
        if off is None or on.mfu > off.mfu:
            return Finding("sequence_parallel", f"tp{tp}", True, on, off, at_tp=tp)
    return Finding("sequence_parallel", "never", True, on, off, at_tp=tp)


def judge(preds: list[Prediction]) -> list[Finding]:
    """Every finding, in QUESTIONS' order, from one plan's predictions."""
    out = [_paired(key, preds) for key in PAIRED] + [_sequence_parallel(preds)]
    best = _best(preds, lambda lay: True)
    if best is None:
        out.append(Finding("best_mfu", "not judged", False, why="no layout is predicted to fit"))
    else:
        out.append(Finding("best_mfu", label(best.layout), True, best))
    return out


def same_everywhere(cells: list[Finding]) -> bool | None:
    """Whether the judged profiles agree on a finding's verdict (None: fewer than two judged it)."""
    verdicts = [f.verdict for f in cells if f.judged]
    return None if len(verdicts) < 2 else len(set(verdicts)) == 1
