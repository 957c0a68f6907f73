// The instantiated backward entry points, one per (dtype, head dim, window, softcap). Declared
// here, defined in bwd_launch.h, explicitly instantiated in instantiations/bwd_*.cu (generated),
// chosen in bwd_dispatch.cu.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "../flash_params.h"

namespace flash::hopper {

template <class Element, int kHeadDim, bool kWindow, bool kSoftcap>
FwdStatus run_bwd(const FlashBwdParams& p, cudaStream_t stream, char* why, int why_len);

}  // namespace flash::hopper
