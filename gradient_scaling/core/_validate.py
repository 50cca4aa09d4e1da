"""Argument checks shared by the library: one message style, NumPy-aware.

Numbers may be Python or NumPy scalars (``numpy.float32(1e-3)``,
``numpy.int64(5)``); booleans are not counts. Every error names the
argument, the value received and what is valid.
"""

import math
import numbers

__all__ = ['count', 'rate', 'positive', 'greater_than_one', 'choice',
           'lookup']


def count(value, name, minimum=1):
    """An integer >= ``minimum`` (bools refused), as a Python int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or value < minimum:
        raise ValueError('{} must be an integer >= {}, got {!r}'.format(
            name, minimum, value))
    return int(value)


def _real(value, name, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError('{} must be {}, got {!r}'.format(name, what, value))
    value = float(value)
    if math.isnan(value):
        raise ValueError('{} must be {}, got {!r}'.format(name, what, value))
    return value


def rate(value, name):
    """A number strictly between 0 and 1, as a Python float."""
    what = 'a number in (0, 1)'
    result = _real(value, name, what)
    if not 0 < result < 1:
        raise ValueError('{} must be {}, got {!r}'.format(name, what, value))
    return result


def _above(value, name, bound):
    what = 'a finite number > {}'.format(bound)
    result = _real(value, name, what)
    if not bound < result < math.inf:
        raise ValueError('{} must be {}, got {!r}'.format(name, what, value))
    return result


def positive(value, name):
    """A finite number > 0, as a Python float."""
    return _above(value, name, 0)


def greater_than_one(value, name):
    """A finite number > 1, as a Python float."""
    return _above(value, name, 1)


def choice(value, name, choices):
    """One of ``choices`` (compared with ==)."""
    if value not in choices:
        raise ValueError('{} must be one of {}, got {!r}'.format(
            name, ', '.join(repr(c) for c in choices), value))
    return value


def lookup(name, table, kind, what):
    """The entry ``name`` of the registry ``table`` (a dict from names), or
    ``name`` itself where it is an instance of ``kind`` already; any other
    value is refused with the valid names (``what``: the noun, e.g.
    ``'format'``)."""
    if isinstance(name, kind):
        return name
    if isinstance(name, str) and name in table:
        return table[name]
    raise ValueError('unknown {} {!r}; valid {}s are {}'.format(
        what, name, what, ', '.join(repr(n) for n in table)))
