// Device-side row gather for PrefetchPipeline's direct path (CUDA builds only): the GPU reads
// the selected rows straight out of page-locked host memory (zero-copy over PCIe/NVLink-C2C)
// into a device buffer, so no CPU thread touches the bytes and no staging copy is made.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace fastddp::data::cuda {

// Host address of page-locked memory -> the address the device reads it through, or nullptr
// when `host` is not page-locked memory mapped into the device's address space.
const void* mapped_device_pointer(const void* host);

// dst[i, :] = src[idx[i], :] for i < n, rows of row_bytes bytes. src is a device-visible
// address (mapped pinned host memory or device memory), idx and dst are device memory.
// Launch errors are checked (C10_CUDA_KERNEL_LAUNCH_CHECK).
void gather_rows(const void* src, const int64_t* idx, int64_t n, size_t row_bytes, void* dst,
                 cudaStream_t stream);

}  // namespace fastddp::data::cuda
