"""Random generators' state as plain arrays, for snapshots.

A resumed run repeats the straight run bit for bit only if every generator
it draws from continues where it stopped: Python's ``random`` (ChainerCV's
augmentations), NumPy's global generator (the iterators' shuffle, the
augmentations, Chainer's dropout) and any generator of its own (the
simulation's stochastic rounding).  Each function here is a Chainer
``serialize`` for one kind of generator: it saves the state as numeric
arrays (no pickle needed to load them, :mod:`gradient_scaling.files`) and
puts it back when given a deserializer.

.. admonition:: Example

    >>> def serialize(self, serializer):        # a Chainer serializable
    ...     random_state.serialize_python(serializer['python'])
    ...     random_state.serialize_numpy(serializer['numpy'])

A deserializer that leaves a value as it is (a key an older file lacks,
:func:`gradient_scaling.files.load_npz`'s ``optional``) leaves the
generator as it is.
"""

import gradient_scaling.compat  # NOQA

import random

import numpy

import chainer

from gradient_scaling.chainer import _internals as internals

__all__ = ['serialize_python', 'serialize_numpy', 'serialize_generator']

# Python ints of a bit generator's state (PCG64's are 128-bit) are stored
# as this many little-endian 64-bit words.
_WORDS = 4


def _loading(serializer):
    return isinstance(serializer, chainer.serializer.Deserializer)


def serialize_python(serializer, generator=random):
    """Python's ``random`` module (or a ``random.Random``)."""
    version, words, gauss = generator.getstate()
    words = serializer('state', numpy.array(words, dtype=numpy.uint64))
    version = serializer('version', numpy.int64(version))
    has_gauss = serializer('has_gauss', numpy.bool_(gauss is not None))
    gauss = serializer('gauss', numpy.float64(gauss or 0.0))
    if _loading(serializer):
        generator.setstate((int(version), tuple(int(w) for w in words),
                            float(gauss) if has_gauss else None))


def serialize_numpy(serializer, generator=numpy.random):
    """A ``numpy.random.RandomState``; by default NumPy's global one."""
    name, keys, pos, has_gauss, gauss = generator.get_state()
    keys = serializer('keys', numpy.array(keys, dtype=numpy.uint32))
    pos = serializer('pos', numpy.int64(pos))
    has_gauss = serializer('has_gauss', numpy.int64(has_gauss))
    gauss = serializer('gauss', numpy.float64(gauss))
    if _loading(serializer):
        generator.set_state((name, numpy.asarray(keys, numpy.uint32),
                             int(pos), int(has_gauss), float(gauss)))


def serialize_generator(serializer, generator):
    """A ``numpy.random.Generator``, or CuPy's (its cuRAND state).

    CuPy's generators keep one cuRAND state per thread in device memory
    (``bit_generator._state``, a CuPy array); it is saved as raw bytes and
    copied back in place.
    """
    bit_generator = generator.bit_generator
    if not isinstance(getattr(bit_generator, 'state', None), dict):
        serializer('curand_state', internals.curand_state(bit_generator))
        return
    state = dict(bit_generator.state)
    kind = state.pop('bit_generator')
    if not _loading(serializer):
        serializer('bit_generator', numpy.array(kind))
    else:
        stored = serializer('bit_generator', None)
        if stored is None:  # absent: left as it is
            return
        if str(stored) != kind:
            raise ValueError('the saved generator is a {}, this one a '
                             '{}'.format(stored, kind))
    flat = {}
    _flatten(state, '', flat)
    loaded = {key: serializer(key, value) for key, value in flat.items()}
    if _loading(serializer):
        state = _unflatten(state, '', loaded)
        state['bit_generator'] = kind
        bit_generator.state = state


def _flatten(state, prefix, flat):
    for key, value in state.items():
        name = prefix + key
        if isinstance(value, dict):
            _flatten(value, name + '/', flat)
        elif isinstance(value, str):
            flat[name] = numpy.array(value)
        elif isinstance(value, (int, numpy.integer)):
            flat[name] = _int_to_words(int(value))
        else:
            flat[name] = numpy.array(value)


def _unflatten(state, prefix, loaded):
    result = {}
    for key, value in state.items():
        name = prefix + key
        if isinstance(value, dict):
            result[key] = _unflatten(value, name + '/', loaded)
        elif isinstance(value, str):
            result[key] = str(loaded[name])
        elif isinstance(value, (int, numpy.integer)):
            result[key] = _words_to_int(loaded[name])
        else:
            result[key] = numpy.asarray(loaded[name], dtype=value.dtype)
    return result


def _int_to_words(value):
    if not 0 <= value < 2 ** (64 * _WORDS):
        raise ValueError('generator state value out of range: {}'.format(
            value))
    mask = 2 ** 64 - 1
    return numpy.array([(value >> (64 * i)) & mask for i in range(_WORDS)],
                       dtype=numpy.uint64)


def _words_to_int(words):
    return sum(int(w) << (64 * i) for i, w in enumerate(words))
