// Host side of one forward instantiation: copy-engine descriptors, shared-memory opt-in, launch.
//
// The tensor maps describe each input as 4-D (d, rows, heads, batch) with byte strides, so every
// stride pattern with stride(-1) == 1 is served as is (transposed views included). Varlen packs
// all sequences on the rows axis (batch extent 1) and the kernel offsets rows by cu_seqlens.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "../flash_params.h"
#include "fwd_kernel.h"
#include "fwd_run.h"

namespace flash::hopper {

using EncodeTiledFn = PFN_cuTensorMapEncodeTiled_v12000;

// The driver entry point, looked up once through the runtime (no link against libcuda).
inline EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = []() -> EncodeTiledFn {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      return nullptr;
    }
    return reinterpret_cast<EncodeTiledFn>(ptr);
  }();
  return fn;
}

struct TensorView4d {
  const void* base;
  uint64_t dims[4];     // d, rows, heads, batch
  int64_t strides[3];   // elements: row, head, batch
};

// Builds one tensor map; returns false (with a reason) when the copy engine cannot address it.
template <class Traits>
bool make_tensor_map(CUtensorMap* map, const TensorView4d& t, int box_rows, const char* name,
                     char* why, int why_len) {
  constexpr uint64_t kElem = sizeof(typename Traits::Element);
  if (reinterpret_cast<uintptr_t>(t.base) % 16 != 0) {
    std::snprintf(why, why_len, "%s: data pointer is not 16-byte aligned", name);
    return false;
  }
  uint64_t strides[3];
  uint64_t natural = t.dims[0] * kElem;  // stride a packed tensor would have; used for extent-1 dims
  for (int i = 0; i < 3; ++i) {
    const bool unit = t.dims[i + 1] == 1;
    const int64_t s = t.strides[i];
    if (!unit && (s <= 0 || (uint64_t(s) * kElem) % 16 != 0 || uint64_t(s) * kElem >= (1ull << 40))) {
      std::snprintf(why, why_len,
                    "%s: stride %lld of dim %d is not a positive multiple of 16 bytes below 2^40",
                    name, static_cast<long long>(s), i + 1);
      return false;
    }
    natural = (natural + 15) / 16 * 16;
    strides[i] = unit ? natural : uint64_t(s) * kElem;
    natural = strides[i] * t.dims[i + 1];
  }
  const cuuint32_t box[4] = {cuuint32_t(Traits::kChunk), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUtensorMapSwizzle swizzle = Traits::kSwizzleBytes == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : Traits::kSwizzleBytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                                   : CU_TENSOR_MAP_SWIZZLE_32B;
  const CUtensorMapDataType dtype = std::is_same_v<typename Traits::Element, cutlass::bfloat16_t>
                                        ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  EncodeTiledFn encode = encode_tiled_fn();
  if (encode == nullptr) {
    std::snprintf(why, why_len, "cuTensorMapEncodeTiled is not available from the driver");
    return false;
  }
  const CUresult r = encode(map, dtype, 4, const_cast<void*>(t.base), t.dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::snprintf(why, why_len, "%s: cuTensorMapEncodeTiled failed with CUresult %d", name, int(r));
    return false;
  }
  return true;
}

// The 4-D view of a tensor on q's side (q, out, dout: Sq/Tq rows, Hq heads) or on k's side
// (k, v: Sk/Tk rows, Hkv heads) of p, with that tensor's own strides.
inline TensorView4d row_view(const FlashParams& p, bool query_side, const void* base,
                             int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
  const uint64_t batch_extent = p.cu_seqlens_q != nullptr ? 1 : uint64_t(p.batch);
  const uint64_t rows = uint64_t(query_side ? p.rows_q : p.rows_k);
  const uint64_t heads = uint64_t(query_side ? p.heads_q : p.heads_kv);
  return {base, {uint64_t(p.head_dim), rows, heads, batch_extent},
          {row_stride, head_stride, batch_stride}};
}

// The score scales of the kernels' arguments: scale * log2(e), or with softcap c * log2(e) and
// scale / c (see softmax.h).
template <bool kSoftcap>
void score_scales(const FlashParams& p, float& scale_log2, float& scale_over_cap) {
  scale_log2 = (kSoftcap ? p.softcap : p.scale) * kLog2e;
  scale_over_cap = kSoftcap ? p.scale / p.softcap : 0.f;
}

// Multiprocessors of the current device; 0 when the runtime cannot say (the grid then covers
// every unit). The runtime answers from its cached device properties.
inline int multiprocessor_count() {
  int device = 0;
  int n = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return 0;
  }
  return n;
}

