"""What a backward pass reports, why it failed, and the overflow policy.

A step is: forward, scaled backward, *decision*, then either the update or a
skip that changes nothing. The decision
(:class:`~gradient_scaling.core.scaler.Scaler`) combines the
:class:`PassResult` of every pass of every rank once, before anyone acts on
it; then the scaler's transition and the :class:`OverflowGuard`.

Non-finite gradients have one of two causes, and they are treated
differently (docs/DESIGN.md, 6); :func:`pass_result` tells them apart:

* ``'data'``: the loss, an input or a forward activation is not finite. No
  scale can help; the step is skipped and counted and no scale changes.
* ``'scale'``: finite data gave non-finite gradients: an overflow, which a
  smaller scale avoids. The step is skipped and the scaler backs off.
"""

import dataclasses
import typing
import warnings

from gradient_scaling.core import _validate
from gradient_scaling.core import arrays

__all__ = ['GradientOverflowError', 'PassResult', 'FINITE', 'OverflowGuard',
           'GemmTrace', 'pass_result']

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
        bad = [r for r in results if not r.finite]
        if not bad:
            return FINITE
        cause = 'scale' if any(r.cause == 'scale' for r in bad) else 'data'

        def union(field):
            return tuple(sorted({n for r in bad for n in getattr(r, field)}))
        return cls(finite=False, cause=cause, parameters=union('parameters'),
                   sites=union('sites'), weight_paths=union('weight_paths'))

    def to_dict(self):
        """Plain values (JSON): what a rank sends the others."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values):
        return cls(finite=bool(values['finite']), cause=values['cause'],
                   **{f: tuple(values[f]) for f in (
                       'parameters', 'sites', 'weight_paths')})

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


#: The result of a finite pass or step (every finite result equals it).
FINITE = PassResult()


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

        >>> from gradient_scaling.core.faults import OverflowGuard, PassResult
        >>> guard = OverflowGuard('gs', patience=2)
        >>> guard.observe(PassResult(), backed_off=False)
        False
        >>> import warnings; warnings.simplefilter('ignore')
        >>> bad = PassResult(finite=False, cause='data', parameters=('/W',))
        >>> guard.observe(bad, backed_off=False), guard.stalled
        (True, 1)

    Args:
        mode (str): Scaling mode, for messages.
        patience (int): Stalled skips in a row before raising (None:
            never, as ``torch.amp.GradScaler``).

    """

    def __init__(self, mode, patience=10):
        self.mode = mode
        self.patience = None if patience is None else \
            _validate.count(patience, 'patience')
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
            scale_text (str or callable): The scaler's scale(s), for
                messages (a callable giving them: called only for a
                skipped step's message).

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
        if callable(scale_text):
            scale_text = scale_text()
        message = '{}: step skipped: {}{} (skips so far: {} data, {} scale)' \
            .format(self.mode, result.describe(),
                    '; ' + scale_text if scale_text else '',
                    self.skips['data'], self.skips['scale'])
        if self.patience is not None and self.stalled >= self.patience:
            hint = ('fix the data or the forward pass (in mixed16 an '
                    'activation may overflow FP16)' if result.cause == 'data'
                    else 'no scale is left to lower')
            raise GradientOverflowError(
                '{} steps in a row were skipped with nothing left to back off'
                ' ({}); last: {}'.format(self.stalled, hint, message))
        warnings.warn(message, RuntimeWarning)
        return True

    def state_dict(self):
        return dict({'stalled': self.stalled},
                    **{'skips_' + c: n for c, n in self.skips.items()})

    def load_state_dict(self, state):
        self.stalled = int(state['stalled'])
        for cause in CAUSES:
            self.skips[cause] = int(state['skips_' + cause])


@dataclasses.dataclass(frozen=True)
class GemmTrace(object):

    """What attributes a GEMM's non-finite weight gradient to data or scale.

    Attributes:
        incoming_finite (bool): Whether the gradient entering the GEMM was
            finite; None where it was not measured (a cached pass).
        operands (tuple): The GEMM's forward operands (input, weight), or
            what stands for their finiteness
            (:meth:`~gradient_scaling.core.arrays.ArrayOps.finite_witness`:
            a trace kept until the step is decided must not keep a
            framework's activations alive).

    """

    incoming_finite: typing.Optional[bool]
    operands: tuple


def pass_result(losses, grads, name_of=str, traces_of=None, sites=()):
    """The :class:`PassResult` of one backward pass.

    One fused finiteness check over the losses and every gradient (one host
    transfer). A non-finite loss is a data fault. With finite losses, the
    forward operands of the GEMMs whose parameters' gradients are not
    finite tell: a non-finite operand is a data fault too, otherwise the
    cause is ``'scale'`` (an overflow); a parameter whose every GEMM had a
    finite incoming gradient overflowed in its weight-gradient path.

    Args:
        losses (list): Loss arrays of the pass.
        grads (iterable of (key, array or None)): Each parameter (any key)
            and its gradient (None: no gradient).
        name_of (callable): A parameter's name from its key; called only
            for parameters whose gradient is not finite.
        traces_of (callable): ``traces_of(names) -> {name: [GemmTrace]}``
            for the parameters with non-finite gradients, called only when
            there are any; None for a plain loss-scaled backward.
        sites (iterable of str): Sites whose incoming gradient was not
            finite, where known.

    """
    keyed = [(k, g) for k, g in grads if g is not None]
    values = list(losses) + [g for _, g in keyed]
    if not values:
        return FINITE
    ops = arrays.ops_for(values[0])
    flags = ops.finite_flags(values)
    if all(flags):
        return FINITE
    n = len(losses)
    bad = sorted({name_of(k) for (k, _), ok in zip(keyed, flags[n:])
                  if not ok})
    cause, weight_paths = 'data', ()
    if all(flags[:n]):
        traces = traces_of(bad) if traces_of is not None else {}
        operands = [a for ts in traces.values() for t in ts
                    for a in t.operands if a is not None]
        if not operands or all(ops.finite_flags(operands)):
            cause = 'scale'
            weight_paths = tuple(name for name in bad if traces.get(name)
                                 and all(t.incoming_finite
                                         for t in traces[name]))
    return PassResult(finite=False, cause=cause, parameters=tuple(bad),
                      sites=tuple(sorted(set(sites))),
                      weight_paths=weight_paths)

