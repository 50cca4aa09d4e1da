"""What the example scripts share, so that each shows only its experiment.

Every script in ``examples/`` reads top to bottom as ChainerCV's examples do
(options, dataset and transform, model, optimizer, Trainer with extensions);
the steps they all take are here, one module per concern:

* :mod:`~example_common.arguments`: the options every script has, their
  checks, the defaults for the data actually used, seeding and the device.
* :mod:`~example_common.errors`: :class:`~example_common.errors.DatasetError`
  and the other bad inputs, and how a script ends on one (one line, exit
  status 2).
* :mod:`~example_common.data`: real data or, when it is absent, the
  embedded data (saying so); the iterators.
* :mod:`~example_common.voc_format`: detection datasets in PASCAL VOC's
  directory layout, with any label names.
* :mod:`~example_common.reports`: evaluation in the model's dtype, the log,
  plots and the final metric.
* :mod:`~example_common.snapshots`: trainer snapshots that carry every
  generator (and, under ChainerMN, every rank's state); resuming from one,
  bit for bit.

It is installed with the project (``setup.py``), so a script started as
``python examples/<experiment>/train.py`` imports it like any package.
"""