// The tile list and the grid of [Note] Persistent schedule (fwd_kernel.h); false when the
// units overflow a 32-bit index.
template <class Traits>
bool make_schedule(const FlashParams& p, FwdSchedule& sched, int& grid) {
  sched.num_m = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  sched.heads = p.heads_q;
  const bool varlen = p.cu_seqlens_q != nullptr;
  sched.paired = !varlen && p.window_right >= 0 && p.window_left < 0;
  sched.units_per_hb = sched.paired ? (sched.num_m + 1) / 2 : sched.num_m;
  const int64_t units = int64_t(sched.units_per_hb) * p.heads_q * p.batch;
  if (units > INT32_MAX) return false;
  sched.units = int(units);
  const int sms = multiprocessor_count();
  grid = varlen || sms <= 0 ? sched.units : int(std::min<int64_t>(units, sms));
  return true;
}

template <class Traits>
FwdStatus launch_fwd(const FlashParams& p, cudaStream_t stream, char* why, int why_len) {
  FwdArgs args;
  args.p = p;
  int grid = 0;
  if (!make_schedule<Traits>(p, args.sched, grid)) {
    std::snprintf(why, why_len, "%d query blocks x %d heads x batch %d exceed 2^31 tiles",
                  args.sched.num_m, p.heads_q, p.batch);
    return FwdStatus::kUnsupportedShape;
  }
  const TensorView4d q = row_view(p, true, p.q, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  const TensorView4d k = row_view(p, false, p.k, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  const TensorView4d v = row_view(p, false, p.v, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  if (!make_tensor_map<Traits>(&args.tma_q, q, Traits::kBlockM, "q", why, why_len) ||
      !make_tensor_map<Traits>(&args.tma_k, k, Traits::kBlockN, "k", why, why_len) ||
      !make_tensor_map<Traits>(&args.tma_v, v, Traits::kBlockN, "v", why, why_len)) {
    return FwdStatus::kMisaligned;
  }
  score_scales<Traits::kSoftcap>(p, args.scale_log2, args.scale_over_cap);

  auto kernel = fwd_kernel<Traits>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         Traits::kSmemBytes);
  if (err == cudaSuccess) {
    kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(args);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    std::snprintf(why, why_len, "hopper forward launch failed: %s", cudaGetErrorString(err));
    return FwdStatus::kLaunchFailed;
  }
  return FwdStatus::kOk;
}

}  // namespace flash::hopper

namespace flash::hopper {

// [Note] Long bands
// A band tile is narrower than a full-mask tile where a wide one wastes more on the masked
// diagonal and on the last, partial query block than its extra consumer gains (TileSize's band
// columns; at D=64: 128 rows, against 192 without a mask). Both costs are per query block, so
// over many queries a band without a left bound (causal, or a right bound only) takes the
// long-band tile (kBlockMLongBand) from kLongBandMinRows queries on. A sliding window keeps the
// band tile at every length: its masked share stays the same however long the sequence. Softcap
// keeps it too (three consumers spill with softcap at D=64). Nothing more is compiled where the
// two columns agree.
// At D=64 (H200, causal, B x S = 16k tokens, 32 heads) the 192-row tile ran 2k -5%, 4k +4%,
// 8k +8%, 16k +13% against the 128-row one.
constexpr int kLongBandMinRows = 4096;

template <class Element, int kHeadDim, bool kWindow, bool kSoftcap>
FwdStatus run_fwd(const FlashParams& p, cudaStream_t stream, char* why, int why_len) {
  using Tile = TileSize<kHeadDim>;
  if constexpr (kWindow && !kSoftcap && Tile::kBlockMLongBand != Tile::kBlockMBand) {
    if (p.window_left < 0 && p.seqlen_q >= kLongBandMinRows) {
      return launch_fwd<FwdTraits<Element, kHeadDim, true, false, true>>(p, stream, why, why_len);
    }
  }
  return launch_fwd<FwdTraits<Element, kHeadDim, kWindow, kSoftcap>>(p, stream, why, why_len);
}

}  // namespace flash::hopper
