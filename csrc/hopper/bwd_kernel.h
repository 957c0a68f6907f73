// sm90a backward attention: the dK/dV/dQ kernel (the preprocess and the dQ cast around it are in
// bwd_prep_cast.h).
//
// Glossary
//   CTA          one (key block of kBlockN keys, kv head, batch); its dK and dV stay in registers
//                and are written once, so GQA's sum over the query heads of a kv head happens
//                inside the CTA (no Hq-sized buffer, no reduction op). With a group split
//                ([Note] Backward group split in csrc/flash_params.h) one of group_splits CTAs
//                of that key block, each over its share of the query heads, writing fp32
//                partials the caller sums, or adding into one fp32 dK/dV the caller converts
//   step         one (query head of the group, query block of kBlockM rows) the CTA visits, in
//                the order of [Note] Backward step order
//   producer     warpgroup 0, warp 0: one elected thread issues the copy-engine loads of K and V
//                (once) and of Q, dO, lse2, delta (per step, kStages deep)
//   dQ warp      warpgroup 0, warp 1: sends each step's fp32 dQ tile to dq_acc (one bulk
//                reduce-add), in key-block order in deterministic mode; idle under a head-dim
//                split ([Note] dQ from registers)
//   consumers    warpgroups 1 and 2, each owning 64 of the CTA's keys (under a head-dim split,
//                [Note] Backward head-dim split in bwd_traits.h: both on the same 64 keys,
//                each owning half of the head dim's columns of dK, dV and dQ)
//   padded row   the workspace row of a query (see [Note] Backward workspaces in flash_params.h)
//
// Per step, each consumer computes (see bwd_traits.h for the GEMM shapes):
//   S^T, dP^T          two SS GEMMs issued back to back
//   P^T = exp2(S^T * scale_log2 - lse2)  (softcap: S^T holds t = tanh(scale * qk / cap) first)
//   dV += P^T dO       RS GEMM, issued as soon as P^T is in registers (at 128 query rows, once
//                      dS^T is too: [Note] dQ by query rows in bwd_traits.h)
//   dS^T = P^T * (dP^T - delta)          (softcap: times 1 - t^2)
//   dK += dS^T Q       RS GEMM (at 128 query rows after the dQ GEMM: [Note] dK behind dQ)
//   dS^T -> the CTA's shared dS tile; dQ (this consumer's half of the columns, or of the rows:
//   [Note] dQ by query rows in bwd_traits.h) = dS K over all kBlockN keys; the fp32 dQ tile ->
//   shared memory, handed to the dQ warp
// The softmax scale (and the softcap chain rule's scale) is applied once: to dK in the epilogue
// and to dQ in the cast kernel.
//
// [Note] Backward barrier protocol
// bar_kv: count 1, the producer's one transaction for K and V. full[s]: count 1, one
// transaction for Q, dO, lse2 and delta of a step. empty[s]: all consumer threads arrive once
// the GEMMs that read Q and dO of the slot have retired (lse2 and delta are read before that).
//
// [Note] dQ through shared memory
// Per step both consumers store their 64 rows of dS^T into the one dS tile and meet at
// kDsBarrier (256 threads); each then computes half of the dQ tile (its columns, or its rows at
// 128 query rows per step) over all kBlockN keys, stores it into the fp32 dQ tile and arrives
// (without waiting) at kDqFullBarrier. The dQ warp waits there (256 + 32 threads), one lane
// issues the bulk reduce-add of the whole tile into dq_acc and waits until it has read the tile
// (bulk_wait_read), and the warp arrives at kDqEmptyBarrier. Consumers wait at kDqEmptyBarrier
// before they write the next step's dS^T: past it, both dQ GEMMs of the step retired (both
// consumers arrived at kDqFullBarrier after them), so the dS tile is free, and the reduce has
// read the dQ tile, so it is free too. The consumers never wait for the copy engine, and a
// deterministic mode's turn is waited for by the dQ warp alone. The fp32 tile is stored in
// fragment order (chunk g of consumer w's columns: 128 float4 of its 128 threads), so the stores
// are conflict-free and one contiguous bulk copy carries the tile; dq_acc keeps that order and
// the cast kernel undoes it.
//
// [Note] dQ from registers
// Under a head-dim split there is no fp32 dQ tile: after its dQ GEMM retires each consumer adds
// its fragments into dq_acc with 16-byte vector reductions (red.global.add.v4.f32), at the
// addresses where the dQ warp's bulk copy would have put them (chunk g of consumer w's columns:
// 128 float4 of its 128 threads), so a warp's reductions cover 512 contiguous bytes and dq_acc's
// order and the cast kernel are the same for every head dim. Each consumer has a dS tile of its
// own (both hold the same dS^T: both compute the full S^T and dP^T), so the consumers never meet:
// a consumer's dQ GEMM of the previous step has retired (its own wait) before it overwrites its
// tile, and its warpgroup meets at kDsWgBarrier + wg (128 threads) between the stores and the
// dQ GEMM that reads them. In deterministic mode thread 0 of each consumer waits for the
// block's turn as the dQ warp would ([Note] Deterministic dQ), its warpgroup waits for it, all
// threads reduce and fence, both consumers meet, and consumer 0's thread 0 publishes the next
// rank.
//
// [Note] Backward step order
// A CTA's steps either take its query heads in turn, each over all its query blocks upwards
// (head-major), or its query blocks downwards, each for all its heads in turn (block-major).
// Block-major puts every CTA of one (kv head, batch) on the last query blocks first, where all
// of them start at about the same time under a causal band, so they read the same Q and dO and
// add into the same dQ rows close together in time: one L2 working set instead of one per CTA.
// Head-major sends CTA n over its own range of blocks, 2n.. at 128 keys per CTA, once per head.
// Block-major gained most where many CTAs of a pair run at once with several heads each (Llama
// 64/8 below 16k keys), and lost where one pair's CTAs fill a whole wave and all meet on every
// block (16k keys at B=1); measurements in docs/performance.md (Backward, block-major steps).
// The same held at head dim 256 (64-key CTAs, so 4k keys at most): Llama 64/8 gained 1.2-1.5x
// up to 4k keys and lost 11% at 8k, GQA 32/8 gained up to 1.15x at 512-1k keys; head dim 64
// moved within +-2% everywhere and stays head-major.
// So it runs where it was measured to gain: a causal band without a left bound over at most
// kBlockMajorKeyBlocks key blocks, head dim 128 or 256, no group split; and not in
// deterministic mode, where the turns would chain the CTAs that meet on a block one step apart.
// The choice is made in launch_bwd (bwd_launch.h).
//
// [Note] Deterministic dQ
// With a semaphore array (one int per workspace block, zeroed by the preprocess), the CTAs that add into one dQ
// block do so in increasing key-block order: CTA n waits until the block's counter equals its
// rank n - n_first among the key blocks that see the query block, reduces, waits for the
// reduce to complete and publishes rank + 1. The same fp32 additions in the same order make dQ
// bitwise reproducible. CTAs are dispatched in blockIdx order, so a CTA only ever waits on
// lower key blocks of its (kv head, batch), which never wait on it.
//
// [Note] Row statistics one group ahead
// P^T and dS^T read lse2 and delta per 8-query group from the stage's shared rows. Each group's
// pair is loaded once for both of the thread's key rows, and the next group's pair is loaded
// before this group's arithmetic, so the load's latency overlaps it instead of stalling the
// FFMA that needs it (the loads are volatile: they stay where they are written). An H100
// profile at D=64 put ~6% of the step's stall samples on those FFMAs (short scoreboard) when
// each pair was loaded right before its use, twice per group.
//
// [Note] dK behind dQ
// With 128 query rows per step (D=64) the dQ GEMM is issued before dK's, and the consumer waits
// only for dV and dQ before it stores its fp32 dQ tile and hands it to the dQ warp, so the
// tile's stores and fence overlap the dK GEMM instead of following every GEMM of the step.
// ptxas keeps the wgmma asynchronous here (no C7512; dV and dQ retire first, so two
// accumulators are in flight at most). At D=128 the same order serialised (docs/performance.md,
// Backward), so 64-row steps keep dK before dS^T's store.
#pragma once

