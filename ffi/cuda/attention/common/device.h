// The device facts the attention plans depend on. The handlers read them from the current device
// (CurrentDeviceInfo); jax_sgl/_plan.py passes a made-up device, so which kernel a call would
// run on another GPU can be checked on any machine. No CUDA kernel syntax: host .cc files and
// launchers include it alike.
#pragma once

#include <cuda_runtime_api.h>

namespace jax_sgl::cuda {

struct DeviceInfo {
  int cc_major = 0;  // compute capability; 0 when unreadable (only the portable kernels run)
  int cc_minor = 0;
  // The defaults are an H100/H200's, for an attribute that cannot be read: only grid sizes and
  // pipeline depths depend on them.
  int num_sms = 132;
  int smem_optin = 227 * 1024;     // shared memory one block may opt in to
  int smem_per_sm = 228 * 1024;
  int smem_reserved = 1024;        // per block, by the driver
};

// Streaming multiprocessors of the current device into *sms, or the error that kept them unread.
inline cudaError_t CurrentSmCount(int* sms) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  return cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
}

// The current device's facts (six attribute reads: host-side lookups, no device work).
inline DeviceInfo CurrentDeviceInfo() {
  DeviceInfo info;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return info;
  auto read = [&](cudaDeviceAttr attr, int* value) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, attr, device) == cudaSuccess) *value = v;
  };
  read(cudaDevAttrComputeCapabilityMajor, &info.cc_major);
  read(cudaDevAttrComputeCapabilityMinor, &info.cc_minor);
  read(cudaDevAttrMultiProcessorCount, &info.num_sms);
  read(cudaDevAttrMaxSharedMemoryPerBlockOptin, &info.smem_optin);
  read(cudaDevAttrMaxSharedMemoryPerMultiprocessor, &info.smem_per_sm);
  read(cudaDevAttrReservedSharedMemoryPerBlock, &info.smem_reserved);
  return info;
}

// sm_90a code runs on exactly compute capability 9.0 (arch-specific PTX: no other device).
inline bool IsSm90(const DeviceInfo& dev) { return dev.cc_major == 9 && dev.cc_minor == 0; }

// sm_100a code runs on exactly compute capability 10.0 (10.3 would need sm_103a code).
inline bool IsSm100(const DeviceInfo& dev) { return dev.cc_major == 10 && dev.cc_minor == 0; }

}  // namespace jax_sgl::cuda
