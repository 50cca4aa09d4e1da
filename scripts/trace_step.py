"""What one cached GS step crosses of the library: calls, files, classes.

A newcomer reading a step follows every call it makes into
``gradient_scaling``; this script counts them, as ``sys.setprofile`` sees
them, for one cached step (``scale -> backward -> step -> update``, the
scales cached: ``update_interval`` 100, four warm-up steps: :func:`warm_up`) of a small MLP
in PyTorch (``GradientScaler``) and in Chainer (``train_step`` with GS):
the library calls, the library files they are in, and the library classes
whose methods they are (``self`` or ``cls`` of the frame).

Usage::

    python scripts/trace_step.py             # both frameworks
    python scripts/trace_step.py --framework torch --verbose

The counts depend on the code only (not on timing): issue 33's "a cached
PyTorch GS step crosses at most half today's classes and files" is
measured with it.
"""

import argparse
import collections
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY = os.path.join(ROOT, 'gradient_scaling')


class Trace(object):

    """The library calls of the code run inside it."""

    def __init__(self):
        self.calls = 0
        self.files = collections.Counter()
        self.classes = set()

    def _profile(self, frame, event, arg):
        if event != 'call':
            return
        path = frame.f_code.co_filename
        if not path.startswith(LIBRARY + os.sep):
            return
        self.calls += 1
        self.files[os.path.relpath(path, LIBRARY)] += 1
        local = frame.f_locals
        owner = local.get('self')
        owner = type(owner) if owner is not None else local.get('cls')
        if isinstance(owner, type) and \
                owner.__module__.startswith('gradient_scaling'):
            self.classes.add(owner.__qualname__)

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def lines(self, name, verbose):
        out = ['{}: {} calls, {} files, {} classes'.format(
            name, self.calls, len(self.files), len(self.classes))]
        if verbose:
            out += ['  {:5d}  {}'.format(n, f)
                    for f, n in self.files.most_common()]
            out.append('  classes: ' + ', '.join(sorted(self.classes)))
        return out


def torch_step():
    """One cached GS step of PyTorch's drop-in, ready to be traced."""
    import torch
    from gradient_scaling.torch import GradientScaler
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradientScaler(model, update_interval=100)
    x, t = torch.randn(4, 8), torch.randint(0, 4, (4,))

    def step():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), t)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return step


def chainer_step():
    """One cached GS step of the Chainer adapter's ``train_step``."""
    import numpy as np
    # The library first: it fits Chainer 7.8.1 to today's NumPy and
    # setuptools as Chainer is imported.
    from gradient_scaling.chainer import training
    import chainer
    import chainer.functions as F
    import chainer.links as L
    rng = np.random.default_rng(0)
    model = chainer.Sequential(L.Linear(8, 16), F.relu, L.Linear(16, 4))
    config = training.ScalingConfig('gs', update_interval=100)
    optimizer, scaler = training.setup_optimizer(
        chainer.optimizers.SGD(lr=0.1), model, config)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    t = rng.integers(0, 4, 4).astype(np.int32)

    def loss_func(x, t):
        return F.softmax_cross_entropy(model(x), t)

    def step():
        training.train_step(optimizer, scaler, loss_func, x, t,
                            config=config)
    return step


FRAMEWORKS = {'torch': torch_step, 'chainer': chainer_step}


def warm_up(step):
    """The steps before the traced one: the refresh at step 0, then
    cached steps (PyTorch's first cached pass on a graph's structure
    records its callbacks' order, the next plans its factors: the traced
    step is one of the many that follow)."""
    for _ in range(4):
        step()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--framework', nargs='+', choices=sorted(FRAMEWORKS),
                        default=sorted(FRAMEWORKS, reverse=True))
    parser.add_argument('--verbose', action='store_true')
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    for name in args.framework:
        if name == 'torch' and importlib.util.find_spec('torch') is None:
            print('torch: not installed')
            continue
        step = FRAMEWORKS[name]()
        warm_up(step)
        with Trace() as trace:
            step()
        print('\n'.join(trace.lines(name, args.verbose)))


if __name__ == '__main__':
    main()
