"""Learning-rate schedules that are a function of the iteration alone.

Chainer's ``ExponentialShift`` under a ``ManualScheduleTrigger`` keeps
the lr it set in its own state and restores it in ``initialize``, which
Chainer's trainer skips once that trigger has fired for the last time: a
run resumed after the last step trained at the initial lr again
(measured: a 14-iteration CIFAR run with steps at 7 and 10, resumed at
10, went on at lr 0.1 instead of 0.001).  :class:`StepSchedule` sets the
lr of every iteration from the iteration, so a resumed run continues on
the same curve, and the lrs equal ``ExponentialShift``'s bit for bit.
"""

from chainer import training

__all__ = ['StepSchedule']


class StepSchedule(training.Extension):

    """An lr multiplied by ``rate`` at each of ``steps``, after an
    optional linear warmup.

    The lr of iteration ``t`` (0-based) rises linearly from ``warmup_lr``
    at ``t = 0`` to ``lr`` at ``t = warmup``, and is multiplied by
    ``rate`` at each iteration of ``steps``.

    >>> from example_common.schedules import StepSchedule
    >>> schedule = StepSchedule(0.4, steps=(60, 80), warmup=10,
    ...                         warmup_lr=0.1)
    >>> [round(schedule.lr_at(t), 6) for t in (0, 5, 10, 60, 80)]
    [0.1, 0.25, 0.4, 0.04, 0.004]

    In a trainer: ``trainer.extend(StepSchedule(0.1, steps=(32000,
    48000)))``.

    """

    trigger = 1, 'iteration'

    def __init__(self, lr, steps, rate=0.1, warmup=0, warmup_lr=None):
        self.lr = lr
        self.steps = tuple(steps)
        self.rate = rate
        self.warmup = warmup
        self.warmup_lr = lr if warmup_lr is None else warmup_lr

    def lr_at(self, iteration):
        if iteration < self.warmup:
            return self.warmup_lr + (self.lr - self.warmup_lr) * \
                iteration / self.warmup
        return self.lr * self.rate ** sum(iteration >= s for s in self.steps)

    def initialize(self, trainer):
        self(trainer)

    def __call__(self, trainer):
        optimizer = trainer.updater.get_optimizer('main')
        optimizer.lr = self.lr_at(trainer.updater.iteration)
