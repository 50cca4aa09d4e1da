"""CUDA kernels of the library, compiled with g++ and run on the CPU.

:mod:`.emulator` compiles a kernel's CUDA source (the very string the
library hands to ``cupy.RawKernel``) together with ``cuda_emulation.h`` into
a shared library and launches it through ctypes; :mod:`.fake_cupy` is a
stand-in ``cupy`` module whose ``RawKernel`` does that, so the library's own
CuPy code path runs on the CPU.
"""
