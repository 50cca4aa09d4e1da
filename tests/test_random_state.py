"""gradient_scaling.random_state: generators saved as arrays, restored."""

import gradient_scaling  # NOQA: compat must precede chainer

import random

import numpy as np
import pytest

from chainer import serializers

from gradient_scaling.chainer import files
from gradient_scaling.chainer import random_state
from gradient_scaling.chainer.simulation import LowPrecisionSimulation


class Generators(object):

    """Python's and NumPy's global generators, a numpy Generator and a
    stochastically rounding simulation, serialized together."""

    def __init__(self, bit_generator=np.random.PCG64):
        self.generator = np.random.Generator(bit_generator(7))
        self.simulation = LowPrecisionSimulation(rounding='stochastic')

    def serialize(self, serializer):
        random_state.serialize_python(serializer['python'])
        random_state.serialize_numpy(serializer['numpy'])
        random_state.serialize_generator(serializer['generator'],
                                         self.generator)
        self.simulation.serialize(serializer['simulation'])

    def draw(self):
        x = np.full(64, 0.1, np.float32)  # between two float16 values
        return (random.random(), random.gauss(0, 1), np.random.rand(),
                np.random.randn(), self.generator.random(),
                self.simulation.truncate(x).tobytes())


@pytest.mark.parametrize('bit_generator', [np.random.PCG64, np.random.MT19937,
                                           np.random.Philox,
                                           np.random.SFC64])
def test_every_generator_continues_where_it_stopped(bit_generator,
                                                    tmp_path):
    random.seed(1)
    np.random.seed(2)
    state = Generators(bit_generator)
    # Mid-stream, with a cached Gaussian in both global generators.
    random.gauss(0, 1)
    np.random.randn()
    state.draw()
    path = str(tmp_path / 'state.npz')
    serializers.save_npz(path, state)
    expected = [state.draw() for _ in range(3)]
    # Another process would start elsewhere.
    random.seed(99)
    np.random.seed(99)
    fresh = Generators(bit_generator)
    assert files.load_npz(path, fresh) == []
    assert [fresh.draw() for _ in range(3)] == expected
    # Numbers only: it loads with pickle disabled.
    with np.load(path, allow_pickle=False) as npz:
        assert all(npz[k].dtype != object for k in npz.files)
        assert len(npz.files) > 10


def test_an_absent_state_leaves_the_generators_alone(tmp_path):
    """A file without the state (a snapshot written before it was saved),
    loaded with the keys optional, leaves every generator as it is."""
    path = str(tmp_path / 'empty.npz')
    np.savez(path, other=np.zeros(1))
    state = Generators()
    state.draw()
    before = (random.getstate(), np.random.get_state()[1].tolist(),
              state.generator.bit_generator.state,
              state.simulation._generator(np).bit_generator.state)
    absent = files.load_npz(path, state, optional=('',))
    assert 'python/state' in absent and 'numpy/keys' in absent
    assert 'simulation/modules' in absent
    assert (random.getstate(), np.random.get_state()[1].tolist(),
            state.generator.bit_generator.state,
            state.simulation._generator(np).bit_generator.state) == before


def test_a_generator_of_another_kind_is_refused(tmp_path):
    path = str(tmp_path / 'pcg.npz')
    serializers.save_npz(path, Generators(np.random.PCG64))
    with pytest.raises(ValueError, match='PCG64'):
        files.load_npz(path, Generators(np.random.Philox))


def test_cupy_generator_state_is_its_curand_bytes(tmp_path):
    """CuPy's generators keep cuRAND states in a device array, copied as
    raw bytes (here a stand-in with NumPy memory: the deserializer copies
    into the array in place, as it does into a CuPy array)."""
    class BitGenerator(object):
        def __init__(self, fill):
            self._state = np.full(96, fill, np.int8)

    class Generator(object):
        def __init__(self, fill):
            self.bit_generator = BitGenerator(fill)

    class Holder(object):
        def __init__(self, fill):
            self.generator = Generator(fill)

        def serialize(self, serializer):
            random_state.serialize_generator(serializer, self.generator)

    path = str(tmp_path / 'curand.npz')
    saved = Holder(3)
    saved.generator.bit_generator._state[::5] = -7
    serializers.save_npz(path, saved)
    restored = Holder(0)
    files.load_npz(path, restored)
    np.testing.assert_array_equal(restored.generator.bit_generator._state,
                                  saved.generator.bit_generator._state)


def test_simulation_seed_follows_numpy_seed():
    """Without a seed, stochastic rounding draws its seed from NumPy's
    global generator: ``--seed`` fixes it too."""
    x = np.full(1000, 0.1, np.float32)
    np.random.seed(4)
    a = LowPrecisionSimulation(rounding='stochastic').truncate(x)
    np.random.seed(4)
    b = LowPrecisionSimulation(rounding='stochastic').truncate(x)
    np.random.seed(5)
    c = LowPrecisionSimulation(rounding='stochastic').truncate(x)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # Round to nearest draws nothing.
    np.random.seed(4)
    LowPrecisionSimulation()
    assert np.random.rand() == (np.random.seed(4), np.random.rand())[1]
