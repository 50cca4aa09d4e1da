"""What the example scripts share, so that each shows only its experiment.

Every script in ``examples/`` reads top to bottom as ChainerCV's examples do
(options, dataset and transform, model, optimizer, Trainer with extensions);
the steps they all take are here, one module per concern:

* :mod:`~example_common.arguments`: the options every script has, their
  checks, the defaults for the data actually used, seeding and the device;
  a script's opening (seed, data, model in its dtype on its device).
* :mod:`~example_common.errors`: the bad inputs (an option value, a
  file; :class:`~example_data.errors.DatasetError` too) and how a script
  ends on one (one line, exit status 2).
* :mod:`~example_common.reports`: evaluation in the model's dtype, the log,
  plots and the final metric.
* :mod:`~example_common.snapshots`: trainer snapshots that carry every
  generator (and, under ChainerMN, every rank's state); resuming from one,
  bit for bit.

The data themselves (the readers of a user's folders, the generated
datasets, the defaults fitted to them, the iterators) are the package
:mod:`example_data`, which the scripts call as ChainerCV's examples call
``chainercv.datasets``.  Both are installed with the project
(``setup.py``), so a script started as ``python
examples/<experiment>/train.py`` imports them like any package.
"""
