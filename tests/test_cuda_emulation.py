"""The library's CUDA kernels, compiled with g++ and run on the CPU.

Each kernel is compiled from the very source string the library hands to
``cupy.RawKernel``, with ``tests/cuda_emulation/cuda_emulation.h``: one
thread per CUDA thread, ``__syncthreads()`` a barrier, and single precision
that flushes subnormals as CuPy's ``-ftz=true`` does. Through a stand-in
``cupy`` module the library's own CuPy path (launch geometry, bit views,
device context, host-side merge) runs unchanged and is compared with the
NumPy path.
"""

import ctypes
import math
import re
import shutil
import subprocess
import sys

import numpy
import pytest

from gradient_scaling.core import statistics

from cuda_emulation import emulator  # NOQA
from cuda_emulation import fake_cupy  # NOQA
from test_statistics import softmax_like_gradient  # NOQA

pytestmark = pytest.mark.skipif(emulator.compiler() is None,
                                reason='needs g++ (or $CXX)')

KERNEL = 'tensor_statistics_kernel'


def old_float32_source(with_log):
    """The kernel as it read float32 before it decoded the bits: the load
    widened to double is cvt.ftz.f64.f32 under -ftz=true."""
    return statistics._kernel_source_for(
        'float', '((double)(v))', '((double)logf((float)(a)))', with_log)


MULTIPROCESSORS = 4


@pytest.fixture(scope='session')
def build_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('cuda_emulation'))


@pytest.fixture
def cupy(build_dir, monkeypatch):
    module = fake_cupy.make_module(build_dir, MULTIPROCESSORS)
    monkeypatch.setitem(sys.modules, 'cupy', module)
    statistics._statistics_kernel.cache_clear()
    statistics._multiprocessor_count.cache_clear()
    yield module
    statistics._statistics_kernel.cache_clear()
    statistics._multiprocessor_count.cache_clear()


def emulated_statistics(x, build_dir, source, ftz=True, log=True):
    """The statistics kernel's result for a NumPy array, launched directly."""
    kernel = emulator.compile_kernel(source, KERNEL, ftz=ftz,
                                     build_dir=build_dir)
    blocks = statistics._grid_size(x.size, MULTIPROCESSORS)
    out = numpy.full(blocks * statistics._N_PARTIALS, numpy.nan)
    kernel((blocks,), (statistics._THREADS,), (x, numpy.int64(x.size), out))
    return statistics._combine_partials(out, x.size, log)


def every_kind_of_value(dtype, n, rng):
    """Values over the dtype's whole range: subnormals, zeros of both signs,
    NaN and infinities included."""
    info = numpy.finfo(dtype) if dtype != numpy.int32 else None
    if info is None:
        return rng.integers(-1000, 1000, n).astype(dtype)
    if dtype == numpy.float16:
        x = rng.integers(0, 2 ** 16, n).astype(numpy.uint16).view(dtype)
    else:
        # float64 up to 1e150, so that sums of squares stay finite.
        top = 38 if dtype == numpy.float32 else 150
        low = math.log10(float(info.smallest_subnormal))
        x = (rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(low, top, n))
        x = x.astype(dtype)
    special = numpy.array([0.0, -0.0, numpy.nan, numpy.inf, -numpy.inf,
                           info.smallest_subnormal, -info.smallest_normal,
                           info.smallest_normal * (1 - info.eps)], dtype)
    x[:min(n, special.size)] = special[:n]
    return rng.permutation(x)


def assert_same_statistics(actual, expected, dtype):
    for field in ('count', 'nonzero', 'n_nonfinite'):
        assert getattr(actual, field) == getattr(expected, field), field
    assert actual.max_abs == expected.max_abs
    assert actual.mean == pytest.approx(
        expected.mean, rel=1e-10, abs=1e-10 * expected.std)
    assert actual.std == pytest.approx(expected.std, rel=1e-10)
    if expected.log_mean is None:
        assert actual.log_mean is None and actual.log_std is None
        return
    # float16/float32 logarithms are single precision on both sides (NumPy's
    # float32 log is off by up to 4e-6 on float32 subnormals; the kernel
    # takes those in double).
    rtol = 1e-6 if dtype in (numpy.float16, numpy.float32) else 1e-10
    assert actual.log_mean == pytest.approx(expected.log_mean, rel=rtol,
                                            abs=rtol)
    assert actual.log_std == pytest.approx(expected.log_std, rel=rtol,
                                           abs=rtol)


