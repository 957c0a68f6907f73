// Host-only self-check: the shared-memory layouts the GEMMs read (kernel_traits.h) place every
// element exactly where the copy engine's swizzled boxes write it. Build and run:
//   nvcc -std=c++17 -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -I<cutlass include> \
//     csrc/hopper/layout_check.cu -o /tmp/layout_check && /tmp/layout_check
#include <cstdio>
#include <cstdlib>

#include "head_dims.h"
#include "kernel_traits.h"

namespace {

// Byte offset the copy engine writes element (row, col) of a (rows x kHeadDim) tile to, when the
// tile is loaded as kChunks boxes of (chunk columns x rows) placed one after another.
template <class Traits>
long box_offset(int row, int col, int rows) {
  constexpr int sw = Traits::kSwizzleBytes;
  const int chunk = col / Traits::kChunk;
  long o = long(row) * sw + long(col % Traits::kChunk) * long(sizeof(typename Traits::Element));
  const long mask = (sw / 16 - 1) << 4;  // 16-byte unit index inside one swizzle row
  o ^= (o >> 3) & mask;                   // XOR with the row index modulo (sw / 16)
  return o + long(chunk) * rows * sw;
}

template <class Traits>
int check() {
  using namespace cute;
  using T = typename Traits::Element;
  constexpr int M = Traits::kBlockM, N = Traits::kBlockN, D = Traits::kHeadDim, S = Traits::kStages;
  T* base = static_cast<T*>(std::aligned_alloc(1024, Traits::kSmemBytes * 2));
  int bad = 0;
  Tensor sQ = make_tensor(make_smem_ptr(base), typename Traits::SmemLayoutQ{});
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < D; ++c) {
      long got = long(reinterpret_cast<char*>(&sQ(r, c)) - reinterpret_cast<char*>(base));
      bad += got != box_offset<Traits>(r, c, M);
    }
  Tensor sK = make_tensor(make_smem_ptr(base), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(base), typename Traits::SmemLayoutV{});
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < N; ++r)
      for (int c = 0; c < D; ++c) {
        long want = box_offset<Traits>(r, c, N) + long(s) * Traits::kTileBytesKV;
        bad += long(reinterpret_cast<char*>(&sK(r, c, s)) - reinterpret_cast<char*>(base)) != want;
        bad += long(reinterpret_cast<char*>(&sV(c, r, s)) - reinterpret_cast<char*>(base)) != want;
      }
  std::free(base);
  std::printf("head dim %3d%s: M %d N %d stages %d swizzle %d smem %d B: %s (%d mismatches)\n", D,
              Traits::kWindow ? " band" : "", M, N, S, Traits::kSwizzleBytes, Traits::kSmemBytes,
              bad ? "FAIL" : "ok", bad);
  return bad;
}

}  // namespace

template <int kHeadDim>
int check_both_tiles() {
  using bf16 = cutlass::bfloat16_t;
  return check<flash::hopper::FwdTraits<bf16, kHeadDim, false, false>>() +
         check<flash::hopper::FwdTraits<bf16, kHeadDim, true, false>>();
}

int main() {
  int bad = 0;
#define FLASH_HOPPER_CHECK_HEAD_DIM(D) bad += check_both_tiles<D>();
  FLASH_HOPPER_FOR_EACH_HEAD_DIM(FLASH_HOPPER_CHECK_HEAD_DIM)
#undef FLASH_HOPPER_CHECK_HEAD_DIM
  return bad ? 1 : 0;
}
