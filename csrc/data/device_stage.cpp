// CPU builds: no device stage. CUDA builds define make_cuda_stage in data/cuda/cuda_stage.cpp.
#include "data/device_stage.h"

#include <c10/util/Exception.h>

namespace fastddp::data {

#ifndef FASTDDP_WITH_CUDA
std::unique_ptr<DeviceStage> make_cuda_stage(const std::vector<at::Tensor>& sources,
                                             const PipelineOptions& options) {
  TORCH_CHECK(false, "PrefetchLoader: device ", options.device,
              " needs fastddp built with CUDA; rebuild with FASTDDP_WITH_CUDA=1, or use device=None");
}
#endif

}  // namespace fastddp::data
