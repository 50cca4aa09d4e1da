import gradient_scaling.compat  # NOQA: must precede any chainer import

import pytest


def pytest_addoption(parser):
    parser.addoption('--run-slow', action='store_true',
                     help='also run tests marked slow')


def pytest_collection_modifyitems(config, items):
    if config.getoption('--run-slow'):
        return
    skip_slow = pytest.mark.skip(reason='slow: pass --run-slow to run')
    for item in items:
        if 'slow' in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _seeded_global_generators():
    """Every test starts from the same global NumPy and Python generators.

    Chainer's initializers draw from NumPy's global generator; without a
    seed a test's model would change from run to run.
    """
    import random

    import numpy
    numpy.random.seed(0)
    random.seed(0)
