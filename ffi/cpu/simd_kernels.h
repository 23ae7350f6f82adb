// Float32 micro-kernel of the CPU attention kernels (forward and backward): the loop that holds
// nearly all the flops. It is compiled once per x86 ISA level (AVX-512, AVX2+FMA,
// baseline) and picked at load time, so a portable wheel still runs the wide FMA path.
#pragma once

namespace jax_sgl::cpu {

// out[i * ldo + c] += sum_e a[i * lda + e] * b[e * ldb + c] for i in [0, m), c in [0, n): the
// matrix product out += A B of A [m, len] and B [len, n], both row-major. With B = K^T stored
// feature-major it gives every score of a block of rows at once, with no horizontal sums; with
// B = V row-major, the forward's P V; with B = dO, Q or K row-major, the backward's dV, dK and
// dQ updates. Each element of B loaded serves four rows.
void MultiplyRows(const float* a, int lda, int m, const float* b, int ldb, int len, int n,
                  float* out, int ldo);

}  // namespace jax_sgl::cpu
