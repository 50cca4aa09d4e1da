// The CUDA execution model on the CPU, for testing kernel source written for
// NVRTC (no CUDA headers) with g++.
//
// * One std::thread per CUDA thread of a block; the blocks of the grid run
//   one after another (or only a chosen subset of them: a sparse grid), so a
//   __shared__ variable (a static here) belongs to one block at a time.
// * __syncthreads() is a std::barrier over the block's threads; a thread
//   that returns leaves the barrier (arrive_and_drop), as exited threads do
//   on Volta and later.
// * threadIdx/blockIdx are thread_local, blockDim/gridDim global.
// * With CUDA_EMULATION_FTZ defined, `float` in the kernel source is
//   ftz_float, which behaves as single precision does under CuPy's
//   -ftz=true: every single-precision instruction (arithmetic, comparison,
//   abs, min/max, logf, ..., and the float <-> double conversions
//   cvt.ftz.f64.f32 / cvt.rn.ftz.f32.f64) flushes subnormal inputs and
//   results to zero of the same sign. Loads, stores and bit casts
//   (__int_as_float) move the bits unchanged, and double precision is never
//   flushed, as in PTX.
//
// The including file provides the kernel and compiles with -std=c++20
// -pthread; emulated_launch() at the end runs the kernel named KERNEL_NAME.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
    unsigned int x, y, z;
};

inline thread_local dim3 threadIdx{0, 0, 0};
inline thread_local dim3 blockIdx{0, 0, 0};
inline dim3 blockDim{1, 1, 1};
inline dim3 gridDim{1, 1, 1};

namespace cuda_emulation {
inline std::optional<std::barrier<>> block_barrier;
}  // namespace cuda_emulation

inline void __syncthreads() {
    cuda_emulation::block_barrier->arrive_and_wait();
}

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static

inline long long __double_as_longlong(double d) {
    long long bits;
    std::memcpy(&bits, &d, sizeof bits);
    return bits;
}

inline double __longlong_as_double(long long bits) {
    double d;
    std::memcpy(&d, &bits, sizeof d);
    return d;
}

#ifdef CUDA_EMULATION_FTZ
namespace cuda_emulation {

inline float flush(float f) {
    return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f;
}

// A float register under -ftz=true. `raw` holds the bits as loaded or moved;
// every instruction that reads the value as a number sees flush(raw).
struct ftz_float {
    float raw;
    ftz_float() = default;
    // A literal or a move: no instruction, no flush.
    constexpr ftz_float(float f) : raw(f) {}
    // cvt.rn.ftz.f32.f64: rounds, then flushes a subnormal result.
    ftz_float(double d) : raw(flush(static_cast<float>(d))) {}
    // cvt.rn.f32.{s,u}{32,64}: never subnormal.
    template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
    ftz_float(I i) : raw(static_cast<float>(i)) {}
    // cvt.ftz.f64.f32: flushes a subnormal input.
    explicit operator double() const { return flush(raw); }
    template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
    explicit operator I() const { return static_cast<I>(flush(raw)); }
    static ftz_float result(float f) { return ftz_float(flush(f)); }
    ftz_float operator-() const { return result(-flush(raw)); }
    ftz_float operator+() const { return result(flush(raw)); }
};

template <class T>
inline constexpr bool is_ftz_v = std::is_same_v<std::decay_t<T>, ftz_float>;
template <class T>
inline constexpr bool is_f32_operand_v =
    is_ftz_v<T> || std::is_same_v<std::decay_t<T>, float>
    || std::is_integral_v<std::decay_t<T>>;
// An operation in single precision: both operands float-like, one ftz.
template <class A, class B>
inline constexpr bool single_v =
    (is_ftz_v<A> || is_ftz_v<B>) && is_f32_operand_v<A> && is_f32_operand_v<B>;
// An ftz_float meeting a double is widened (cvt.ftz.f64.f32) first.
template <class A, class B>
inline constexpr bool widened_v =
    (is_ftz_v<A> && std::is_same_v<std::decay_t<B>, double>)
    || (is_ftz_v<B> && std::is_same_v<std::decay_t<A>, double>);

inline float operand(ftz_float f) { return flush(f.raw); }
inline float operand(float f) { return flush(f); }
template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
inline float operand(I i) { return static_cast<float>(i); }
inline double wide(ftz_float f) { return static_cast<double>(f); }
inline double wide(double d) { return d; }

#define CUDA_EMULATION_ARITHMETIC(op)                                        \
    template <class A, class B, std::enable_if_t<single_v<A, B>, int> = 0>   \
    inline ftz_float operator op(A a, B b) {                                 \
        return ftz_float::result(operand(a) op operand(b));                  \
    }                                                                        \
    template <class A, class B, std::enable_if_t<widened_v<A, B>, int> = 0>  \
    inline double operator op(A a, B b) {                                    \
        return wide(a) op wide(b);                                           \
    }
CUDA_EMULATION_ARITHMETIC(+)
CUDA_EMULATION_ARITHMETIC(-)
CUDA_EMULATION_ARITHMETIC(*)
CUDA_EMULATION_ARITHMETIC(/)
#undef CUDA_EMULATION_ARITHMETIC

#define CUDA_EMULATION_COMPARISON(op)                                        \
    template <class A, class B, std::enable_if_t<single_v<A, B>, int> = 0>   \
    inline bool operator op(A a, B b) {                                      \
        return operand(a) op operand(b);                                     \
    }                                                                        \
    template <class A, class B, std::enable_if_t<widened_v<A, B>, int> = 0>  \
    inline bool operator op(A a, B b) {                                      \
        return wide(a) op wide(b);                                           \
    }
CUDA_EMULATION_COMPARISON(<)
CUDA_EMULATION_COMPARISON(>)
CUDA_EMULATION_COMPARISON(<=)
CUDA_EMULATION_COMPARISON(>=)
CUDA_EMULATION_COMPARISON(==)
CUDA_EMULATION_COMPARISON(!=)
#undef CUDA_EMULATION_COMPARISON

#define CUDA_EMULATION_COMPOUND(op)                                          \
    template <class B, std::enable_if_t<is_f32_operand_v<B>, int> = 0>       \
    inline ftz_float& operator op##=(ftz_float& a, B b) {                    \
        return a = a op b;                                                   \
    }
