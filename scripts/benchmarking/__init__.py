"""The benchmarks' one harness, shared by scripts/benchmark.py and
scripts/benchmark_kernels.py.

* :mod:`benchmarking.harness`: the timing loop (variants alternated within
  each round), the peak-memory rounds, the timer of a hook's own calls
  (``TimedCalls`` into ``SectionTimes``), BLAS thread limiting;
  framework-neutral.
* :mod:`benchmarking.rows`: the result rows (dataclasses) and their
  builders; :mod:`benchmarking.report`: the Markdown report.
* :mod:`benchmarking.cases`: Chainer's models, each with its loss and a
  batch; :mod:`benchmarking.chainer_variants`: the variants trained on them.
  Another framework adds its own cases and variants module.

A sibling of the scripts: ``python scripts/benchmark.py`` finds it as
Python finds a script's own modules, with no ``sys.path`` edit.
"""
