"""Where a PyTorch GS pass, cached or refreshing, spends its time, by cause.

:class:`CauseTimers` times, inside one ``with`` (the classes are patched
while it lasts and put back after), what a GS pass does on the host, by
the part of the hook that does it: the reading of the graph's structure,
the plan reused on it, the callbacks' registration and the rest of
``scale``; in the backward, each kind of callback (GEMM pre-hooks, the
cast sites, branch post-hooks, multi-output pre-hooks, GEMM post-hooks,
landing hooks; on a speculated refresh, the GEMM sites' reads its native
hooks kept made into the step's records and traces:
:mod:`~gradient_scaling.torch.speculation`; on a planned pass, the cast
sites' alone, and the setting
of the factors the native hooks then apply, untimed:
:mod:`~gradient_scaling.torch.planned_pass`) and the division of the gradients left in ``.grad`` at the
pass's end; in ``step``, the pass's end and its finiteness check. A
callback's time includes the tensor operations it runs (its
multiplications, a cast's ``max|g|``), not PyTorch's call into it (the
``GradScaler + no-op hooks`` control measures that), and the timer's own
cost (two ``perf_counter`` reads and a call, a fraction of a
microsecond). Under ``torch.compile`` the scaling runs inside the
compiled backward (not timed here: the phase table has it), the hook
meets each region as it is entered and left, and a gradient that leaves
the graph at scale 1 lands without calling
:meth:`~gradient_scaling.torch.hook.GradientScaling.land` (those calls
are not timed: the no-op control measures what a call costs). :func:`cause_samples` runs steps of a variant under the
timers; ``rows.cause_rows`` makes the table.
"""

import collections
import contextlib
import time

from gradient_scaling.torch import backward_rules
from gradient_scaling.torch import graph
from gradient_scaling.torch import hook as hook_module
from gradient_scaling.torch import planned_pass
from gradient_scaling.torch import speculation

__all__ = ['CAUSES', 'CauseTimers', 'cause_samples']

#: The causes, in the order of a step: (label, phase).
CAUSES = (
    ('graph structure read', 'scale'),
    ('plan reused on it (or walked)', 'scale'),
    ('callbacks registered', 'scale'),
    ('rest of scale (the step\'s bookkeeping)', 'scale'),
    ('GEMM pre-hooks (without their cast sites)', 'backward'),
    ('speculated GEMM sites\' reads made into records', 'backward'),
    ('cast sites', 'backward'),
    ('planned factors set (then applied natively)', 'backward'),
    ('branch post-hooks', 'backward'),
    ('multi-output pre-hooks', 'backward'),
    ('GEMM post-hooks', 'backward'),
    ('landing hooks', 'backward'),
    ('compiled regions entered and left', 'backward'),
    ('division in .grad at the pass\'s end', 'backward'),
    ('pass end and finiteness check', 'step'),
)

# The timers' wrapping of the callbacks a pass registers (not a cause).
_WRAPPING = 'wrapping'


class CauseTimers(object):

    """Inside the ``with``: seconds and calls per cause (:data:`CAUSES`),
    accumulated in :attr:`seconds` and :attr:`calls` (read and reset
    them between steps)."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self._stack = contextlib.ExitStack()

    def _timed(self, cause, function, within=None):
        """``function`` timed as ``cause``; what runs inside it under
        ``within`` causes is not counted twice."""
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter
        inner = within or ()

        def timed(*args, **kwargs):
            before = {c: seconds[c] for c in inner}
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                spent = clock() - start
                for c in inner:
                    spent -= seconds[c] - before[c]
                seconds[cause] += spent
                calls[cause] += 1
        return timed

    def _patch(self, owner, name, make):
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._stack.callback(setattr, owner, name, original)

    def _factory(self, owner, name, cause, within=None):
        """A method that makes a callback: the callback it makes timed
        (the wrapping's own time kept apart: the registration that asks
        for the callback does not count it)."""
        timed, seconds, clock = self._timed, self.seconds, time.perf_counter

        def make(original):
            def factory(pass_, *args):
                callback = original(pass_, *args)
                start = clock()
                wrapped = timed(cause, callback, within)
                seconds[_WRAPPING] += clock() - start
                return wrapped
            return factory
        self._patch(owner, name, make)

    def _method(self, owner, name, cause, within=None):
        self._patch(owner, name,
                    lambda original: self._timed(cause, original, within))

    def __enter__(self):
        (structure, plan, register, scale, gemm, made_good, cast, planned,
         branch, multi, post, land, region, divide, end) = [
             c for c, _ in CAUSES]
        rules = backward_rules.BackwardPass
        self._method(graph.PlanCache, 'structure', structure)
        self._method(graph.PlanCache, 'plan', plan, [structure])
        self._method(rules, '_register', register, [_WRAPPING])
        self._method(hook_module.GradientScaling, 'attach', scale,
                     [structure, plan, register, _WRAPPING])
        self._method(rules, '_cast_site', cast)
        self._factory(rules, '_gemm_in', gemm, [cast])
        self._factory(rules, '_gemm_refreshed', gemm, [cast])
        self._method(speculation.Speculation, 'flush', made_good)
        self._factory(rules, '_cast', cast)
        self._method(planned_pass.PlannedRun, 'start', planned)
        self._factory(rules, '_contribute', branch)
        self._factory(rules, '_unify_outputs', multi)
        self._factory(rules, '_gemm_out', post)
        self._method(hook_module.GradientScaling, 'land', land)
        self._method(hook_module.GradientScaling, 'region_entered', region)
        self._method(hook_module.GradientScaling, 'region_left', region)
        self._method(hook_module.GradientScaling, '_unscale_pass', divide)
        self._method(hook_module.GradientScaling, 'finish_pass', end,
                     [divide])
        return self

    def __exit__(self, *exc):
        self._stack.close()


def cause_samples(variant, steps):
    """``({cause: (phase, calls per step, [seconds of each step])},
    [CPU seconds of each step])`` over ``steps`` steps of ``variant`` (a
    ``TorchStep`` with a GS scaler). A landing hook is timed from
    :meth:`~gradient_scaling.torch.hook.GradientScaling.land` (what it
    calls on every gradient an eager pass scaled whose scale the native
    landing was not given before it landed)."""
    per_step = {cause: [] for cause, _ in CAUSES}
    calls = collections.Counter()
    totals = []
    with CauseTimers() as timers:
        for _ in range(steps):
            timers.seconds.clear()
            timers.calls.clear()
            variant.prepare()
            start = time.process_time()
            variant.step()
            totals.append(time.process_time() - start)
            for cause in per_step:
                per_step[cause].append(timers.seconds[cause])
            calls.update(timers.calls)
    phases = dict(CAUSES)
    return {cause: (phases[cause], calls[cause] / steps, per_step[cause])
            for cause in per_step}, totals
