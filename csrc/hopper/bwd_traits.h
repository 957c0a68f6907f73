// Compile-time shape of one backward instantiation: tiles, shared-memory layouts, warpgroup GEMMs.
//
// Glossary
//   kBlockN      keys per CTA (two consumer warpgroups of 64 keys each; 64 keys shared by both
//                under a head-dim split); dK and dV of these keys stay in registers for the
//                whole CTA
//   kBlockM      query rows per pipeline step (one Q tile and one dO tile per stage)
//   S^T = K Q^T          scores, transposed (rows = keys), SS GEMM (RS at D=64: [Note] K and V
//                        in registers)
//   dP^T = V dO^T        SS GEMM (RS at D=64)
//   dV += P^T dO         RS GEMM: P^T from registers, dO read MN-major (its rows are the K extent);
//                        kDkvCols wide (half the head dim under a head-dim split)
//   dK += dS^T Q         RS GEMM, Q read MN-major
//   dQ_tile = dS K       SS GEMM over all kBlockN keys: both consumers write their dS^T into one
//                        shared tile (MN-major A), and each computes half of dQ's columns
//                        (K read MN-major, sliced at a column chunk), or 64 of its rows ([Note]
//                        dQ by query rows); the kBlockM x kHeadDim fp32 tile goes to shared
//                        memory and one bulk reduce-add sends it to dq_acc
//
// [Note] dQ by query rows
// At D=64 a 64-row step is short: five 64 x 64 x 64 GEMM units per consumer, against per-step
// costs that do not shrink with it (the full-barrier wait, two fences, the dS and dQ barriers).
// There a step takes 128 query rows (BwdTileSize<64>), so the same costs are spread over twice
// the tensor work. S^T and dP^T are 64 x 128 accumulators (64 registers each), which leaves no
// room for K and V in registers, so their GEMMs read K and V from shared memory again ([Note] K
// and V in registers); with 128 columns per instruction K's and V's bytes per multiply-add are
// half those at 64. The dV GEMM is issued only once P^T and dS^T are both in their register A
// operands (kLateDv): issued earlier, P^T's operand and the dV and dK GEMMs in flight beside the
// two accumulators make ptxas serialise every wgmma (C7512). The dQ GEMM splits by rows instead
// of columns: consumer w computes query rows [64 w, 64 w + 64) over all kHeadDim columns and all
// kBlockN keys. Its A operand is its 64 rows of the dS tile (one contiguous block of
// SmemLayoutDs), and its fragments are exactly one 64-row workspace block in the order the cast
// kernel reads (the same as two column halves), so dq_acc and the cast kernel are the same for
// every tile. The workspaces are aligned to 128 rows so that a 128-row step never reaches
// another sequence's rows ([Note] Backward workspaces in csrc/flash_params.h).
//
// [Note] Backward head-dim split
// Above D=128 the two-consumer decomposition does not fit: dK and dV of 64 keys are 2 x D/2
// fp32 registers per consumer thread (256 at D=256), and K, V of 128 keys plus two stages of Q
// and dO exceed shared memory. There (kSplitHeadDim) the CTA holds 64 keys and both consumers
// work on all of them: each computes the same S^T and dP^T (64 x kBlockM over the whole head
// dim) but owns half of the head dim's columns of dK, dV and dQ (kDkvCols = kDqCols = D/2: 64 +
// 64 + 64 registers at D=256). The price is the redundant S^T and dP^T: 7 GEMM units per step
// instead of 5. Each consumer stores its dS^T into a dS tile of its own, so the consumers never
// wait for each other (the pipeline slots aside). The fp32 dQ tile of
// 64 x D would not fit beside two pipeline stages either (64 KB at D=256), so each consumer adds
// its dQ fragments straight from registers into dq_acc (vector reductions in the same fragment
// order the dQ warp's tile has, so dq_acc and the cast kernel are unchanged) and the dQ warp is
// not used ([Note] dQ from registers in bwd_kernel.h).
//
// [Note] One tile, two views
// Q, dO, K and V land from the copy engine as (rows, kHeadDim) tiles in the chunk-stacked swizzled
// layout of kernel_traits.h. The K-major view feeds the GEMMs that contract over the head dim;
// the MN-major view of the same bytes, (kHeadDim, rows), feeds the GEMMs that contract over rows
// (dV, dK, dQ). Nothing is transposed in memory.
#pragma once

#include "kernel_traits.h"
#include "bwd_tile_sizes.h"

