// The per-node side of autotuning (op.cc's Tuner holds the process's decisions):
// which way a node runs a call, by its shape class, and the timing of the calls that
// measure.  StitchedKernel (op.cc: its kernel or its native segment) and
// StitchedAttention (attention.cc: the fused op or its unfused products around the
// softmax kernel) share it.  The two ops live in separate libraries, loaded
// RTLD_LOCAL, so there is one Tuner, op.cc's, and the OpenBLAS library reaches it
// through the C functions in `Api` (runtime/blas.py hands them over, as it hands the
// output pool): one table of decisions, one sink to the disk cache, one
// stitching.runtime.autotune_decisions().
#ifndef STITCHING_RUNTIME_TUNE_H_
#define STITCHING_RUNTIME_TUNE_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "tensorflow/core/framework/op_kernel.h"

namespace stitching_tune {

constexpr int kClasses = 64;  // log2 of the input bytes
enum Choice : int { kUndecided = 0, kKernel = 1, kNative = 2 };

// op.cc's Tuner as C functions (op.cc: TuneNext, TuneRecord, TunePreload, handed out
// as kTuneApi by stitching_tune_api).
struct Api {
  // The decision for (hash, cls), or kUndecided with the way to run now in *way and
  // whether to time it (*timed); *cached: the decision came from the cache.
  int (*next)(const char* hash, int cls, int measure, int* way, int* timed, int* cached);
  void (*record)(const char* hash, int cls, int way, int64_t ns);
  void (*preload)(const char* hash);
  // 1 when no kernel of the process runs tier-1 code or holds for its upgrade (op.cc
  // Registry::Settled): a StitchedAttention's unfused function holds a StitchedKernel,
  // whose code the op cannot see, so it measures only then (attention.cc).
  int (*settled)();
};

struct Counters {
  std::atomic<int64_t> cached{0};   // (node, class) decisions adopted from the cache
  std::atomic<int64_t> timed{0};    // calls run while measuring
  std::atomic<int64_t> native{0};   // calls served by the native way once decided
};

// floor(log2(bytes of all inputs)), the shape class a decision holds for.
inline int ShapeClass(tensorflow::OpKernelContext* ctx) {
  uint64_t bytes = 0;
  for (int i = 0; i < ctx->num_inputs(); ++i) bytes += ctx->input(i).TotalBytes();
  int cls = 0;
  while (bytes > 1 && cls < kClasses - 1) {
    bytes >>= 1;
    ++cls;
  }
  return cls;
}

// One node's decisions per shape class (a decided class costs the node one atomic
// load) and the call that follows them.
class Node {
 public:
  // Runs this call the tuned way and returns true, or returns false where the kernel
  // is this call's way and has not run (the caller runs it).  `measure` false: an
  // undecided class runs the kernel untimed (op.cc: tier-1 code is not what will run).
  // `native()` returns whether it ran the native way (false: it had to run the kernel).
  template <typename Kernel, typename Native>
  bool Run(const Api& api, const std::string& hash, tensorflow::OpKernelContext* ctx,
           bool measure, Counters* counts, Kernel kernel, Native native) {
    const int cls = ShapeClass(ctx);
    int d = decided_[cls].load(std::memory_order_acquire);
    if (d == kUndecided) {
      int way = kKernel, timed = 0, cached = 0;
      d = api.next(hash.c_str(), cls, measure, &way, &timed, &cached);
      if (d == kUndecided && !measure) return false;
      if (d == kUndecided) {
        const auto t0 = std::chrono::steady_clock::now();
        if (way == kNative) native(); else kernel();
        const auto dt = std::chrono::steady_clock::now() - t0;
        counts->timed.fetch_add(1, std::memory_order_relaxed);
        if (timed && ctx->status().ok()) {
          api.record(hash.c_str(), cls, way,
                     std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count());
        }
        return true;
      }
      if (decided_[cls].exchange(d) == kUndecided && cached) counts->cached.fetch_add(1);
    }
    if (d != kNative) return false;
    if (native()) counts->native.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

 private:
  std::atomic<int> decided_[kClasses] = {};   // per shape class: a Choice
};

}  // namespace stitching_tune

#endif  // STITCHING_RUNTIME_TUNE_H_
