"""`harness compare`'s machinery: the compare spec (spec.py: one workload, a list of runs, each
checked before anything launches), running them (orchestrate.py), and the loss-parity and
fingerprint verdicts (parity.py). The report is harness.report.compare."""
