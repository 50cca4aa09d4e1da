"""A Chainer twin's weights (and BatchNorm statistics) into a model of
:mod:`torch_models`, matched by name.

The twins have the same layer names: PyTorch's ``res2.a.conv1.conv`` is
Chainer's ``/res2/a/conv1/conv``. Convolutions and linear layers take
``W`` and ``b``, BatchNorm ``gamma``, ``beta``, ``avg_mean`` and
``avg_var``; the arrays are copied as they are (the layouts agree), into
the module's dtype. Chainer itself is not imported: the links are only
read.

>>> copy_from_chainer(chainercv.links.SegNetBasic(n_class=4), model)
"""

import numpy as np
import torch
import torch.nn as nn

__all__ = ['copy_from_chainer']

_NAMES = {nn.Conv2d: {'weight': 'W', 'bias': 'b'},
          nn.ConvTranspose2d: {'weight': 'W', 'bias': 'b'},
          nn.Linear: {'weight': 'W', 'bias': 'b'},
          nn.BatchNorm2d: {'weight': 'gamma', 'bias': 'beta',
                           'running_mean': 'avg_mean',
                           'running_var': 'avg_var'}}


def _link_at(chain, path):
    link = chain
    for part in path.split('.'):
        link = getattr(link, part, None)
        if link is None:
            raise ValueError('the Chainer model has no link /{}'.format(
                path.replace('.', '/')))
    return link


def copy_from_chainer(chainer_model, model):
    """Gives ``model`` every weight of ``chainer_model``; returns the
    number of tensors copied.

    Raises:
        ValueError: Where a layer has no twin of the same name and shape.

    """
    copied = 0
    with torch.no_grad():
        for path, module in model.named_modules():
            names = _NAMES.get(type(module))
            if names is None:
                continue
            link = _link_at(chainer_model, path)
            for ours, theirs in names.items():
                target = getattr(module, ours)
                if target is None:
                    continue
                value = getattr(link, theirs)
                array = np.asarray(getattr(value, 'array', value))
                if array.shape != tuple(target.shape):
                    raise ValueError('{}.{}: shape {}, the Chainer twin\'s '
                                     '{}'.format(path, ours,
                                                 tuple(target.shape),
                                                 array.shape))
                target.copy_(torch.from_numpy(array).to(target.dtype))
                copied += 1
    return copied
