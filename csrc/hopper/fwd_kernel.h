// sm90a forward attention kernel: a persistent CTA per SM, each running a static list of
// (query block, query head, batch) tiles ([Note] Persistent schedule).
//
// Glossary
//   producer     warpgroup 0: one elected thread issues every copy-engine (TMA) load; the
//                warpgroup keeps few registers (setmaxnreg) and its other warps leave at once
//   consumers    warpgroups 1 and 2: each owns 64 query rows of the tile and runs
//                S = Q K^T (SS wgmma), masking/softcap hooks, online softmax, O += P V (RS wgmma)
//   stage        one slot of the K ring and one of the V ring (kStages deep); `full_*` barriers
//                count the bytes the copy engine lands, `empty_*` barriers count the consumer
//                threads that finished reading the slot
//   phase        the parity bit of a ring slot's barrier, flipped each time the ring wraps
//   q_start/k_start  first token of this sequence on the token axis (varlen), else 0
//   unit         what the schedule hands a CTA: one tile, or two tiles of one (head, batch)
//                whose causal work adds up to a constant
//
// Key blocks are visited from the last visible one down to the first, so the partial blocks at
// the sequence end (and the diagonal) come first; each block is masked only when its rectangle
// touches an invisible element (BandMask::needs_mask), so interior blocks pay nothing.
// A consumer runs one loop over the CTA's steps, the (tile, key block) pairs of all its tiles
// ([Note] Step loop): the S GEMM of one step and the P V GEMM of the step before are in flight
// together, across tile boundaries too, and the softmax of the former overlaps the latter.
// Across the two consumers, the GEMMs of one warpgroup are issued while the other runs its
// softmax ([Note] Pingpong).
//
// [Note] Barrier protocol
// full_k[s]/full_v[s]: init count 1; the producer arrives once with the expected byte count and
// the loads complete the transaction. empty_k[s]/empty_v[s]: init count = all consumer threads;
// each arrives after its wgmma that read the slot has retired (warpgroup_wait<0>). The producer
// waits empty with the opposite parity, so the first pass through the ring does not block.
// The ring's stage and phase run on across tiles, so the next tile's K/V stream in as soon as
// the last blocks of this one are read. Q has a full/empty pair of its own (phase = parity of
// the tiles the CTA has started): it is loaded for every tile, even one with no visible key
// block (the consumers wait on it when their walk reaches the tile, release it unread, write
// zeros and -inf/s_aux, and move on). A consumer waits full_q before the tile's first S GEMM
// (the peeled one, or the loop iteration whose step starts the tile) and each consumer thread
// arrives on empty_q right after the tile's last S GEMM has retired (the warpgroup_wait<1> of
// the step of its last block; for a one-block tile, the step that starts it). The next tile's Q
// then lands while the last S GEMM's softmax runs; it is needed one iteration later, when the
// next tile's first S GEMM is issued together with this tile's last P V.
//
// [Note] Persistent schedule
// Batched calls launch one CTA per SM (fewer when there are fewer units); CTA c runs units c,
// c + grid, c + 2 grid, ... in the order unit -> (block pair or block, head, batch), blocks of
// one (head, batch) adjacent, so the CTAs working at one moment share a few heads' K/V in L2.
// Under a triangle band (a right bound, no left bound: causal) the work of query block m grows
// with m, so a unit pairs blocks num_m-1-j and j, whose work adds up to the same amount for
// every j: a static round robin then gives every CTA the same work, where single blocks in the
// same order would leave some CTAs a quarter more (the CTAs whose blocks are all long).
// Without a band every block costs the same and a unit is one block. Varlen batches, whose
// tiles differ by their documents' lengths, launch one CTA per tile in the same order and let
// the hardware balance them, as before the schedule existed. The producer and the consumers walk
// the same list and skip the same invalid tiles, so no tile index passes between them. The
// producer walks it with two nested loops, the consumers with a TileCursor advanced from inside
// their step loop; keep the two in the same order. Never hand the consumers' loop body (which
// holds the GEMMs) to a shared walker as a lambda: that put its accumulators on the stack
// (ptxas: 1184-byte frame at D=128 softcap).
//
// [Note] Pingpong
// One named barrier per consumer c (kPingpongBarrier + c, 256 threads: the 128 of c that wait
// plus the 128 of the consumer before c in the ring that arrive) hands the tensor cores round
// the ring 0, 1, ..., last, 0, ... (two or three consumers, [Note] Consumer warpgroups): in
// each step-loop iteration a consumer waits for its turn, issues its S and P V GEMMs, then gives
// the turn to the next and runs its softmax (and, at a tile boundary, stores the old tile's O)
// while the others' GEMMs execute. The turns run on across tiles. All consumers walk the same
// tiles with the same key-block ranges, so all have the same step count L, counted before the
// loop, and run L-1 iterations; the peeled first S GEMM and last P V take no turn. The last
// consumer grants the first turn (arrive on barrier 0) before its first S GEMM when L > 1 and
// withholds the grant of its last iteration; every other consumer grants in every iteration.
// Barrier 0: L-1 syncs (consumer 0), 1 + (L-2) arrivals (the last); barrier c > 0: L-1 syncs
// (consumer c), L-1 arrivals (consumer c-1); with L <= 1 none is used, and none is left pending
// at exit. A consumer never arrives twice on one barrier before its owner has synced on it: the
// turns form one sequence, a consumer's grant after turn k opens turn k+1, and its next grant
// comes after turn k + (consumers), which waited for turn k+1.
//
// [Note] Q descriptors
// The S GEMM reads Q through one wgmma descriptor per 16-column slice, each the base descriptor
// plus a constant. Q sits in one place for the whole kernel, so the compiler computes all of
// them once before the step loop and keeps them live (2 registers each, 32 at D=256); ptxas then
// spilled them and reloaded them from local memory in every iteration (fp16 D=256: 15 LDL.64 per
// step). The loop passes the base through an empty asm, so the slices are added per use like
// K's (whose stage is a run-time index).
#pragma once

