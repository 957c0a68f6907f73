// The checks both dispatchers (fwd_dispatch.cu, bwd_dispatch.cu) make before choosing a kernel:
// an sm90 device, a head dim the kernels can take, a GQA shape, the grid limits.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>

#include "../flash_params.h"

namespace flash::hopper {

// kOk when `what` ("forward" / "backward") may run on this device and shape; else the status
// and a reason in `why`.
inline FwdStatus check_device_and_shape(const FlashParams& p, const char* what, char* why,
                                        int why_len) {
  int device = 0;
  int major = 0;
  int minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    std::snprintf(why, why_len, "could not query the current CUDA device");
    return FwdStatus::kNoKernelForArch;
  }
  if (major != 9 || minor != 0) {
    std::snprintf(why, why_len, "the sm90 %s needs compute capability 9.0, got %d.%d", what,
                  major, minor);
    return FwdStatus::kNoKernelForArch;
  }
  if (p.head_dim <= 0 || p.head_dim % 8 != 0) {
    std::snprintf(why, why_len, "head dim %d is not a positive multiple of 8", p.head_dim);
    return FwdStatus::kUnsupportedShape;
  }
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) {
    std::snprintf(why, why_len, "query heads %d are not a multiple of kv heads %d", p.heads_q,
                  p.heads_kv);
    return FwdStatus::kUnsupportedShape;
  }
  if (p.batch > 65535 || p.heads_q > 65535) {
    std::snprintf(why, why_len, "batch %d or heads %d exceed the grid limit 65535", p.batch,
                  p.heads_q);
    return FwdStatus::kUnsupportedShape;
  }
  return FwdStatus::kOk;
}

}  // namespace flash::hopper
