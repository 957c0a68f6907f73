// Host side of one backward instantiation: the preprocess, the main kernel and the dQ cast, in
// that order on one stream. Tensor maps as in fwd_launch.h (Q and dO boxes of kBlockM rows, K
// and V boxes of kBlockN rows).
#pragma once

// fwd_launch.h first: it includes <cudaTypedefs.h> before the CuTe headers
#include "fwd_launch.h"
#include "bwd_kernel.h"
#include "bwd_run.h"

namespace flash::hopper {

template <class Traits>
FwdStatus launch_bwd(const FlashBwdParams& p, cudaStream_t stream, char* why, int why_len) {
  using Element = typename Traits::Element;
  const FlashParams& f = p.fwd;
  static_assert(kWorkspaceAlign % Traits::kBlockM == 0 && Traits::kBlockM % kWorkspaceRows == 0,
                "a step covers whole workspace blocks and never crosses a sequence's padding");
  constexpr int kDqCols = Traits::kDqCols;
  static_assert(Traits::kDqRows == kWorkspaceRows &&
                    (kDqCols == Traits::kHeadDim || 2 * kDqCols == Traits::kHeadDim),
                "the cast kernel's fragment order: 64 rows of a consumer, all or half the columns");
  if (p.dq_acc_cols != Traits::kHeadDim) {
    std::snprintf(why, why_len, "dq_acc has %d columns; head dim %d runs on the %d-column kernel",
                  p.dq_acc_cols, f.head_dim, Traits::kHeadDim);
    return FwdStatus::kUnsupportedShape;
  }
  const int group = f.heads_kv > 0 ? f.heads_q / f.heads_kv : 0;
  if (p.group_splits < 1 || group % p.group_splits != 0 ||
      (p.group_splits > 1 && p.dkv_partial == nullptr)) {
    std::snprintf(why, why_len, "group_splits %d must divide Hq / Hkv = %d (and needs dkv_partial)",
                  p.group_splits, group);
    return FwdStatus::kUnsupportedShape;
  }
  BwdArgs args;
  args.p = p;
  const TensorView4d q = row_view(f, true, f.q, f.q_row_stride, f.q_head_stride, f.q_batch_stride);
  const TensorView4d dout = row_view(f, true, p.dout, p.dout_row_stride, p.dout_head_stride,
                                     p.dout_batch_stride);
  const TensorView4d k = row_view(f, false, f.k, f.k_row_stride, f.k_head_stride, f.k_batch_stride);
  const TensorView4d v = row_view(f, false, f.v, f.v_row_stride, f.v_head_stride, f.v_batch_stride);
  if (!make_tensor_map<Traits>(&args.tma_q, q, Traits::kBlockM, "q", why, why_len) ||
      !make_tensor_map<Traits>(&args.tma_do, dout, Traits::kBlockM, "dout", why, why_len) ||
      !make_tensor_map<Traits>(&args.tma_k, k, Traits::kBlockN, "k", why, why_len) ||
      !make_tensor_map<Traits>(&args.tma_v, v, Traits::kBlockN, "v", why, why_len)) {
    return FwdStatus::kMisaligned;
  }
  score_scales<Traits::kSoftcap>(f, args.scale_log2, args.scale_over_cap);
  args.grad_scale = f.scale;
  const int key_blocks = (f.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // [Note] Backward step order
  args.block_major = Traits::kWindow && (Traits::kHeadDim == 128 || Traits::kHeadDim == 256) &&
                     f.window_right == 0 && f.window_left < 0 && p.dq_semaphore == nullptr &&
                     p.group_splits == 1 && key_blocks <= kBlockMajorKeyBlocks;

  // [Note] dK and dV through shared memory
  args.dkv_staged = Traits::kStagedDkv && p.dkv_partial == nullptr &&
                    vector_ok(p.dk, p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride,
                              f.head_dim, 8, sizeof(Element)) &&
                    vector_ok(p.dv, p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride,
                              f.head_dim, 8, sizeof(Element));

  // the preprocess also writes the padding rows up to the alignment; the cast has none to write
  const dim3 rows_grid(workspace_rows_of(f.seqlen_q) / kWorkspaceRows, f.heads_q, f.batch);
  const bool has_rows = rows_grid.x > 0;
  // [Note] Backward preprocess and cast: wide accesses where the tensors allow them
  const bool vec_in = vector_ok(f.out, f.out_row_stride, f.out_head_stride, f.out_batch_stride,
                                f.head_dim, 8, sizeof(Element)) &&
                      vector_ok(p.dout, p.dout_row_stride, p.dout_head_stride,
                                p.dout_batch_stride, f.head_dim, 8, sizeof(Element));
  const bool vec_dq = vector_ok(p.dq, p.dq_row_stride, p.dq_head_stride, p.dq_batch_stride,
                                f.head_dim, 4, sizeof(Element));
  constexpr int D = Traits::kHeadDim;
  if (has_rows) bwd_prep_kernel<Element, D><<<rows_grid, 256, 0, stream>>>(p, vec_in);
  cudaError_t err = cudaGetLastError();
  auto kernel = bwd_kernel<Traits>;
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Traits::kSmemBytes);
  }
  if (err == cudaSuccess && f.seqlen_k > 0) {
    // [Note] Backward group split: group_splits CTAs per (key block, kv head, batch)
    const dim3 grid(key_blocks, f.heads_kv * p.group_splits, f.batch);
    kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess && has_rows) {
    bwd_dq_cast_kernel<Element, D><<<rows_grid, 128, 0, stream>>>(p, f.scale, vec_dq);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    std::snprintf(why, why_len, "hopper backward launch failed: %s", cudaGetErrorString(err));
    return FwdStatus::kLaunchFailed;
  }
  return FwdStatus::kOk;
}

template <class Element, int kHeadDim, bool kWindow, bool kSoftcap>
FwdStatus run_bwd(const FlashBwdParams& p, cudaStream_t stream, char* why, int why_len) {
  return launch_bwd<BwdTraits<Element, kHeadDim, kWindow, kSoftcap>>(p, stream, why, why_len);
}

}  // namespace flash::hopper
