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
        # Which values to save, found once (walking the links costs more
        # than copying their values).
        self._values = [(sub, name) for sub in link.links()
                        for name in internals.persistent_names(sub)]
        # The same, as two columns (capture reads them with map).
        self._links, self._names = list(zip(*self._values)) or ((), ())
        self._saved = [None] * len(self._values)
        self.capture()

    def capture(self):
        """Saves every value as it is now (into the same buffers as the
        last capture, when the shapes agree)."""
        saved = self._saved
        # (_same_array_layout inline, the values read by map: this runs
        # every step)
        for i, (value, old) in enumerate(zip(
                map(getattr, self._links, self._names), saved)):
            if type(value) is type(old) and hasattr(value, 'shape') and \
                    value.shape == old.shape and value.dtype == old.dtype:
                old[...] = value
            else:
                saved[i] = value.copy() if hasattr(value, 'copy') else value

    def restore(self):
        """Puts every captured value back (arrays in place)."""
        for (sub, name), value in zip(self._values, self._saved):
            current = getattr(sub, name)
            if _same_array_layout(current, value):
                current[...] = value
            else:
                setattr(sub, name, value)


def _same_array_layout(a, b):
    # The type first: a value that is no array (BatchNorm's N, an int) then
    # costs one comparison.
    return (type(a) is type(b) and hasattr(a, 'shape')
            and a.shape == b.shape and a.dtype == b.dtype)
