// The CPU inner loops of the AMP kernels and the shared-memory all-reduce. Each is compiled
// twice -- for x86-64-v3 (AVX2 + FMA) and for the baseline -- and the dynamic loader picks one
// when the module loads (GCC function multi-versioning, FASTDDP_CPU_CLONES), so one build runs
// on any x86-64 CPU and uses 256-bit vectors and FMA where it has them. Elsewhere, and in
// sanitizer builds (FASTDDP_NO_CPU_CLONES), there is one baseline version.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(FASTDDP_NO_CPU_CLONES)
#define FASTDDP_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FASTDDP_CPU_CLONES
#endif

// A helper that a FASTDDP_CPU_CLONES function calls: inlined into each clone, so that its loops
// are compiled for that clone's target. A helper the compiler chooses not to inline (a large
// loop nest) is one baseline copy that both clones call.
#if defined(__GNUC__)
#define FASTDDP_CLONED_HELPER __attribute__((always_inline)) inline
#else
#define FASTDDP_CLONED_HELPER inline
#endif

namespace fastddp {

// Sum of squares of p[0..n), accumulated in double. NaN exactly when an element is inf or NaN
// (each term adds v - v, which is 0 for a finite v); +inf only when finite squares overflow a
// double (float64 elements beyond 1.3e154). The AMP check reads NaN as an inf/NaN gradient, as
// torch's per-element check does, and takes an overflow as a finite gradient of infinite norm.
double sum_squares(const float* p, int64_t n);
double sum_squares(const double* p, int64_t n);
double sum_squares(const c10::Half* p, int64_t n);
double sum_squares(const c10::BFloat16* p, int64_t n);

// p[i] *= c, computed in float (double for double tensors) and rounded once.
void scale_in_place(float* p, int64_t n, float c);
void scale_in_place(double* p, int64_t n, float c);
void scale_in_place(c10::Half* p, int64_t n, float c);
void scale_in_place(c10::BFloat16* p, int64_t n, float c);

namespace detail {

template <typename T>
inline double sum_squares(const T* p, int64_t n) {
  // Sixteen independent accumulators: the loop is bound by the latency of the additions, not
  // by their width, so it needs several vector dependency chains in flight (four of 4 doubles
  // with AVX2, eight of 2 with SSE2); one accumulator would be a single serial chain, as
  // floating-point addition may not be reordered.
  constexpr int kLanes = 16;
  double acc[kLanes] = {};
  int64_t k = 0;
  // The square of a float32/float16/bfloat16 value cannot overflow a double, so an infinite sum
  // means an inf element and becomes NaN once at the end; only float64 squares can overflow, so
  // only float64 adds v - v (0, or NaN for inf/NaN) per element.
  constexpr bool kWide = std::is_same_v<T, double>;
  auto term = [](double v) { return kWide ? v * v + (v - v) : v * v; };
  for (; k + kLanes <= n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += term(static_cast<double>(p[k + j]));
  }
  for (; k < n; ++k) acc[0] += term(static_cast<double>(p[k]));
  double total = 0.0;
  for (double a : acc) total += a;
  return !kWide && std::isinf(total) ? std::numeric_limits<double>::quiet_NaN() : total;
}

template <typename T, typename Op>
inline void scale_in_place(T* p, int64_t n, Op c) {
  for (int64_t k = 0; k < n; ++k) p[k] = static_cast<T>(static_cast<Op>(p[k]) * c);
}

}  // namespace detail
}  // namespace fastddp
