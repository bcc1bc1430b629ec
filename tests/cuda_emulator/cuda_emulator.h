// Runs a CUDA kernel body on the CPU, for tests on machines without an NVIDIA GPU
// (tests/cuda_emulation.py builds a body as MLX's cuda_kernel wraps it around this).
//
// A work group's threads are CPU threads that run the body concurrently, so barriers and
// shared memory behave as on the device: __syncthreads is a barrier of the group,
// __shared__ arrays are static (one copy, shared by the group's threads; work groups run
// one after another, on the same threads), warp shuffles and ballots go through an
// exchange and a barrier of the warp (every lane of the warp must call them together, as
// the kernels here do), atomics are the compiler's __atomic builtins. C++17 and GCC or
// Clang suffice: std::barrier is used where the library has it, std::atomic_ref (which
// older libc++ lacks) is not. A thread that returns early must not be awaited by a later
// __syncthreads of its group (undefined on the device too). Not emulated: warp
// divergence, memory fences beyond the barrier's, fast-math intrinsics, timing.
#pragma once

#include <condition_variable>
#include <mutex>
#include <version>
#if __cplusplus >= 202002L && __has_include(<barrier>)
#include <barrier>
#endif
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __shared__ static
#define __restrict__
#define __align__(n) alignas(n)

struct camkv_dim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local camkv_dim3 threadIdx, blockIdx;
inline camkv_dim3 blockDim, gridDim;
// A reusable barrier of `count` threads: the library's where it has one (its waits are
// cheap), else one of a mutex and a condition variable (one generation per crossing).
#if defined(__cpp_lib_barrier)
using camkv_emulated_barrier = std::barrier<>;
#else
class camkv_emulated_barrier {
 public:
  explicit camkv_emulated_barrier(unsigned count) : count_(count) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    unsigned generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      lock.unlock();
      crossed_.notify_all();
    } else {
      crossed_.wait(lock, [&] { return generation != generation_; });
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable crossed_;
  unsigned count_, arrived_ = 0, generation_ = 0;
};
#endif

inline camkv_emulated_barrier* camkv_group_barrier = nullptr;
inline std::vector<uint64_t> camkv_exchange;
inline std::vector<std::unique_ptr<camkv_emulated_barrier>> camkv_warp_barriers;

inline void camkv_warp_sync() { camkv_warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }

inline void __syncthreads() { camkv_group_barrier->arrive_and_wait(); }

struct uint4 {
  unsigned x, y, z, w;
};
// Half-precision elements: their bits, converted to and from float as the device rounds
// (to nearest, ties to even).
struct camkv_bf16 {
  uint16_t bits;
  camkv_bf16() = default;
  camkv_bf16(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    bits = std::isnan(x) ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
  }
};
struct camkv_f16 {
  uint16_t bits;
  camkv_f16() = default;
  camkv_f16(float x) { bits = camkv_f16_bits(x); }
  operator float() const {
    uint32_t sign = uint32_t(bits & 0x8000u) << 16, exponent = (bits >> 10) & 0x1Fu, mantissa = bits & 0x3FFu;
    float magnitude = exponent == 0 ? std::ldexp(float(mantissa), -24)
                      : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                       : std::ldexp(float(mantissa | 0x400u), int(exponent) - 25);
    return sign ? -magnitude : magnitude;
  }
  static uint16_t camkv_f16_bits(float x) {
    uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
    float a = std::fabs(x);
    if (std::isnan(x)) return 0x7E00u;
    if (a >= 65520.0f) return sign | 0x7C00u;  // rounds to infinity
    if (a < std::ldexp(1.0f, -14)) return sign | uint16_t(std::nearbyint(std::ldexp(a, 24)));  // subnormal
    int exponent;
    float fraction = std::frexp(a, &exponent);  // a = fraction * 2^exponent, fraction in [0.5, 1)
    uint32_t mantissa = uint32_t(std::nearbyint(std::ldexp(fraction, 11)));  // 11 bits, ties to even
    if (mantissa == 2048u) { mantissa = 1024u; ++exponent; }
    return sign | uint16_t(((exponent + 14) << 10) | (mantissa & 0x3FFu));
  }
};
// A view's strides, as MLX passes them (indexed like an array).
using Strides = const int64_t*;

