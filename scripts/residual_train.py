"""``examples/cifar/train.py``, with or without its residual connections.

For the ``residual`` study (Table 1's claim that residual connections
mitigate underflow): ``--no-skips`` replaces every
:class:`chainer_links.resnet.BasicBlock`'s ``relu(F(x) + shortcut(x))``
by ``relu(F(x))`` in this process (the shortcut's projection, where the
block has one, is left unused), then runs the example with the other
arguments, unchanged::

    python scripts/residual_train.py --no-skips --scaling none \\
        --precision sim-fp16 --count-underflow
"""

import gradient_scaling  # NOQA: restores what Chainer needs, first

import os
import runpy
import sys

import chainer.functions as F

from chainer_links import resnet

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'examples', 'cifar', 'train.py')


def plain_forward(self, x):
    """A BasicBlock without its shortcut."""
    return F.relu(self.conv2(self.conv1(x)))


def main(argv):
    argv = list(argv)
    if '--no-skips' in argv:
        argv.remove('--no-skips')
        resnet.BasicBlock.forward = plain_forward
        print('residual_train: BasicBlock without its shortcut', flush=True)
    sys.argv = [TRAIN] + argv
    runpy.run_path(TRAIN, run_name='__main__')


if __name__ == '__main__':
    main(sys.argv[1:])
