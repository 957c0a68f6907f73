// Compile-time shape of one forward instantiation: tiles, shared-memory layouts, warpgroup GEMMs.
//
// Glossary
//   kBlockM      query rows per CTA: 64 per consumer warpgroup, two or three of them
//   kBlockN      keys per pipeline stage
//                (kBlockM and kBlockN come from the tile table's band columns when kWindow)
//   kHeadDim     head dim the kernel is compiled for (inputs with d <= kHeadDim run on it; the
//                copy engine zero-fills columns d..kHeadDim, which add nothing to Q.K nor to O)
//   chunk        columns of one copy-engine box: one swizzle row (128, 64 or 32 bytes)
//   S = Q K^T    scores, fp32 in registers (SS GEMM: both operands in shared memory)
//   O += P V     output, fp32 in registers (RS GEMM: P from registers, V from shared memory)
//
// [Note] Shared-memory layouts and the copy engine
// Q and K tiles are (rows, kHeadDim), K-major; the V tile is viewed as (kHeadDim, kBlockN),
// MN-major, which is the same bytes as its (kBlockN, kHeadDim) rows: the PV GEMM reads V
// transposed through the descriptor, so V is never transposed in memory. All three are tiled
// from the hardware's swizzle atoms (8 rows x one swizzle row) with the atoms of one column chunk
// stacked down all rows first; that is exactly what one copy-engine box of (chunk columns x rows)
// writes with the matching swizzle mode, so a tile is `chunks` boxes placed `rows * chunk`
// elements apart. csrc/hopper/layout_check.cu checks this equivalence element by element.
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "build with -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (build.toml cuda-flags): see [Note] wgmma widths"
#endif
#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

#include "tile_sizes.h"

namespace flash::hopper {

namespace gmma = cute::SM90::GMMA;

template <int kSwizzleBytes, class T>
struct SwizzleAtoms;
template <class T>
struct SwizzleAtoms<128, T> {
  using K = gmma::Layout_K_SW128_Atom<T>;
  using MN = gmma::Layout_MN_SW128_Atom<T>;
};
template <class T>
struct SwizzleAtoms<64, T> {
  using K = gmma::Layout_K_SW64_Atom<T>;
  using MN = gmma::Layout_MN_SW64_Atom<T>;
};
template <class T>
struct SwizzleAtoms<32, T> {
  using K = gmma::Layout_K_SW32_Atom<T>;
  using MN = gmma::Layout_MN_SW32_Atom<T>;
};

template <class Element_, int kHeadDim_, bool kWindow_, bool kSoftcap_, bool kLongBand_ = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kWindow = kWindow_;    // causal or sliding window: band masking compiled in
  static constexpr bool kSoftcap = kSoftcap_;  // s = cap * tanh(s / cap) compiled in
  // a band without a left bound over many queries ([Note] Long bands in fwd_launch.h)
  static constexpr bool kLongBand = kLongBand_;

  using Tile = TileSize<kHeadDim>;
  static_assert(kWindow || !kLongBand, "the long-band tile is a band tile");
  static constexpr int kBlockM =
      kLongBand ? Tile::kBlockMLongBand : kWindow ? Tile::kBlockMBand : Tile::kBlockM;
  static constexpr int kBlockN = kWindow ? Tile::kBlockNBand : Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;

  // [Note] Consumer warpgroups: one per 64 query rows of the tile, taking turns on the tensor
  // cores ([Note] Pingpong in fwd_kernel.h). Two hide one consumer's softmax under the other's
  // GEMMs when the GEMMs are the longer part (D >= 96); at D=64 a step's softmax (its exp2
  // count does not shrink with D) outlasts one consumer's GEMMs, and three consumers hide it
  // under two. The register file is split by setmaxnreg: 128 x 24 for the producer, and
  // 256 x 240 or 384 x 160 for the consumers (<= 65536).
  static constexpr int kRowsPerWarpgroup = 64;
  static constexpr int kConsumerWarpgroups = kBlockM / kRowsPerWarpgroup;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = kConsumerWarpgroups == 2 ? 240 : 160;
  static_assert(kBlockM == kRowsPerWarpgroup * kConsumerWarpgroups, "one 64-row slice per consumer");
  static_assert(kConsumerWarpgroups == 2 || kConsumerWarpgroups == 3, "two or three consumers");
  static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <= 65536,
                "the register budgets fit the register file");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "GEMM K extents are multiples of 16");
  static_assert(kBlockN <= 256, "one copy-engine box and one wgmma cover the key block");

  static constexpr int kSwizzleBytes = kHeadDim % 64 == 0 ? 128 : kHeadDim % 32 == 0 ? 64 : 32;
  static constexpr int kChunk = kSwizzleBytes / int(sizeof(Element));
  static constexpr int kChunks = kHeadDim / kChunk;
  static_assert(kHeadDim % kChunk == 0, "head dim is a whole number of swizzle rows");

  using AtomK = typename SwizzleAtoms<kSwizzleBytes, Element>::K;
  using AtomMN = typename SwizzleAtoms<kSwizzleBytes, Element>::MN;

  using SmemLayoutQ = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // (kHeadDim, kBlockN, stage); key-rows mode first in the atom order so that one column chunk
  // covers all rows contiguously, as the copy engine writes it.
  using SmemLayoutV = decltype(cute::tile_to_shape(
      AtomMN{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));

  // [Note] wgmma widths: key blocks such as 176, 112 and 80 are single wgmma instructions only
  // with CUTLASS's extended shapes (CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, set in build.toml's
  // cuda-flags); without them the selector would tile the S GEMM into 16-wide instructions.
  using MmaS = decltype(cute::make_tiled_mma(
      gmma::ss_op_selector<Element, Element, float,
                           cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>()));
  using MmaO = decltype(cute::make_tiled_mma(
      gmma::rs_op_selector<Element, Element, float,
                           cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>,
                           gmma::Major::K, gmma::Major::MN>()));

  static constexpr int kTileBytesQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kTileBytesKV = kBlockN * kHeadDim * int(sizeof(Element));

  // Dynamic shared memory: Q, K stages, V stages, then the mbarriers; +1024 to align the base
  // (swizzled tiles need 1024-byte alignment; the dynamic base only promises 16).
  static constexpr int kOffsetK = kTileBytesQ;
  static constexpr int kOffsetV = kOffsetK + kStages * kTileBytesKV;
  static constexpr int kOffsetBarriers = kOffsetV + kStages * kTileBytesKV;
  static constexpr int kNumBarriers = 2 + 4 * kStages;  // Q full/empty, K/V full/empty
  static constexpr int kSmemBytes = kOffsetBarriers + 8 * kNumBarriers + 1024;
  static_assert(kTileBytesQ % 1024 == 0 && kTileBytesKV % 1024 == 0, "tiles keep 1024-byte alignment");
  static_assert(kSmemBytes <= 227 * 1024, "fits the sm90 per-block shared-memory limit");
  static_assert(cute::size<1>(typename MmaS::AtomShape_MNK{}) == kBlockN,
                "the S GEMM is one wgmma wide (see [Note] wgmma widths)");
};

}  // namespace flash::hopper
