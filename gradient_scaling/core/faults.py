"""Why a backward pass failed: the cause of non-finite gradients.

Non-finite gradients have one of two causes, and they are treated
differently (docs/DESIGN.md, 6; the decision and the overflow policy are
:class:`~gradient_scaling.core.scaler.PassResult` and
:class:`~gradient_scaling.core.scaler.OverflowGuard`): :func:`pass_result`
tells them apart, from the :class:`GemmTrace` of the GEMMs whose
parameters' gradients are not finite:

* ``'data'``: the loss, an input or a forward activation is not finite. No
  scale can help; the step is skipped and counted and no scale changes.
* ``'scale'``: finite data gave non-finite gradients: an overflow, which a
  smaller scale avoids. The step is skipped and the scaler backs off.
"""

import typing

from gradient_scaling.core import arrays
from gradient_scaling.core.scaler import FINITE
from gradient_scaling.core.scaler import PassResult

__all__ = ['GemmTrace', 'pass_result']


class GemmTrace(typing.NamedTuple):

    """What attributes a GEMM's non-finite weight gradient to data or scale.

    Attributes:
        incoming_finite (bool): Whether the gradient entering the GEMM was
            finite; None where it was not measured (a cached pass).
        operands (tuple): The GEMM's forward operands (input, weight), or
            what stands for their finiteness
            (:meth:`~gradient_scaling.core.arrays.ArrayOps.finite_witness`:
            a trace kept until the step is decided must not keep a
            framework's activations alive).

    (Immutable: one GEMM's trace is shared by its parameters; a named
    tuple, made at every refresh's GEMM site, is made faster than a
    frozen dataclass.)

    """

    incoming_finite: typing.Optional[bool]
    operands: tuple


def pass_result(losses, grads, name_of=str, traces_of=None, sites=()):
    """The :class:`~gradient_scaling.core.scaler.PassResult` of one
    backward pass.

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
    grads = list(grads)
    values = list(losses)
    values += [g for _, g in grads if g is not None]
    if not values:
        return FINITE
    ops = arrays.ops_for(values[0])
    flags = ops.finite_flags(values)
    if all(flags):
        return FINITE
    # (Paired with their keys only now: a finite pass, the usual one,
    # never needs them.)
    keyed = [(k, g) for k, g in grads if g is not None]
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

