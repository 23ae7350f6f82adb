// Host check of the paged sm90 forward's K/V ring layout (config.h SmemLayoutKVRows) against the
// order in which one 5-D page box (sm90/fwd/page_map.h: a block of 128 bytes of columns, or 64
// for e4m3 hd64's 64-byte rows, 8 rows, column block, kv head, 8-row group) writes shared
// memory: element (row r, column c, stage s) of the ring must sit where the box puts it,
// s * N * D + ((r / 8) * (D / W) + c / W) * 8 W + (r % 8) * W + c % W with W the block's
// elements, before the swizzle (applied by TMA and by wgmma alike on the smem address), and the
// swizzle must be the map's (128- or 64-byte). Every head dim of the sm90 forward, bf16 (fp16 is
// the same layout) and e4m3. Build and run on any machine with nvcc and the CuTe headers:
//   nvcc -std=c++17 --expt-relaxed-constexpr -I. -isystem <cutlass>/include \
//     -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED=1 -o /tmp/chk tools/check_page_box_layout.cu && /tmp/chk
// (.ci/run runs it.)
#include <cstdio>

#include "ffi/cuda/attention/sm90/fwd/config.h"

template <typename E, int kD>
int Check() {
  using Cfg = jax_sgl::cuda::sm90::FlashConfig<E, kD>;
  constexpr int kN = Cfg::kBlockN, kStages = Cfg::kStages;
  constexpr int kRowBytes = kD * int(sizeof(E));
  constexpr int kBlockBytes = kRowBytes < 128 ? 64 : 128;  // page_map.h's block and swizzle
  constexpr int kW = kBlockBytes / int(sizeof(E)), kBlocks = kD / kW;
  const auto rows = typename Cfg::SmemLayoutKVRows{};
  const auto plain = cute::get_nonswizzle_portion(rows);
  using Swizzle = std::decay_t<decltype(cute::get_swizzle_portion(rows))>;
  static_assert(std::is_same_v<Swizzle, cute::Swizzle<kBlockBytes == 128 ? 3 : 2, 4, 3>>,
                "the ring must carry the swizzle of the TMA map");
  int bad = 0;
  for (int s = 0; s < kStages; ++s)
    for (int r = 0; r < kN; ++r)
      for (int c = 0; c < kD; ++c) {
        const int want = s * kN * kD + ((r / 8) * kBlocks + c / kW) * 8 * kW + (r % 8) * kW + c % kW;
        if (int(plain(r, c, s)) != want && bad++ < 5)
          std::printf("hd%d (%d-byte): (%d, %d, %d) at %d, the box writes %d\n", kD,
                      int(sizeof(E)), r, c, s, int(plain(r, c, s)), want);
      }
  std::printf("hd%d, %d-byte elements: %d keys x %d stages, %s\n", kD, int(sizeof(E)), kN,
              kStages, bad ? "MISMATCH" : "ok");
  return bad;
}

int main() {
  using bf16 = cutlass::bfloat16_t;
  using e4m3 = cutlass::float_e4m3_t;
  return (Check<bf16, 64>() + Check<bf16, 128>() + Check<bf16, 256>() + Check<e4m3, 64>() +
          Check<e4m3, 128>() + Check<e4m3, 256>()) != 0;
}
