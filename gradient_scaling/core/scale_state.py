"""What gradient scaling remembers between steps: the scales and the backoffs.

:class:`~gradient_scaling.GradientScaling` applies the paper's rules during
backprop; what it carries from one step to the next lives here, each piece
with its own transition table and ``state_dict`` (the refresh schedule,
``age`` and ``forced``, is the
:class:`~gradient_scaling.core.controller.ScaleController`'s own):

* :class:`ScaleTable`: the cached local scales, and the scales a step
  computed but has not committed yet (:class:`StagedScales`).
* :class:`WeightPathBackoff`: the per-parameter scale of a GEMM's
  weight-gradient path, an extension of the paper for layers whose weight
  or bias gradient overflows.

Every transition happens when a step is *concluded* (taken or skipped, see
:mod:`gradient_scaling.core.scaler`); during a backward pass nothing here
changes except what is staged in the step. A skip caused by data discards
what was staged and changes nothing, so the next step runs as if the bad
batch had never been seen (docs/DESIGN.md, 6).
"""

import math

from gradient_scaling.core import _validate
from gradient_scaling.core import rules

__all__ = ['ScaleTable', 'StagedScales', 'WeightPathBackoff', 'dict_state',
           'load_dict_state']


class ScaleTable(object):

    """The cached local scales of GEMM, cast and branch sites.

    GEMM sites are keyed by their weight's link path (stable across
    processes with ``target=``), casts and branches by backward traversal
    order. A branch entry is valid only for the scales it unified (its
    *signature*). During a step, new values are *staged*; they replace the
    committed ones when the step is taken and are dropped when it is
    skipped. With ChainerMN, every rank commits the same table: the
    smallest value any rank staged for a key.

    Transition table:

    =========================  =========================================
    event                      table
    =========================  =========================================
    a site computes a scale    staged (visible to the rest of the step)
    step taken                 staged entries committed (min over ranks)
    step skipped               staged entries dropped
    =========================  =========================================
    """

    def __init__(self):
        self.scales = {}
        self.signatures = {}

    def lookup(self, staged, key, signature=None):
        """The scale for ``key`` (``staged`` first, unless None), or None
        if there is none valid for ``signature``."""
        for table in (self,) if staged is None else (staged, self):
            if key in table.scales:
                if signature is None or \
                        table.signatures.get(key) == signature:
                    return table.scales[key]
                return None
        return None

    def commit(self, staged_tables):
        """Commits what one step staged (one table per rank)."""
        for key in _keys(t.scales for t in staged_tables):
            values = [(t.scales[key], t.signatures.get(key))
                      for t in staged_tables if key in t.scales]
            scale, signature = min(values, key=lambda v: v[0])
            self.scales[key] = scale
            if signature is None:
                self.signatures.pop(key, None)
            else:
                self.signatures[key] = signature

    def state_dict(self):
        return dict(dict_state('scale', self.scales),
                    **dict_state('branch', self.signatures))

    def load_state_dict(self, state):
        self.scales = load_dict_state(state, 'scale', float)
        self.signatures = load_dict_state(state, 'branch', str)


class StagedScales(object):

    """What one step computed for the :class:`ScaleTable` (picklable;
    created when a site first stages: a cached step has none)."""

    def __init__(self):
        self.scales = {}
        self.signatures = {}
        self.amax = {}  # estimators that track maxima (amax recipes)

    def stage(self, key, scale, signature=None):
        self.scales[key] = scale
        if signature is not None:
            self.signatures[key] = signature

    def __bool__(self):
        return bool(self.scales or self.amax)

    def to_dict(self):
        """Plain values (JSON): what a rank sends the others."""
        return {'scales': dict(self.scales),
                'signatures': dict(self.signatures),
                'amax': dict(self.amax)}

    @classmethod
    def from_dict(cls, values):
        staged = cls()
        staged.scales = {k: float(v) for k, v in values['scales'].items()}
        staged.signatures = dict(values['signatures'])
        staged.amax = {k: float(v) for k, v in values['amax'].items()}
        return staged


