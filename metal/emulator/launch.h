// Entry point of the emulated Metal kernels, free of Metal macros: runs the kernel registered
// under `name` (metal/kernels/kernel_names.h) over a grid, with buffers[i] bound at index i (the
// enums of metal/kernels/params.h) and `params` pointing at the kernel's Metal*Params struct.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jax_sgl::metal_emu {

// Throws std::invalid_argument for an unknown name and std::runtime_error when the emulator
// detects a barrier deadlock or a threadgroup-memory overflow.
void Launch(const std::string& name, const uint32_t groups[3], uint32_t threads,
            void* const* buffers, const void* params);

std::vector<std::string> KernelNames();

}  // namespace jax_sgl::metal_emu
