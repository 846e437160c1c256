// The arithmetic of the shared-memory all-reduce (shm_allreduce.h): each rank sums its slice of
// a chunk from every rank's copy, then copies the peers' reduced slices back. Both can sum the
// squares of what they write (the AMP statistics, ShmWork::sum_of_squares) block by block, the
// same blocking on every rank, so every rank arrives at the same bits. Compiled for AVX2 + FMA
// and the baseline (common/cpu_kernels.h).
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

namespace fastddp::reducer {

// How each rank's value is averaged before the sum, in the bucket's dtype: multiplied by
// `factor` (1 / world size: torch DDP's reducer) or divided by it (the world size: torch's
// allreduce_hook, tensor.div_). The two round differently where 1 / world size is inexact.
struct Scaling {
  double factor = 1.0;
  bool divide = false;
  bool identity() const { return factor == 1.0; }
};

// dst[i] = sum over k of src[k][i] scaled by `scale` for n elements of `dtype` (float32, float64, bfloat16
// or float16; the half types add in float and round each sum), in the order of src, also
// written to `copy` unless it is null. dst may be one of the sources. Returns the sum of squares of the written
// values when `squares`, else 0.
double reduce_slice(at::ScalarType dtype, char* dst, char* copy, const std::vector<const char*>& src, int64_t n,
                    Scaling scale, bool squares);

// memcpy of n elements of `dtype`; returns the sum of squares of the copied values when
// `squares`, else 0.
double copy_slice(at::ScalarType dtype, char* dst, const char* src, int64_t n, bool squares);

}  // namespace fastddp::reducer
