"""What the benchmark scripts share: the timed models and the timing.

* :mod:`benchmarking.cases`: each model with its loss and a batch of
  inputs (a small CNN, ResNet-50, SSD300 + multibox loss, SegNetBasic),
  and a gradient-like tensor for the statistics throughput.
* :mod:`benchmarking.alternate`: variants timed in turn within each round,
  so that all of them see the same machine load, and the Markdown table of
  medians and ratios.

A sibling of the scripts: ``python scripts/benchmark.py`` finds it as
Python finds a script's own modules, with no ``sys.path`` edit.
"""
