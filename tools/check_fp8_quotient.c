// Checks the quotient rope_pool_fused's CUDA kernel uses for its e4m3 pool write
// (ffi/cuda/rope_pool/rope_pool.cu ScaleDivider: x * inv with two fma residual corrections,
// inv = RN(1 / scale)) against IEEE division x / scale, over every finite float32 x (at a stride)
// for a set of scales. Where the two differ, both must give the same e4m3 byte: +-0 (quotients
// below 2^-30) or saturation (rounding past the largest float).
//   gcc -O2 -ffp-contract=off -o /tmp/check_fp8_quotient tools/check_fp8_quotient.c -lm
//   /tmp/check_fp8_quotient <random scales> <seed> <x stride>      e.g. 40 5 61 (about 40 s)
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float FromBits(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t Bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }

static float Quotient(float x, float scale, float inv) {
  const float q0 = x * inv;
  const float q1 = fmaf(fmaf(-q0, scale, x), inv, q0);
  const float q2 = fmaf(fmaf(-q1, scale, x), inv, q1);
  // q0 or q1 past the largest float: the quotient overflows (a later step would make NaN of it).
  return fabsf(q0) > 3.402823466e38f || isnan(q0) ? q0 : fabsf(q1) > 3.402823466e38f ? q1 : q2;
}

int main(int argc, char** argv) {
  if (argc != 4) { fprintf(stderr, "usage: %s <random scales> <seed> <x stride>\n", argv[0]); return 2; }
  const int random_scales = atoi(argv[1]);
  const uint64_t stride = (uint64_t)atoll(argv[3]);
  srand((unsigned)atoi(argv[2]));
  const float fixed[] = {1.f, 0.05f, 3.f, FromBits(0x3f7fffff), FromBits(0x3fffffff)};
  const int n_fixed = sizeof(fixed) / sizeof(fixed[0]);
  uint64_t differ = 0, same_byte = 0;
  for (int i = 0; i < n_fixed + random_scales; ++i) {
    float scale = i < n_fixed ? fixed[i]
                              : FromBits(((uint32_t)(107 + rand() % 30) << 23) | (rand() & 0x7fffff));
    volatile float s = scale;  // no constant folding of the division
    const float inv = 1.f / s;
    for (uint64_t u = 0; u < (1ull << 32); u += stride) {
      const float x = FromBits((uint32_t)u);
      if (!isfinite(x)) continue;
      const float want = x / s, got = Quotient(x, s, inv);
      if (Bits(got) == Bits(want)) continue;
      const int both_zero = fabsf(want) < 0x1p-30f && fabsf(got) < 0x1p-30f &&
                            signbit(want) == signbit(got);
      const int both_saturate = fabsf(want) > 448.f && fabsf(got) > 448.f &&
                                signbit(want) == signbit(got);
      if (both_zero || both_saturate) { ++same_byte; continue; }
      if (differ++ < 5) printf("scale %a x %a: x / scale %a, quotient %a\n", scale, x, want, got);
    }
  }
  printf("%llu quotients differ in their e4m3 byte; %llu differ only where e4m3 is the same\n",
         (unsigned long long)differ, (unsigned long long)same_byte);
  return differ != 0;
}