# ---------------------------------------------------------------------------
# The statistics kernel through the library's CuPy path


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64, numpy.int32])
@pytest.mark.parametrize('n', [1, 2, 7, 255, 257, 3 * 4096 + 5, 2 ** 17 + 3])
@pytest.mark.parametrize('log', [True, False])
def test_kernel_matches_numpy(cupy, dtype, n, log):
    x = every_kind_of_value(dtype, n, numpy.random.default_rng(n))
    actual = statistics.tensor_statistics(cupy.asarray(x), log=log)
    expected = statistics.tensor_statistics(x, log=log)
    assert_same_statistics(actual, expected, dtype)
    launch, = cupy.launches
    assert launch.grid == (statistics._grid_size(n, MULTIPROCESSORS),)
    assert launch.block == (statistics._THREADS,)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_empty_and_non_contiguous(cupy, dtype):
    stats = statistics.tensor_statistics(cupy.asarray(numpy.zeros(0, dtype)))
    assert (stats.count, stats.nonzero, stats.mean, stats.log_mean) == (
        0, 0, 0.0, 0.0)
    assert cupy.launches == []  # nothing to launch for
    x = every_kind_of_value(dtype, 60000, numpy.random.default_rng(3))
    view = x.reshape(300, 200).T[::2, 1::3]
    actual = statistics.tensor_statistics(cupy.ndarray(view, 0))
    assert_same_statistics(actual, statistics.tensor_statistics(view), dtype)


def test_kernel_launches_on_the_arrays_device(cupy):
    x = every_kind_of_value(numpy.float32, 5000, numpy.random.default_rng(4))
    with cupy.cuda.Device(1):
        on_device_1 = cupy.asarray(x)
    assert cupy.cuda.Device().id == 0
    actual = statistics.tensor_statistics(on_device_1)
    assert_same_statistics(actual, statistics.tensor_statistics(x),
                           numpy.float32)
    assert [launch.device for launch in cupy.launches] == [1]
    assert cupy.cuda.Device().id == 0  # the caller's device is restored


def test_fake_device_check_catches_a_launch_on_the_wrong_device(cupy):
    # The guard the previous test relies on: a kernel launched on device 0
    # with an array of device 1 fails, as the library's kernel did before it
    # entered the array's device.
    with cupy.cuda.Device(1):
        x = cupy.asarray(numpy.ones(10, numpy.float64))
    kernel = cupy.RawKernel(statistics._kernel_source('float64', False),
                            KERNEL)
    with pytest.raises(RuntimeError, match='device 1 .* device 0'):
        kernel((1,), (statistics._THREADS,),
               (x, numpy.int64(10), cupy.empty(8)))


# ---------------------------------------------------------------------------
# Subnormals under -ftz=true: the defect the bit decoding fixes


def test_softmax_like_float32_gradient_under_ftz(build_dir):
    g = softmax_like_gradient()
    expected = statistics.tensor_statistics(g)
    tiny = numpy.finfo(numpy.float32).tiny
    n_subnormal = int(numpy.count_nonzero((g != 0) & (abs(g) < tiny)))
    assert expected.nonzero == 516186 and n_subnormal == 208794

    fixed = emulated_statistics(
        g.view(numpy.uint32), build_dir,
        statistics._kernel_source('float32', True))
    assert_same_statistics(fixed, expected, numpy.float32)

    old_source = old_float32_source(True)
    old = emulated_statistics(g, build_dir, old_source, ftz=True)
    # The old kernel read every float32 subnormal as zero ...
    assert old.nonzero == expected.nonzero - n_subnormal
    # ... and so saw ln|g| 11.5 higher: -67.3 instead of -78.8.
    assert expected.log_mean == pytest.approx(-78.839, abs=1e-3)
    assert old.log_mean == pytest.approx(-67.299, abs=1e-3)
    # Without the flush the old kernel was right: the emulated flag is what
    # made it wrong, as on the GPU.
    assert_same_statistics(
        emulated_statistics(g, build_dir, old_source, ftz=False), expected,
        numpy.float32)


@pytest.mark.parametrize('dtype', ['float16', 'float32', 'float64'])
def test_subnormals_only(build_dir, dtype):
    # Every positive and negative subnormal of float16, and a spread of
    # float32/float64 subnormals: each must count as a non-zero.
    if dtype == 'float16':
        bits = numpy.arange(1, 1024, dtype=numpy.uint16)
        x = numpy.concatenate([bits, bits | 0x8000]).view(numpy.float16)
        view = x.view(numpy.uint16)
    else:
        info = numpy.finfo(dtype)
        x = numpy.linspace(-1, 1, 4001) * float(info.smallest_normal)
        x = x.astype(dtype)
        view = x.view(numpy.uint32) if dtype == 'float32' else x
    expected = statistics.tensor_statistics(x)
    actual = emulated_statistics(view, build_dir,
                                 statistics._kernel_source(dtype, True))
    assert actual.nonzero == expected.nonzero == numpy.count_nonzero(x)
    assert_same_statistics(actual, expected, numpy.dtype(dtype).type)


# ---------------------------------------------------------------------------
# 64-bit index arithmetic, without 2**32 elements

