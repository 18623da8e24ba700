"""Honest measurement, one job per module: timers (the device-synchronised step timer), ranges (the
harness's own named ranges inside a step), stats (a distribution's summary), mfu (peaks and MFU),
memory (the peak a step held), census (the tensors an engine holds, the activations a step saves),
fingerprint (the machine a record was measured on), stream (the live TensorBoard metrics).

A measurement is a distribution: warm-up excluded, every measured step kept, summarised by
median and spread with a distribution-free interval of the median at the coverage it has (stats).
"""
