// Replays the Hopper e4m3 forward's V transpose (ffi/cuda/attention/sm90/fwd/fp8.cuh
// Fp8TransposeMap + TransposeBlock4x4, the code TransposeV runs) on the host for every fp8 head
// dim and both ring stages: every V^T byte must be V(Fp8KeyOfColumn(k), d) of the same stage,
// written exactly once, and every load / store offset 4-byte aligned inside its ring. Prints, per
// shape, the worst smem bank conflict of a warp's 32-bit access (1: conflict-free).
//   nvcc -std=c++17 --expt-relaxed-constexpr -I. -isystem build/cutlass \
//     -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED=1 -o /tmp/check_fp8_transpose \
//     tools/check_fp8_transpose.cu && /tmp/check_fp8_transpose
#include <cstdio>
#include <vector>

#include "ffi/cuda/attention/sm90/fwd/fp8.cuh"

namespace sm90 = jax_sgl::cuda::sm90;

template <int kHeadDim>
bool Check() {
  using Cfg = sm90::FlashConfig<cutlass::float_e4m3_t, kHeadDim>;
  using Map = sm90::Fp8TransposeMap<Cfg>;
  using LayoutV = typename Cfg::SmemLayoutKV;
  using LayoutVt = typename Cfg::SmemLayoutVtFp8;
  constexpr int kN = Cfg::kBlockN, kD = Cfg::kHeadDim;
  const int v_size = int(cute::cosize_v<LayoutV>), vt_size = int(cute::cosize_v<LayoutVt>);
  bool ok = true;
  int worst_load = 0, worst_store = 0;
  for (int stage = 0; stage < Cfg::kStages; ++stage) {
    // Element ids instead of bytes: V(key, d) is key * kD + d + 1; 0 is "never written".
    std::vector<int> v(v_size, 0), vt(vt_size, 0), writes(vt_size, 0);
    for (int key = 0; key < kN; ++key)
      for (int d = 0; d < kD; ++d) v[int(LayoutV{}(key, d, stage))] = key * kD + d + 1;
    for (int warp = 0; warp < 4; ++warp) {
      for (int it = 0; it < Map::kPerThread; ++it) {
        uint32_t r[32][4], w[32][4];
        for (int i = 0; i < 4; ++i) {
          int banks[32] = {};
          for (int lane = 0; lane < 32; ++lane) {
            const Map map(32 * warp + lane, stage);
            const uint32_t off = map.Load(it, i);
            if (off % 4 != 0 || int(off) + 4 > v_size) { ok = false; continue; }
            ++banks[off / 4 % 32];
            // Byte labels 4 i + b: which load and which of its bytes (TransposeBlock4x4 moves
            // bytes, so the labels come out where the bytes go).
            r[lane][i] = (4 * i) | (4 * i + 1) << 8 | (4 * i + 2) << 16 | (4 * i + 3) << 24;
          }
          for (int b : banks) worst_load = b > worst_load ? b : worst_load;
        }
        for (int lane = 0; lane < 32; ++lane)
          sm90::TransposeBlock4x4(r[lane], Map(32 * warp + lane, stage).LoadSwap(),
                                  Map(32 * warp + lane, stage).Swap(), w[lane]);
        for (int j = 0; j < 4; ++j) {
          int banks[32] = {};
          for (int lane = 0; lane < 32; ++lane) {
            const Map map(32 * warp + lane, stage);
            const uint32_t off = map.Store(it, j);
            if (off % 4 != 0 || int(off) + 4 > vt_size) { ok = false; continue; }
            ++banks[off / 4 % 32];
            for (int b = 0; b < 4; ++b) {
              const int label = (w[lane][j] >> (8 * b)) & 0xff, i = label / 4, c = label % 4;
              vt[off + b] = v[map.Load(it, i) + c];
              ++writes[off + b];
            }
          }
          for (int bk : banks) worst_store = bk > worst_store ? bk : worst_store;
        }
      }
    }
    for (int d = 0; d < kD; ++d)
      for (int k = 0; k < kN; ++k) {
        const int off = int(LayoutVt{}(d, k, stage));
        const int want = int(sm90::Fp8KeyOfColumn(k)) * kD + d + 1;
        if (vt[off] != want || writes[off] != 1) {
          if (ok) std::printf("hd%d stage %d: V^T(%d, %d) = %d (want %d), written %d times\n",
                              kHeadDim, stage, d, k, vt[off], want, writes[off]);
          ok = false;
        }
      }
  }
  std::printf("hd%d, %d-key tiles (%s map): %s; worst bank conflict: loads %d-way, stores %d-way\n",
              kHeadDim, kN, Map::kMapped ? "bank" : "plain", ok ? "ok" : "WRONG", worst_load,
              worst_store);
  return ok;
}

int main() {
  const bool ok = Check<64>() & Check<128>() & Check<256>();
  return ok ? 0 : 1;
}