template <typename T>
inline T camkv_bit_cast_to(const void* from) {
  T to;
  std::memcpy(&to, from, sizeof(T));
  return to;
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  camkv_exchange[threadIdx.x] = bits;
  camkv_warp_sync();
  uint64_t other = camkv_exchange[threadIdx.x ^ unsigned(lane_mask)];
  camkv_warp_sync();
  return camkv_bit_cast_to<T>(&other);
}

inline unsigned __ballot_sync(unsigned, bool flag) {
  camkv_exchange[threadIdx.x] = flag ? 1 : 0;
  camkv_warp_sync();
  unsigned first = threadIdx.x / 32 * 32, ballot = 0;
  for (unsigned lane = 0; lane < 32 && first + lane < blockDim.x; ++lane) {
    if (camkv_exchange[first + lane]) ballot |= 1u << lane;
  }
  camkv_warp_sync();
  return ballot;
}

inline int __float_as_int(float x) { return camkv_bit_cast_to<int>(&x); }
inline unsigned __float_as_uint(float x) { return camkv_bit_cast_to<unsigned>(&x); }
inline float __int_as_float(int x) { return camkv_bit_cast_to<float>(&x); }
inline float __uint_as_float(unsigned x) { return camkv_bit_cast_to<float>(&x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// Rounded as written (the build does not contract a * b + c: -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
using std::fmaf;
using std::fmaxf;
using std::fminf;
using std::isfinite;
using std::isnan;
using std::min;
using std::max;

inline int atomicAdd(int* at, int value) { return __atomic_fetch_add(at, value, __ATOMIC_SEQ_CST); }
inline unsigned atomicAdd(unsigned* at, unsigned value) { return __atomic_fetch_add(at, value, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* at, float value) {  // a compare-and-swap loop on the float's bits
  unsigned* bits = reinterpret_cast<unsigned*>(at);
  unsigned seen = __atomic_load_n(bits, __ATOMIC_SEQ_CST), sum;
  do {
    sum = __float_as_uint(__uint_as_float(seen) + value);
  } while (!__atomic_compare_exchange_n(bits, &seen, sum, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  return __uint_as_float(seen);
}

template <typename T>
inline T camkv_atomic_extreme(T* at, T value, bool larger) {
  T seen = __atomic_load_n(at, __ATOMIC_SEQ_CST);
  while ((larger ? value > seen : value < seen) &&
         !__atomic_compare_exchange_n(at, &seen, value, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return seen;
}
inline int atomicMax(int* at, int value) { return camkv_atomic_extreme(at, value, true); }
inline unsigned atomicMin(unsigned* at, unsigned value) { return camkv_atomic_extreme(at, value, false); }

// Runs body() once per thread of `blocks` work groups of `threads` threads: the same
// `threads` CPU threads take each work group in turn, a barrier between two groups.
template <typename Body>
void camkv_launch(unsigned blocks, unsigned threads, Body body) {
  blockDim = {threads, 1, 1};
  gridDim = {blocks, 1, 1};
  camkv_exchange.assign(threads, 0);
  camkv_warp_barriers.clear();
  for (unsigned first = 0; first < threads; first += 32) {
    camkv_warp_barriers.push_back(std::make_unique<camkv_emulated_barrier>(std::min(32u, threads - first)));
  }
  camkv_emulated_barrier group(threads);
  camkv_group_barrier = &group;
  std::vector<std::thread> running;
  running.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    running.emplace_back([=, &group] {
      threadIdx = {t, 0, 0};
      for (unsigned b = 0; b < blocks; ++b) {
        blockIdx = {b, 0, 0};
        body();
        group.arrive_and_wait();  // the group's shared memory is the next group's after this
      }
    });
  }
  for (auto& thread : running) thread.join();
}
