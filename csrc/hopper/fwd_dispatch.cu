// The one dispatch point of the CUDA forward: device -> dtype -> head dim -> features.
//
// Compiled for every architecture in the build; only the sm90a pass holds kernel bodies
// (fwd_kernel.h), so on other devices this reports kNoKernelForArch and the package falls back.
#include <cuda_runtime.h>

#include <cstdio>

#include "../flash_params.h"
#include "dispatch_checks.h"
#include "fwd_run.h"
#include "head_dims.h"

namespace flash {

namespace {

template <class Element, int kHeadDim>
FwdStatus run_features(const FlashParams& p, cudaStream_t stream, char* why, int why_len) {
  const bool window = p.window_left >= 0 || p.window_right >= 0;
  const bool softcap = p.softcap > 0.f;
  if (window) {
    return softcap ? hopper::run_fwd<Element, kHeadDim, true, true>(p, stream, why, why_len)
                   : hopper::run_fwd<Element, kHeadDim, true, false>(p, stream, why, why_len);
  }
  return softcap ? hopper::run_fwd<Element, kHeadDim, false, true>(p, stream, why, why_len)
                 : hopper::run_fwd<Element, kHeadDim, false, false>(p, stream, why, why_len);
}

template <class Element>
FwdStatus run_head_dim(const FlashParams& p, cudaStream_t stream, char* why, int why_len) {
#define FLASH_HOPPER_TRY_HEAD_DIM(D) \
  if (p.head_dim <= D) return run_features<Element, D>(p, stream, why, why_len);
  FLASH_HOPPER_FOR_EACH_HEAD_DIM(FLASH_HOPPER_TRY_HEAD_DIM)
#undef FLASH_HOPPER_TRY_HEAD_DIM
  std::snprintf(why, why_len, "head dim %d is above the largest compiled head dim", p.head_dim);
  return FwdStatus::kUnsupportedShape;
}

}  // namespace

FwdStatus hopper_fwd(const FlashParams& p, void* stream, char* why, int why_len) {
  const FwdStatus checked = hopper::check_device_and_shape(p, "forward", why, why_len);
  if (checked != FwdStatus::kOk) return checked;
  if (p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0 || p.rows_q == 0) return FwdStatus::kOk;
  if (p.rows_k == 0) {
    std::snprintf(why, why_len, "k and v have no rows (the copy engine needs a non-empty tensor)");
    return FwdStatus::kUnsupportedShape;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return p.is_bf16 ? run_head_dim<cutlass::bfloat16_t>(p, s, why, why_len)
                   : run_head_dim<cutlass::half_t>(p, s, why, why_len);
}

}  // namespace flash
