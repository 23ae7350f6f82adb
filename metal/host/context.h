// The process-wide Metal state behind jax_sgl's "cpu" handlers on macOS (Objective-C++ inside,
// plain C++ interface): the device, one command queue, the shipped metallib, a pipeline cache,
// and Dispatch(), which runs one kernel on XLA's host buffers through unified memory.
//
// Selection (JAX_SGL_METAL environment variable, read once):
//   unset / "auto": Metal for calls above a work threshold, the C++ CPU kernels below it
//   "1": Metal whenever the kernels support the call (tests compare the two paths with this)
//   "0": never Metal
// With no Metal device, no metallib, or an unsupported call, the CPU kernels run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "metal/host/plan.h"

namespace jax_sgl::metal {

enum class Mode { kOff, kAuto, kForce };
Mode SelectedMode();

// True when the Metal path is available and should run a call doing `work` (rough flop or
// element count; compared with `auto_threshold` in auto mode).
bool UseMetal(double work, double auto_threshold);

// One kernel argument: a host buffer (XLA's), bound at `index`. Outputs are copied back when the
// buffer had to be staged.
struct HostArg {
  int index;
  void* data;
  size_t bytes;
  bool output;
};

// Runs kernel `name` over `grid` with the args and `params` (bound with setBytes at
// params_index) and waits for it: an XLA CPU handler must return with its results written.
// Returns an empty string on success, else what failed.
std::string Dispatch(const char* name, const Grid& grid, const std::vector<HostArg>& args,
                     const void* params, size_t params_bytes, int params_index);

// Lets a handler hand the call back to the CPU kernels (see DeclineToCpu in handlers.h).
void MarkDeclined();
bool TakeDeclined();

}  // namespace jax_sgl::metal
