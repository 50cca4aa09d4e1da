"""The shape of the S2FP8 paper's Table 1 at CPU scale, by examples/cifar.

``python scripts/reproduce.py s2fp8``: ResNet-20 (CIFAR-style) on
Fashion-MNIST (the Debian package dataset-fashion-mnist, which the study
needs: without it ``reproduce.py`` stops before any run and says so)
trained by ``examples/cifar/train.py`` with the same budget (seed,
iterations, batch, lr schedule) in FP32, FP8 E5M2 unscaled, FP8 with a
fixed loss scale of 100, S2FP8, GS-FP8 with the paper's model and with the
closed loop (hybrid), Transformer Engine's amax recipes (delayed and
current), FP8 E4M3 (unscaled, amax, GS) and GS-FP16; test accuracy in FP32.
A training study (:mod:`studies.training`): it resumes run by run and
writes ``s2fp8.md``, ``s2fp8_runs.csv`` and ``s2fp8.png``.
"""

from studies.training import Study
from studies.training import Variant

__all__ = ['STUDY']

E5M2 = 'sim-fp8-e5m2'
E4M3 = 'sim-fp8-e4m3'

# Cambier et al.'s comparison: the number formats, with and without
# scaling, every other setting the same.
STUDY = Study(
    's2fp8', 'S2FP8 Table 1', 'ResNet-20 on Fashion-MNIST',
    'examples/cifar/train.py', 'validation/main/accuracy', 'test accuracy',
    [32],
    # 100 iterations of 32 images (lr 0.05, x0.1 at 50% and 75%), GS
    # refreshing every 10; Fashion-MNIST's 10000 test images at the end
    # only (an evaluation costs more than the 100 iterations).
    ['--dataset', 'fashion-mnist', '--arch', 'resnet20', '--iteration',
     '100', '--lr', '0.05', '--eval-interval', '100', '--update-interval',
     '10'],
    [Variant('FP32', ['--scaling', 'fp32'], None),
     Variant('FP8 E5M2', ['--scaling', 'none'], None, E5M2),
     Variant('FP8+LS(100)', ['--scaling', 'fixed', '--loss-scale', '100'],
             100, E5M2),
     Variant('S2FP8', ['--scaling', 'none'], None, 's2fp8'),
     Variant('GS-FP8 (model)', ['--scaling', 'gs'], None, E5M2),
     Variant('GS-FP8 (hybrid)', ['--scaling', 'gs', '--gs-estimator',
                                 'hybrid'], None, E5M2),
     # Transformer Engine's recipes: GEMM inputs in FP8, outputs FP32.
     Variant('amax-delayed', ['--scaling', 'amax-delayed'], None, E5M2),
     Variant('amax-current', ['--scaling', 'amax-current'], None, E5M2),
     # E4M3 (range 2**-9 .. 448) for gradients: unscaled, it loses most
     # of them; with a per-tensor scale it is a real candidate.
     Variant('FP8 E4M3', ['--scaling', 'none'], None, E4M3),
     Variant('amax-current E4M3', ['--scaling', 'amax-current'], None, E4M3),
     Variant('GS-FP8 E4M3 (hybrid)', ['--scaling', 'gs', '--gs-estimator',
                                      'hybrid'], None, E4M3),
     Variant('GS-FP16', ['--scaling', 'gs'], None, 'sim-fp16')],
    {}, [], precision=None)
