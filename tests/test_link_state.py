"""LinkState: the persistent values a skipped step puts back."""

import gradient_scaling  # NOQA

import numpy as np

import chainer
import chainer.links as L

from gradient_scaling.chainer.link_state import LinkState


def test_link_state_restores_batchnorm_statistics_in_place():
    model = chainer.Sequential(L.Linear(3, 4), L.BatchNormalization(4))
    bn = model[1]
    x = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    bn(model[0](x), finetune=True)  # some history; finetune counts N
    mean, var, n = bn.avg_mean, bn.avg_var, bn.N
    saved = (mean.copy(), var.copy(), n)
    state = LinkState(model)
    bad_x = x.copy()
    bad_x[0, 0] = np.nan
    bn(model[0](bad_x), finetune=True)
    assert np.isnan(bn.avg_mean).all() and bn.N == n + 1
    state.restore()
    assert bn.avg_mean is mean and bn.avg_var is var  # the same arrays
    np.testing.assert_array_equal(bn.avg_mean, saved[0])
    np.testing.assert_array_equal(bn.avg_var, saved[1])
    assert bn.N == saved[2]
