// The arithmetic of the shared-memory all-reduce (shm_kernels.h).
#include "reducer/shm_kernels.h"

#include "common/cpu_kernels.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace fastddp::reducer {

namespace {

// Elements per block of the reduction and the copy. The squares of a slice are summed block by
// block, by its owner as it reduces the slice and by every other rank as it copies it: the same
// blocking on both sides gives the same bits on every rank.
constexpr int64_t kBlock = 2048;

// A sum rounded to T and back (a no-op where T is Acc).
template <typename T, typename Acc>
inline Acc rounded_to(Acc value) {
  if constexpr (std::is_same_v<T, Acc>) {
    return value;
  } else {
    return static_cast<Acc>(static_cast<T>(value));
  }
}

// dst[i] = sum over src of scale(src[k][i]), added in the order of src, and the same values
// into `copy` when it is not null. `scale` maps a T to Acc: each rank's value is scaled (and
// rounded to T) before the sum, as torch DDP averages each gradient before its all-reduce, so at
// world size 2 the result has torch's bits also where the sum itself would overflow or the
// halves are subnormal. Each addition rounds to T, as gloo's does (a bf16/fp16 pair is added in
// fp32 and rounded), so with src in gloo's order (ring_order.h) the result is gloo's at every
// world size. dst may be one of the sources: each block is read completely before it is
// written. Returns the sum of squares of the written values when `squares` (each block is
// squared, and copied, while it is in L1).
template <typename T, typename Acc, class Scale>
FASTDDP_CLONED_HELPER double sum_slices(T* dst, T* copy, const std::vector<const T*>& src, int64_t n, Scale scale,
                                        bool squares) {
  Acc acc[kBlock];
  double sumsq = 0.0;
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    const T* s0 = src[0] + base;
    for (int64_t i = 0; i < m; ++i) acc[i] = scale(s0[i]);
    for (size_t k = 1; k < src.size(); ++k) {
      const T* s = src[k] + base;
      for (int64_t i = 0; i < m; ++i) acc[i] = rounded_to<T>(acc[i] + scale(s[i]));
    }
    T* d = dst + base;
    for (int64_t i = 0; i < m; ++i) d[i] = static_cast<T>(acc[i]);
    if (copy) std::memcpy(copy + base, d, static_cast<size_t>(m) * sizeof(T));
    if (squares) sumsq += sum_squares(d, m);
  }
  return sumsq;
}

// The scaling as torch applies it to a tensor of T (at::mul / at::div with a scalar compute in
// Acc and round to T): a no-op rounding for fp32/fp64, a rounding for bf16/fp16.
template <typename T, typename Acc>
FASTDDP_CLONED_HELPER double sum_bytes(char* dst, char* copy, const std::vector<const char*>& src, int64_t n,
                                       Scaling scaling, bool squares) {
  std::vector<const T*> typed;
  typed.reserve(src.size());
  for (const char* s : src) typed.push_back(reinterpret_cast<const T*>(s));
  T* out = reinterpret_cast<T*>(dst);
  T* again = reinterpret_cast<T*>(copy);
  const Acc f = static_cast<Acc>(scaling.factor);
  if (scaling.identity()) {
    return sum_slices<T, Acc>(out, again, typed, n, [](T v) { return static_cast<Acc>(v); }, squares);
  }
  if (scaling.divide) {
    return sum_slices<T, Acc>(out, again, typed, n,
                              [f](T v) { return static_cast<Acc>(static_cast<T>(static_cast<Acc>(v) / f)); }, squares);
  }
  return sum_slices<T, Acc>(out, again, typed, n,
                            [f](T v) { return static_cast<Acc>(static_cast<T>(static_cast<Acc>(v) * f)); }, squares);
}

// memcpy of `n` elements, returning the sum of squares of the copied values when `squares`
// (block by block, so each block is squared from L1 right after it was copied).
template <typename T>
FASTDDP_CLONED_HELPER double copy_elements(char* dst, const char* src, int64_t n, bool squares) {
  if (!squares) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(T));
    return 0.0;
  }
  double sumsq = 0.0;
  for (int64_t base = 0; base < n; base += kBlock) {
    const int64_t m = std::min(kBlock, n - base);
    T* d = reinterpret_cast<T*>(dst) + base;
    std::memcpy(d, reinterpret_cast<const T*>(src) + base, static_cast<size_t>(m) * sizeof(T));
    sumsq += sum_squares(d, m);
  }
  return sumsq;
}

}  // namespace

// The reduction of one slice per dtype, each compiled for AVX2 + FMA and the baseline.
FASTDDP_CPU_CLONES double reduce_slice(at::ScalarType dtype, char* dst, char* copy, const std::vector<const char*>& src,
                                       int64_t n, Scaling scale, bool squares) {
  switch (dtype) {
    case at::kFloat: return sum_bytes<float, float>(dst, copy, src, n, scale, squares);
    case at::kDouble: return sum_bytes<double, double>(dst, copy, src, n, scale, squares);
    case at::kBFloat16: return sum_bytes<c10::BFloat16, float>(dst, copy, src, n, scale, squares);
    case at::kHalf: return sum_bytes<c10::Half, float>(dst, copy, src, n, scale, squares);
    default: TORCH_CHECK(false, "DDPWrapper: shared-memory all-reduce does not support ", dtype);
  }
}

double copy_slice(at::ScalarType dtype, char* dst, const char* src, int64_t n, bool squares) {
  switch (dtype) {
    case at::kFloat: return copy_elements<float>(dst, src, n, squares);
    case at::kDouble: return copy_elements<double>(dst, src, n, squares);
    case at::kBFloat16: return copy_elements<c10::BFloat16>(dst, src, n, squares);
    case at::kHalf: return copy_elements<c10::Half>(dst, src, n, squares);
    default: TORCH_CHECK(false, "DDPWrapper: shared-memory all-reduce does not support ", dtype);
  }
}

}  // namespace fastddp::reducer
