// Objective-C++ side of metal/host/context.h. Built only on macOS (metal/metal.cmake), with ARC.
//
// Zero-copy: XLA's CPU buffers live in unified memory, so a page-aligned buffer is wrapped with
// newBufferWithBytesNoCopy (length rounded up to whole pages, as Metal requires; the tail of the
// last page is never touched by the kernels). Others are staged through a shared-storage buffer:
// copied in, and copied back after the kernel for outputs.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "metal/host/context.h"

namespace jax_sgl::metal {
namespace {

// The metallib ships next to the extension module that contains this code.
NSString* MetallibPath() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<const void*>(&MetallibPath), &info) || !info.dli_fname) return nil;
  NSString* module = [NSString stringWithUTF8String:info.dli_fname];
  return [[module stringByDeletingLastPathComponent]
      stringByAppendingPathComponent:@"jax_sgl_kernels.metallib"];
}

class Context {
 public:
  static Context& Get() {
    static Context* ctx = new Context();  // never destroyed: XLA may call handlers at exit
    return *ctx;
  }
  bool ok() const { return device_ != nil && queue_ != nil && library_ != nil; }
  id<MTLDevice> device() const { return device_; }
  id<MTLCommandQueue> queue() const { return queue_; }

  id<MTLComputePipelineState> Pipeline(const char* name, std::string* error) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pipelines_.find(name);
    if (it != pipelines_.end()) return it->second;
    id<MTLFunction> fn = [library_ newFunctionWithName:[NSString stringWithUTF8String:name]];
    if (fn == nil) {
      *error = std::string("metallib has no kernel ") + name;
      return nil;
    }
    NSError* err = nil;
    id<MTLComputePipelineState> pso = [device_ newComputePipelineStateWithFunction:fn error:&err];
    if (pso == nil) {
      *error = std::string("pipeline ") + name + ": " +
               (err ? err.localizedDescription.UTF8String : "unknown error");
      return nil;
    }
    pipelines_.emplace(name, pso);
    return pso;
  }

 private:
  Context() {
    device_ = MTLCreateSystemDefaultDevice();
    if (device_ == nil) return;
    queue_ = [device_ newCommandQueue];
    NSString* path = MetallibPath();
    if (path == nil) return;
    NSError* err = nil;
    // Fails (and leaves the CPU path) on macOS older than the metallib's MSL version (3.1).
    library_ = [device_ newLibraryWithURL:[NSURL fileURLWithPath:path] error:&err];
  }

  id<MTLDevice> device_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  id<MTLLibrary> library_ = nil;
  std::mutex mu_;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

thread_local bool tls_declined = false;

}  // namespace

Mode SelectedMode() {
  static const Mode mode = [] {
    const char* env = std::getenv("JAX_SGL_METAL");
    if (env == nullptr || std::strcmp(env, "auto") == 0) return Mode::kAuto;
    return std::strcmp(env, "0") == 0 ? Mode::kOff : Mode::kForce;
  }();
  return mode;
}

bool UseMetal(double work, double auto_threshold) {
  const Mode mode = SelectedMode();
  if (mode == Mode::kOff) return false;
  if (mode == Mode::kAuto && work < auto_threshold) return false;
  return Context::Get().ok();
}

void MarkDeclined() { tls_declined = true; }

bool TakeDeclined() {
  const bool d = tls_declined;
  tls_declined = false;
  return d;
}

std::string Dispatch(const char* name, const Grid& grid, const std::vector<HostArg>& args,
                     const void* params, size_t params_bytes, int params_index) {
  @autoreleasepool {
    Context& ctx = Context::Get();
    std::string error;
    id<MTLComputePipelineState> pso = ctx.Pipeline(name, &error);
    if (pso == nil) return error;
    if (pso.maxTotalThreadsPerThreadgroup < grid.threads)
      return std::string(name) + ": threadgroup too large for this device";

    const size_t page = size_t(getpagesize());
    struct Bound {
      id<MTLBuffer> buffer;
      const HostArg* arg;
      bool staged;
    };
    std::vector<Bound> bound;
    bound.reserve(args.size());
    for (const HostArg& a : args) {
      id<MTLBuffer> buf = nil;
      bool staged = false;
      if (a.bytes == 0) {
        // Metal wants a buffer at every index; empty operands are flagged off in the params.
        buf = [ctx.device() newBufferWithLength:16 options:MTLResourceStorageModeShared];
      } else if (reinterpret_cast<uintptr_t>(a.data) % page == 0) {
        buf = [ctx.device() newBufferWithBytesNoCopy:a.data
                                              length:(a.bytes + page - 1) / page * page
                                             options:MTLResourceStorageModeShared
                                         deallocator:nil];
      }
      if (buf == nil && a.bytes > 0) {
        buf = [ctx.device() newBufferWithLength:a.bytes options:MTLResourceStorageModeShared];
        if (buf != nil) std::memcpy(buf.contents, a.data, a.bytes);
        staged = true;
      }
      if (buf == nil) return std::string(name) + ": cannot allocate a Metal buffer";
      bound.push_back({buf, &a, staged});
    }

    id<MTLCommandBuffer> cmd = [ctx.queue() commandBuffer];
    id<MTLComputeCommandEncoder> enc = [cmd computeCommandEncoder];
    [enc setComputePipelineState:pso];
    for (const Bound& b : bound) [enc setBuffer:b.buffer offset:0 atIndex:NSUInteger(b.arg->index)];
    [enc setBytes:params length:params_bytes atIndex:NSUInteger(params_index)];
    [enc dispatchThreadgroups:MTLSizeMake(grid.groups[0], grid.groups[1], grid.groups[2])
        threadsPerThreadgroup:MTLSizeMake(grid.threads, 1, 1)];
    [enc endEncoding];
    [cmd commit];
    [cmd waitUntilCompleted];
    if (cmd.status == MTLCommandBufferStatusError)
      return std::string(name) + ": " +
             (cmd.error ? cmd.error.localizedDescription.UTF8String : "command buffer failed");
    for (const Bound& b : bound)
      if (b.staged && b.arg->output) std::memcpy(b.arg->data, b.buffer.contents, b.arg->bytes);
    return std::string();
  }
}

}  // namespace jax_sgl::metal
