"""What the tests and benchmarks share, kept out of the product modules: starting N gloo ranks
from Python (spawn.py), one launch per engine and world size shared by a test session
(launches.py), the single-device reference run and the comparison against it (reference.py), the
own engine's layout cases run in one launch (equivalence.py), the engines' MoE parity checks
(moe_parity.py), fake records for report tests and benchmarks (synthetic.py), the own engine's
pipeline programs drawn and run grouped (schedules.py), and any engine's run with its census and
optimizer states for optimizer tests (optimizers.py). Nothing in harness/ outside this package
imports it."""