CUDA_EMULATION_COMPOUND(+)
CUDA_EMULATION_COMPOUND(-)
CUDA_EMULATION_COMPOUND(*)
CUDA_EMULATION_COMPOUND(/)
#undef CUDA_EMULATION_COMPOUND

}  // namespace cuda_emulation

using cuda_emulation::ftz_float;

// The single-precision math library under -ftz=true (libdevice's __nv_*f
// with __CUDA_FTZ): subnormal arguments read as zero (logf -> -inf),
// subnormal results become zero.
#define CUDA_EMULATION_UNARY(name, host)                                     \
    inline ftz_float name(ftz_float x) {                                     \
        return ftz_float::result(host(cuda_emulation::operand(x)));          \
    }
CUDA_EMULATION_UNARY(logf, std::log)
CUDA_EMULATION_UNARY(log2f, std::log2)
CUDA_EMULATION_UNARY(expf, std::exp)
CUDA_EMULATION_UNARY(exp2f, std::exp2)
CUDA_EMULATION_UNARY(sqrtf, std::sqrt)
CUDA_EMULATION_UNARY(fabsf, std::fabs)
CUDA_EMULATION_UNARY(floorf, std::floor)
CUDA_EMULATION_UNARY(rintf, std::rint)
CUDA_EMULATION_UNARY(log, std::log)
CUDA_EMULATION_UNARY(exp, std::exp)
CUDA_EMULATION_UNARY(sqrt, std::sqrt)
CUDA_EMULATION_UNARY(fabs, std::fabs)
#undef CUDA_EMULATION_UNARY

#define CUDA_EMULATION_BINARY(name, host)                                    \
    inline ftz_float name(ftz_float x, ftz_float y) {                        \
        return ftz_float::result(host(cuda_emulation::operand(x),            \
                                      cuda_emulation::operand(y)));          \
    }
CUDA_EMULATION_BINARY(fmaxf, std::fmax)
CUDA_EMULATION_BINARY(fminf, std::fmin)
CUDA_EMULATION_BINARY(fmax, std::fmax)
CUDA_EMULATION_BINARY(fmin, std::fmin)
CUDA_EMULATION_BINARY(copysignf, std::copysign)
#undef CUDA_EMULATION_BINARY

#define float ftz_float
#endif  // CUDA_EMULATION_FTZ

// Bit casts move the bits: no flush (mov.b32).
inline float __int_as_float(int bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

inline int __float_as_int(float f) {
    int bits;
    std::memcpy(&bits, &f, sizeof bits);
    return bits;
}

namespace cuda_emulation {

template <class... A, std::size_t... I>
void invoke(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(
        args[I])...);
}

// Runs the blocks listed in `blocks` (linear indices into the grid), in
// that order, each with one std::thread per CUDA thread; `args[i]` points
// at the value of the kernel's i-th parameter.
template <class... A>
void launch(void (*kernel)(A...), dim3 grid, dim3 block, void** args,
            const long long* blocks, long long n_blocks) {
    gridDim = grid;
    blockDim = block;
    const unsigned int n_threads = block.x * block.y * block.z;
    auto next_block = [n_threads]() noexcept {
        block_barrier.emplace(n_threads);
    };
    next_block();
    std::barrier end_of_block(n_threads, next_block);
    std::vector<std::thread> threads;
    threads.reserve(n_threads);
    for (unsigned int t = 0; t < n_threads; ++t) {
        threads.emplace_back([&, t] {
            threadIdx = {t % block.x, (t / block.x) % block.y,
                         t / (block.x * block.y)};
            for (long long k = 0; k < n_blocks; ++k) {
                const long long b = blocks[k];
                blockIdx = {
                    static_cast<unsigned int>(b % grid.x),
                    static_cast<unsigned int>((b / grid.x) % grid.y),
                    static_cast<unsigned int>(b / (grid.x * (long long)grid.y))};
                invoke(kernel, args, std::index_sequence_for<A...>{});
                block_barrier->arrive_and_drop();
                end_of_block.arrive_and_wait();
            }
        });
    }
    for (std::thread& thread : threads) {
        thread.join();
    }
}

}  // namespace cuda_emulation
