// The one dispatch point of the CUDA backward: device -> dtype -> head dim -> features.
//
// As fwd_dispatch.cu: compiled for every architecture, kernel bodies only in the sm90a pass.
#include <cuda_runtime.h>

#include <cstdio>

#include "../flash_params.h"
#include "dispatch_checks.h"
#include "bwd_head_dims.h"
#include "bwd_run.h"

namespace flash {

namespace {

template <class Element, int kHeadDim>
FwdStatus run_features(const FlashBwdParams& p, cudaStream_t stream, char* why, int why_len) {
  const bool window = p.fwd.window_left >= 0 || p.fwd.window_right >= 0;
  const bool softcap = p.fwd.softcap > 0.f;
  if (window) {
    return softcap ? hopper::run_bwd<Element, kHeadDim, true, true>(p, stream, why, why_len)
                   : hopper::run_bwd<Element, kHeadDim, true, false>(p, stream, why, why_len);
  }
  return softcap ? hopper::run_bwd<Element, kHeadDim, false, true>(p, stream, why, why_len)
                 : hopper::run_bwd<Element, kHeadDim, false, false>(p, stream, why, why_len);
}

template <class Element>
FwdStatus run_head_dim(const FlashBwdParams& p, cudaStream_t stream, char* why, int why_len) {
#define FLASH_HOPPER_TRY_HEAD_DIM(D) \
  if (p.fwd.head_dim <= D) return run_features<Element, D>(p, stream, why, why_len);
  FLASH_HOPPER_FOR_EACH_BWD_HEAD_DIM(FLASH_HOPPER_TRY_HEAD_DIM)
#undef FLASH_HOPPER_TRY_HEAD_DIM
  std::snprintf(why, why_len, "head dim %d is above the largest compiled backward head dim",
                p.fwd.head_dim);
  return FwdStatus::kUnsupportedShape;
}

}  // namespace

FwdStatus hopper_bwd(const FlashBwdParams& p, void* stream, char* why, int why_len) {
  const FlashParams& f = p.fwd;
  const FwdStatus checked = hopper::check_device_and_shape(f, "backward", why, why_len);
  if (checked != FwdStatus::kOk) return checked;
  if (f.batch == 0 || f.heads_q == 0) return FwdStatus::kOk;
  if (f.rows_q == 0 || f.rows_k == 0) {
    std::snprintf(why, why_len, "q or k has no rows (the copy engine needs non-empty tensors)");
    return FwdStatus::kUnsupportedShape;
  }
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return f.is_bf16 ? run_head_dim<cutlass::bfloat16_t>(p, s, why, why_len)
                   : run_head_dim<cutlass::half_t>(p, s, why, why_len);
}

}  // namespace flash
