// The one place the sm_90a flash forward's tile and schedule are chosen, per head dim. No CUDA
// or CuTe here: the host dispatch includes it.
//
// The choice does not depend on dtype (bf16 and fp16 run the same instructions), on causal (the
// best measured tile was the same both ways at every head dim) or on the call's length (a
// short-call choice, persistent 128-key tiles at S <= 2k, was measured and lost nowhere by
// enough to keep a second kernel). All figures: H200, ratios to cuDNN in the same run,
// benchmarks/notes/NOTES_sm90.md.
#pragma once

namespace jax_sgl::cuda::sm90 {

struct FwdTileSize {
  // Keys per tile: a multiple of 16 (the K step of P V), at most 256 (wgmma N, TMA box).
  int block_n;
  // Grid = #SMs, each CTA loops over work tiles; the loads of the next tile overlap the epilogue
  // of the current one. Else one CTA per tile.
  bool persistent;
  // The O rescale of a step runs between the issue of S = Q K^T and of P V, while the tensor
  // cores compute S, instead of after the softmax.
  bool early_rescale;
  // Depth of the K and V rings (fp8: also the V staging ring and the V^T ring). Two everywhere
  // the 16-bit kernels were measured: three K/V stages ran 3-5% slower there
  // (benchmarks/notes/experiments.md).
  int stages = 2;
  // Independent chains of the softmax's row max (softmax.h), merged at the end. One chain is N/4
  // dependent FMNMX a row (4 cycles each in the SASS) ahead of the step's first exponential;
  // four issue back to back.
  int max_chains = 1;
};

// Query rows per work tile (config.h kBlockM: two consumer warpgroups of 64 rows), for the host's
// tile counts (Sm90TileGrid).
inline constexpr int kSm90FwdBlockM = 128;

// Paged K/V: keys per TMA box of the page pool (config.h kPageBoxRows): 16 rows are two 8-row
// groups of swizzle atoms, so each box lands aligned in the key tile; the dispatch takes page
// sizes that are multiples of it, so that no box straddles a page.
inline constexpr int kSm90PageBoxRows = 16;

// sm90 serves head dims 64, 128 and 256 only (others run on the portable kernel).
constexpr bool Sm90FwdHeadDim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

constexpr FwdTileSize FwdTile(int head_dim) {
  // hd64: 192-key tiles halve the softmax rounds per FLOP, which matter most at hd64 (half the
  // GEMM per softmax element of hd128); persistent with the early rescale measured 0.996-0.998x
  // against 0.94-0.97x for 128-key tiles, and 1.01-1.05x with the tail split at 4k-8k.
  // hd128: persistent 128-key tiles, rescale after the softmax: best or tied-best in all twelve
  // (S 1k-8k, heads, mask) cells after the spill fix, 0.89-1.06x where 176-key tiles ran
  // 0.79-0.98x; 1.03-1.09x at 8k with the tail split. (176 keys: S 88 + P 44 + O 64 registers.)
  // hd256: O alone takes 128 registers, so keys come in tiles of 80 (Q 64 KiB + 2 stages x
  // 2 x 40 KiB = 224 KiB of smem), one CTA per tile with the early rescale: 1.07x non-causal,
  // 1.09x causal, against 0.96-1.03x persistent.
  // Four max chains at hd128: H100, 2026-12-07, bench_attention.py --head-dims 128 --seqlens 4096,
  // three same-call pairs against one chain: +2.9% / +2.4% full, +1.3% / +1.5% causal (16/16 and
  // 32/8 heads; every run above every one-chain run). The e4m3 kernel lost 2.3% with them
  // (FwdTileFp8 keeps one). hd64 / hd256 keep one too: with four, hd64 lost 0.4-1.7% and hd256
  // traded +1.5% full for -1% causal (H100, 2026-12-08, S 8k, A/B/B/A; experiments.md).
  return head_dim == 64    ? FwdTileSize{192, true, true}
         : head_dim == 128 ? FwdTileSize{128, true, false, 2, 4}
                           : FwdTileSize{80, false, true};
}

// fp8 hd128 ring depth. Two stages leave the producer about two consumer steps between the
// release of a V^T slot and the first reader of the tile it transposes into it, plus one step
// for that tile's V load; three (Q 16 + 3 x (K, V staging, V^T) 16 + O 32 KiB) fit only the
// 128-key tile, and the 16-bit kernels lost 3-5% to a third stage. A three-stage 128-key build
// was made (2026-12-05) but its timing run found no device time; the 192-key tile below holds
// two only.
inline constexpr int kFp8Hd128Stages = 2;
// fp8 hd128 keys per tile, a multiple of 64 (the V transpose's blocks, fp8.cuh Fp8TransposeMap,
// conflict-free at any of them): 192 amortizes each step's fixed work (O rescale, row max
// shuffles, barriers, wgmma descriptors: ~130 of a step's 469 instructions at 128) over 1.5x the
// keys, as FA3's wider fp8 tiles do (128 x 224 at hd128); smem holds it with two stages (Q 16 +
// 2 x 3 x 24 + O 32 = 192 KiB). H100, same session, bench_attention_fp8.py at S 4k (B*S 32k, 16
// heads): 742 / 637 TFLOP/s full / causal against 708 / 624 for 128 keys (+4.8% / +2.1%; 0.85x /
// 1.02x cuDNN fp8), the same error; S 16k was not reached in that run.
inline constexpr int kFp8Hd128Keys = 192;

// e4m3 inputs (FlashConfig::kFp8). Timed at hd128 only (the tile above; hd64 and hd256 not
// yet). The choices are bounded by registers and by the producer's V transpose (blocks of 16
// keys, four warps: tiles of a multiple of 64 keys). 128-key tiles at hd64. FA3 runs 128 x 224
// at hd128 (bytes are half those of bf16, so smem holds wider tiles); S (112) + P (28) + O (64)
// registers leave ptxas little room beside the 232 a consumer has, and 224 keys are no multiple
// of 64. hd256: 64-key tiles (O alone takes 128 registers; Q 32 KiB + K, V staging and V^T 2 x
// 16 KiB each + O bf16 64 KiB = 192 KiB), one CTA per tile; 0 spills in ptxas, where the bf16
// hd256 kernel spills (its consumers' S is 80 keys wide).
constexpr FwdTileSize FwdTileFp8(int head_dim) {
  return head_dim == 64    ? FwdTileSize{128, true, true}
         : head_dim == 128 ? FwdTileSize{kFp8Hd128Keys, true, false, kFp8Hd128Stages}
                           : FwdTileSize{64, false, true};
}

}  // namespace jax_sgl::cuda::sm90
