"""What a low-precision simulation lost where it stored values: the counts.

A simulation (:mod:`gradient_scaling.chainer.simulation`,
:mod:`~gradient_scaling.chainer.block_simulation`) rounds gradients where
mixed precision stores them; with ``measure_underflow`` it hands each
rounding to a :class:`LostValueCounts`, which keeps, per GEMM site and
operand, how many non-zero values there were and how many became zero
(:class:`UnderflowCount`), and how many bits of scales were stored per
element stored. :meth:`LostValueCounts.observation` turns the counts into
the ``scaling/...`` entries a training loop reports, and starts again.

.. admonition:: Example

    >>> import numpy as np
    >>> from gradient_scaling.core.lost_values import LostValueCounts
    >>> counts = LostValueCounts()
    >>> counts.count('fc:LinearFunction', 'gx', np.array([1e-9, 0.5, 0.0]),
    ...              np.array([0.0, 0.5, 0.0]))
    >>> counts.observation()['scaling/measured_underflow']
    0.5

"""

import dataclasses

from gradient_scaling.core import statistics

__all__ = ['UnderflowCount', 'LostValueCounts']


@dataclasses.dataclass
class UnderflowCount(object):

    """Gradient values of one GEMM operand that rounding turned into zeros.

    Attributes:
        site (str): Link path (or parameter name) of the weight and the
            function's class name.
        operand (str): ``'x'``, ``'W'`` or ``'b'``: whose gradient; ``'gy'``
            for the incoming gradient when only inputs are rounded (for the
            data-gradient GEMM of a block format), ``'gy_wgrad'`` for the
            block format's copy of it that the weight-gradient GEMM reads.
        nonzero (int): Non-zero gradient values before rounding, summed
            over all backward passes measured.
        underflowed (int): Those of them that rounded to zero.
        flushed_in_blocks (int): Those lost values whose block (block
            formats only) also held a larger value that was kept: lost to
            the block's shared scale rather than to the format's range.

    """

    site: str
    operand: str
    nonzero: int = 0
    underflowed: int = 0
    flushed_in_blocks: int = 0

    @property
    def rate(self):
        """Fraction of the non-zero values that underflowed (0 if none)."""
        return self.underflowed / self.nonzero if self.nonzero else 0.0


class LostValueCounts(object):

    """Counts of lost gradient values per site and operand, and of the
    scale bits stored, since the last :meth:`observation` or :meth:`reset`.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self._counts = {}
        self._outside = set()  # keys left out of the totals
        self._scale_bits = 0
        self._elements = 0

    def stored(self, elements, scale_bits=0):
        """``elements`` values were stored in the format with ``scale_bits``
        bits of scales."""
        self._scale_bits += scale_bits
        self._elements += elements

    def add(self, site, operand, nonzero, lost, flushed_in_blocks=0,
            in_total=True):
        """Adds counts made elsewhere (e.g. a block format's
        ``count_lost``); ``in_total=False`` keeps them out of
        :meth:`observation`'s totals (reported per site and operand only).
        """
        key = (site, operand)
        if not in_total:
            self._outside.add(key)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = UnderflowCount(*key)
        count.nonzero += nonzero
        count.underflowed += lost
        count.flushed_in_blocks += flushed_in_blocks

    def count(self, site, operand, array, rounded, in_total=True):
        """Counts the non-zero values of ``array`` that are zero in
        ``rounded`` (bit-exact masks: CuPy flushes float32 subnormals in
        float comparisons, and a bfloat16 result may be one); ``in_total``
        as :meth:`add` takes it."""
        xp = statistics.get_array_module(array)
        with statistics.device_scope(array):
            nonzero = statistics.nonzero_mask(array)
            lost = nonzero & ~statistics.nonzero_mask(rounded)
            self.add(site, operand, int(xp.count_nonzero(nonzero)),
                     int(xp.count_nonzero(lost)), in_total=in_total)

    def report(self):
        """Copies of the counts, in order of first appearance."""
        return [dataclasses.replace(c) for c in self._counts.values()]

    def observation(self):
        """The counts as ``scaling/...`` entries, then a :meth:`reset`;
        empty when no non-zero gradient value was counted; the totals are
        left out when none was counted in them.

        ``measured_underflow``: the fraction of the non-zero gradient values
        that became zero, over the sites and operands in the totals;
        ``worst_measured_underflow``: the largest of theirs; ``lost/<site>/
        <operand>``: each one's; ``operand_lost/<operand>``: each operand's
        over every site; ``flushed_in_blocks``: the fraction lost beside a
        larger value of its block; ``scale_bits_per_element``: bits of
        scales per element stored (forward operands and gradients).
        """
        counts, outside = self.report(), self._outside
        bits, elements = self._scale_bits, self._elements
        self.reset()
        if not any(c.nonzero for c in counts):
            return {}
        total = [c for c in counts if (c.site, c.operand) not in outside]
        nonzero = sum(c.nonzero for c in total)
        observation = {'scaling/scale_bits_per_element': bits / elements
                       if elements else 0.0}
        if nonzero:
            observation.update({
                'scaling/worst_measured_underflow': max(
                    c.rate for c in total),
                'scaling/measured_underflow': sum(
                    c.underflowed for c in total) / nonzero,
                'scaling/flushed_in_blocks': sum(
                    c.flushed_in_blocks for c in total) / nonzero})
        observation.update(('scaling/lost/{}/{}'.format(c.site, c.operand),
                            c.rate) for c in counts)
        observation.update(_operand_rates(counts))
        return observation


def _operand_rates(counts):
    """``operand_lost/<operand>`` entries: lost over non-zero, all sites."""
    rates = {}
    for operand in dict.fromkeys(c.operand for c in counts):
        mine = [c for c in counts if c.operand == operand]
        nonzero = sum(c.nonzero for c in mine)
        rates['scaling/operand_lost/' + operand] = sum(
            c.underflowed for c in mine) / nonzero if nonzero else 0.0
    return rates
