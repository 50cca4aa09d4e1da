"""Every example in the library's docstrings runs and prints what it says.

The class and module docstrings open with a short runnable example (the
project's style); this runs each one with :mod:`doctest`, so an example
that no longer matches the code fails here instead of misleading a reader.
"""

import doctest
import importlib
import pkgutil

import pytest

import chainer_links
import example_common
import example_data
import gradient_scaling

# The library, the model links and the examples' shared code.
PACKAGES = (gradient_scaling, chainer_links, example_common, example_data)


def _modules():
    names = [m.name for package in PACKAGES for m in pkgutil.walk_packages(
        package.__path__, package.__name__ + '.')]
    assert len(names) > 40, names
    return names


def _needs(name):
    if name.startswith(('gradient_scaling.torch', 'chainer_links.torch')):
        return 'torch'
    if name.startswith('gradient_scaling.cuda'):
        return 'cupy'
    return None


@pytest.mark.parametrize('name', _modules())
def test_docstring_examples_run(name):
    needed = _needs(name)
    if needed:
        pytest.importorskip(needed)
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name, globs={}):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, '{} of {} examples of {} failed (the ' \
        'report above says which)'.format(results.failed,
                                          results.attempted, name)


def test_the_examples_are_found():
    # The finder must see the examples: a module known to hold some.
    module = importlib.import_module('gradient_scaling.core.formats')
    tests = doctest.DocTestFinder().find(module)
    assert sum(len(t.examples) for t in tests) >= 3
