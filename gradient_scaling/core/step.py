"""The parts every training step shares: what a backward pass reports, the
overflow policy, and what a skipped step puts back.

A step is: forward, scaled backward, *decision*, then either the update or a
skip that changes nothing. The decision is made from a :class:`PassResult`,
combined over ChainerMN ranks before anyone acts on it, by an
:class:`OverflowGuard`; :class:`LinkState` restores what the forward pass
changed (BatchNorm's running statistics) when the step is skipped.

Non-finite gradients have one of two causes, and they are treated
differently (docs/DESIGN.md, 6):

* ``'data'``: the loss, an input or a forward activation is not finite. No
  scale can help; the step is skipped and counted and no scale changes.
* ``'scale'``: finite data gave non-finite gradients: an overflow, which a
  smaller scale avoids. The step is skipped and the scaler backs off.
"""

import gradient_scaling.compat  # NOQA

import dataclasses
import typing
import warnings

from gradient_scaling.core import _validate
from gradient_scaling.core import statistics

__all__ = ['GradientOverflowError', 'PassResult', 'OverflowGuard',
           'gradient_result', 'combine_across_ranks']

#: Causes of a non-finite pass.
CAUSES = ('data', 'scale')


class GradientOverflowError(RuntimeError):

    """Raised when overflowing steps persist with no scale left to lower."""


@dataclasses.dataclass(frozen=True)
class PassResult(object):

    """What a backward pass (or the passes of one step) tells the step.

    Attributes:
        finite (bool): The loss and every parameter gradient are finite.
        cause (str): ``None`` if finite, else ``'data'`` (the loss, an input
            or a forward operand is not finite) or ``'scale'`` (finite data
            gave non-finite gradients: an overflow).
        parameters (tuple of str): Parameters whose gradient is not finite,
            each named once, sorted.
        sites (tuple of str): Scaling sites whose incoming gradient was not
            finite, where known (GS refresh passes).
        weight_paths (tuple of str): GS: parameters whose weight-gradient
            GEMM overflowed although its inputs were finite.

    """

    finite: bool = True
    cause: typing.Optional[str] = None
    parameters: tuple = ()
    sites: tuple = ()
    weight_paths: tuple = ()

    def __post_init__(self):
        if self.finite != (self.cause is None):
            raise ValueError('a finite pass has no cause and a non-finite '
                             'one has one of {}; got finite={!r}, cause={!r}'
                             .format(CAUSES, self.finite, self.cause))
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError('cause must be one of {}, got {!r}'.format(
                CAUSES, self.cause))

    @classmethod
    def combine(cls, results):
        """One result for several passes or ranks: finite if all are.

        The cause is ``'scale'`` if any result's is (an overflow somewhere
        calls for backing off), else ``'data'``; names are merged.
        """
        results = list(results)
        bad = [r for r in results if not r.finite]
        if not bad:
            return cls()
        cause = 'scale' if any(r.cause == 'scale' for r in bad) else 'data'

        def union(field):
            return tuple(sorted({n for r in bad for n in getattr(r, field)}))
        return cls(finite=False, cause=cause, parameters=union('parameters'),
                   sites=union('sites'), weight_paths=union('weight_paths'))

    def describe(self, limit=8):
        """One line for warnings and errors."""
        if self.finite:
            return 'finite'
        what = ('the loss, an input or a forward activation is not finite'
                if self.cause == 'data' else
                'gradients overflowed although the loss and the forward '
                'pass were finite')
        params = list(self.parameters)
        text = '{}; non-finite gradients in {} parameter(s) ({}{})'.format(
            what, len(params), ', '.join(params[:limit]),
            ', ...' if len(params) > limit else '')
        if self.sites:
            text += '; sites whose incoming gradient was not finite: ' + \
                ', '.join(self.sites[:limit])
        if self.weight_paths:
            text += '; weight-gradient GEMMs that overflowed: ' + \
                ', '.join(self.weight_paths[:limit])
        return text


