#include "common/cpu_kernels.h"

namespace fastddp {

FASTDDP_CPU_CLONES double sum_squares(const float* p, int64_t n) { return detail::sum_squares(p, n); }
FASTDDP_CPU_CLONES double sum_squares(const double* p, int64_t n) { return detail::sum_squares(p, n); }
FASTDDP_CPU_CLONES double sum_squares(const c10::Half* p, int64_t n) { return detail::sum_squares(p, n); }
FASTDDP_CPU_CLONES double sum_squares(const c10::BFloat16* p, int64_t n) { return detail::sum_squares(p, n); }

FASTDDP_CPU_CLONES void scale_in_place(float* p, int64_t n, float c) { detail::scale_in_place(p, n, c); }
FASTDDP_CPU_CLONES void scale_in_place(double* p, int64_t n, float c) {
  detail::scale_in_place(p, n, static_cast<double>(c));
}
FASTDDP_CPU_CLONES void scale_in_place(c10::Half* p, int64_t n, float c) { detail::scale_in_place(p, n, c); }
FASTDDP_CPU_CLONES void scale_in_place(c10::BFloat16* p, int64_t n, float c) { detail::scale_in_place(p, n, c); }

}  // namespace fastddp
