"""Tests of gradient_scaling.core.lost_values: the simulations' counts."""

import numpy
import pytest

from gradient_scaling.core.lost_values import LostValueCounts
from gradient_scaling.core.lost_values import UnderflowCount
from helpers import cupy_or_skip


def test_counts_per_site_and_operand():
    counts = LostValueCounts()
    a = numpy.array([1e-9, 0.5, 0.0, -1e-30, 2.0], numpy.float32)
    rounded = numpy.array([0.0, 0.5, 0.0, 0.0, 2.0], numpy.float32)
    counts.count('s1', 'gy', a, rounded)
    counts.count('s1', 'gy', a, a)  # a second pass adds up
    counts.add('s2', 'gy_wgrad', 10, 4, 3)
    assert counts.report() == [UnderflowCount('s1', 'gy', 8, 2, 0),
                               UnderflowCount('s2', 'gy_wgrad', 10, 4, 3)]
    assert counts.report()[0].rate == 0.25
    assert UnderflowCount('s', 'x').rate == 0.0


def test_a_float32_subnormal_is_a_non_zero_value():
    counts = LostValueCounts()
    a = numpy.array([1e-45, 1e-40, 0.0], numpy.float32)
    counts.count('s', 'gy', a, numpy.zeros(3, numpy.float32))
    assert counts.report()[0] == UnderflowCount('s', 'gy', 2, 2)


def test_observation_then_a_fresh_start():
    counts = LostValueCounts()
    counts.add('s1', 'gy', 100, 10, 5)
    counts.add('s2', 'gy', 100, 30, 0)
    counts.add('s2', 'gy_wgrad', 200, 0)
    counts.stored(400, scale_bits=100)
    counts.stored(600)
    observation = counts.observation()
    assert observation == pytest.approx({
        'scaling/measured_underflow': 40 / 400,
        'scaling/worst_measured_underflow': 0.3,
        'scaling/flushed_in_blocks': 5 / 400,
        'scaling/scale_bits_per_element': 0.1,
        'scaling/lost/s1/gy': 0.1, 'scaling/lost/s2/gy': 0.3,
        'scaling/lost/s2/gy_wgrad': 0.0,
        'scaling/operand_lost/gy': 0.2,
        'scaling/operand_lost/gy_wgrad': 0.0})
    assert counts.observation() == {}  # nothing counted since
    assert counts.report() == []


def test_reset_and_nothing_non_zero():
    counts = LostValueCounts()
    counts.count('s', 'gy', numpy.zeros(4), numpy.zeros(4))
    assert counts.observation() == {}
    counts.add('s', 'gy', 3, 1)
    counts.reset()
    assert counts.report() == [] and counts.observation() == {}


@pytest.mark.gpu
def test_cupy_subnormals_count():
    cupy = cupy_or_skip()
    counts = LostValueCounts()
    a = cupy.asarray(numpy.array([1e-45, 1e-40, 1.0], numpy.float32))
    counts.count('s', 'gy', a, cupy.zeros(3, cupy.float32))
    assert counts.report()[0] == UnderflowCount('s', 'gy', 3, 3)


def test_counts_outside_the_totals_are_reported_per_site_only():
    counts = LostValueCounts()
    counts.add('s1', 'x', 100, 1)
    counts.add('s1', 'gy', 50, 50, in_total=False)
    observation = counts.observation()
    assert observation['scaling/measured_underflow'] == 0.01
    assert observation['scaling/worst_measured_underflow'] == 0.01
    assert observation['scaling/lost/s1/gy'] == 1.0
    assert observation['scaling/operand_lost/gy'] == 1.0
    counts.add('s1', 'gy', 50, 50, in_total=False)
    observation = counts.observation()  # nothing in the totals
    assert 'scaling/measured_underflow' not in observation
    assert observation['scaling/operand_lost/gy'] == 1.0
    counts.add('s1', 'gy', 5, 1)  # the reset forgot what was outside
    assert counts.observation()['scaling/measured_underflow'] == 0.2