class OverflowGuard(object):

    """The overflow policy: skip a non-finite step, count it, raise when stuck.

    Shared by every scaler that checks its gradients. A step whose combined
    :class:`PassResult` is not finite is skipped. The scaler says whether it
    *backed off* (lowered a scale) in reaction; a skip after which nothing
    could be lowered (a data fault, or a scale already at its floor) is a
    *stalled* skip. ``patience`` stalled skips in a row raise
    :class:`GradientOverflowError`: skipping forever would end training
    silently.

    Transition table (``stalled`` counts stalled skips in a row):

    =========================================  =======  ==============  ==========================
    combined pass result                       step     ``stalled``     counters
    =========================================  =======  ==============  ==========================
    finite                                     taken    0               --
    not finite, the scaler backed off          skipped  unchanged       ``skips[cause]`` + 1
    not finite, nothing left to back off       skipped  + 1             ``skips[cause]`` + 1;
                                                                        raise at ``patience``
    =========================================  =======  ==============  ==========================

    Every skip also warns (``RuntimeWarning``) with the result's description.

    .. admonition:: Example

        >>> guard = OverflowGuard('gs', patience=2)
        >>> guard.observe(PassResult(), backed_off=False)
        False
        >>> import warnings; warnings.simplefilter('ignore')
        >>> bad = PassResult(finite=False, cause='data', parameters=('/W',))
        >>> guard.observe(bad, backed_off=False), guard.stalled
        (True, 1)

    Args:
        mode (str): Scaling mode, for messages.
        patience (int): Stalled skips in a row before raising.

    """

    def __init__(self, mode, patience=10):
        self.mode = mode
        self.patience = _validate.count(patience, 'patience')
        self.stalled = 0
        self.skips = {cause: 0 for cause in CAUSES}

    @property
    def total_skips(self):
        return sum(self.skips.values())

    def observe(self, result, backed_off, scale_text=''):
        """Applies one step's result; returns whether the step is skipped.

        Args:
            result (PassResult): The step's combined result.
            backed_off (bool): Whether the scaler lowered a scale because of
                it (ignored for a finite result).
            scale_text (str): The scaler's scale(s), for messages.

        Raises:
            GradientOverflowError: At the ``patience``-th stalled skip in a
                row.

        """
        if result.finite:
            self.stalled = 0
            return False
        self.skips[result.cause] += 1
        if result.cause == 'data' or not backed_off:
            self.stalled += 1
        message = '{}: step skipped: {}{} (skips so far: {} data, {} scale)' \
            .format(self.mode, result.describe(),
                    '; ' + scale_text if scale_text else '',
                    self.skips['data'], self.skips['scale'])
        if self.stalled >= self.patience:
            hint = ('fix the data or the forward pass (in mixed16 an '
                    'activation may overflow FP16)' if result.cause == 'data'
                    else 'no scale is left to lower')
            raise GradientOverflowError(
                '{} steps in a row were skipped with nothing left to back off'
                ' ({}); last: {}'.format(self.stalled, hint, message))
        warnings.warn(message, RuntimeWarning)
        return True

    def serialize(self, serializer):
        self.stalled = int(serializer('stalled', self.stalled))
        for cause in CAUSES:
            self.skips[cause] = int(serializer('skips_' + cause,
                                               self.skips[cause]))


def gradient_result(losses, named_grads):
    """The :class:`PassResult` of a loss-scaled backward (no hook).

    One fused finiteness check over the losses and every gradient (one host
    transfer). A non-finite loss is a data fault; finite losses with a
    non-finite gradient are an overflow.

    Args:
        losses (list): Loss arrays of the step's backward passes.
        named_grads (iterable of (str, array or None)): Each parameter's
            name and gradient (None: no gradient).

    """
    named = [(n, g) for n, g in named_grads if g is not None]
    arrays = list(losses) + [g for _, g in named]
    if not arrays:
        return PassResult()
    flags = statistics.finite_flags(arrays)
    loss_ok, grad_ok = flags[:len(losses)], flags[len(losses):]
    if all(flags):
        return PassResult()
    return PassResult(
        finite=False, cause='scale' if all(loss_ok) else 'data',
        parameters=tuple(sorted(n for (n, _), ok in zip(named, grad_ok)
                                if not ok)))


def combine_across_ranks(communicator, payload):
    """Every rank's ``payload``, in rank order, on every rank.

    One MPI allgather of a small picklable object (the step's result and
    what it staged), so that every rank takes the same decision and keeps
    the same state.
    """
    return communicator.mpi_comm.allgather(payload)
