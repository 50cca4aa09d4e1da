"""ChainerCV's SegNetBasic, usable under ``chainer.mixed16``."""

import numpy

import chainer.functions as F
from chainercv.links import SegNetBasic as _ChainerCVSegNetBasic

__all__ = ['SegNetBasic', 'LRN_ARGS']

#: SegNetBasic's input normalisation: ``local_response_normalization(x,
#: n, k, alpha, beta)`` with these (ChainerCV's values).
LRN_ARGS = (5, 1, 1e-4 / 5., 0.75)


def _unpool(x, indices):
    """ChainerCV's SegNetBasic unpooling: ``x`` (cropped to ``indices``'s
    size where they differ) upsampled by 2 at the max-pooling's indices."""
    if x.shape != indices.shape:
        min_h = min(x.shape[2], indices.shape[2])
        min_w = min(x.shape[3], indices.shape[3])
        x = x[:, :, :min_h, :min_w]
        indices = indices[:, :, :min_h, :min_w]
    outsize = (x.shape[2] * 2, x.shape[3] * 2)
    return F.upsampling_2d(x, indices, ksize=2, stride=2, outsize=outsize)


class SegNetBasic(_ChainerCVSegNetBasic):
    """ChainerCV's :class:`~chainercv.links.SegNetBasic` whose input
    normalisation runs in FP32 when the model runs in FP16.

    SegNetBasic first applies a local response normalisation to the raw
    images (values in [0, 255]): it sums the squares of 5 neighbouring
    channels, up to 3 x 255^2 = 195,075 for an RGB pixel, beyond FP16's
    largest number (65,504). In float16 that sum overflows, on the CPU and
    on the GPU (Chainer stores it in the input's dtype), and the
    normalised value of a bright pixel is 0 instead of ~80: the model
    silently sees black where the image is bright. Here a float16 input is
    normalised in float32 and cast back (the output is at most the input,
    so it fits); any other input goes through ChainerCV's forward
    unchanged, so an FP32 model computes exactly ChainerCV's graph.
    """

    def forward(self, x):
        if x.dtype != numpy.float16:
            return super(SegNetBasic, self).forward(x)
        return self.after_normalisation(F.cast(
            F.local_response_normalization(F.cast(x, numpy.float32),
                                           *LRN_ARGS), x.dtype))

    def after_normalisation(self, h):
        """The rest of ChainerCV's forward, from the normalised images
        ``h`` to the scores."""
        h, indices1 = F.max_pooling_2d(
            F.relu(self.conv1_bn(self.conv1(h))), 2, 2, return_indices=True)
        h, indices2 = F.max_pooling_2d(
            F.relu(self.conv2_bn(self.conv2(h))), 2, 2, return_indices=True)
        h, indices3 = F.max_pooling_2d(
            F.relu(self.conv3_bn(self.conv3(h))), 2, 2, return_indices=True)
        h, indices4 = F.max_pooling_2d(
            F.relu(self.conv4_bn(self.conv4(h))), 2, 2, return_indices=True)
        h = _unpool(h, indices4)
        h = self.conv_decode4_bn(self.conv_decode4(h))
        h = _unpool(h, indices3)
        h = self.conv_decode3_bn(self.conv_decode3(h))
        h = _unpool(h, indices2)
        h = self.conv_decode2_bn(self.conv_decode2(h))
        h = _unpool(h, indices1)
        h = self.conv_decode1_bn(self.conv_decode1(h))
        return self.conv_classifier(h)
