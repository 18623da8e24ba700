"""`harness compare`'s console after a long comparison: beside the verdict and the report's path, the fastest
run and the lines of Why, the same sentences the report's Why section holds (a 17-run comparison once printed
only the verdict and a path after 8 minutes)."""

from __future__ import annotations

import json
import os

from harness.report.compare_steps import console_lines, why_section

REPORT = os.path.join(os.path.dirname(__file__), "..", "reports", "compare-cpu-default.json")


def test_the_console_names_the_fastest_run_and_says_why_as_the_report_does():
    with open(REPORT) as f:
        summary = json.load(f)
    lines = console_lines(summary)
    section = why_section(summary)
    fastest = next(b for b in section.body if isinstance(b, str) and b.startswith("Fastest run"))
    assert lines[0] == "fastest run (measured median): " + fastest.split("**")[1]
    items = [i.replace("**", "") for b in section.body if hasattr(b, "items") for i in b.items]
    said = [line.removeprefix("why: ") for line in lines[1:]]
    assert said and all(s in items for s in said)


def test_a_comparison_without_timed_runs_prints_no_fastest_run():
    assert console_lines({"runs": []}) == []