class WeightPathBackoff(object):

    """Per-parameter scale of a GEMM's weight-gradient path (< 1 when used).

    The paper scales a GEMM's data path only; the weight gradient keeps the
    incoming scale. Just after a capped softmax cast the incoming gradient
    sits near the format's maximum, and the weight or bias gradient (a sum
    over the batch) can overflow although every input is finite: the run
    would skip forever. Such a parameter's weight path gets a power-of-two
    scale ``gamma <= 1`` of its own:

    * an overflow attributed to it (its GEMM's incoming gradient and
      operands finite, its gradient not) divides ``gamma`` by ``factor``,
      down to ``floor``; the refresh this forces measures it right away;
    * at each refresh, a parameter with ``gamma < 1`` has the largest value
      of its gradient measured, and ``gamma`` is set to the largest power
      of two (at most 1) that keeps that value ``headroom`` times below the
      format's maximum. A layer whose gradients are normal again is back at
      ``gamma = 1`` after one refresh, not after thousands of steps.

    Transition table (applied when the step is concluded):

    ======================================  ==================================
    event                                   ``gamma`` of parameter p
    ======================================  ==================================
    skipped, p's weight path overflowed     ``max(gamma / factor, floor)``
    taken after a refresh, max ``m``         ``min(1, pow2_floor(gamma * max /
    measured for p (gamma < 1)              (headroom * m)))``, >= ``floor``;
                                            1 (forgotten) when ``m == 0``
    anything else                           unchanged
    ======================================  ==================================

    Args:
        factor (float): Backoff per attributed overflow (> 1).
        floor (float): Smallest ``gamma``.
        headroom (float): Margin below the format's maximum kept at a
            refresh (>= 1).

    Attributes:
        scales (dict): ``gamma`` of each parameter that has one (< 1);
            every other parameter's is 1 (``scales.get(name, 1.0)``).

    """

    def __init__(self, factor=256.0, floor=2.0 ** -24, headroom=4.0):
        self.factor = _validate.greater_than_one(factor, 'weight_backoff')
        self.floor = _validate.positive(floor, 'weight_backoff_floor')
        self.headroom = _validate.positive(headroom, 'weight_headroom')
        if self.headroom < 1 or self.floor > 1:
            raise ValueError('need weight_headroom >= 1 and '
                             'weight_backoff_floor <= 1, got {!r} and {!r}'
                             .format(headroom, floor))
        self.scales = {}

    def managed(self, name):
        return name in self.scales

    def back_off(self, names):
        """Lowers the named paths; returns whether any could be lowered."""
        lowered = False
        for name in names:
            gamma = self.scales.get(name, 1.0)
            new = max(rules.pow2_floor(gamma / self.factor),
                      self.floor)
            if new < gamma:
                self.scales[name] = new
                lowered = True
        return lowered

    def regrow(self, maxima, fmt_max):
        """Sets each measured path from its largest gradient value."""
        for name, largest in maxima.items():
            gamma = self.scales.get(name)
            if gamma is None or not math.isfinite(largest):
                continue
            if largest == 0:
                del self.scales[name]
                continue
            new = min(1.0, rules.pow2_floor(
                gamma * fmt_max / (self.headroom * largest)))
            new = max(new, self.floor)
            if new >= 1.0:
                del self.scales[name]
            else:
                self.scales[name] = new

    def state_dict(self):
        return dict_state('weight_scale', self.scales)

    def load_state_dict(self, state):
        self.scales = load_dict_state(state, 'weight_scale', float)


def _keys(dicts):
    seen = {}
    for d in dicts:
        for key in d:
            seen.setdefault(key, None)
    return list(seen)


def dict_state(prefix, table):
    """A str-keyed dict as two lists, ``<prefix>_keys`` and ``_values``."""
    return {prefix + '_keys': list(table),
            prefix + '_values': list(table.values())}


def load_dict_state(state, prefix, convert):
    """The dict :func:`dict_state` wrote, values through ``convert``."""
    keys, values = state[prefix + '_keys'], state[prefix + '_values']
    return {str(k): convert(v) for k, v in zip(keys, values)}
