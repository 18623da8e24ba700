"""Time report generation from 2,000 synthetic records (target: under 15 s on a 2-core CPU).

    python benchmarks/report_scale.py [--records N] [--out DIR]

Prints the time; the last line reads `seconds: <n>`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=2000)
    p.add_argument("--out", help="report directory (default: a temporary one)")
    a = p.parse_args()
    from harness.report.build import build_report
    from harness.testing.synthetic import make_records

    records = make_records(a.records, seed=1)
    out = a.out or tempfile.mkdtemp(prefix="report-scale-")
    t0 = time.perf_counter()
    paths = build_report(records, out, title=f"Synthetic report ({a.records} records)")
    seconds = time.perf_counter() - t0
    size = os.path.getsize(paths["html"])
    print(f"{a.records} records -> {paths['html']} ({size / 1e6:.1f} MB) in {seconds:.2f} s (target < 15 s)")
    print(f"seconds: {seconds:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