#include "bwd_prep_cast.h"
#include "bwd_traits.h"
#include "fwd_kernel.h"

namespace flash::hopper {

struct BwdArgs {
  CUtensorMap tma_q;   // boxes of (chunk, kBlockM, 1, 1)
  CUtensorMap tma_do;
  CUtensorMap tma_k;   // boxes of (chunk, kBlockN, 1, 1)
  CUtensorMap tma_v;
  FlashBwdParams p;
  float scale_log2;      // as FwdArgs
  float scale_over_cap;
  float grad_scale;      // softmax scale: dK and dQ are multiplied by it once
  int block_major;       // [Note] Backward step order
  int dkv_staged;        // [Note] dK and dV through shared memory
};

// Key blocks up to which a causal band takes block-major steps ([Note] Backward step order).
constexpr int kBlockMajorKeyBlocks = 64;

// Step j of a CTA over `heads` query heads and the query blocks [m_min, m_min + m_count): its
// query head (counted from the CTA's first) and query block ([Note] Backward step order).
__device__ __forceinline__ void step_at(int j, bool block_major, int heads, int m_min,
                                        int m_count, int& head, int& m) {
  if (block_major) {
    head = j % heads;
    m = m_min + m_count - 1 - j / heads;
  } else {
    head = j / m_count;
    m = m_min + j % m_count;
  }
}

constexpr int kBwdProducerRegisters = 24;
constexpr int kBwdConsumerRegisters = 240;  // 128 x 24 + 256 x 240 = 64512 <= 65536
// Hardware barrier ids (id 0 is __syncthreads) and their thread counts: [Note] dQ through
// shared memory.
constexpr int kDsBarrier = 1;               // both consumers
constexpr int kDqFullBarrier = 2;           // both consumers and the dQ warp
constexpr int kDqEmptyBarrier = 3;
constexpr int kDqTurnBarrier = 4;           // head-dim split, deterministic: both consumers
constexpr int kDqTurnWgBarrier = 5;         // ... and 5 + wg: one consumer ([Note] dQ from
                                            // registers)
constexpr int kDsWgBarrier = 7;             // head-dim split: 7 + wg, one consumer's dS tile
constexpr int kEpilogueBarrier = 9;         // both consumers: K and V are free
constexpr int kEpilogueWgBarrier = 10;      // ... and 10 + wg: one consumer's staged dK and dV
constexpr int kDsThreads = 256;
constexpr int kDqThreads = 256 + 32;

// One bulk reduce-add of `bytes` from shared to global memory (fp32 add, by the copy engine).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, const void* smem, int bytes) {
  const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(gmem), "r"(src), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Adds four floats to 16-byte aligned global memory (one vector reduction, performed in L2).
__device__ __forceinline__ void red_add_float4(float* gmem, float x, float y, float z, float w) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
               ::"l"(gmem), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

// The issuing thread's bulk operations have finished reading shared memory / completed.
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// [Note] Explicit shared-memory accesses
// The consumers' own shared-memory traffic (lse2 and delta reads, the fp32 dQ tile's stores)
// goes through these instead of plain C++ accesses: the shared-memory pointers are rebuilt from
// an integer (the 1024-byte alignment of the base), so the compiler no longer knows they are
// shared and emitted generic LD/ST. Those take the long-latency L1TEX path, and the async-proxy
// fence after the dQ tile waited for them: the H200 profile put a fifth of all the kernel's stall
// samples (idle producer warps included) on those loads and the two fences. Deriving the
// base from the array instead keeps LDS/STS too, but raised the spills (24 -> 68 bytes at D=128).
// The loads are volatile so that they stay where the code places them.
__device__ __forceinline__ float2 ld_shared_float2(const float* p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];"
               : "=f"(v.x), "=f"(v.y) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
  return v;
}

