// Score hooks (softcap, band mask) and the online softmax of one consumer warpgroup.
//
// Glossary
//   frag         a wgmma accumulator of 64 rows x N columns, per thread shaped ((2, 2, N/8), 1, 1):
//                element ((c0, c1, g), 0, 0) is row r0 + 8*c1, column 8*g + 2*(lane % 4) + c0, with
//                r0 = 16*warp + lane/4 (warp and lane inside the warpgroup): each thread owns two
//                rows, and the four threads of a quad share them
//   log2 units   scores multiplied by scale * log2(e), so that exp becomes exp2 (one MUFU op)
//
// [Note] Fully masked rows never make NaN
// The running max of a row stays -inf until a visible key arrives. The exponent offset then uses
// 0 instead of -inf, so exp2(-inf - 0) = 0 for masked scores and the correction factor
// exp2(-inf - offset) = 0 multiplies an all-zero row. At the end a row with no visible key has
// sum 0: out = 0 and lse = -inf, or lse = s_aux with a sink (the sink joins as one more logit).
//
// [Note] Lazy rescale
// A row's running max moves often in its first key blocks and rarely after. Each move costs a
// multiply of the whole O accumulator row (at D=256, 128 registers per thread per step, as much
// ALU work as the step's exp2s). The max is therefore moved only when the block's max exceeds
// it by more than kRescaleSlack in log2 units; otherwise the row keeps its old max, and its
// correction factor is exactly 1. Probabilities are then at most 2^kRescaleSlack instead of 1,
// which bf16/fp16 P and the fp32 O and sum hold at the same relative precision, and the final
// lse = max + log2(sum) is the same value. One thing is lost: a row's largest probability is
// no longer exactly 1, so a peaked row carries its rounding (an fp32 emulation of the loop with
// bf16 P, keys scaled up to 6x: max error 1.45x the every-step rescale's; 1.0x on plain random
// scores). The consumer skips the O multiply when no row of its warp moved (a warp vote).
// The decision is quad-uniform (taken on the quad-reduced max), so the four threads that share
// a row keep one max.
//
// [Note] Softcap in log2 units
// With softcap c the score is c * tanh(scale * qk / c). The hook keeps t = tanh(scale * qk / c) in
// the accumulator and the softmax uses c * log2(e) as its scale, so one code path serves both.
#pragma once

#include <cute/tensor.hpp>
#include <climits>
#include <cmath>

namespace flash::hopper {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kRescaleSlack = 8.f;  // [Note] Lazy rescale, in log2 units

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Number of 8-column groups in an accumulator fragment type.
template <class Frag>
__host__ __device__ constexpr int frag_col_groups() {
  using Layout = typename cute::remove_cvref_t<Frag>::layout_type;
  return decltype(cute::size<0, 2>(Layout{}))::value;
}

// Band + sequence-end mask. kWindow=false compiles the band out; the sequence end stays.
template <bool kWindow>
struct BandMask {
  int seqlen_k;
  int diag;  // Sk - Sq: query i sits on key i + diag
  int left, right;

  // True when some (row, col) of the rectangle is invisible; uniform per warpgroup.
  __device__ __forceinline__ bool needs_mask(int row_lo, int row_hi, int col_lo, int col_hi) const {
    bool any = col_hi >= seqlen_k;
    if constexpr (kWindow) {
      any |= left >= 0 && col_lo < row_hi + diag - left;
      any |= right >= 0 && col_hi > row_lo + diag + right;
    }
    return any;
  }

