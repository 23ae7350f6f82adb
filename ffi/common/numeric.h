// Scalar conversions between the storage dtypes jax_sgl accepts and float32, written with bit
// operations so the CPU backend needs no compiler support for _Float16 / __bf16 and rounds exactly
// as XLA does (round to nearest even; NaN stays NaN).
#pragma once

#include <cstdint>
#include <cstring>

#include "ffi/common/host_device.h"

namespace jax_sgl {

JAX_SGL_HD uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
JAX_SGL_HD float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// bfloat16 is the top half of a float32.
struct bf16_t {
  uint16_t bits;
};
JAX_SGL_HD float ToFloat(bf16_t x) { return BitsFloat(uint32_t(x.bits) << 16); }
JAX_SGL_HD bf16_t FromFloatBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{uint16_t(u >> 16)};
}

// IEEE binary16.
struct f16_t {
  uint16_t bits;
};
JAX_SGL_HD float ToFloat(f16_t x) {
  uint32_t h = x.bits;
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return BitsFloat(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return BitsFloat(sign);
    // Subnormal: value = man * 2^-24.
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (man << 13));
}
JAX_SGL_HD f16_t FromFloatF16(float f) {
  uint32_t u = FloatBits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return f16_t{uint16_t(sign | 0x7e00u)};
  if (abs >= 0x477ff000u) return f16_t{uint16_t(sign | 0x7c00u)};  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): scale so the integer part is the subnormal mantissa.
    float a = BitsFloat(abs);
    float scaled = a * 16777216.0f;  // 2^24
    uint32_t m = uint32_t(scaled);
    float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return f16_t{uint16_t(sign | m)};
  }
  uint32_t mant_round = abs + 0xfffu + ((abs >> 13) & 1u);
  return f16_t{uint16_t(sign | ((mant_round - 0x38000000u) >> 13))};
}

// float8_e4m3fn (no infinities; 0x7f/0xff are NaN). Inputs only: jax_sgl never writes fp8.
struct f8e4m3_t {
  uint8_t bits;
};
JAX_SGL_HD float ToFloat(f8e4m3_t x) {
  uint32_t b = x.bits;
  uint32_t sign = (b & 0x80u) << 24;
  uint32_t exp = (b >> 3) & 0xfu;
  uint32_t man = b & 0x7u;
  if (exp == 0xfu && man == 0x7u) return BitsFloat(sign | 0x7fc00000u);
  if (exp == 0) {
    float v = float(man) * 0.001953125f;  // man * 2^-9
    return sign ? -v : v;
  }
  return BitsFloat(sign | ((exp + 120u) << 23) | (man << 20));
}

// float8_e5m2: the top byte of an IEEE binary16.
struct f8e5m2_t {
  uint8_t bits;
};
JAX_SGL_HD float ToFloat(f8e5m2_t x) { return ToFloat(f16_t{uint16_t(uint16_t(x.bits) << 8)}); }

// float8_e8m0fnu: an exponent byte, 2^(bits - 127), the MX formats' block scale; 0xff is NaN.
// Every value is a float32 (2^-127 a subnormal), so the conversion is exact.
struct f8e8m0_t {
  uint8_t bits;
};
JAX_SGL_HD float ToFloat(f8e8m0_t x) {
  if (x.bits == 0xffu) return BitsFloat(0x7fc00000u);
  if (x.bits == 0) return BitsFloat(0x00400000u);  // 2^-127: mantissa bit 22 of a subnormal
  return BitsFloat(uint32_t(x.bits) << 23);
}

JAX_SGL_HD float ToFloat(float x) { return x; }

// Storage from float, selected by the destination type.
template <typename T>
JAX_SGL_HD T FromFloat(float f);
template <>
JAX_SGL_HD float FromFloat<float>(float f) { return f; }
template <>
JAX_SGL_HD bf16_t FromFloat<bf16_t>(float f) { return FromFloatBf16(f); }
template <>
JAX_SGL_HD f16_t FromFloat<f16_t>(float f) { return FromFloatF16(f); }

}  // namespace jax_sgl
