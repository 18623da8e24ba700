"""Engine single: facts.py (what it runs, no torch import), adapter.py (build), and its heavy modules."""
