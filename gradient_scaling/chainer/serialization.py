"""The core's state dicts in Chainer's serializers (Trainer snapshots, npz).

The core's state machines describe their state as flat ``name: value``
dicts of Python numbers, strings and lists (``state_dict()``), restored by
``load_state_dict()``. Chainer saves arrays under keys: a list becomes a
NumPy array (strings as a Unicode array, never an object array, so that
the file loads with pickle off), a ``/`` in a name a level of the archive.

.. admonition:: Example

    >>> import os, tempfile, chainer
    >>> from gradient_scaling.core.scale_state import WeightPathBackoff
    >>> from gradient_scaling.chainer import serialization
    >>> backoff = WeightPathBackoff()
    >>> backoff.back_off(['/l1/W'])  # its weight path overflowed
    True
    >>> path = os.path.join(tempfile.mkdtemp(), 'backoff.npz')
    >>> chainer.serializers.save_npz(path, serialization.Serializable(
    ...     backoff))
    >>> restored = WeightPathBackoff()
    >>> chainer.serializers.load_npz(path, serialization.Serializable(
    ...     restored))
    >>> restored.scales
    {'/l1/W': 0.00390625}
"""

import gradient_scaling.compat  # NOQA

import numpy

import chainer

__all__ = ['loading', 'serialize_state', 'Serializable']


def loading(serializer):
    """Whether ``serializer`` reads (a Chainer deserializer)."""
    return isinstance(serializer, chainer.serializer.Deserializer)


def _to_array(value):
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return numpy.array(value, dtype=numpy.str_)
        return numpy.array(value, dtype=numpy.float64 if not value or any(
            isinstance(v, float) for v in value) else None)
    return value


def serialize_state(serializer, obj):
    """Saves ``obj.state_dict()`` or restores it with ``load_state_dict``.

    On loading, every entry of the object's own current state dict is read
    (its names are fixed; a missing one reads None where the deserializer
    allows it, and the object decides what that means).
    """
    if loading(serializer):
        obj.load_state_dict({name: serializer(name, None)
                             for name in obj.state_dict()})
        return
    for name, value in obj.state_dict().items():
        serializer(name, _to_array(value))


class Serializable(object):

    """Gives an object with ``state_dict``/``load_state_dict`` Chainer's
    ``serialize`` (for ``chainer.serializers.save_npz`` / ``load_npz``)."""

    def __init__(self, obj):
        self.obj = obj

    def serialize(self, serializer):
        serialize_state(serializer, self.obj)