SYNTHETIC_PRELUDE = r'''
#include <sys/mman.h>
/* The value at x[i] is made from the address &x[i] (never read): i / 2**32,
   zero where i % 7 == 0, NaN at the last index. x points into a reserved,
   inaccessible range of n bytes, so the addresses are real. */
static const unsigned char* synthetic_base;
static long long synthetic_n;
static double synthetic_value(const unsigned char* p) {
    const long long i = p - synthetic_base;
    if (i == synthetic_n - 1)
        return __longlong_as_double(0x7ff8000000000000LL);
    return i % 7 == 0 ? 0.0 : (double)i * 2.3283064365386963e-10;
}
extern "C" const unsigned char* synthetic_reserve(long long n) {
    void* p = mmap(nullptr, (size_t)n, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    synthetic_base = (const unsigned char*)p;
    synthetic_n = n;
    return synthetic_base;
}
'''


def synthetic_block_rows(n, blocks, grid):
    """Partial rows the kernel should write for the given blocks."""
    stride = grid * statistics._THREADS
    rows = []
    for b in blocks:
        first = b * statistics._THREADS + numpy.arange(statistics._THREADS)
        count = (n - first + stride - 1) // stride
        i = numpy.concatenate([first[t] + stride * numpy.arange(count[t])
                               for t in range(statistics._THREADS)])
        v = numpy.where(i % 7 == 0, 0.0, i * 2.0 ** -32)
        v[i == n - 1] = numpy.nan
        finite = v[numpy.isfinite(v)]
        logs = numpy.log(finite[finite != 0])
        rows.append([finite.size, finite.mean(),
                     ((finite - finite.mean()) ** 2).sum(), finite.max(),
                     logs.size, logs.mean(), ((logs - logs.mean()) ** 2).sum(),
                     v.size - finite.size])
    return numpy.array(rows)


