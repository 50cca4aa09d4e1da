"""What a skipped step puts back: the persistent values the forward pass changed."""

import gradient_scaling.compat  # NOQA

from gradient_scaling.chainer import _internals as internals

__all__ = ['LinkState']


class LinkState(object):

    """The persistent values of a link and its children, to put back.

    The forward pass of a training step changes persistent values
    (BatchNorm's ``avg_mean``, ``avg_var`` and ``N``), in place. Captured
    before the forward and restored when the step is skipped, the batch
    leaves no trace: a NaN batch cannot poison the running statistics.

    Args:
        link (~chainer.Link): The model (every child link is included).

    """

    def __init__(self, link):
        self._saved = []
        for sub in link.links():
            for name in internals.persistent_names(sub):
                value = getattr(sub, name)
                if hasattr(value, 'copy'):
                    value = value.copy()
                self._saved.append((sub, name, value))

    def restore(self):
        """Puts every captured value back (arrays in place)."""
        for sub, name, value in self._saved:
            current = getattr(sub, name)
            if (hasattr(current, 'shape') and hasattr(value, 'shape')
                    and current.shape == value.shape
                    and current.dtype == value.dtype):
                current[...] = value
            else:
                setattr(sub, name, value)
