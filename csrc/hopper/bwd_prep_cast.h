// The backward's kernels around the main one: the preprocess (delta, lse2, zeroed dQ
// accumulator) before it and the dQ cast after it, with the workspace layout they share with it
// ([Note] Backward workspaces in csrc/flash_params.h).
#pragma once

#include "fwd_kernel.h"

namespace flash::hopper {

// [Note] Backward workspaces: the preprocess and the cast serve blocks of kWorkspaceRows rows;
// the preprocess also writes a sequence's padding rows up to kWorkspaceAlign.
constexpr int kWorkspaceRows = kBwdWorkspaceBlock;
constexpr int kWorkspaceAlign = kBwdWorkspaceAlign;

// First padded row of (batch, head) in the workspaces.
__device__ __forceinline__ int64_t workspace_row(const FlashBwdParams& p, int batch, int head) {
  if (p.fwd.cu_seqlens_q != nullptr) {
    const int64_t start = (int64_t(p.fwd.cu_seqlens_q[batch]) + kWorkspaceAlign * batch) /
                          kWorkspaceAlign * kWorkspaceAlign;
    return int64_t(head) * p.ws_rows + start;
  }
  return (int64_t(batch) * p.fwd.heads_q + head) * p.ws_rows;
}

// Rows of a sequence of `seqlen_q` queries in the workspaces, padding included.
__host__ __device__ __forceinline__ int workspace_rows_of(int seqlen_q) {
  return (seqlen_q + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// The 64-row workspace block a CTA of the preprocess or the cast serves: blockIdx = (block,
// query head, batch). The cast has nothing to do once the block starts past its sequence's
// queries; the preprocess still writes the padding rows up to the alignment.
struct WorkspaceBlock {
  int head, batch, row;  // row: the block's first query row in its sequence
  SeqInfo seq;

  __device__ __forceinline__ explicit WorkspaceBlock(const FlashParams& f)
      : head(blockIdx.y), batch(blockIdx.z), row(blockIdx.x * kWorkspaceRows), seq(f, blockIdx.z) {}
  __device__ __forceinline__ bool empty() const { return row >= seq.seqlen_q; }
  __device__ __forceinline__ bool past_padding() const {
    return row >= workspace_rows_of(seq.seqlen_q);
  }
  // the block's first padded row in the workspaces
  __device__ __forceinline__ int64_t ws_row(const FlashBwdParams& p) const {
    return workspace_row(p, batch, head) + row;
  }
};

// [Note] Backward preprocess and cast
// Both run once per 64-row workspace block of each (query head, batch) and move only bytes, so
// they are written for bandwidth: wide accesses, every load of a thread issued before its first
// use, no atomics. The preprocess reads O and dO in 16-byte chunks (a half-warp per row, one
// chunk per lane), writes delta and lse2, and zeroes the block's dq_acc rows (and, in
// deterministic mode, its semaphore), so the caller allocates the workspaces uninitialised and
// no separate fill runs. The cast reads the block's fp32 dQ in the main kernel's fragment order
// (coalesced float4 loads), turns it into rows through shared memory, and writes each row of
// dq in 8-byte runs of four elements. Unaligned or odd-strided tensors (the host checks) take
// element-wise loads and stores in the same kernels.

// 16-byte (preprocess) / 8-byte (cast) vector access is allowed for this tensor: base and every
// stride aligned, head dim a multiple of the vector.
inline bool vector_ok(const void* ptr, int64_t s0, int64_t s1, int64_t s2,
                                          int head_dim, int elems, int elem_bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % (elems * elem_bytes) == 0 && s0 % elems == 0 &&
         s1 % elems == 0 && s2 % elems == 0 && head_dim % elems == 0;
}

// delta = rowsum(dO * O) and lse2 = lse * log2(e) into the padded workspaces, the block's dq_acc
// rows zeroed ([Note] Backward preprocess and cast). One CTA per (64-row block, query head,
// batch); warp w, half h handles rows 16 i + 2 w + h, lane l of the half the chunks
// [8 l + 128 c, 8 l + 128 c + 8).
template <class Element, int D>
__global__ void __launch_bounds__(256) bwd_prep_kernel(const __grid_constant__ FlashBwdParams p,
                                                       bool vec) {
#if defined(FLASH_HOPPER_DEVICE_PASS)
  constexpr int kPasses = kWorkspaceRows / 16;
  constexpr int kLaneChunks = (D + 127) / 128;  // 16-byte chunks of a row per lane of a half-warp
  const FlashParams& f = p.fwd;
  const WorkspaceBlock blk(f);
  if (blk.past_padding()) return;
  const int head = blk.head, batch = blk.batch, block_row = blk.row;
  const SeqInfo& seq = blk.seq;
  const int64_t ws = blk.ws_row(p);
  const Element* out = static_cast<const Element*>(f.out) + int64_t(batch) * f.out_batch_stride +
                       int64_t(head) * f.out_head_stride;
  const Element* dout = static_cast<const Element*>(p.dout) + int64_t(batch) * p.dout_batch_stride +
                        int64_t(head) * p.dout_head_stride;
  const float* lse = f.lse + int64_t(batch) * f.lse_batch_stride + int64_t(head) * f.lse_head_stride;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int chunk = lane % 16;

  float sum[kPasses];
  CUTE_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    const int row = block_row + 16 * i + 2 * warp + lane / 16;
    sum[i] = 0.f;
    if (row >= seq.seqlen_q) continue;
    const int64_t tok = seq.q_start + row;
    if (vec) {
      CUTE_UNROLL
      for (int c = 0; c < kLaneChunks; ++c) {
        const int col = 8 * (chunk + 16 * c);
        if (col >= f.head_dim) continue;
        const uint4 o = *reinterpret_cast<const uint4*>(out + tok * f.out_row_stride + col);
        const uint4 g = *reinterpret_cast<const uint4*>(dout + tok * p.dout_row_stride + col);
        const Element* oe = reinterpret_cast<const Element*>(&o);
        const Element* ge = reinterpret_cast<const Element*>(&g);
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) sum[i] += float(oe[e]) * float(ge[e]);
      }
    } else {
      for (int c = chunk; c < f.head_dim; c += 16) {
        sum[i] += float(out[tok * f.out_row_stride + c]) * float(dout[tok * p.dout_row_stride + c]);
      }
    }
  }
  // zero this block's dq_acc rows while the loads are in flight
  float4* acc = reinterpret_cast<float4*>(p.dq_acc + ws * D);
  CUTE_UNROLL
  for (int i = threadIdx.x; i < kWorkspaceRows * D / 4; i += 256) {
    acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if (p.dq_semaphore != nullptr && threadIdx.x == 0) p.dq_semaphore[ws / kWorkspaceRows] = 0;
  CUTE_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    CUTE_UNROLL
    for (int o = 8; o > 0; o /= 2) sum[i] += __shfl_xor_sync(0xffffffff, sum[i], o);
    const int r = 16 * i + 2 * warp + lane / 16;
    if (chunk == 0) {
      const int row = block_row + r;
      float lse2 = INFINITY;
      if (row < seq.seqlen_q) {
        const float l = lse[seq.q_start + row];
        lse2 = l == -INFINITY ? INFINITY : l * kLog2e;
      }
      p.delta[ws + r] = sum[i];
      p.lse2[ws + r] = lse2;
    }
  }
#endif
}

// dq = dq_acc * scale in q's dtype and dq's strides ([Note] Backward preprocess and cast).
// dq_acc holds each 64-row block in the order the main kernel's consumers hold their dQ
// fragments ([Note] dQ through shared memory): thread t of this 128-thread CTA reads what
// consumer thread t wrote, and puts it into a row-major shared tile (rows padded by 8 floats, so
// a warp's float2 stores are two conflict-free wavefronts), one half of the columns (one
// consumer's) at a time so that the tile stays within static shared memory at D=256.
template <class Element, int D>
__global__ void __launch_bounds__(128) bwd_dq_cast_kernel(const __grid_constant__ FlashBwdParams p,
                                                          float scale, bool vec) {
#if defined(FLASH_HOPPER_DEVICE_PASS)
  constexpr int kDqCols = D / 2, kGroups = kDqCols / 8, kPitch = kDqCols + 8;
  __shared__ __align__(16) float tile[kWorkspaceRows * kPitch];
  const FlashParams& f = p.fwd;
  const WorkspaceBlock blk(f);
  if (blk.empty()) return;
  const int head = blk.head, batch = blk.batch, block_row = blk.row;
  const SeqInfo& seq = blk.seq;
  const float4* acc = reinterpret_cast<const float4*>(p.dq_acc + blk.ws_row(p) * D);
  Element* dq = static_cast<Element*>(p.dq) + int64_t(batch) * p.dq_batch_stride +
                int64_t(head) * p.dq_head_stride;
  const int tid = threadIdx.x;
  const int r0 = 16 * (tid / 32) + (tid % 32) / 4;
  const int col_lane = 2 * (tid % 4);
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    float4 v[kGroups];
    CUTE_UNROLL
    for (int i = 0; i < kGroups; ++i) v[i] = acc[(h * kGroups + i) * 128 + tid];
    if (h > 0) __syncthreads();  // the first half's reads of the tile are done
    CUTE_UNROLL
    for (int i = 0; i < kGroups; ++i) {
      const int col = 8 * i + col_lane;
      *reinterpret_cast<float2*>(&tile[r0 * kPitch + col]) = make_float2(v[i].x, v[i].y);
      *reinterpret_cast<float2*>(&tile[(r0 + 8) * kPitch + col]) = make_float2(v[i].z, v[i].w);
    }
    __syncthreads();
    constexpr int kQuads = kDqCols / 4;  // four-column runs per row of the half
    CUTE_UNROLL
    for (int idx = tid; idx < kWorkspaceRows * kQuads; idx += 128) {
      const int r = idx / kQuads;
      const int c = 4 * (idx % kQuads);
      const int col = h * kDqCols + c;
      const int row = block_row + r;
      if (row >= seq.seqlen_q || col >= f.head_dim) continue;
      const float4 x = *reinterpret_cast<const float4*>(&tile[r * kPitch + c]);
      Element* dst = dq + int64_t(seq.q_start + row) * p.dq_row_stride + col;
      if (vec) {
        __align__(8) Element quad[4] = {Element(x.x * scale), Element(x.y * scale),
                                        Element(x.z * scale), Element(x.w * scale)};
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(quad);
      } else {
        const float xs[4] = {x.x, x.y, x.z, x.w};
        CUTE_UNROLL
        for (int e = 0; e < 4; ++e) {
          if (col + e < f.head_dim) dst[e] = Element(xs[e] * scale);
        }
      }
    }
  }
#endif
}

}  // namespace flash::hopper