def test_indices_beyond_2_31_on_a_sparse_grid(build_dir):
    # n > 2**32 elements on an H200-sized grid (132 multiprocessors): every
    # thread walks ~48,000 grid strides, past 2**31 and 2**32. Only a few
    # blocks are run (all 256 threads each, so the block reduction is real):
    # the first, the one holding the NaN at n - 1, and the last.
    n = 3 * 2 ** 31 + 12345
    grid = statistics._grid_size(n, 132)
    assert grid == 132 * statistics._BLOCKS_PER_MULTIPROCESSOR
    stride = grid * statistics._THREADS
    blocks = sorted({0, ((n - 1) % stride) // statistics._THREADS, grid - 1})
    assert len(blocks) == 3
    source = SYNTHETIC_PRELUDE + statistics._kernel_source_for(
        'unsigned char', 'synthetic_value(&(v))', 'log(a)', True)
    kernel = emulator.compile_kernel(source, KERNEL, build_dir=build_dir)
    reserve = kernel._library.synthetic_reserve
    reserve.restype = ctypes.c_void_p
    reserve.argtypes = [ctypes.c_longlong]
    base = reserve(n)
    if not base:
        pytest.skip('cannot reserve {} bytes of address space'.format(n))
    out = numpy.full(grid * statistics._N_PARTIALS, numpy.nan)
    kernel((grid,), (statistics._THREADS,),
           (numpy.uint64(base), numpy.int64(n), out), blocks=blocks)
    rows = out.reshape(grid, statistics._N_PARTIALS)[blocks]
    expected = synthetic_block_rows(n, blocks, grid)
    numpy.testing.assert_array_equal(rows[:, [0, 3, 4, 7]],
                                     expected[:, [0, 3, 4, 7]])
    numpy.testing.assert_allclose(rows, expected, rtol=1e-9)
    # The rows cover indices past 2**32, up to the last one (whose NaN is
    # counted in the block that holds it).
    assert rows[:, 3].max() == (n - 2) * 2.0 ** -32 > 1.0
    assert rows[:, 7].tolist() == [float(b == blocks[1]) for b in blocks]


# ---------------------------------------------------------------------------
# The emulation itself, and what nvcc makes of the source


FLUSH_PROBE = r'''
extern "C" __global__ void probe(const float* x, double* out) {
    const float v = x[threadIdx.x];
    double* o = out + 6 * threadIdx.x;
    o[0] = (double)v;                  /* cvt.ftz.f64.f32 */
    o[1] = (double)(v * 1.0f);         /* mul.ftz.f32 */
    o[2] = v != 0.0f;                  /* setp.neu.ftz.f32 */
    o[3] = (double)logf(v);            /* libdevice logf, FTZ variant */
    o[4] = (double)(float)((double)__float_as_int(v) * 1e-45);
    o[5] = (double)__float_as_int(__int_as_float(__float_as_int(v)));
}
'''


@pytest.mark.parametrize('ftz', [True, False])
def test_emulated_flag_flushes_what_cupy_flushes(build_dir, ftz):
    x = numpy.array([1e-40, -3e-42, 2e-38, 1.0], numpy.float32)
    kernel = emulator.compile_kernel(FLUSH_PROBE, 'probe', ftz=ftz,
                                     build_dir=build_dir)
    out = numpy.zeros((4, 6))
    kernel((1,), (4,), (x, out))
    wide = x.astype(numpy.float64)
    bits = x.view(numpy.int32).astype(numpy.float64)
    subnormal = numpy.array([True, True, False, False])
    flushed = numpy.where(subnormal & ftz, 0.0, wide)
    numpy.testing.assert_array_equal(out[:, 0], flushed)
    numpy.testing.assert_array_equal(out[:, 1], flushed)
    numpy.testing.assert_array_equal(out[:, 2], flushed != 0)
    with numpy.errstate(divide='ignore', invalid='ignore'):
        logs = numpy.log(numpy.abs(flushed)).astype(numpy.float32)
    logs[(flushed < 0)] = numpy.nan
    numpy.testing.assert_allclose(out[:, 3], logs, rtol=1e-6)
    # A double narrowed to a float32 subnormal is flushed too (the first
    # value's bits times 1e-45 is ~1e-38 / 1e-37, near the edge).
    narrowed = (bits * 1e-45).astype(numpy.float32).astype(numpy.float64)
    if ftz:
        narrowed[numpy.abs(narrowed) < numpy.finfo(numpy.float32).tiny] = 0
    numpy.testing.assert_array_equal(out[:, 4], narrowed)
    numpy.testing.assert_array_equal(out[:, 5], bits)  # bit casts: no flush


def nvcc_ptx(source, tmp_path, name):
    nvcc = shutil.which('nvcc')
    if nvcc is None:
        pytest.skip('nvcc not found')
    path = tmp_path / (name + '.cu')
    path.write_text(source)
    # CuPy's flag; sm_90 is the H200's architecture.
    subprocess.run([nvcc, '-ptx', '-arch=sm_90', '-ftz=true', str(path),
                    '-o', str(tmp_path / (name + '.ptx'))], check=True,
                   capture_output=True, timeout=300)
    return (tmp_path / (name + '.ptx')).read_text()


def single_precision_instructions(ptx):
    return re.findall(r'^\s*(\S*\.f32\S*)', ptx, re.MULTILINE)


@pytest.mark.parametrize('dtype', ['float16', 'float32', 'float64'])
def test_ptx_reads_no_value_in_single_precision(tmp_path, dtype):
    # Without the log statistics, no single-precision instruction is left
    # that could flush a value; with them, only logf of normal float32
    # magnitudes (the float32 kernel sends subnormals to log in double).
    ptx = nvcc_ptx(statistics._kernel_source(dtype, False), tmp_path, dtype)
    assert single_precision_instructions(ptx) == []
    old = nvcc_ptx(old_float32_source(False), tmp_path, 'old')
    assert 'cvt.ftz.f64.f32' in single_precision_instructions(old)
    if dtype == 'float32':
        with_log = nvcc_ptx(statistics._kernel_source(dtype, True), tmp_path,
                            'log')
        # The subnormal test is made in double, against 2**-126.
        assert re.search(r'setp\.\w+\.f64\s.*0d3810000000000000', with_log)


@pytest.mark.parametrize('dtype', ['float16', 'float32', 'float64'])
def test_blocks_per_multiprocessor_are_resident_at_once(tmp_path, dtype):
    # The grid is sized to run in one wave: _BLOCKS_PER_MULTIPROCESSOR blocks
    # of _THREADS threads must fit in an SM's 65536 registers (allocated in
    # units of 8 per thread) and its 228 KB of shared memory (sm_90).
    nvcc = shutil.which('nvcc')
    if nvcc is None:
        pytest.skip('nvcc not found')
    path = tmp_path / 'k.cu'
    path.write_text(statistics._kernel_source(dtype, True))
    result = subprocess.run(
        [nvcc, '-cubin', '-arch=sm_90', '-ftz=true', '-Xptxas', '-v',
         str(path), '-o', str(tmp_path / 'k.cubin')], check=True,
        capture_output=True, text=True, timeout=300)
    registers = int(re.search(r'Used (\d+) registers', result.stderr)
                    .group(1))
    shared = int(re.search(r'(\d+) bytes smem', result.stderr).group(1))
    blocks = statistics._BLOCKS_PER_MULTIPROCESSOR
    assert blocks * statistics._THREADS * (-(-registers // 8) * 8) <= 65536
    assert blocks * shared <= 228 * 1024
    # ... and the loads of one thread are issued together.
    ptx = nvcc_ptx(statistics._kernel_source(dtype, True), tmp_path, 'k')
    assert len(re.findall(r'ld\.global', ptx)) == statistics._UNROLL
