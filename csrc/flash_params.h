// FlashParams: the one record handed from the torch binding to the CUDA kernels.
//
// Filled once in torch-ext/torch_binding.cpp, read by every launcher and kernel. Plain C++ (no CUDA
// or torch headers) so the binding, the host launchers and the device code share it.
//
// Glossary
//   B, Hq, Hkv   batch size, query heads, key/value heads (GQA: query head h reads kv head
//                h / (Hq / Hkv); K and V are never expanded)
//   Sq, Sk       longest query / key sequence (batched: the sizes; varlen: the bounds)
//   rows         the token axis of a tensor: Sq or Sk per batch (batched), Tq or Tk (varlen)
//   d            the head dimension of the inputs (multiple of 8, at most 256)
//   window       bottom-right aligned band: key j is visible from query i iff
//                (left < 0 or j >= i + Sk - Sq - left) and (right < 0 or j <= i + Sk - Sq + right);
//                causal is window_right == 0
#pragma once

#include <cstdint>

namespace flash {

struct FlashParams {
  // Inputs; element strides (the last dimension has stride 1). In varlen mode the batch strides
  // are 0 and rows are found through cu_seqlens.
  const void* q;
  const void* k;
  const void* v;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;

  // Outputs: out like q, lse float32 (B, Hq, Sq) or (Hq, Tq).
  void* out;
  float* lse;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  int64_t lse_batch_stride, lse_head_stride;

  // Varlen (both null in batched mode) and sinks (null when absent): device pointers.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  const float* s_aux;  // (Hq,) one logit per query head

  int batch, heads_q, heads_kv, head_dim;
  int seqlen_q, seqlen_k;  // Sq / Sk (batched sizes, or varlen maxima)
  int rows_q, rows_k;      // extent of the token axis: Sq / Sk batched, Tq / Tk varlen

  float scale;   // softmax scale
  float softcap; // 0 = off
  int window_left, window_right;  // -1 = unbounded

  bool is_bf16;  // else fp16
};

// Outcome of a launch request. Anything but kOk means nothing was launched.
enum class FwdStatus : int {
  kOk = 0,
  kNoKernelForArch,   // not an sm90 device, or this binary was built without sm90a
  kUnsupportedShape,  // head dim / dtype outside the compiled set
  kMisaligned,        // a base pointer or stride violates the 16-byte rule of the copy engine
  kLaunchFailed,      // the CUDA runtime refused (the message says why)
};

// The backward's record: the forward's fields (q, k, v, out, lse and the shape) plus the
// gradients and the fp32 workspaces.
//
// [Note] Backward workspaces
// lse2, delta and dq_acc are indexed by a padded row: every sequence starts on a multiple of
// kBwdWorkspaceAlign (128, the largest kBlockM of a main kernel) rows and owns whole 128-row
// blocks, so one step of the main kernel (64 or 128 query rows) reads one aligned run of lse2
// and of delta and never reaches another sequence's rows. Batched: row (b * Hq + h) * ws_rows + i
// with ws_rows = Sq rounded up to 128. Varlen: row h * ws_rows + start_b + i with
// start_b = (cu_seqlens_q[b] + 128 * b) / 128 * 128 and ws_rows = Tq + 128 * B rounded up to 128.
// lse2 = lse * log2(e) (+inf where lse is -inf and on padding rows, so their P is 0); delta =
// rowsum(dO * O) (0 on padding rows); dq_acc (ws rows x the compiled head dim, zeroed by the
// preprocess, so the caller need not) sums dS K over all key blocks, each block of
// kBwdWorkspaceBlock (64) rows in the kernel's fragment order (csrc/hopper/bwd_kernel.h), and is
// scaled and cast into dq at the end. Deterministic mode's semaphores: one per 64-row block.
constexpr int kBwdWorkspaceAlign = 128;
constexpr int kBwdWorkspaceBlock = 64;

struct FlashBwdParams {
  FlashParams fwd;
  const void* dout;
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  void* dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  void* dk;
  void* dv;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  float* dq_acc;
  float* lse2;
  float* delta;
  int64_t ws_rows;
  int dq_acc_cols;  // the compiled head dim the call runs on (>= head_dim)
  int* dq_semaphore;  // deterministic mode: one int per workspace block (zeroed by the preprocess); else null
  // [Note] Backward group split: with group_splits > 1, the CTAs of a kv head each take
  // group / group_splits of its query heads and write fp32 partial dK (scaled) and dV into
  // dkv_partial, (2, group_splits, ...k's shape...), contiguous; the caller sums the splits.
  // With dkv_add the buffer is (2, 1, ...k's shape...), zeroed by the caller, and every split
  // adds into it (fp32 atomics: the order of the adds, and so the rounding, is not fixed;
  // never in deterministic mode); part_split_stride is then 0.
  // Strides in elements, for one split's slice (k's layout); dv's half is one `part_half` on.
  float* dkv_partial;
  int group_splits;
  bool dkv_add;
  int64_t part_split_stride, part_half_stride, part_batch_stride, part_row_stride,
      part_head_stride;
};

// Runs the sm90 forward on `stream` (a cudaStream_t). On failure returns the status and writes a
// readable reason into `why` (at most why_len bytes, NUL-terminated).
FwdStatus hopper_fwd(const FlashParams& params, void* stream, char* why, int why_len);

// Runs the sm90 backward (preprocess, dK/dV/dQ kernel, dQ cast) on `stream`; same contract.
FwdStatus hopper_bwd(const FlashBwdParams& params, void* stream, char* why, int why_len);

}  // namespace flash