namespace flash::hopper {

template <class Element_, int kHeadDim_, bool kWindow_, bool kSoftcap_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kWindow = kWindow_;
  static constexpr bool kSoftcap = kSoftcap_;

  using Tile = BwdTileSize<kHeadDim>;
  static constexpr int kBlockM = kSoftcap ? Tile::kBlockMSoftcap : Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  // [Note] Backward head-dim split
  static constexpr bool kSplitHeadDim = kHeadDim > 128;
  // [Note] dQ by query rows: with 128 query rows per step each consumer's dQ GEMM takes 64 of
  // the rows and every column; with 64 rows, all the rows and half of the columns
  static constexpr bool kDqByRows = !kSplitHeadDim && kBlockM == 128;
  static constexpr int kDqRows = kDqByRows ? kBlockM / 2 : kBlockM;
  static constexpr int kDqCols = kDqByRows ? kHeadDim : kHeadDim / 2;
  // float4 of one consumer's dQ fragments in the fp32 dQ tile (fragment order: consumer w's
  // start at w times this)
  static constexpr int kDqConsumerFloat4 = kDqRows * kDqCols / 4;
  // the dV GEMM is issued after dS^T, not before it ([Note] dQ by query rows)
  static constexpr bool kLateDv = kDqByRows;
  // each consumer's columns of dK and dV
  static constexpr int kDkvCols = kSplitHeadDim ? kHeadDim / 2 : kHeadDim;
  // dK and dV leave through shared memory ([Note] dK and dV through shared memory in
  // bwd_kernel.h): a consumer's 64 x kDkvCols rows fit where its share of K (and of V) was, and
  // the swizzle wants whole groups of 8 chunks per row (not D=96 or 192)
  static constexpr bool kStagedDkv = kDkvCols % 64 == 0;

  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kKeysPerWarpgroup = 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static_assert(kBlockN == kKeysPerWarpgroup * (kSplitHeadDim ? 1 : kConsumerWarpgroups),
                "one 64-key slice per consumer, or one shared by both under a head-dim split");
  static_assert(kBlockM == 64 || (kBlockM == 128 && !kSplitHeadDim),
                "64 query rows per step, or 128 split by rows for the dQ GEMM");
  static_assert(kHeadDim % 16 == 0, "GEMM K extents are multiples of 16");

  // The widest swizzle whose column chunk divides a consumer's dQ columns, so that they are
  // whole chunks of the MN-major K view.
  static constexpr int kSwizzleBytes = kDqCols % 64 == 0 ? 128 : kDqCols % 32 == 0 ? 64 : 32;
  static constexpr int kChunk = kSwizzleBytes / int(sizeof(Element));
  static constexpr int kChunks = kHeadDim / kChunk;
  static_assert(kDqCols % kChunk == 0, "a consumer's dQ columns are whole swizzle rows");
  static_assert(kDqCols % 8 == 0, "dQ fragments are whole 8-column groups");

  using AtomK = typename SwizzleAtoms<kSwizzleBytes, Element>::K;
  using AtomMN = typename SwizzleAtoms<kSwizzleBytes, Element>::MN;