__device__ __forceinline__ void st_shared_float4(float4* p, float x, float y, float z, float w) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};"
               ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "f"(x), "f"(y), "f"(z),
               "f"(w) : "memory");
}

__device__ __forceinline__ void st_shared_u32(void* p, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;"
               ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(v) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_u4(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))) : "memory");
  return v;
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(int* p, int v) {
  asm volatile("fence.proxy.async.global;" ::: "memory");  // the bulk reduce's writes first
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Blocks of `block` positions on one axis that hold a position in [lo, hi] after clipping
// to [0, extent); empty (first >= last) when nothing is left.
__device__ __forceinline__ void clipped_blocks(int lo, int hi, int extent, int block, int& first,
                                               int& last) {
  lo = max(lo, 0);
  hi = min(hi, extent - 1);
  first = lo / block;
  last = lo > hi ? first : hi / block + 1;
}

// Query blocks [m_min, m_max) holding an existing query that sees a key of [key_lo, key_hi]
// (existing keys). Exact, and the mirror of key_blocks_of_query_block: a CTA visits query
// block m iff that function's range for m holds the CTA's key block (deterministic mode's
// ordering counts on it).
template <class Traits>
__device__ __forceinline__ void query_block_range(const FlashParams& p, int key_lo, int key_hi,
                                                  int seqlen_q, int seqlen_k, int& m_min,
                                                  int& m_max) {
  const int diag = seqlen_k - seqlen_q;
  int first_q = 0, last_q = seqlen_q - 1;
  if constexpr (Traits::kWindow) {
    if (p.window_right >= 0) first_q = key_lo - diag - p.window_right;
    if (p.window_left >= 0) last_q = key_hi - diag + p.window_left;
  }
  clipped_blocks(first_q, last_q, seqlen_q, Traits::kBlockM, m_min, m_max);
}

// Key blocks [n_min, n_max) holding an existing key visible from a query of [row_lo, row_hi].
template <class Traits>
__device__ __forceinline__ void key_blocks_of_query_block(const FlashParams& p, int row_lo,
                                                          int row_hi, int seqlen_q, int seqlen_k,
                                                          int& n_min, int& n_max) {
  const int diag = seqlen_k - seqlen_q;
  int first_k = 0, last_k = seqlen_k - 1;
  if constexpr (Traits::kWindow) {
    if (p.window_left >= 0) first_k = row_lo + diag - p.window_left;
    if (p.window_right >= 0) last_k = row_hi + diag + p.window_right;
  }
  clipped_blocks(first_k, last_k, seqlen_k, Traits::kBlockN, n_min, n_max);
}

// Writes a 64-row accumulator (rows = this warpgroup's keys) to dst rows [row_lo, ...) in pairs
// (of Element, or of fp32 when Element is float; with `add`, fp32 pairs added atomically).
template <class Element, int D, class Frag>
__device__ __forceinline__ void store_rows(const Frag& acc, float mul, Element* dst,
                                           int64_t row_stride, int row0, int row_start,
                                           int rows_valid, int head_dim, int col_lane,
                                           bool add = false) {
  CUTE_UNROLL
  for (int c1 = 0; c1 < 2; ++c1) {
    const int row = row0 + 8 * c1;
    if (row >= rows_valid) continue;
    Element* out_row = dst + int64_t(row_start + row) * row_stride;
    CUTE_UNROLL
    for (int g = 0; g < D / 8; ++g) {
      const int col = 8 * g + col_lane;
      if (col < head_dim) {
        if constexpr (std::is_same_v<Element, float>) {  // a group split's fp32 partial
          const float2 pair = make_float2(acc(cute::make_coord(0, c1, g), 0, 0) * mul,
                                          acc(cute::make_coord(1, c1, g), 0, 0) * mul);
          if (add) {
            atomicAdd(reinterpret_cast<float2*>(out_row + col), pair);
          } else {
            *reinterpret_cast<float2*>(out_row + col) = pair;
          }
        } else {
          __align__(4) Element pair[2] = {Element(acc(cute::make_coord(0, c1, g), 0, 0) * mul),
                                          Element(acc(cute::make_coord(1, c1, g), 0, 0) * mul)};
          *reinterpret_cast<uint32_t*>(out_row + col) = *reinterpret_cast<uint32_t*>(pair);
        }
      }
    }
  }
}

// [Note] dK and dV through shared memory
// The epilogue's dK and dV leave the accumulators as 4-byte pairs: stored straight to global
// memory that is 16 stores per thread and tensor at D=64, each touching 8 rows with 16 of every
// 32 bytes written, and the warps then wait for them to drain before the CTA can leave. Where
// dk and dv allow 16-byte accesses, each consumer instead writes its 64 rows into the shared
// memory K and V held (free once both consumers' last GEMMs retired: kEpilogueBarrier), 16-byte
// chunks XOR-swizzled by row so that the pair stores and the chunk reads are conflict-free, and
// then copies them out in 16-byte chunks, whole rows per group of lanes.
template <class Element, int kCols, class Frag>
__device__ __forceinline__ void stage_rows(const Frag& acc, float mul, Element* stage, int row0,
                                           int col_lane) {
  static_assert(kCols % 64 == 0, "whole groups of 8 chunks per row for the swizzle");
  CUTE_UNROLL
  for (int c1 = 0; c1 < 2; ++c1) {
    const int row = row0 + 8 * c1;
    CUTE_UNROLL
    for (int g = 0; g < kCols / 8; ++g) {
      __align__(4) Element pair[2] = {Element(acc(cute::make_coord(0, c1, g), 0, 0) * mul),
                                      Element(acc(cute::make_coord(1, c1, g), 0, 0) * mul)};
      st_shared_u32(stage + row * kCols + ((g ^ (row & 7)) * 8) + col_lane,
                    *reinterpret_cast<uint32_t*>(pair));
    }
  }
}

// 64 staged rows of kCols (stage_rows' layout) to dst rows [row_start, ...), 16 bytes a lane.
template <class Element, int kCols>
__device__ __forceinline__ void copy_staged_rows(const Element* stage, Element* dst,
                                                 int64_t row_stride, int row_start, int rows_valid,
                                                 int cols_valid, int tid) {
  constexpr int kChunks = kCols / 8;
  CUTE_UNROLL
  for (int i = tid; i < 64 * kChunks; i += 128) {
    const int row = i / kChunks, c = i % kChunks;
    if (row < rows_valid && 8 * c < cols_valid) {
      const uint4 v = ld_shared_u4(stage + row * kCols + ((c ^ (row & 7)) * 8));
      *reinterpret_cast<uint4*>(dst + int64_t(row_start + row) * row_stride + 8 * c) = v;
    }
  }
}

// The dQ warp: per step, waits for both consumers' halves of the fp32 dQ tile, sends the tile
// to dq_acc with one bulk reduce-add (in deterministic mode after the lower key blocks' reduces
// into the same block) and frees the tile once it has been read ([Note] dQ through shared
// memory, [Note] Deterministic dQ).
template <class Traits>
__device__ __forceinline__ void bwd_dq_warp(const FlashBwdParams& p, const SeqInfo& seq, int batch,
                                            int head0, int n_block, int m_min, int m_count,
                                            int heads, int steps, bool block_major,
                                            const float* dq_tile, int lane) {
  constexpr int M = Traits::kBlockM;
  const FlashParams& f = p.fwd;
  for (int j = 0; j < steps; ++j) {
    named_barrier_sync(kDqFullBarrier, kDqThreads);
    if (lane == 0) {
      int head, m;
      step_at(j, block_major, heads, m_min, m_count, head, m);
      head += head0;
      const int q_lo = m * M;
      const int64_t ws_row = workspace_row(p, batch, head) + q_lo;
      int* turn = p.dq_semaphore == nullptr ? nullptr : p.dq_semaphore + ws_row / kWorkspaceRows;
      int rank = 0;
      if (turn != nullptr) {
        int n_first, n_end;
        key_blocks_of_query_block<Traits>(f, q_lo, min(q_lo + M, seq.seqlen_q) - 1, seq.seqlen_q,
                                          seq.seqlen_k, n_first, n_end);
        rank = n_block - n_first;
        while (load_acquire(turn) != rank) {
        }
        // the previous CTA's reduce, seen through the acquire, before ours in the async proxy
        asm volatile("fence.proxy.async.global;" ::: "memory");
      }
      bulk_reduce_add(p.dq_acc + ws_row * Traits::kHeadDim, dq_tile, Traits::kTileBytesDq);
      if (turn != nullptr) {
        bulk_wait_all();
        store_release(turn, rank + 1);
      } else {
        bulk_wait_read();
      }
    }
    __syncwarp();
    if (j + 1 < steps) named_barrier_arrive(kDqEmptyBarrier, kDqThreads);
  }
  if (lane == 0) bulk_wait_all();  // the CTA's shared memory outlives the last reduce
}

// One consumer's dQ fragments of one step into dq_acc ([Note] dQ from registers), in key-block
// order in deterministic mode ([Note] Deterministic dQ).
template <class Traits, class Frag>
__device__ __forceinline__ void bwd_dq_from_registers(const FlashBwdParams& p, const SeqInfo& seq,
                                                      int batch, int head, int q_lo, int n_block,
                                                      const Frag& dq, int wg, int tid) {
  constexpr int M = Traits::kBlockM, kGroups = Traits::kDqCols / 8;
  const int64_t ws_row = workspace_row(p, batch, head) + q_lo;
  int* turn = p.dq_semaphore == nullptr ? nullptr : p.dq_semaphore + ws_row / kWorkspaceRows;
  int rank = 0;
  if (turn != nullptr) {
    if (tid == 0) {
      int n_first, n_end;
      key_blocks_of_query_block<Traits>(p.fwd, q_lo, min(q_lo + M, seq.seqlen_q) - 1,
                                        seq.seqlen_q, seq.seqlen_k, n_first, n_end);
      rank = n_block - n_first;
      while (load_acquire(turn) != rank) {
      }
    }
    named_barrier_sync(kDqTurnWgBarrier + wg, 128);
  }
  float* dst = p.dq_acc + ws_row * Traits::kHeadDim + 4 * (wg * kGroups * 128 + tid);
  CUTE_UNROLL
  for (int g = 0; g < kGroups; ++g) {
    red_add_float4(dst + 4 * 128 * g, dq(cute::make_coord(0, 0, g), 0, 0),
                   dq(cute::make_coord(1, 0, g), 0, 0), dq(cute::make_coord(0, 1, g), 0, 0),
                   dq(cute::make_coord(1, 1, g), 0, 0));
  }
  if (turn != nullptr) {
    __threadfence();  // this thread's reductions before the next rank's
    named_barrier_sync(kDqTurnBarrier, kDsThreads);
    if (wg == 0 && tid == 0) store_release(turn, rank + 1);
  }
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) bwd_kernel(const __grid_constant__ BwdArgs args) {
#if defined(FLASH_HOPPER_DEVICE_PASS)
  using namespace cute;
  using Element = typename Traits::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int M = Traits::kBlockM, N = Traits::kBlockN, D = Traits::kHeadDim, S = Traits::kStages;
  constexpr bool kSplit = Traits::kSplitHeadDim;  // [Note] Backward head-dim split
  constexpr int kDkv = Traits::kDkvCols;
  const FlashBwdParams& p = args.p;
  const FlashParams& f = p.fwd;

  const int n_block = blockIdx.x;  // causal: the first key blocks see the most queries, go first
  // [Note] Backward group split: blockIdx.y = kv head * group_splits + split
  const int kv_head = blockIdx.y / p.group_splits;
  const int split = blockIdx.y % p.group_splits;
  const int batch = blockIdx.z;
  const SeqInfo seq(f, batch);
  if (n_block * N >= seq.seqlen_k) return;  // varlen: this sequence is shorter than the grid
  const int group = f.heads_q / f.heads_kv;
  int m_min, m_max;
  query_block_range<Traits>(f, n_block * N, min(n_block * N + N, seq.seqlen_k) - 1, seq.seqlen_q,
                            seq.seqlen_k, m_min, m_max);
  const int m_count = max(m_max - m_min, 0);
  const int heads_per_split = group / p.group_splits;
  const int head0 = kv_head * group + split * heads_per_split;  // this CTA's first query head
  const int steps = heads_per_split * m_count;

  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  Element* smem_k = reinterpret_cast<Element*>(smem);
  Element* smem_v = reinterpret_cast<Element*>(smem + Traits::kOffsetV);
  Element* smem_q = reinterpret_cast<Element*>(smem + Traits::kOffsetQ);
  Element* smem_do = reinterpret_cast<Element*>(smem + Traits::kOffsetDo);
  Element* smem_ds = reinterpret_cast<Element*>(smem + Traits::kOffsetDs);
  float* smem_lse = reinterpret_cast<float*>(smem + Traits::kOffsetLse);
  float* smem_delta = reinterpret_cast<float*>(smem + Traits::kOffsetDelta);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Traits::kOffsetBarriers);
  uint64_t* bar_kv = bars;
  uint64_t* full = bars + 1;
  uint64_t* empty = full + S;

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    Barrier::init(bar_kv, 1);
    CUTE_UNROLL
    for (int s = 0; s < S; ++s) {
      Barrier::init(&full[s], 1);
      Barrier::init(&empty[s], Traits::kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<kBwdProducerRegisters>();
    if (!kSplit && warp == 1 && steps > 0) {
      const float* dq_tile = reinterpret_cast<const float*>(smem + Traits::kOffsetDq);
      bwd_dq_warp<Traits>(p, seq, batch, head0, n_block, m_min, m_count, heads_per_split, steps,
                          args.block_major, dq_tile, lane);
    }
    if (warp != 0 || !elect_one_sync() || steps == 0) return;
    prefetch_tma_descriptor(&args.tma_q);
    prefetch_tma_descriptor(&args.tma_do);
    prefetch_tma_descriptor(&args.tma_k);
    prefetch_tma_descriptor(&args.tma_v);
    const int key_row = seq.k_start + n_block * N;
    Barrier::arrive_and_expect_tx(bar_kv, 2 * Traits::kTileBytesK);
    load_tile<Traits>(&args.tma_k, bar_kv, smem_k, N, key_row, kv_head, seq.tma_batch);
    load_tile<Traits>(&args.tma_v, bar_kv, smem_v, N, key_row, kv_head, seq.tma_batch);
    PipelineState<Traits> st;
    for (int j = 0; j < steps; ++j) {
      int head, m;
      step_at(j, args.block_major, heads_per_split, m_min, m_count, head, m);
      head += head0;
      const int q_row = seq.q_start + m * M;
      const int64_t ws = workspace_row(p, batch, head) + m * M;
      Barrier::wait(&empty[st.stage], st.phase ^ 1u);
      Barrier::arrive_and_expect_tx(&full[st.stage], 2 * Traits::kTileBytesQ + 2 * Traits::kRowBytes);
      load_tile<Traits>(&args.tma_q, &full[st.stage], smem_q + st.stage * M * D, M, q_row, head,
                        seq.tma_batch);
      load_tile<Traits>(&args.tma_do, &full[st.stage], smem_do + st.stage * M * D, M, q_row, head,
                        seq.tma_batch);
      SM90_BULK_COPY_G2S::copy(p.lse2 + ws, &full[st.stage], smem_lse + st.stage * M,
                               Traits::kRowBytes);
      SM90_BULK_COPY_G2S::copy(p.delta + ws, &full[st.stage], smem_delta + st.stage * M,
                               Traits::kRowBytes);
      st.advance();
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<kBwdConsumerRegisters>();
  const int wg = warpgroup - 1;
  const int tid = threadIdx.x % 128;
  typename Traits::MmaSdP mma_sdp;
  typename Traits::MmaDkv mma_dkv;
  typename Traits::MmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);

  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sDo = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQt{});
  Tensor sDot = make_tensor(make_smem_ptr(smem_do), typename Traits::SmemLayoutQt{});
  const int key_wg = kSplit ? 0 : wg;  // this consumer's 64-key slice of the CTA
  const int col_wg = kSplit ? wg : 0;  // and its slice of dK's and dV's columns
  Tensor sKw = local_tile(sK(_, _, 0), Shape<_64, Int<D>>{}, make_coord(key_wg, 0));
  Tensor sVw = local_tile(sV(_, _, 0), Shape<_64, Int<D>>{}, make_coord(key_wg, 0));

  // (MMA, 1, D/16): descriptors, or registers ([Note] K and V in registers), filled below once
  // K and V have landed
  Tensor tSrK = thr_sdp.partition_fragment_A(sKw);
  Tensor tSrV = thr_sdp.partition_fragment_A(sVw);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, 1, D/16, S)
  Tensor tSrDo = thr_sdp.partition_fragment_B(sDo);
  // (MMA, 1, M/16, S): this consumer's kDkv columns of dO and Q
  Tensor tKVrDo = thr_dkv.partition_fragment_B(
      local_tile(sDot, Shape<Int<kDkv>, Int<M>, Int<S>>{}, make_coord(col_wg, 0, 0)));
  Tensor tKVrQ = thr_dkv.partition_fragment_B(
      local_tile(sQt, Shape<Int<kDkv>, Int<M>, Int<S>>{}, make_coord(col_wg, 0, 0)));
  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<_64, Int<M>>{});
  Tensor tSrDp = partition_fragment_C(mma_sdp, Shape<_64, Int<M>>{});
  // softcap's factor 1 - t^2 for dS, two entries of S^T per fp16 pair: half the registers of a
  // copy of t, which spilled inside the step loop at D=128 and 256. fp16's rounding of a value in
  // [0, 1] (2^-11 relative) is below that of dS itself, rounded to the element type after.
  __half2 tSrCap[Traits::kSoftcap ? decltype(size(tSrS))::value / 2 : 1];
  Tensor tDvrDv = partition_fragment_C(mma_dkv, Shape<_64, Int<kDkv>>{});
  Tensor tDkrDk = partition_fragment_C(mma_dkv, Shape<_64, Int<kDkv>>{});
  Tensor tPa = make_tensor<Element>(AOperandShape<M / 8>{});
  Tensor tDsa = make_tensor<Element>(AOperandShape<M / 8>{});
  Tensor tPa_words = recast<uint32_t>(tPa);
  Tensor tDsa_words = recast<uint32_t>(tDsa);
  static_assert(decltype(size<0, 2>(tSrS))::value == M / 8, "accumulator layout ((2,2,M/8),1,1)");
  if constexpr (kSplit) smem_ds += wg * (Traits::kTileBytesDs / int(sizeof(Element)));
  Tensor sDs = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutDs{});
  // this consumer's dQ GEMM: its rows of dS and all of K's columns, or all rows and its half of
  // the columns ([Note] dQ by query rows in bwd_traits.h)
  constexpr bool kDqByRows = Traits::kDqByRows;
  constexpr int kDqRows = Traits::kDqRows, kDqCols = Traits::kDqCols;
  Tensor tQrDs = thr_dq.partition_fragment_A(local_tile(
      sDs, Shape<Int<kDqRows>, Int<N>>{}, make_coord(kDqByRows ? wg : 0, 0)));  // (MMA, 1, N/16)
  Tensor tQrK = thr_dq.partition_fragment_B(local_tile(
      sKt(_, _, 0), Shape<Int<kDqCols>, Int<N>>{}, make_coord(kDqByRows ? 0 : wg, 0)));
  Tensor tQrDq = partition_fragment_C(mma_dq, Shape<Int<kDqRows>, Int<kDqCols>>{});
  float4* dq_tile = reinterpret_cast<float4*>(smem + Traits::kOffsetDq);

  const int key_lo = n_block * N + key_wg * Traits::kKeysPerWarpgroup;  // this warpgroup's keys
  const int key0 = key_lo + 16 * warp + lane / 4;                   // this thread's first key
  const int col_lane = 2 * (lane % 4);
  const BandMask<Traits::kWindow> mask{seq.seqlen_k, seq.seqlen_k - seq.seqlen_q, f.window_left,
                                       f.window_right};
  const ScoreMod<Traits::kSoftcap> score_mod{args.scale_over_cap};
  clear(tDvrDv);
  clear(tDkrDk);

  if (steps > 0) {
    Barrier::wait(bar_kv, 0);
    if constexpr (Traits::kKvInRegisters) {
      cute::copy(thr_sdp.partition_A(sKw), tSrK);
      cute::copy(thr_sdp.partition_A(sVw), tSrV);
    }
    PipelineState<Traits> st;
    for (int j = 0; j < steps; ++j) {
      int head, m;
      step_at(j, args.block_major, heads_per_split, m_min, m_count, head, m);
      const int q_lo = m * M;
      Barrier::wait(&full[st.stage], st.phase);

      // S^T and dP^T, back to back
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tSrDp);
      warpgroup_arrive();
      mma_sdp.accumulate_ = gmma::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tSrK); ++kb) {
        cute::gemm(mma_sdp, tSrK(_, _, kb), tSrQ(_, _, kb, st.stage), tSrS);
        mma_sdp.accumulate_ = gmma::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_arrive();
      mma_sdp.accumulate_ = gmma::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tSrV); ++kb) {
        cute::gemm(mma_sdp, tSrV(_, _, kb), tSrDo(_, _, kb, st.stage), tSrDp);
        mma_sdp.accumulate_ = gmma::ScaleOut::One;
      }
      warpgroup_commit_batch();

      // lse2 and delta of this thread's query columns, read from the slot when used (the slot
      // stays valid until this thread arrives on empty[])
      const float* lse_s = smem_lse + st.stage * M + col_lane;
      const float* delta_s = smem_delta + st.stage * M + col_lane;

      warpgroup_wait<1>();  // S^T is in
      warpgroup_fence_operand(tSrS);
      score_mod.apply(tSrS);
      if constexpr (Traits::kSoftcap) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS) / 2; ++i) {
          const float t0 = tSrS(2 * i), t1 = tSrS(2 * i + 1);
          tSrCap[i] = __floats2half2_rn(fmaf(-t0, t0, 1.f), fmaf(-t1, t1, 1.f));
        }
      }
      // [Note] Row statistics one group ahead
      float2 lse_next = ld_shared_float2(lse_s);
      CUTE_UNROLL
      for (int g = 0; g < M / 8; ++g) {
        const float2 lse2 = lse_next;
        if (g + 1 < M / 8) lse_next = ld_shared_float2(lse_s + 8 * (g + 1));
        CUTE_UNROLL
        for (int c1 = 0; c1 < 2; ++c1) {
          float& x0 = tSrS(make_coord(0, c1, g), 0, 0);
          float& x1 = tSrS(make_coord(1, c1, g), 0, 0);
          x0 = exp2_approx(fmaf(x0, args.scale_log2, -lse2.x));
          x1 = exp2_approx(fmaf(x1, args.scale_log2, -lse2.y));
        }
      }
      if (mask.needs_mask(q_lo, q_lo + M - 1, key_lo, key_lo + Traits::kKeysPerWarpgroup - 1)) {
        mask.apply_transposed(tSrS, key0, q_lo + col_lane, 0.f);
      }
      // acc += A B with A (P^T or dS^T) from registers and B (dO or Q) from this stage's slot
      auto issue_dkv_gemm = [&](auto& acc, auto& a, auto& a_words, auto& b) {
        warpgroup_fence_operand(acc);
        warpgroup_fence_operand(a_words);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(a); ++kb) {
          cute::gemm(mma_dkv, a(_, _, kb), b(_, _, kb, st.stage), acc);
        }
        warpgroup_commit_batch();
      };
      // dV += P^T dO, issued here, or with 128 query rows once dS^T is formed too ([Note] dQ by
      // query rows in bwd_traits.h)
      auto issue_dv = [&] { issue_dkv_gemm(tDvrDv, tPa, tPa_words, tKVrDo); };
      if constexpr (!Traits::kLateDv) {
        to_a_operand(tSrS, tPa);
        issue_dv();
        warpgroup_wait<1>();  // dP^T is in (the dV GEMM may still run)
      } else {
        warpgroup_wait<0>();  // dP^T is in
      }
      warpgroup_fence_operand(tSrDp);
      float2 delta_next = ld_shared_float2(delta_s);
      CUTE_UNROLL
      for (int g = 0; g < M / 8; ++g) {
        const float2 delta = delta_next;
        if (g + 1 < M / 8) delta_next = ld_shared_float2(delta_s + 8 * (g + 1));
        CUTE_UNROLL
        for (int c1 = 0; c1 < 2; ++c1) {
          CUTE_UNROLL
          for (int c0 = 0; c0 < 2; ++c0) {
            const auto at = make_coord(c0, c1, g);
            float ds = tSrS(at, 0, 0) * (tSrDp(at, 0, 0) - (c0 == 0 ? delta.x : delta.y));
            if constexpr (Traits::kSoftcap) {
              const float2 cap = __half22float2(tSrCap[c1 + 2 * g]);  // entry c0 + 2 c1 + 4 g
              ds *= c0 == 0 ? cap.x : cap.y;
            }
            tSrDp(at, 0, 0) = ds;
          }
        }
      }
      if constexpr (Traits::kLateDv) to_a_operand(tSrS, tPa);
      to_a_operand(tSrDp, tDsa);
      if constexpr (Traits::kLateDv) issue_dv();

      // dK += dS^T Q, issued here, or with 128 query rows after the dQ GEMM ([Note] dK behind
      // dQ)
      auto issue_dk = [&] { issue_dkv_gemm(tDkrDk, tDsa, tDsa_words, tKVrQ); };
      constexpr bool kDkAfterDq = Traits::kDqByRows;
      if constexpr (!kDkAfterDq) issue_dk();

      // dS^T into this consumer's 64 rows of the shared dS tile; both consumers' rows must be
      // in before either reads the tile ([Note] dQ through shared memory)
      // (tDsa holds dS^T in the accumulator's register order: see to_a_operand)
      Tensor sDsT = make_tensor(make_smem_ptr(smem_ds), typename Traits::SmemLayoutDsT{});
      typename Traits::SmemCopyDs copy_ds;
      auto thr_copy_ds = copy_ds.get_thread_slice(tid);
      Tensor tDsc = make_tensor(tDsa.data(), tSrDp.layout());
      Tensor tSsDs = thr_copy_ds.partition_D(
          local_tile(sDsT, Shape<_64, Int<M>>{}, make_coord(key_wg, 0)));
      if constexpr (kSplit) {  // this consumer's own dS tile ([Note] dQ from registers)
        cute::copy(copy_ds, thr_copy_ds.retile_S(tDsc), tSsDs);
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(kDsWgBarrier + wg, 128);
      } else {
        // last step's dS and dQ tiles are free
        if (j > 0) named_barrier_sync(kDqEmptyBarrier, kDqThreads);
        cute::copy(copy_ds, thr_copy_ds.retile_S(tDsc), tSsDs);
        cutlass::arch::fence_view_async_shared();
        named_barrier_sync(kDsBarrier, kDsThreads);
      }

      if constexpr (kSplit) {
        // dV and dK retire first, so that P^T's and dS^T's registers are free before dQ's
        // 64 x D/2 accumulator is live (else ptxas serialises every wgmma at D=256, C7512)
        warpgroup_wait<0>();
        warpgroup_fence_operand(tDvrDv);
        warpgroup_fence_operand(tDkrDk);
        warpgroup_fence_operand(tPa_words);
        warpgroup_fence_operand(tDsa_words);
      }
      // dQ tile, this consumer's half of the columns, over all kBlockN keys
      warpgroup_fence_operand(tQrDq);
      warpgroup_arrive();
      mma_dq.accumulate_ = gmma::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tQrDs); ++kb) {
        cute::gemm(mma_dq, tQrDs(_, _, kb), tQrK(_, _, kb), tQrDq);
        mma_dq.accumulate_ = gmma::ScaleOut::One;
      }
      warpgroup_commit_batch();
      // this consumer's fp32 dQ fragments into the dQ tile, handed to the dQ warp ([Note] dQ
      // through shared memory)
      auto send_dq_tile = [&] {
        CUTE_UNROLL
        for (int g = 0; g < kDqCols / 8; ++g) {
          st_shared_float4(&dq_tile[wg * Traits::kDqConsumerFloat4 + g * 128 + tid],
                           tQrDq(make_coord(0, 0, g), 0, 0), tQrDq(make_coord(1, 0, g), 0, 0),
                           tQrDq(make_coord(0, 1, g), 0, 0), tQrDq(make_coord(1, 1, g), 0, 0));
        }
        cutlass::arch::fence_view_async_shared();
        named_barrier_arrive(kDqFullBarrier, kDqThreads);  // the dQ warp sends the tile
      };
      if constexpr (kDkAfterDq) {
        issue_dk();
        warpgroup_wait<1>();  // dV and dQ are in; dK runs on while the dQ tile is stored
        warpgroup_fence_operand(tQrDq);
        send_dq_tile();
      }
      warpgroup_wait<0>();  // also retires dV and dK: Q and dO of the slot are free
      warpgroup_fence_operand(tQrDq);
      warpgroup_fence_operand(tDvrDv);
      warpgroup_fence_operand(tDkrDk);
      warpgroup_fence_operand(tPa_words);
      warpgroup_fence_operand(tDsa_words);
      Barrier::arrive(&empty[st.stage]);
      if constexpr (kSplit) {
        bwd_dq_from_registers<Traits>(p, seq, batch, head0 + head, q_lo, n_block, tQrDq,
                                      wg, tid);
      } else if constexpr (!kDkAfterDq) {
        send_dq_tile();
      }
      st.advance();
    }
  }

  // epilogue: this warpgroup's 64 keys of dK (scaled) and dV, its kDkv columns of them
  const int rows_valid = seq.seqlen_k - key_lo;
  const int row_start = seq.k_start + key_lo;
  const int r0 = 16 * warp + lane / 4;
  const int col0 = col_wg * kDkv;
  const int cols_valid = f.head_dim - col0;
  if (p.dkv_partial != nullptr) {  // [Note] Backward group split: this split's fp32 partials
    float* dk = p.dkv_partial + split * p.part_split_stride + int64_t(batch) * p.part_batch_stride +
                int64_t(kv_head) * p.part_head_stride;
    store_rows<float, kDkv>(tDkrDk, args.grad_scale, dk + col0, p.part_row_stride, r0,
                            row_start, rows_valid, cols_valid, col_lane, p.dkv_add);
    store_rows<float, kDkv>(tDvrDv, 1.f, dk + p.part_half_stride + col0, p.part_row_stride, r0,
                            row_start, rows_valid, cols_valid, col_lane, p.dkv_add);
    return;
  }
  Element* dk = static_cast<Element*>(p.dk) + int64_t(batch) * p.dk_batch_stride +
                int64_t(kv_head) * p.dk_head_stride;
  Element* dv = static_cast<Element*>(p.dv) + int64_t(batch) * p.dv_batch_stride +
                int64_t(kv_head) * p.dv_head_stride;
  if constexpr (Traits::kStagedDkv) {
    if (args.dkv_staged) {  // [Note] dK and dV through shared memory
      named_barrier_sync(kEpilogueBarrier, kDsThreads);
      // this consumer's 64 rows of dK's and dV's kDkv columns, where K and V were
      Element* stage_k = smem_k + wg * 64 * kDkv;
      Element* stage_v = smem_v + wg * 64 * kDkv;
      stage_rows<Element, kDkv>(tDkrDk, args.grad_scale, stage_k, r0, col_lane);
      stage_rows<Element, kDkv>(tDvrDv, 1.f, stage_v, r0, col_lane);
      named_barrier_sync(kEpilogueWgBarrier + wg, 128);
      copy_staged_rows<Element, kDkv>(stage_k, dk + col0, p.dk_row_stride, row_start,
                                      rows_valid, cols_valid, tid);
      copy_staged_rows<Element, kDkv>(stage_v, dv + col0, p.dv_row_stride, row_start,
                                      rows_valid, cols_valid, tid);
      return;
    }
  }
  store_rows<Element, kDkv>(tDkrDk, args.grad_scale, dk + col0, p.dk_row_stride, r0, row_start,
                            rows_valid, cols_valid, col_lane);
  store_rows<Element, kDkv>(tDvrDv, 1.f, dv + col0, p.dv_row_stride, r0, row_start, rows_valid,
                            cols_valid, col_lane);
#endif
}

}  // namespace flash::hopper
