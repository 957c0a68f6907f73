// Compile-time shape of one backward instantiation: tiles, shared-memory layouts, warpgroup GEMMs.
//
// Glossary
//   kBlockN      keys per CTA (two consumer warpgroups of 64 keys each); dK and dV of these keys
//                stay in registers for the whole CTA
//   kBlockM      query rows per pipeline step (one Q tile and one dO tile per stage)
//   S^T = K Q^T          scores, transposed (rows = keys), SS GEMM
//   dP^T = V dO^T        SS GEMM
//   dV += P^T dO         RS GEMM: P^T from registers, dO read MN-major (its rows are the K extent)
//   dK += dS^T Q         RS GEMM, Q read MN-major
//   dQ_part = dS K_wg    SS GEMM: dS written to shared memory (MN-major A), K read MN-major; each
//                        warpgroup adds the partial of its 64 keys into the fp32 dQ accumulator
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
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  // dQ partial of one warpgroup in kDqSplits column slices of kDqCols, so that its accumulator
  // never lives beside a full-width copy (registers: dK + dV + one slice)
  static constexpr int kDqSplits = Tile::kDqSplits;
  static constexpr int kDqCols = kHeadDim / kDqSplits;

  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kKeysPerWarpgroup = 64;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static_assert(kBlockN == kKeysPerWarpgroup * kConsumerWarpgroups, "one 64-key slice per consumer");
  static_assert(kBlockM == 64, "the dS tile is one 64 x 64 swizzle block");
  static_assert(kHeadDim % 16 == 0, "GEMM K extents are multiples of 16");

  static constexpr int kSwizzleBytes = kHeadDim % 64 == 0 ? 128 : kHeadDim % 32 == 0 ? 64 : 32;
  static constexpr int kChunk = kSwizzleBytes / int(sizeof(Element));
  static constexpr int kChunks = kHeadDim / kChunk;
  static_assert(kHeadDim % kChunk == 0, "head dim is a whole number of swizzle rows");
  static_assert(kDqSplits == 1 || kDqCols % kChunk == 0, "dQ slices are whole column chunks");

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
  // dS of one warpgroup as the A operand of the dQ GEMM, (M queries, 64 keys), queries contiguous;
  // and the same bytes indexed (keys, queries) to store the dS^T accumulator into.
  using SmemLayoutDs = decltype(cute::tile_to_shape(
      gmma::Layout_MN_SW128_Atom<Element>{}, cute::Shape<cute::Int<kBlockM>, cute::_64>{}));
  using SmemLayoutDsT = decltype(cute::composition(
      SmemLayoutDs{}, cute::make_layout(cute::Shape<cute::_64, cute::Int<kBlockM>>{},
                                        cute::Stride<cute::Int<kBlockM>, cute::_1>{})));

  using MmaSdP = decltype(cute::make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float,
                           cute::Shape<cute::_64, cute::Int<kBlockM>, cute::Int<kHeadDim>>>()));
  using MmaDkv = decltype(cute::make_tiled_mma(
      gmma::rs_op_selector<Element, Element, float,
                           cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockM>>,
                           gmma::Major::K, gmma::Major::MN>()));
  using MmaDq = decltype(cute::make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float,
                           cute::Shape<cute::Int<kBlockM>, cute::Int<kDqCols>, cute::_64>,
                           gmma::Major::MN, gmma::Major::MN>()));

  static constexpr int kTileBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kTileBytesK = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kTileBytesDs = kBlockM * 64 * int(sizeof(Element));
  static constexpr int kRowBytes = kBlockM * int(sizeof(float));  // lse2 or delta of one step

  // Dynamic shared memory: K, V, Q stages, dO stages, dS (2 buffers per consumer), lse2 and delta
  // stages, mbarriers; +1024 to align the base.
  static constexpr int kOffsetV = kTileBytesK;
  static constexpr int kOffsetQ = kOffsetV + kTileBytesK;
  static constexpr int kOffsetDo = kOffsetQ + kStages * kTileBytesQ;
  static constexpr int kOffsetDs = kOffsetDo + kStages * kTileBytesQ;
  static constexpr int kOffsetLse = kOffsetDs + 2 * kConsumerWarpgroups * kTileBytesDs;
  static constexpr int kOffsetDelta = kOffsetLse + kStages * kRowBytes;
  static constexpr int kOffsetBarriers = kOffsetDelta + kStages * kRowBytes;
  static constexpr int kNumBarriers = 1 + 2 * kStages;  // K/V, full[s], empty[s]
  static constexpr int kSmemBytes = kOffsetBarriers + 8 * kNumBarriers + 1024;
  static_assert(kTileBytesQ % 1024 == 0 && kTileBytesK % 1024 == 0, "tiles keep 1024-byte alignment");
  static_assert(kSmemBytes <= 227 * 1024, "fits the sm90 per-block shared-memory limit");
};

}  // namespace flash::hopper