  template <int kRows, int kStagesT>
  using RowsK = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>, cute::Int<kStagesT>>{}));
  template <int kRows, int kStagesT>
  using RowsMN = decltype(cute::tile_to_shape(
      AtomMN{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kRows>, cute::Int<kStagesT>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));

  using SmemLayoutQ = RowsK<kBlockM, kStages>;     // Q and dO: (M, D, stage)
  using SmemLayoutQt = RowsMN<kBlockM, kStages>;   // the same bytes as (D, M, stage)
  using SmemLayoutK = RowsK<kBlockN, 1>;           // K and V: (N, D, 1)
  using SmemLayoutKt = RowsMN<kBlockN, 1>;         // K as (D, N, 1)
  // dS of the CTA as the A operand of the dQ GEMM, (M queries, N keys), queries contiguous, each
  // 64 query rows one contiguous block (a consumer's A operand under kDqByRows); and the same
  // bytes indexed (keys, queries), where each consumer stores its 64 rows of dS^T.
  using SmemLayoutDs = decltype(cute::tile_to_shape(
      gmma::Layout_MN_SW128_Atom<Element>{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>>{},
      cute::Step<cute::_2, cute::_1>{}));
  using SmemLayoutDsT = decltype(cute::composition(
      SmemLayoutDs{}, cute::make_layout(cute::Shape<cute::Int<kBlockN>, cute::Int<kBlockM>>{},
                                        cute::Stride<cute::Int<kBlockM>, cute::_1>{})));

  // [Note] K and V in registers
  // K and V stay in shared memory for the whole CTA, and the S^T and dP^T GEMMs read them as
  // their A operands in every step: with both operands in shared memory those GEMMs read
  // 2 x 64 x kHeadDim x 2 bytes per consumer per step on top of Q and dO, and the kernel is
  // bound by shared-memory bandwidth, not the tensor pipe (an H200 profile). Where the
  // registers allow (D=64: 16 + 16 per thread beside dK, dV, S^T, dP^T and the dQ half), each
  // consumer copies its 64 rows of K and V into registers once and the two GEMMs run RS.
  // With 128 query rows per step the S^T and dP^T accumulators take the registers K and V
  // would need ([Note] dQ by query rows).
  static constexpr bool kKvInRegisters = kHeadDim <= 64 && kBlockM == 64;
  using MmaSdP = decltype(cute::make_tiled_mma(cute::conditional_return<kKvInRegisters>(
      gmma::rs_op_selector<Element, Element, float,
                           cute::Shape<cute::_64, cute::Int<kBlockM>, cute::Int<kHeadDim>>>(),
      gmma::ss_op_selector<Element, Element, float,
                           cute::Shape<cute::_64, cute::Int<kBlockM>, cute::Int<kHeadDim>>>())));
  using MmaDkv = decltype(cute::make_tiled_mma(
      gmma::rs_op_selector<Element, Element, float,
                           cute::Shape<cute::_64, cute::Int<kDkvCols>, cute::Int<kBlockM>>,
                           gmma::Major::K, gmma::Major::MN>()));
  using MmaDq = decltype(cute::make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float,
                           cute::Shape<cute::Int<kDqRows>, cute::Int<kDqCols>, cute::Int<kBlockN>>,
                           gmma::Major::MN, gmma::Major::MN>()));

  // dS^T from the S^T/dP^T accumulator layout into the shared dS tile: one stmatrix per four
  // 8 x 8 blocks (a block's 8 query columns are 16 contiguous bytes of a key's row).
  using SmemCopyDs = decltype(cute::make_tiled_copy_C(
      cute::Copy_Atom<cute::SM90_U32x4_STSM_N, Element>{}, MmaSdP{}));

  static constexpr int kTileBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kTileBytesK = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kTileBytesDs = kBlockM * kBlockN * int(sizeof(Element));
  // one dS tile shared by the consumers, or one each under a head-dim split ([Note] dQ from
  // registers in bwd_kernel.h)
  static constexpr int kDsTiles = kSplitHeadDim ? kConsumerWarpgroups : 1;
  // the fp32 dQ tile the dQ warp sends; none under a head-dim split ([Note] dQ from registers)
  static constexpr int kTileBytesDq = kSplitHeadDim ? 0 : kBlockM * kHeadDim * int(sizeof(float));
  static constexpr int kRowBytes = kBlockM * int(sizeof(float));  // lse2 or delta of one step

  // Dynamic shared memory: K, V, Q stages, dO stages, dS, the fp32 dQ tile, lse2 and delta
  // stages, mbarriers; +1024 to align the base.
  static constexpr int kOffsetV = kTileBytesK;
  static constexpr int kOffsetQ = kOffsetV + kTileBytesK;
  static constexpr int kOffsetDo = kOffsetQ + kStages * kTileBytesQ;
  static constexpr int kOffsetDs = kOffsetDo + kStages * kTileBytesQ;
  static constexpr int kOffsetDq = kOffsetDs + kDsTiles * kTileBytesDs;
  static constexpr int kOffsetLse = kOffsetDq + kTileBytesDq;
  static constexpr int kOffsetDelta = kOffsetLse + kStages * kRowBytes;
  static constexpr int kOffsetBarriers = kOffsetDelta + kStages * kRowBytes;
  static constexpr int kNumBarriers = 1 + 2 * kStages;  // K/V, full[s], empty[s]
  static constexpr int kSmemBytes = kOffsetBarriers + 8 * kNumBarriers + 1024;
  static_assert(kTileBytesQ % 1024 == 0 && kTileBytesK % 1024 == 0, "tiles keep 1024-byte alignment");
  static_assert(kSmemBytes <= 227 * 1024, "fits the sm90 per-block shared-memory limit");
};

}  // namespace flash::hopper
