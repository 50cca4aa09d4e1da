"""What examples/torch/train.py is made of, one module per concept.

* :mod:`~torch_example.errors`: a bad input ends the run with one
  ``error:`` line and exit status 2.
* :mod:`~torch_example.arguments`: the command line (the Chainer
  examples' switches) and its checks.
* :mod:`~torch_example.precision`: FP32, autocast or a simulated format,
  and the :class:`~gradient_scaling.torch.GradientScaler` for ``--scaling``.
* :mod:`~torch_example.data`: the datasets (example_data's readers), their
  transforms, and the training batches of each process.
* :mod:`~torch_example.tasks`: classification and segmentation: model,
  loss, schedule, metric.
* :mod:`~torch_example.distributed`: several processes (``torchrun``),
  one decision per step, identical replicas.
* :mod:`~torch_example.snapshots`: everything a run needs to continue bit
  for bit, written with ``torch.save`` and read with ``weights_only=True``.
* :mod:`~torch_example.reports`: the log, the printed table, the per-site
  scales (CSV and figure), the final metric line.

None of them imports Chainer.
"""
