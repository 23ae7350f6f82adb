// Host check of the paged sm90 forward's K/V ring layout (config.h SmemLayoutKVRows) against the
// order in which one 5-D page box (sm90/fwd/page_map.h: 64 columns, 8 rows, head-dim block, kv
// head, 8-row group) writes shared memory: element (row r, column c, stage s) of the ring must sit
// where the box puts it, s * N * D + ((r / 8) * (D / 64) + c / 64) * 512 + (r % 8) * 64 + c % 64,
// before the 128-byte swizzle (applied by TMA and by wgmma alike on the smem address), and the
// swizzle must be the 128-byte one. Every head dim of the sm90 forward, bf16 (fp16 is the same
// layout). Build and run on any machine with nvcc and the CuTe headers:
//   nvcc -std=c++17 --expt-relaxed-constexpr -I. -isystem <cutlass>/include \
//     -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED=1 -o /tmp/chk tools/check_page_box_layout.cu && /tmp/chk
// (.ci/run runs it.)
#include <cstdio>

#include "ffi/cuda/attention/sm90/fwd/config.h"

template <int kD>
int Check() {
  using Cfg = jax_sgl::cuda::sm90::FlashConfig<cutlass::bfloat16_t, kD>;
  constexpr int kN = Cfg::kBlockN, kStages = Cfg::kStages, kBlocks = kD / 64;
  const auto rows = typename Cfg::SmemLayoutKVRows{};
  const auto plain = cute::get_nonswizzle_portion(rows);
  static_assert(std::is_same_v<std::decay_t<decltype(cute::get_swizzle_portion(rows))>,
                               cute::Swizzle<3, 4, 3>>,
                "the ring must carry the 128-byte swizzle of the TMA map");
  int bad = 0;
  for (int s = 0; s < kStages; ++s)
    for (int r = 0; r < kN; ++r)
      for (int c = 0; c < kD; ++c) {
        const int want = s * kN * kD + ((r / 8) * kBlocks + c / 64) * 512 + (r % 8) * 64 + c % 64;
        if (int(plain(r, c, s)) != want && bad++ < 5)
          std::printf("hd%d: (%d, %d, %d) at %d, the box writes %d\n", kD, r, c, s,
                      int(plain(r, c, s)), want);
      }
  std::printf("hd%d: %d keys x %d stages, %s\n", kD, kN, kStages, bad ? "MISMATCH" : "ok");
  return bad;
}

int main() { return (Check<64>() + Check<128>() + Check<256>()) != 0; }