#include <cuda.h>
#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "../flash_params.h"
#include "kernel_traits.h"
#include "softmax.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_HOPPER_DEVICE_PASS 1
#endif

namespace flash::hopper {

// The static tile list of [Note] Persistent schedule.
struct FwdSchedule {
  int num_m;          // query blocks per (head, batch): of Sq, or of the longest sequence (varlen)
  int units_per_hb;   // units per (head, batch): num_m, or ceil(num_m / 2) when paired
  int heads;          // Hq
  int units;          // units_per_hb * Hq * B
  bool paired;

  struct Tile {
    int m_block, head, batch;
  };

  // Tile `part` (0 or 1) of unit u; false when the unit has no such part.
  __host__ __device__ bool tile(int u, int part, Tile& t) const {
    const int j = u % units_per_hb;
    const int hb = u / units_per_hb;
    t.head = hb % heads;
    t.batch = hb / heads;
    t.m_block = num_m - 1 - j;  // longest first
    if (part == 0) return true;
    t.m_block = j;
    return paired && j < num_m - 1 - j;
  }
};

struct FwdArgs {
  CUtensorMap tma_q;  // (d, rows_q, Hq, B) boxes of (chunk, kBlockM, 1, 1)
  CUtensorMap tma_k;  // (d, rows_k, Hkv, B) boxes of (chunk, kBlockN, 1, 1)
  CUtensorMap tma_v;
  FlashParams p;
  FwdSchedule sched;
  float scale_log2;      // scale * log2(e), or softcap * log2(e) with softcap (see softmax.h)
  float scale_over_cap;  // scale / softcap (softcap only)
};

// Register budgets after setmaxnreg: Traits::kProducerRegisters and kConsumerRegisters
// ([Note] Consumer warpgroups). The producer only walks the schedule and issues copies; the
// consumers hold S, P and O (at D=128 with 176 keys: 88 + 44 + 64 registers).
// Hardware barrier ids of the pingpong hand-over (id 0 is __syncthreads), one per consumer.
constexpr int kPingpongBarrier = 1;
constexpr int kPingpongThreads = 256;

// `threads` (a multiple of 32) take part in hardware barrier `id`; arrive does not wait.
__device__ __forceinline__ void named_barrier_sync(int id, int threads = kPingpongThreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int id, int threads = kPingpongThreads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

struct SeqInfo {
  int q_start, k_start, seqlen_q, seqlen_k, tma_batch;

  SeqInfo() = default;

  __device__ __forceinline__ SeqInfo(const FlashParams& p, int batch) {
    if (p.cu_seqlens_q != nullptr) {
      q_start = p.cu_seqlens_q[batch];
      seqlen_q = p.cu_seqlens_q[batch + 1] - q_start;
      k_start = p.cu_seqlens_k[batch];
      seqlen_k = p.cu_seqlens_k[batch + 1] - k_start;
      tma_batch = 0;
    } else {
      q_start = k_start = 0;
      seqlen_q = p.seqlen_q;
      seqlen_k = p.seqlen_k;
      tma_batch = batch;
    }
  }
};

// Key blocks [n_min, n_max) that hold at least one key visible from the query rows
// [row_lo, row_hi] (the rows of this tile that exist).
template <class Traits>
__device__ __forceinline__ void key_block_range(const FlashParams& p, int row_lo, int row_hi,
                                                int seqlen_q, int seqlen_k, int& n_min, int& n_max) {
  constexpr int N = Traits::kBlockN;
  n_min = 0;
  n_max = (seqlen_k + N - 1) / N;
  if constexpr (Traits::kWindow) {
    const int diag = seqlen_k - seqlen_q;
    if (p.window_right >= 0) {
      const int last_key = row_hi + diag + p.window_right;  // may be negative
      n_max = min(n_max, last_key < 0 ? 0 : last_key / N + 1);
    }
    if (p.window_left >= 0) {
      const int first_key = row_lo + diag - p.window_left;
      n_min = first_key <= 0 ? 0 : first_key / N;
    }
  }
}

template <class Traits>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == Traits::kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// Issues the kChunks boxes of one (rows x kHeadDim) tile onto one barrier.
template <class Traits>
__device__ __forceinline__ void load_tile(const CUtensorMap* map, uint64_t* bar,
                                          typename Traits::Element* smem, int rows, int row,
                                          int head, int batch) {
  CUTE_UNROLL
  for (int c = 0; c < Traits::kChunks; ++c) {
    cute::SM90_TMA_LOAD_4D::copy(map, bar, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                 smem + c * rows * Traits::kChunk, c * Traits::kChunk, row, head,
                                 batch);
  }
}

// One warpgroup GEMM, issued and retired: c (+)= a * b over all K slices.
template <bool kZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  using namespace cute;
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? gmma::ScaleOut::Zero : gmma::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = gmma::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
}

// The tile of unit u, part `part`, with its sequence and visible key blocks; false when the unit
// has no such part or the tile holds no query row (varlen: a sequence shorter than the longest).
// The producer and the consumers call it alike, so they skip the same tiles.
template <class Traits>
struct TileWork {
  FwdSchedule::Tile t;
  SeqInfo seq;
  int n_min, n_max;

