"""Table 1's testable claim: residual connections mitigate underflow.

The paper explains GS's small gain on ResNet classification (Table 1) by
the residual connections: a gradient reaching a block's input is the sum
of the block's path and the identity, so it does not shrink layer after
layer as in a plain network.  ``python scripts/reproduce.py residual``:
ResNet-20 (``examples/cifar/train.py`` on the embedded 32x32 shapes, batch 32, lr
0.1, 60 iterations: the example's schedule shortened to the part that
measures the lost fraction) with and without
its residual connections (``scripts/residual_train.py --no-skips``:
every block ``relu(F(x))`` instead of ``relu(F(x) + shortcut(x))``), no
loss scaling, in simulated FP16 and FP8 E5M2, counting the non-zero
gradient values entering and leaving every GEMM that rounding turns into
zeros (``--count-underflow``), several paired seeds.  Writes
``residual.md``, ``residual_runs.csv`` and ``residual.png``; the verdict
compares the lost fractions (:data:`studies.verdicts.UNDERFLOW`).
"""

from studies.training import Study
from studies.training import Variant

__all__ = ['STUDY']

E5M2 = 'sim-fp8-e5m2'

STUDY = Study(
    'residual', 'Table 1: residual connections',
    'ResNet-20 with and without residual connections on the embedded '
    'classification data (32x32), 60 iterations, no scaling',
    'scripts/residual_train.py', 'validation/main/accuracy',
    'top-1 accuracy', [32],
    # 60 iterations (lr 0.1, x0.1 at 30 and 45): the lost fraction is
    # the study's number, and a run costs 2 min here instead of 10.
    ['--arch', 'resnet20', '--iteration', '60', '--eval-interval', '60'],
    [Variant('FP16, skips', ['--scaling', 'none'], None, 'sim-fp16'),
     Variant('FP16, no skips', ['--scaling', 'none', '--no-skips'], None,
             'sim-fp16'),
     Variant('E5M2, skips', ['--scaling', 'none'], None, E5M2),
     Variant('E5M2, no skips', ['--scaling', 'none', '--no-skips'], None,
             E5M2)],
    {}, [], precision=None)
