"""The scalers the drop-in tests run with, and how a test marks a kind.

A test written for ``torch.amp.GradScaler`` runs once per kind: the
reference (``torch.amp.GradScaler('cpu', ...)``, which must pass every
test, so it proves the test) and ``GradientScaler`` in ``mode='dynamic-gradscaler'``
and ``mode='gs'``, each built as a user who swaps the class would build
it: with GradScaler's settings the test names and the model trained.
Both GradientScaler kinds must pass every test too, except the scenarios
that gradient scaling, which has no single loss scale, cannot mean.

``cases(gs=...)`` gives a test's parametrization: every kind unmarked, or
GS with ``single_scale('why')``, a skip that says why GS cannot mean the
scenario.
"""

import collections

import pytest
import torch

from gradient_scaling.torch import GradientScaler

Kind = collections.namedtuple('Kind', 'name single_scale build')
Kind.__doc__ = """A scaler to test: ``single_scale`` when it has one loss
scale that ``get_scale`` reports and GradScaler's settings grow and back
off; ``build(model, **settings)`` makes one."""


def _gradscaler(model, **settings):
    return torch.amp.GradScaler('cpu', **settings)


def _gradient_scaler(mode):
    def build(model, **settings):
        return GradientScaler(model=model, mode=mode, **settings)
    return build


GRADSCALER = Kind('gradscaler', True, _gradscaler)
DYNAMIC = Kind('dynamic-gradscaler', True, _gradient_scaler('dynamic-gradscaler'))
GS = Kind('gs', False, _gradient_scaler('gs'))
KINDS = (GRADSCALER, DYNAMIC, GS)


def make(kind, model, enabled=True, **settings):
    """``kind``'s scaler with GradScaler's ``settings``; ``enabled`` is
    passed only when False, ``device`` never (the constructor tests
    cover both), so that a missing argument fails only the tests that
    need it."""
    if not enabled:
        settings['enabled'] = False
    return kind.build(model, **settings)


def loss_scale_settings(kind):
    """A smaller initial scale (2**10) for the kinds with one loss scale;
    none for GS (it takes GradScaler's settings and has no use for them:
    the framework tests build it as a user of gradient scaling would)."""
    return {'init_scale': 2.0 ** 10} if kind.single_scale else {}


def single_scale(reason):
    """A scenario about the single loss scale, which GS does not have."""
    return pytest.mark.skip(reason='GS has no single loss scale: ' + reason)


def cases(gs=None):
    """The kinds as a parametrization; ``gs``: GS's mark (a
    ``single_scale`` skip), if any."""
    return [pytest.param(kind, id=kind.name,
                         marks=gs if kind is GS and gs is not None else ())
            for kind in KINDS]


def enabled_cases():
    """``(kind, enabled)`` for a scenario PyTorch runs with scaling
    enabled and disabled."""
    return [pytest.param(kind, enabled, id='{}-{}'.format(
        kind.name, 'enabled' if enabled else 'disabled'))
        for kind in KINDS for enabled in (True, False)]
