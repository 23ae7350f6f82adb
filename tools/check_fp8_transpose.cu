// Replays the Hopper e4m3 forward's V transpose (ffi/cuda/attention/sm90/fwd/fp8.cuh
// Fp8TransposeMap + TransposeBlock, the code TransposeV runs) on the host for every fp8 head dim
// and ring stage, with models of ldmatrix.x4.trans and stmatrix.x4 (b16): every V^T byte must be
// V(Fp8KeyOfColumn(k), d) of the same stage, written exactly once, every matrix row 16-byte
// aligned inside its ring. Prints, per shape, the worst smem bank conflict of one matrix's eight
// 16-byte rows (1: conflict-free). Both staging layouts: the dense / varlen ring (SmemLayoutKV)
// and the paged page boxes' rows form (SmemLayoutKVRows).
//   nvcc -std=c++17 --expt-relaxed-constexpr -I. -isystem build/cutlass \
//     -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED=1 -o /tmp/check_fp8_transpose \
//     tools/check_fp8_transpose.cu && /tmp/check_fp8_transpose
#include <cstdio>
#include <vector>

#include "ffi/cuda/attention/sm90/fwd/fp8.cuh"

namespace sm90 = jax_sgl::cuda::sm90;

// The most rows of one matrix (eight 16-byte rows) that share a 4-byte bank at distinct words.
int WorstBank(const uint32_t (&rows)[8]) {
  int worst = 0;
  for (int bank = 0; bank < 32; ++bank) {
    std::vector<uint32_t> words;
    for (uint32_t row : rows)
      for (uint32_t w = row / 4; w < row / 4 + 4; ++w)
        if (w % 32 == uint32_t(bank)) {
          bool seen = false;
          for (uint32_t x : words) seen |= x == w;
          if (!seen) words.push_back(w);
        }
    worst = int(words.size()) > worst ? int(words.size()) : worst;
  }
  return worst;
}

template <int kHeadDim, bool kRows>
bool Check() {
  using Cfg = sm90::FlashConfig<cutlass::float_e4m3_t, kHeadDim>;
  using LayoutV =
      std::conditional_t<kRows, typename Cfg::SmemLayoutKVRows, typename Cfg::SmemLayoutKV>;
  using Map = sm90::Fp8TransposeMap<Cfg, LayoutV>;
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
        // ldmatrix: lane 8 m + row names row `row` of matrix m.
        uint32_t load_row[4][8], store_row[4][8];
        for (int lane = 0; lane < 32; ++lane) {
          const Map map(32 * warp + lane);
          load_row[lane / 8][lane % 8] = Map::LoadStage(stage) + map.Load(it);
          store_row[lane / 8][lane % 8] = Map::StoreStage(stage) + map.Store(it);
        }
        for (int m = 0; m < 4; ++m) {
          for (int row = 0; row < 8; ++row) {
            if (load_row[m][row] % 16 || int(load_row[m][row]) + 16 > v_size) ok = false;
            if (store_row[m][row] % 16 || int(store_row[m][row]) + 16 > vt_size) ok = false;
          }
          const int lw = WorstBank(load_row[m]), sw = WorstBank(store_row[m]);
          worst_load = lw > worst_load ? lw : worst_load;
          worst_store = sw > worst_store ? sw : worst_store;
        }
        if (!ok) {
          std::printf("hd%d: a matrix row outside its ring or not 16-byte aligned\n", kHeadDim);
          return false;
        }
        for (int lane = 0; lane < 32; ++lane) {
          const Map map(32 * warp + lane);
          const int r = lane / 4, c = lane % 4;
          // .trans: lane (r, c) gets of matrix m the b16 elements (2c, r) and (2c + 1, r), i.e.
          // bytes 2r, 2r + 1 of rows 2c and 2c + 1. Labels 4 m + b name them; TransposeBlock moves
          // labels as it moves bytes.
          int src[16];
          uint32_t d[4], w[4];
          for (int m = 0; m < 4; ++m) {
            d[m] = (4 * m) | (4 * m + 1) << 8 | (4 * m + 2) << 16 | (4 * m + 3) << 24;
            src[4 * m + 0] = v[load_row[m][2 * c] + 2 * r];
            src[4 * m + 1] = v[load_row[m][2 * c] + 2 * r + 1];
            src[4 * m + 2] = v[load_row[m][2 * c + 1] + 2 * r];
            src[4 * m + 3] = v[load_row[m][2 * c + 1] + 2 * r + 1];
          }
          sm90::TransposeBlock(d, map.sel_even, map.sel_odd, w);
          // stmatrix: register i of lane (r, c) -> bytes 4c .. 4c + 3 of row r of matrix i.
          for (int i = 0; i < 4; ++i)
            for (int b = 0; b < 4; ++b) {
              const int off = int(store_row[i][r]) + 4 * c + b;
              vt[off] = src[(w[i] >> (8 * b)) & 0xff];
              ++writes[off];
            }
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
  std::printf("hd%d, %d-key tiles, %s V: %s; worst bank conflict: ldmatrix %d-way, stmatrix "
              "%d-way\n", kHeadDim, kN, kRows ? "paged (rows)" : "dense", ok ? "ok" : "WRONG",
              worst_load, worst_store);
  return ok;
}

int main() {
  const bool ok = Check<64, false>() & Check<128, false>() & Check<256, false>() &
                  Check<64, true>() & Check<128, true>() & Check<256, true>();
  return ok ? 0 : 1;
}
