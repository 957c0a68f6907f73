// The instantiated entry points, one per (dtype, head dim, window, softcap). Declared here,
// defined in fwd_launch.h, explicitly instantiated in instantiations/*.cu (generated), chosen in
// fwd_dispatch.cu. Light on purpose: the dispatcher does not compile any kernel.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "../flash_params.h"

namespace flash::hopper {

template <class Element, int kHeadDim, bool kWindow, bool kSoftcap>
FwdStatus run_fwd(const FlashParams& p, cudaStream_t stream, char* why, int why_len);

}  // namespace flash::hopper
