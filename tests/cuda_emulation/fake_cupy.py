"""A stand-in ``cupy`` module whose kernels run in the CPU emulation.

Just enough of CuPy for the library's CuPy code paths that launch their own
kernels: arrays live on numbered fake devices, ``cupy.cuda.Device`` is a
context manager that makes one current, allocations land on the current
device, and a ``RawKernel`` compiles its source with
:func:`~cuda_emulation.emulator.compile_kernel` and refuses, as a GPU would
fault, an array that is not on the device it is launched on. Every launch
is recorded in ``module.launches``.

.. admonition:: Example

    >>> cupy = make_module(build_dir, multiprocessor_count=4)
    >>> monkeypatch.setitem(sys.modules, 'cupy', cupy)
    >>> statistics.tensor_statistics(cupy.asarray(x))

"""

import collections
import types

import numpy

from cuda_emulation import emulator


Launch = collections.namedtuple('Launch', ('name', 'device', 'grid', 'block'))


def make_module(build_dir, multiprocessor_count=4, device_count=2, ftz=True):
    """A fresh fake ``cupy`` module (its own devices and launch record)."""
    cupy = types.ModuleType('cupy')
    cupy.__version__ = 'emulated'
    cupy.launches = []
    current = [0]

    class Device(object):
        __module__ = 'cupy.cuda.device'

        def __init__(self, device_id=None):
            self.id = current[0] if device_id is None else int(device_id)
            if not 0 <= self.id < device_count:
                raise ValueError('no device {}'.format(self.id))
            self.attributes = {'MultiProcessorCount': multiprocessor_count}
            self._previous = []

        def __enter__(self):
            self._previous.append(current[0])
            current[0] = self.id
            return self

        def __exit__(self, *exc):
            current[0] = self._previous.pop()

        def use(self):
            current[0] = self.id

        def synchronize(self):
            pass

    class ndarray(object):
        __module__ = 'cupy'

        def __init__(self, array, device_id):
            self._array = array
            self.device = Device(device_id)

        def __getattr__(self, name):
            # The array's metadata, read through; its data only by get().
            if name in ('dtype', 'shape', 'size', 'ndim', 'nbytes'):
                return getattr(self._array, name)
            raise AttributeError(name)

        @property
        def data_pointer(self):
            return self._array.ctypes.data

        def _here(self, array):
            return ndarray(array, current[0])

        def view(self, dtype):
            return ndarray(self._array.view(dtype), self.device.id)

        def reshape(self, *shape):
            return ndarray(self._array.reshape(*shape), self.device.id)

        def astype(self, dtype, copy=True):
            return self._here(self._array.astype(dtype, copy=True))

        def get(self):
            return self._array.copy()

        def __getitem__(self, index):
            return ndarray(self._array[index], self.device.id)

    def asarray(x, dtype=None):
        if isinstance(x, ndarray) and dtype is None:
            return x
        source = x._array if isinstance(x, ndarray) else x
        return ndarray(numpy.array(source, dtype=dtype), current[0])

    def ascontiguousarray(x):
        # As in CuPy: a contiguous array is returned as it is, wherever it
        # lives; a copy is made on the current device.
        if x._array.flags.c_contiguous:
            return x
        return ndarray(numpy.ascontiguousarray(x._array), current[0])

    def empty(shape, dtype=numpy.float64):
        return ndarray(numpy.full(shape, numpy.nan).astype(dtype),
                       current[0])

    def asnumpy(x):
        return x.get() if isinstance(x, ndarray) else numpy.asarray(x)

    class RawKernel(object):

        def __init__(self, code, name, options=()):
            self.code = code
            self.name = name
            self._kernel = emulator.compile_kernel(code, name, ftz=ftz,
                                                   build_dir=build_dir)

        def __call__(self, grid, block, args):
            for a in args:
                if isinstance(a, ndarray) and a.device.id != current[0]:
                    raise RuntimeError(
                        'an array on device {} was passed to kernel {} '
                        'launched on device {}'.format(
                            a.device.id, self.name, current[0]))
            cupy.launches.append(Launch(self.name, current[0], grid, block))
            self._kernel(grid, block, args)

    cuda = types.ModuleType('cupy.cuda')
    cuda.Device = Device
    cuda.runtime = types.SimpleNamespace(
        getDeviceCount=lambda: device_count)
    vars(cupy).update(
        cuda=cuda, ndarray=ndarray, asarray=asarray, array=asarray,
        ascontiguousarray=ascontiguousarray, empty=empty, asnumpy=asnumpy,
        RawKernel=RawKernel)
    return cupy
