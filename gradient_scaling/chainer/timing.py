"""The Chainer hook's timing points: its own work, by section, into a timer.

:func:`time_hook` (what ``GradientScaling(timer=...)`` and
:meth:`~gradient_scaling.chainer.hook.GradientScaling.time_with` call)
wraps the hook's entry points, the open step's rules and the backward
wrappers, on that hook's own objects only: each call adds its *own*
seconds (less those of the timed calls inside it) to one of
:data:`TIMED_SECTIONS`. A hook without a timer runs no timing code.
"""

import time
import types

from gradient_scaling.chainer import backward_rules

__all__ = ['TIMED_SECTIONS', 'Timing', 'time_hook']

#: The sections a timer receives.
TIMED_SECTIONS = ('dispatch', 'scale choice', 'rescaling', 'branches',
                  'traces', 'measurement', 'finiteness check')
_STEP_SECTIONS = {'gemm': 'scale choice', 'cast': 'scale choice',
                  'weight_path': 'scale choice', 'branch': 'branches',
                  'trace': 'traces', 'measure': 'measurement'}


def time_hook(hook, timer):
    """Times ``hook``'s work with ``timer`` (``add(section, seconds)``,
    optionally a ``clock``)."""
    timing = Timing(timer)
    for name in ('backward_preprocess', 'hold_step', 'begin_backward',
                 'end_backward', 'step_payload', 'conclude'):
        setattr(hook, name, timing.wrap('dispatch', getattr(hook, name)))
    hook._pass_result = timing.wrap('finiteness check', hook._pass_result)
    controller = hook.controller
    controller.transition = timing.wrap('dispatch', controller.transition)
    begin_pass = controller.begin_pass
    controller.begin_pass = lambda: timing.time_step(begin_pass())
    timing.time_rules(hook.rules)
    return timing


class Timing(object):

    """Wraps callables: each call adds its own seconds to a timer's section."""

    def __init__(self, timer):
        self.add, self.clock = timer.add, getattr(timer, 'clock',
                                                  time.perf_counter)
        self.inner = [0.0]  # per open timed call: its timed calls' seconds
        self.step = None

    def wrap(self, section, fn):
        """``fn`` timed (``section`` None: its time is only subtracted)."""
        add, clock, inner = self.add, self.clock, self.inner

        def timed(*args, **kwargs):
            inner.append(0.0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = clock() - start
                own = seconds - inner.pop()
                inner[-1] += seconds
                if section is not None:
                    add(section, own)
        return timed

    def time_step(self, step):
        """The open step with its rules timed (a new StepScales a step)."""
        if step is not self.step:
            self.step = step
            for name, section in _STEP_SECTIONS.items():
                setattr(step, name, self.wrap(section, getattr(step, name)))
        return step

    def time_rules(self, rules):
        """Times the backward wrappers (not the function's own backward, their
        first argument) and ``rescale``: the methods calling it are rebound,
        on ``rules`` alone, to copies that see a timed one."""
        scope = dict(vars(backward_rules), rescale=self.wrap(
            'rescaling', backward_rules.rescale))
        for name, fn in vars(type(rules)).items():
            if isinstance(fn, types.FunctionType) and \
                    'rescale' in fn.__code__.co_names:
                copy = types.FunctionType(fn.__code__, scope, name,
                                          fn.__defaults__, fn.__closure__)
                setattr(rules, name, types.MethodType(copy, rules))
        for name in ('gemm', 'cast', 'plain'):
            rule = getattr(rules, name)
            setattr(rules, name, self.wrap('dispatch', lambda backward, *a,
                    rule=rule: rule(self.wrap(None, backward), *a)))
