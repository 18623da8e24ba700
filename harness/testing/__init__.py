"""What the tests and benchmarks share, kept out of the product modules: starting N gloo ranks
from Python (spawn.py), the single-device reference run and the comparison against it
(reference.py), the own engine's layout cases run in one launch (equivalence.py), and fake
records for report tests and benchmarks (synthetic.py), the own engine's pipeline programs drawn and
run grouped (schedules.py). Nothing in harness/ outside this
package imports it."""
