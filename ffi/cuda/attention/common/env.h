// Run-time knobs of the CUDA attention host code: environment variables read at every call, so
// one process can A/B kernels (benchmarks/ab_*.py).
#pragma once

#include <cstdlib>

namespace jax_sgl::cuda {

// An integer environment variable, or `fallback` when unset, empty or not a number.
inline int EnvInt(const char* name, int fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(env, &end, 10);
  return *end == '\0' ? int(v) : fallback;
}

}  // namespace jax_sgl::cuda
