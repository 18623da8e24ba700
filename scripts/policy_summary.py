"""The bf16 policy check's summary: per engine, the loss difference from the reference, the
memory census in multiples of the parameter count, saved activations, step time and peak memory.

    python scripts/policy_summary.py results.sqlite
"""

from __future__ import annotations

import json
import sys

from harness.store import ResultsStore


def main(path: str) -> int:
    records = {r["run_id"]: r for r in ResultsStore(path).records()}
    ref = (records.get("single") or {}).get("metrics", {}).get("losses") or []
    out = {}
    for run_id, rec in records.items():
        m = rec.get("metrics") or {}
        losses, P = m.get("losses") or [], m.get("parameter_count")
        census = m.get("memory_census") or {}
        out[run_id] = {
            "status": rec["status"],
            "error": (rec.get("error") or "").splitlines()[:1],
            "max_rel_loss_diff_vs_reference": max(
                (abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=False)), default=None
            ),
            "census_in_P": {c: {d: round(n / P, 3) for d, n in v.items()} for c, v in census.items()} if P else None,
            "activations_saved_MiB_per_micro_batch": (m.get("activations_saved_bytes") or 0) / 2**20,
            "step_time_ms_median": (m.get("step_time_s") or {}).get("median", 0) * 1e3,
            "peak_memory_GiB": (m.get("peak_memory_bytes") or 0) / 2**30,
            "mfu_palm": (m.get("mfu") or {}).get("palm"),
            "precision_policy": (m.get("engine") or {}).get("precision_policy"),
            "device": (rec.get("fingerprint") or {}).get("device_name"),
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