  TileWork() = default;

  __device__ __forceinline__ TileWork(const FwdArgs& args, int u, int part, bool& valid) {
    constexpr int M = Traits::kBlockM;
    valid = args.sched.tile(u, part, t);
    if (!valid) return;
    seq = SeqInfo(args.p, t.batch);
    valid = t.m_block * M < seq.seqlen_q;
    if (!valid) return;
    key_block_range<Traits>(args.p, t.m_block * M, min(t.m_block * M + M, seq.seqlen_q) - 1,
                            seq.seqlen_q, seq.seqlen_k, n_min, n_max);
  }
};

// The consumers' walk over the CTA's tile list: the valid tiles in the producer's order, one per
// next() (plain integer state, so the step loop can advance it; [Note] Persistent schedule).
struct TileCursor {
  int u, part;  // the (unit, part) looked at next

  __device__ __forceinline__ TileCursor() : u(blockIdx.x), part(0) {}

  template <class Traits>
  __device__ __forceinline__ bool next(const FwdArgs& args, TileWork<Traits>& w) {
    while (u < args.sched.units) {
      bool valid;
      w = TileWork<Traits>(args, u, part, valid);
      if (part == 1) {
        part = 0;
        u += gridDim.x;
      } else {
        part = 1;
      }
      if (valid) return true;
    }
    return false;
  }
};

// Writes this thread's two rows of O (the fp32 fragment o, or zeros when kZero) and their lse.
// thread_row: the thread's first row inside the tile.
template <class Traits, bool kZero, class FragO>
__device__ __forceinline__ void store_tile(const FlashParams& p, const TileWork<Traits>& w,
                                           int thread_row, int lane, FragO const& o,
                                           const float lse[2]) {
  using Element = typename Traits::Element;
  constexpr int D = Traits::kHeadDim;
  const int row0 = w.t.m_block * Traits::kBlockM + thread_row;
  const int col_lane = 2 * (lane % 4);
  Element* out = static_cast<Element*>(p.out) + int64_t(w.t.batch) * p.out_batch_stride +
                 int64_t(w.t.head) * p.out_head_stride;
  float* lse_out = p.lse + int64_t(w.t.batch) * p.lse_batch_stride +
                   int64_t(w.t.head) * p.lse_head_stride;
  CUTE_UNROLL
  for (int c1 = 0; c1 < 2; ++c1) {
    const int row = row0 + 8 * c1;
    if (row >= w.seq.seqlen_q) continue;
    Element* out_row = out + int64_t(w.seq.q_start + row) * p.out_row_stride;
    CUTE_UNROLL
    for (int g = 0; g < D / 8; ++g) {
      const int col = 8 * g + col_lane;
      if (col < p.head_dim) {
        // col is even and head_dim a multiple of 8: the pair is in range together
        __align__(4) Element pair[2];
        if constexpr (kZero) {
          pair[0] = pair[1] = Element(0.f);
        } else {
          pair[0] = Element(o(cute::make_coord(0, c1, g), 0, 0));
          pair[1] = Element(o(cute::make_coord(1, c1, g), 0, 0));
        }
        *reinterpret_cast<uint32_t*>(out_row + col) = *reinterpret_cast<uint32_t*>(pair);
      }
    }
    // a select, not lse[c1]: where this loop stays rolled, an indexed lse went to local memory
    if (lane % 4 == 0) lse_out[w.seq.q_start + row] = c1 == 0 ? lse[0] : lse[1];
  }
}

__device__ __forceinline__ float sink_log2_of(const FlashParams& p, int head) {
  return p.s_aux != nullptr ? p.s_aux[head] * kLog2e : -INFINITY;
}

// Normalises the finished O of tile w with its softmax state and stores O and lse.
template <class Traits, class FragO>
__device__ __forceinline__ void finish_tile(const FwdArgs& args, const TileWork<Traits>& w,
                                            OnlineSoftmax& softmax, FragO& o, int thread_row,
                                            int lane) {
  float lse[2];
  softmax.finalize(o, args.scale_log2, sink_log2_of(args.p, w.t.head), lse);
  store_tile<Traits, false>(args.p, w, thread_row, lane, o, lse);
}

// Moves the cursor to the next tile that has a visible key block and waits for its Q (true), or
// to the end of the list (false). The tiles without one on the way are finished here: their Q is
// waited for and released unread (the producer loads it like any other), O = 0 and lse = -inf,
// or s_aux with a sink (the finalize of a row with no visible key). q_phase: [Note] Barrier
// protocol.
template <class Traits>
__device__ __forceinline__ bool next_tile_with_keys(const FwdArgs& args, TileCursor& cursor,
                                                    TileWork<Traits>& w, uint64_t* full_q,
                                                    uint64_t* empty_q, uint32_t& q_phase,
                                                    int thread_row, int lane) {
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  while (cursor.next(args, w)) {
    Barrier::wait(full_q, q_phase);
    q_phase ^= 1u;
    if (w.n_max > w.n_min) return true;
    Barrier::arrive(empty_q);
    OnlineSoftmax none;
    none.init();
    auto o = cute::make_tensor<float>(
        cute::Layout<cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_1>, cute::_1, cute::_1>>{});
    cute::clear(o);
    float lse[2];
    none.finalize(o, args.scale_log2, sink_log2_of(args.p, w.t.head), lse);
    store_tile<Traits, true>(args.p, w, thread_row, lane, o, lse);
  }
  return false;
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) fwd_kernel(const __grid_constant__ FwdArgs args) {
#if defined(FLASH_HOPPER_DEVICE_PASS)
  using namespace cute;
  using Element = typename Traits::Element;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  constexpr int M = Traits::kBlockM, N = Traits::kBlockN, D = Traits::kHeadDim, S = Traits::kStages;
  const FlashParams& p = args.p;
  const int heads_per_kv = p.heads_q / p.heads_kv;

  extern __shared__ char smem_raw[];
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  Element* smem_q = reinterpret_cast<Element*>(smem);
  Element* smem_k = reinterpret_cast<Element*>(smem + Traits::kOffsetK);
  Element* smem_v = reinterpret_cast<Element*>(smem + Traits::kOffsetV);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Traits::kOffsetBarriers);
  uint64_t* full_q = bars;
  uint64_t* empty_q = bars + 1;
  uint64_t* full_k = bars + 2;
  uint64_t* full_v = full_k + S;
  uint64_t* empty_k = full_v + S;
  uint64_t* empty_v = empty_k + S;

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;  // inside the warpgroup
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    Barrier::init(full_q, 1);
    Barrier::init(empty_q, Traits::kConsumerThreads);
    CUTE_UNROLL
    for (int s = 0; s < S; ++s) {
      Barrier::init(&full_k[s], 1);
      Barrier::init(&full_v[s], 1);
      Barrier::init(&empty_k[s], Traits::kConsumerThreads);
      Barrier::init(&empty_v[s], Traits::kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (warp != 0 || !elect_one_sync()) return;
    prefetch_tma_descriptor(&args.tma_q);
    prefetch_tma_descriptor(&args.tma_k);
    prefetch_tma_descriptor(&args.tma_v);
    PipelineState<Traits> st;
    uint32_t tiles_done = 0;
    for (int u = blockIdx.x; u < args.sched.units; u += gridDim.x) {
      CUTE_NO_UNROLL
      for (int part = 0; part < 2; ++part) {
        bool valid;
        const TileWork<Traits> w(args, u, part, valid);
        if (!valid) continue;
        const int kv_head = w.t.head / heads_per_kv;
        Barrier::wait(empty_q, (tiles_done & 1u) ^ 1u);
        Barrier::arrive_and_expect_tx(full_q, Traits::kTileBytesQ);
        load_tile<Traits>(&args.tma_q, full_q, smem_q, M, w.seq.q_start + w.t.m_block * M,
                          w.t.head, w.seq.tma_batch);
        for (int n = w.n_max - 1; n >= w.n_min; --n) {
          const int row = w.seq.k_start + n * N;
          Barrier::wait(&empty_k[st.stage], st.phase ^ 1u);
          Barrier::arrive_and_expect_tx(&full_k[st.stage], Traits::kTileBytesKV);
          load_tile<Traits>(&args.tma_k, &full_k[st.stage], smem_k + st.stage * N * D, N, row,
                            kv_head, w.seq.tma_batch);
          Barrier::wait(&empty_v[st.stage], st.phase ^ 1u);
          Barrier::arrive_and_expect_tx(&full_v[st.stage], Traits::kTileBytesKV);
          load_tile<Traits>(&args.tma_v, &full_v[st.stage], smem_v + st.stage * N * D, N, row,
                            kv_head, w.seq.tma_batch);
          st.advance();
        }
        ++tiles_done;
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
  const int wg = warpgroup - 1;
  const int tid = threadIdx.x % 128;
  typename Traits::MmaS mma_s;
  typename Traits::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);

  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Traits::SmemLayoutQ{});
  Tensor sQw = local_tile(sQ, Shape<_64, Int<D>>{}, make_coord(wg, 0));
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutV{});
  Tensor tSrQ = thr_s.partition_fragment_A(sQw);  // (MMA, 1, D/16) descriptors
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, 1, D/16, S)
  Tensor tOrV = thr_o.partition_fragment_B(sV);   // (MMA, 1, N/16, S)
  Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<N>>{});
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_64, Int<D>>{});
  static_assert(decltype(size<0, 2>(tSrS))::value == N / 8, "accumulator layout ((2,2,N/8),1,1)");
  Tensor tOrP = make_tensor<Element>(AOperandShape<N / 8>{});
  Tensor tOrP_words = recast<uint32_t>(tOrP);  // for compiler fences around the async read of P

  const int col_lane = 2 * (lane % 4);
  const int thread_row = wg * Traits::kRowsPerWarpgroup + 16 * warp + lane / 4;  // in the tile
  const ScoreMod<Traits::kSoftcap> score_mod{args.scale_over_cap};
  PipelineState<Traits> st_k;  // slot of the block whose scores are computed next
  PipelineState<Traits> st_v;  // slot of the block whose P V is added next
  uint32_t q_phase = 0;        // parity of the tiles this CTA has started

  // [Note] Step loop: a step is one (tile, key block) pair; the CTA's steps are all the blocks
  // of all its tiles, in the order the producer loads them. Iteration i issues the S GEMM of
  // step i and the P V of step i-1 in one turn, whether or not step i starts a new tile: the
  // CTA's first S GEMM is peeled before the loop and its last P V after it, so no wgmma is
  // issued under a run-time condition (v3's `pending` flag made ptxas serialise them all, C7520).
  // A tile boundary changes only what runs after the GEMMs: once the P V of step i-1 has
  // retired, the old tile's O is finalised and stored and O is cleared, while the scores of
  // step i go through a fresh softmax. Both consumers walk the same tiles, so they run the same
  // number of steps L.
  int steps = 0;  // L
  {
    TileCursor c;
    TileWork<Traits> t;
    while (c.next(args, t)) steps += max(t.n_max - t.n_min, 0);
  }

  TileCursor cursor;
  TileWork<Traits> w;  // the tile of the current step
  OnlineSoftmax softmax;
  float corr[2];
  // Scores of key block n of tile t, already in tSrS: hooks, mask when the block needs it, softmax.
  auto scores_to_probs = [&](const TileWork<Traits>& t, int n) {
    const int row_lo = t.t.m_block * M + wg * Traits::kRowsPerWarpgroup;  // this warpgroup's rows
    const BandMask<Traits::kWindow> mask{t.seq.seqlen_k, t.seq.seqlen_k - t.seq.seqlen_q,
                                         p.window_left, p.window_right};
    score_mod.apply(tSrS);
    if (mask.needs_mask(row_lo, row_lo + Traits::kRowsPerWarpgroup - 1, n * N, n * N + N - 1)) {
      mask.apply(tSrS, t.t.m_block * M + thread_row, n * N + col_lane);
    }
    softmax.update(tSrS, args.scale_log2, corr);
  };

  if (steps > 0) {
    next_tile_with_keys(args, cursor, w, full_q, empty_q, q_phase, thread_row, lane);
    int n = w.n_max - 1;  // key block of the current step
    constexpr int kLast = Traits::kConsumerWarpgroups - 1;
    const int next_wg = wg == kLast ? 0 : wg + 1;  // whose turn follows ours
    if (wg == kLast && steps > 1) named_barrier_arrive(kPingpongBarrier + 0);  // [Note] Pingpong
    // Step 0: the S GEMM alone, outside the turns.
    softmax.init();
    clear(tOrO);
    mma_o.accumulate_ = gmma::ScaleOut::One;
    Barrier::wait(&full_k[st_k.stage], st_k.phase);
    warpgroup_gemm<true>(mma_s, tSrQ, tSrK(_, _, _, st_k.stage), tSrS);
    Barrier::arrive(&empty_k[st_k.stage]);
    if (n == w.n_min) Barrier::arrive(empty_q);  // the tile's last S GEMM has retired
    scores_to_probs(w, n);
    to_a_operand(tSrS, tOrP);
    st_k.advance();
    // [Note] Overlap inside a warpgroup: the scores of step i are issued before the P V of step
    // i-1, and the softmax of step i runs while that P V is on the tensor cores. O is rescaled by
    // step i's correction (or finalised, at a tile boundary) only after the P V has retired.
    for (int i = 1; i < steps; ++i) {
      const bool boundary = n == w.n_min;  // step i-1 was its tile's last block
      const TileWork<Traits> prev = w;     // the tile of step i-1
      if (boundary) {
        next_tile_with_keys(args, cursor, w, full_q, empty_q, q_phase, thread_row, lane);
        n = w.n_max - 1;
      } else {
        --n;
      }
      Barrier::wait(&full_k[st_k.stage], st_k.phase);
      // Q's descriptors, from a base the compiler cannot hoist ([Note] Q descriptors)
      gmma::DescriptorIterator q_desc = tSrQ.data();
      asm volatile("" : "+r"(q_desc.desc_.reg32_[0]));
      const Tensor tSrQ_now = make_tensor(q_desc, tSrQ.layout());
      named_barrier_sync(kPingpongBarrier + wg);  // our turn on the tensor cores
      warpgroup_fence_operand(tSrS);
      warpgroup_arrive();
      mma_s.accumulate_ = gmma::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tSrQ); ++kb) {
        cute::gemm(mma_s, tSrQ_now(_, _, kb), tSrK(_, _, kb, st_k.stage), tSrS);
        mma_s.accumulate_ = gmma::ScaleOut::One;
      }
      warpgroup_commit_batch();
      Barrier::wait(&full_v[st_v.stage], st_v.phase);
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP_words);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tOrP); ++kb) {
        cute::gemm(mma_o, tOrP(_, _, kb), tOrV(_, _, kb, st_v.stage), tOrO);
      }
      warpgroup_commit_batch();
      if (wg != kLast || i + 1 < steps) named_barrier_arrive(kPingpongBarrier + next_wg);
      warpgroup_wait<1>();  // scores of step i are in
      warpgroup_fence_operand(tSrS);
      Barrier::arrive(&empty_k[st_k.stage]);
      if (n == w.n_min) Barrier::arrive(empty_q);  // the tile's last S GEMM has retired
      OnlineSoftmax done = softmax;  // the old tile's state, finalised below on a boundary
      if (boundary) softmax.init();
      scores_to_probs(w, n);
      warpgroup_wait<0>();  // P V of step i-1 is in
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP_words);
      Barrier::arrive(&empty_v[st_v.stage]);
      to_a_operand(tSrS, tOrP);
      if (boundary) {
        finish_tile(args, prev, done, tOrO, thread_row, lane);
        clear(tOrO);  // the next P V accumulates onto it (ScaleOut::One); fenced before its issue
      } else if (OnlineSoftmax::warp_rescales(corr)) {  // [Note] Lazy rescale
        OnlineSoftmax::rescale(tOrO, corr);
      }
      st_k.advance();
      st_v.advance();
    }
    // Step L-1's P V alone, outside the turns.
    Barrier::wait(&full_v[st_v.stage], st_v.phase);
    warpgroup_gemm<false>(mma_o, tOrP, tOrV(_, _, _, st_v.stage), tOrO);
    Barrier::arrive(&empty_v[st_v.stage]);
    st_v.advance();
    finish_tile(args, w, softmax, tOrO, thread_row, lane);
  }
  // The tiles after the last one with a visible key block, if any, have none.
  next_tile_with_keys(args, cursor, w, full_q, empty_q, q_phase, thread_row, lane);
#endif
}

}  // namespace flash::hopper