  // s: accumulator fragment; row0 = this thread's first row, col0 = first column of the block
  // plus 2 * (lane % 4).
  template <class Frag>
  __device__ __forceinline__ void apply(Frag& s, int row0, int col0) const {
    constexpr int kGroups = frag_col_groups<Frag>();
    CUTE_UNROLL
    for (int c1 = 0; c1 < 2; ++c1) {
      const int row = row0 + 8 * c1;
      int lo = 0;
      int hi = seqlen_k - 1;
      if constexpr (kWindow) {
        if (left >= 0) lo = row + diag - left;
        if (right >= 0) hi = min(hi, row + diag + right);
      }
      CUTE_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        CUTE_UNROLL
        for (int c0 = 0; c0 < 2; ++c0) {
          const int col = col0 + 8 * g + c0;
          if (col < lo || col > hi) s(cute::make_coord(c0, c1, g), 0, 0) = -INFINITY;
        }
      }
    }
  }

  // The backward's transposed tile: rows are keys (key0 = this thread's first key row), columns
  // are queries (q0 = first query of the block plus 2 * (lane % 4)); invisible entries get value.
  // Each key row's visible queries are one range [q_first, q_last], found before the row's
  // entries, so that an entry costs two compares and a select. Testing the window's bounds per
  // entry instead (they are run-time values) compiled to a branch around every entry.
  template <class Frag>
  __device__ __forceinline__ void apply_transposed(Frag& s, int key0, int q0, float value) const {
    constexpr int kGroups = frag_col_groups<Frag>();
    CUTE_UNROLL
    for (int c1 = 0; c1 < 2; ++c1) {
      const int key = key0 + 8 * c1;
      int q_first = 0;                             // queries are >= 0
      int q_last = key < seqlen_k ? INT_MAX : -1;  // a key past the sequence: no query sees it
      if constexpr (kWindow) {
        if (right >= 0) q_first = key - diag - right;              // key <= q + diag + right
        if (left >= 0) q_last = min(q_last, key - diag + left);    // key >= q + diag - left
      }
      CUTE_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        CUTE_UNROLL
        for (int c0 = 0; c0 < 2; ++c0) {
          const int q = q0 + 8 * g + c0;
          if (q < q_first || q > q_last) s(cute::make_coord(c0, c1, g), 0, 0) = value;
        }
      }
    }
  }
};

template <bool kSoftcap>
struct ScoreMod {
  float scale_over_cap;  // scale / softcap
  template <class Frag>
  __device__ __forceinline__ void apply(Frag& s) const {
    if constexpr (kSoftcap) {
      CUTE_UNROLL
      for (int i = 0; i < cute::size(s); ++i) s(i) = tanhf(s(i) * scale_over_cap);
    }
  }
};

struct OnlineSoftmax {
  float row_max[2];
  float row_sum[2];  // this thread's partial sum; the quad is reduced once, at the end

  __device__ __forceinline__ void init() {
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Turns scores s into unnormalised probabilities in place; returns in corr[] the factor the
  // rows of o must be multiplied by (rescale) before this block's P V is added: exactly 1 where
  // the row kept its max ([Note] Lazy rescale).
  template <class FragS>
  __device__ __forceinline__ void update(FragS& s, float scale_log2, float corr[2]) {
    constexpr int kGroupsS = frag_col_groups<FragS>();
    CUTE_UNROLL
    for (int c1 = 0; c1 < 2; ++c1) {
      float mx = row_max[c1];
      CUTE_UNROLL
      for (int g = 0; g < kGroupsS; ++g) {
        mx = fmaxf(mx, fmaxf(s(cute::make_coord(0, c1, g), 0, 0), s(cute::make_coord(1, c1, g), 0, 0)));
      }
      mx = quad_max(mx);
      // [Note] Lazy rescale; NaN (both -inf) and a first visible key (old -inf) move the max
      const bool keep = (mx - row_max[c1]) * scale_log2 <= kRescaleSlack;
      mx = keep ? row_max[c1] : mx;
      const float offset = mx == -INFINITY ? 0.f : mx * scale_log2;
      corr[c1] = keep ? 1.f : exp2_approx(row_max[c1] * scale_log2 - offset);
      row_max[c1] = mx;
      float sum = row_sum[c1] * corr[c1];
      CUTE_UNROLL
      for (int g = 0; g < kGroupsS; ++g) {
        CUTE_UNROLL
        for (int c0 = 0; c0 < 2; ++c0) {
          float& x = s(cute::make_coord(c0, c1, g), 0, 0);
          x = exp2_approx(fmaf(x, scale_log2, -offset));
          sum += x;
        }
      }
      row_sum[c1] = sum;
    }
  }

  // Whether a row of this thread's warp moved its max ([Note] Lazy rescale): warp-uniform.
  __device__ __forceinline__ static bool warp_rescales(const float corr[2]) {
    return __any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f);
  }

