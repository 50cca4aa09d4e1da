"""Compile CUDA kernel source with g++ and run it on the CPU.

The execution model and CuPy's ``-ftz=true`` flag are emulated by
``cuda_emulation.h`` (see its header comment): one ``std::thread`` per CUDA
thread, blocks in sequence, ``__syncthreads()`` a barrier, and with
``ftz=True`` single precision that flushes subnormals as CuPy's kernels do.

.. admonition:: Example

    >>> kernel = compile_kernel(source, 'my_kernel', build_dir='/tmp/k')
    >>> kernel((4,), (256,), (x, numpy.int64(x.size), out))

"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading

import numpy


HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      'cuda_emulation.h')
_FLAGS = ('-std=c++20', '-O2', '-shared', '-fPIC', '-pthread', '-w')
_LAUNCHER = r'''
extern "C" void emulated_launch(
        unsigned int gx, unsigned int gy, unsigned int gz, unsigned int bx,
        unsigned int by, unsigned int bz, void** args,
        const long long* blocks, long long n_blocks) {
    cuda_emulation::launch(&KERNEL_NAME, dim3{gx, gy, gz}, dim3{bx, by, bz},
                           args, blocks, n_blocks);
}
'''


def compiler():
    """The C++ compiler to use, or None when there is none."""
    return shutil.which(os.environ.get('CXX', 'g++'))


def _dims(d):
    d = tuple(int(v) for v in (d if isinstance(d, (tuple, list)) else (d,)))
    if not 1 <= len(d) <= 3 or min(d) < 1:
        raise ValueError('grid and block need 1 to 3 positive sizes, got '
                         '{!r}'.format(d))
    return d + (1,) * (3 - len(d))


def _argument(value):
    """A ctypes object holding one kernel argument as CUDA would pass it."""
    pointer = getattr(value, 'data_pointer', None)
    if pointer is not None:  # a fake_cupy.ndarray
        return ctypes.c_void_p(pointer)
    if isinstance(value, numpy.ndarray):
        return ctypes.c_void_p(value.ctypes.data)
    if isinstance(value, numpy.generic):
        return (ctypes.c_char * value.nbytes).from_buffer_copy(value.tobytes())
    raise TypeError(
        'kernel arguments must be arrays or NumPy scalars (CuPy passes a '
        'Python scalar with a type of its own choosing), got {!r}'.format(
            type(value)))


class EmulatedKernel(object):

    """One compiled kernel; call it as a ``cupy.RawKernel``.

    ``blocks`` selects the blocks to run (linear indices into the grid, in
    that order); by default all of them run, as on a GPU.
    """

    def __init__(self, path, name, ftz):
        self.path = path
        self.name = name
        self.ftz = ftz
        self._library = ctypes.CDLL(path)
        self._launch = self._library.emulated_launch
        self._launch.restype = None

    def __call__(self, grid, block, args, blocks=None):
        grid, block = _dims(grid), _dims(block)
        n_grid = grid[0] * grid[1] * grid[2]
        blocks = numpy.arange(n_grid, dtype=numpy.int64) if blocks is None \
            else numpy.asarray(blocks, dtype=numpy.int64)
        if blocks.size and (blocks.min() < 0 or blocks.max() >= n_grid):
            raise ValueError('blocks must lie in [0, {}), got {}'.format(
                n_grid, blocks))
        values = [_argument(a) for a in args]
        pointers = (ctypes.c_void_p * max(len(values), 1))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        self._launch(*[ctypes.c_uint(v) for v in grid + block],
                     pointers, ctypes.c_void_p(blocks.ctypes.data),
                     ctypes.c_longlong(blocks.size))


def compile_kernel(source, name, ftz=True, build_dir=None, defines=()):
    """Compiles ``source`` (CUDA C for NVRTC) for the CPU.

    Args:
        source (str): Kernel source, exactly as given to ``cupy.RawKernel``.
        name (str): The ``extern "C" __global__`` function to launch.
        ftz (bool): Emulate CuPy's ``-ftz=true`` (the default, as on the
            GPU) or IEEE single precision with subnormals.
        build_dir (str): Where the shared libraries are cached, keyed by a
            hash of the header, source and flags.
        defines (tuple of str): Extra ``-D`` definitions.

    Returns:
        EmulatedKernel: The kernel.

    """
    cxx = compiler()
    if cxx is None:
        raise RuntimeError('no C++ compiler (g++ or $CXX) found')
    if build_dir is None:
        build_dir = os.path.join('/tmp', 'cuda_emulation_{}'.format(
            os.getuid()))
    flags = list(_FLAGS) + ['-DKERNEL_NAME=' + name] + [
        '-D' + d for d in defines] + (['-DCUDA_EMULATION_FTZ'] if ftz else [])
    with open(HEADER) as f:
        header = f.read()
    key = hashlib.sha256('\0'.join(
        [header, source, cxx] + flags).encode()).hexdigest()[:20]
    path = os.path.join(build_dir, '{}_{}.so'.format(name, key))
    if not os.path.exists(path):
        # Compiled under a private name and renamed: concurrent test
        # processes never load a half-written library.
        os.makedirs(build_dir, exist_ok=True)
        stem = '{}.{}.{}'.format(path[:-3], os.getpid(), threading.get_ident())
        with open(stem + '.cpp', 'w') as f:
            f.write(source + '\n' + _LAUNCHER)
        result = subprocess.run(
            [cxx] + flags + ['-include', HEADER, stem + '.cpp', '-o',
                             stem + '.so'], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError('{} failed on {}.cpp:\n{}'.format(
                cxx, stem, result.stderr[-4000:]))
        os.replace(stem + '.so', path)
    return EmulatedKernel(path, name, ftz)