  template <class FragO>
  __device__ __forceinline__ static void rescale(FragO& o, const float corr[2]) {
    constexpr int kGroupsO = frag_col_groups<FragO>();
    CUTE_UNROLL
    for (int c1 = 0; c1 < 2; ++c1) {
      CUTE_UNROLL
      for (int g = 0; g < kGroupsO; ++g) {
        o(cute::make_coord(0, c1, g), 0, 0) *= corr[c1];
        o(cute::make_coord(1, c1, g), 0, 0) *= corr[c1];
      }
    }
  }

  // Normalises o; writes the natural-log lse of each row into lse[2]. sink_log2 is s_aux * log2(e)
  // or -inf without a sink.
  template <class FragO>
  __device__ __forceinline__ void finalize(FragO& o, float scale_log2, float sink_log2, float lse[2]) {
    constexpr int kGroupsO = frag_col_groups<FragO>();
    CUTE_UNROLL
    for (int c1 = 0; c1 < 2; ++c1) {
      float sum = quad_sum(row_sum[c1]);
      float m = row_max[c1] == -INFINITY ? -INFINITY : row_max[c1] * scale_log2;
      float o_scale = 1.f;
      if (sink_log2 != -INFINITY) {
        const float top = fmaxf(m, sink_log2);
        o_scale = exp2_approx(m - top);
        sum = sum * o_scale + exp2_approx(sink_log2 - top);
        m = top;
      }
      // sum >= 1 whenever a key is visible (the row maximum contributes exp2(0)), so the fast
      // reciprocal and log2 (MUFU, no denormal slow path) are exact to a few ulp here; this
      // runs once per tile on the path that the other warpgroup's GEMMs must hide.
      const float inv = sum > 0.f ? __fdividef(o_scale, sum) : 0.f;
      lse[c1] = sum > 0.f ? (m + __log2f(sum)) * kLn2 : -INFINITY;
      CUTE_UNROLL
      for (int g = 0; g < kGroupsO; ++g) {
        o(cute::make_coord(0, c1, g), 0, 0) *= inv;
        o(cute::make_coord(1, c1, g), 0, 0) *= inv;
      }
    }
  }
};

// The A-operand register layout of the PV GEMM for a key block of kGroups 8-column groups.
template <int kGroups>
using AOperandShape = cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1, cute::Int<kGroups / 2>>;

// The S accumulator, rounded to the input type, written as the register A operand of the PV
// GEMM: a K=16 slice of A is two consecutive 8-column groups of S, in the same per-thread order
// ((col pair, row + 8, col group), 1, N/16).
template <class FragS, class FragP>
__device__ __forceinline__ void to_a_operand(FragS const& s, FragP& p) {
  using Element = typename cute::remove_cvref_t<FragP>::value_type;
  constexpr int kGroups = frag_col_groups<FragS>();
  static_assert(kGroups % 2 == 0, "key block is a multiple of 16");
  using namespace cute;
  CUTE_UNROLL
  for (int kb = 0; kb < kGroups / 2; ++kb) {
    CUTE_UNROLL
    for (int v2 = 0; v2 < 2; ++v2) {
      CUTE_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        CUTE_UNROLL
        for (int v0 = 0; v0 < 2; ++v0) {
          p(make_coord(v0, v1, v2), 0, kb) = Element(s(make_coord(v0, v1, 2 * kb + v2), 0, 0));
        }
      }
    }
  }
}

}  // namespace flash::hopper
