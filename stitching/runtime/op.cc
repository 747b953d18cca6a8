// StitchedKernel: one generic TensorFlow op that runs a fused kernel compiled by Numba.
//
// Design
// ------
// A graph node carries its fused region as a serialized spec (an opaque string to this
// file).  Native code cannot live in a graph, so code is resolved *in the running
// process*: a process-wide registry maps the exact spec string to an Entry holding two
// C function pointers produced by Numba `@cfunc`s plus the kernel's signature:
//
//   int64 shape_fn(const int64* in_dims, int64* params, int64* out_dims, int64* sched)
//   void  body(int64 begin, int64 end, void** ins, void** outs, const int64* params)
//
// or, for a kernel registered with a shape *program* (an int64 array the code generator
// wrote), the shape function is an interpreter shared by all such kernels:
//
//   int64 interp(const int64* program, const int64* in_dims, int64* params,
//                int64* out_dims, int64* sched)
//
// `sched` is in/out (4 words): on entry the entry's launch hint (rows per work unit,
// column block; 0 = let shape_fn choose), then 1, 0; on return the work units, the
// cost per unit, the number of phases and the bytes of temp memory the body needs.
// A kernel with phases > 1 (a row reduction split across units) is run over all its
// units once per phase, params[kPhaseSlot] = phase, each phase after the previous
// one finished; its temp buffer (partial reductions) is passed as outs[n_out].
// The hint is the cost model's choice for the node's own spec; the code may be shared
// with specs that chose differently (a shape-generic twin), so it is data, not code.
//
// The OpKernel constructor looks the spec up once (compiling on a miss through an
// optional Python callback) and checks the node's declared dtypes/ranks against the
// entry, so a tampered or stale graph fails with a TF error instead of running native
// code on the wrong buffers.  Compute() asks shape_fn for output shapes, kernel
// parameters and a work decomposition [0, sched[0]) with a per-unit cost, allocates the
// outputs, and runs body over that range on TF's intra-op pool.  Inputs are passed by
// their buffer pointers (no copy) and the body runs without the Python GIL.
//
// The registry and the compiler hook are exported with C linkage so that Python can
// drive them through ctypes on the same dlopen image that tf.load_op_library loaded.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "functions.h"
#include "tune.h"
#include "tensorflow/core/common_runtime/process_function_library_runtime.h"
#include "tensorflow/core/framework/allocator.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/framework/node_def_util.h"
#include "tensorflow/core/platform/logging.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tsl/profiler/lib/traceme.h"
#include "tsl/profiler/lib/traceme_encode.h"

#if GOOGLE_CUDA
#include "gpu/launcher.h"
#include "xla/stream_executor/activate_context.h"
#include "xla/stream_executor/stream.h"
#include "xla/stream_executor/stream_executor.h"
#endif

namespace stitching {
namespace {

using tensorflow::DataType;
using tensorflow::DataTypeVector;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::PartialTensorShape;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// ---- ABI ----------------------------------------------------------------------------

using BodyFn = void (*)(int64_t begin, int64_t end, void** ins, void** outs,
                        const int64_t* params);
using ShapeFn = int64_t (*)(const int64_t* in_dims, int64_t* params, int64_t* out_dims,
                            int64_t* sched);
using InterpFn = int64_t (*)(const int64_t* program, const int64_t* in_dims,
                            int64_t* params, int64_t* out_dims, int64_t* sched);
using CompilerFn = int (*)(const char* spec);

constexpr int kAbiVersion = 10;  // 8: the assets installer is a callback of its own,
                                 // 9: stitching_upgrade_body (tiered compiles),
                                 // 10: stitching_tier1_body (no autotuning on tier 1)
constexpr int64_t kMaxProgram = 1 << 20;   // sanity bound on a shape program's words
constexpr int kMaxParams = 32;      // size of the params array shape_fn may fill
constexpr int kPhaseSlot = kMaxParams - 1;   // params[31]: the phase being run
constexpr int64_t kMaxPhases = 64;  // sanity bound (the codegen stops at 9)
constexpr int kMaxRank = 64;        // sanity bound; the IR itself stops at 8
constexpr int kMaxTensors = 1024;   // sanity bound on inputs/outputs per kernel
constexpr size_t kMaxSpecBytes = size_t{1} << 20;   // ir/spec.py MAX_JSON_BYTES

// Everything needed to run one compiled kernel.  Immutable once registered but for
// `body`; kernels share it through shared_ptr so it outlives any registry change.
struct Entry {
  // The kernel's code.  A kernel first built quickly (tier 1; compile/parallel.py,
  // "Tiers") has it replaced by its optimized build once that is ready
  // (Registry::Upgrade).  A call
  // reads it once (RunKernel) and runs every unit and phase on that code, so a swap
  // takes effect at a call boundary; the old code stays mapped for the process's life
  // (no kernel object is ever unloaded), so calls still running it finish safely.
  mutable std::atomic<BodyFn> body{nullptr};
  // Set while `body` is tier-1 code expected to be slower than the region's own TF
  // ops (Registry::Hold): a node that has them runs them instead, until the upgrade
  // clears it.
  mutable std::atomic<bool> hold{false};
  // Set while `body` is tier-1 code (Registry::Tier1), held or not: the autotuner
  // (Tuner) does not time it, since its tier-2 code will run instead.
  mutable std::atomic<bool> tier1{false};
  ShapeFn shape_fn = nullptr;       // with an empty `program`
  InterpFn interp = nullptr;        // with a non-empty `program`
  std::vector<int64_t> program;
  std::vector<int> in_ranks, out_ranks;
  DataTypeVector in_dtypes, out_dtypes;
  std::vector<std::string> errors;
  // Static input dims the spec promises (-1: unknown), flattened like in_dims.  A
  // kernel compiled for a shape-generic twin does not check them itself.
  std::vector<int64_t> in_static;
  // Launch hint passed to shape_fn in sched[0..1]: rows per unit, column block.
  int64_t launch[2] = {0, 0};
  int in_dims_total = 0, out_dims_total = 0;
};

// ---- Registry -----------------------------------------------------------------------

class Registry {
 public:
  // Function-static and leaked on purpose: kernels may still run during static
  // destruction at process exit.
  static Registry& Get() {
    static Registry* r = new Registry;
    return *r;
  }

  // Returns true if newly inserted; an existing entry for the same spec is kept, so
  // registration is idempotent and a running kernel never sees its entry replaced.
  // Code already upgraded (Upgrade) is registered as its replacement: Python may read
  // a kernel's old address just before it upgrades.
  bool Insert(const std::string& spec, std::shared_ptr<const Entry> e) {
    std::lock_guard<std::mutex> lock(mu_);
    auto up = upgraded_.find(e->body.load(std::memory_order_relaxed));
    if (up != upgraded_.end()) e->body.store(up->second, std::memory_order_release);
    if (held_.count(e->body.load(std::memory_order_relaxed))) {
      e->hold.store(true, std::memory_order_release);
    }
    if (tier1_.count(e->body.load(std::memory_order_relaxed))) {
      e->tier1.store(true, std::memory_order_release);
    }
    return map_.emplace(spec, std::move(e)).second;
  }

  // `body` is tier-1 code: kernels running it (registered now or later, until its
  // upgrade) are not autotuned (Entry::tier1).
  void Tier1(BodyFn body) {
    std::lock_guard<std::mutex> lock(mu_);
    if (upgraded_.count(body)) return;  // upgraded already
    tier1_.insert(body);
    settled_.store(false, std::memory_order_release);
    for (auto& kv : map_) {
      if (kv.second->body.load(std::memory_order_relaxed) == body) {
        kv.second->tier1.store(true, std::memory_order_release);
      }
    }
  }

  // Kernels running `body` (registered now or later, until its upgrade) hold: their
  // nodes run the region's original ops (Entry::hold).
  void Hold(BodyFn body) {
    std::lock_guard<std::mutex> lock(mu_);
    if (upgraded_.count(body)) return;  // upgraded already: nothing to wait for
    held_.insert(body);
    settled_.store(false, std::memory_order_release);
    for (auto& kv : map_) {
      if (kv.second->body.load(std::memory_order_relaxed) == body) {
        kv.second->hold.store(true, std::memory_order_release);
      }
    }
  }

  // Every entry running `from` runs `to` from its next call on, and so does any entry
  // registered with `from` later.  Returns how many entries were switched now.
  int64_t Upgrade(BodyFn from, BodyFn to) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : upgraded_) {
      if (kv.second == from) kv.second = to;  // a chain of upgrades ends at `to`
    }
    upgraded_[from] = to;
    held_.erase(from);
    tier1_.erase(from);
    settled_.store(tier1_.empty() && held_.empty(), std::memory_order_release);
    int64_t n = 0;
    for (auto& kv : map_) {
      BodyFn expected = from;
      if (kv.second->body.compare_exchange_strong(expected, to,
                                                  std::memory_order_acq_rel)) {
        kv.second->hold.store(false, std::memory_order_release);  // after the code
        kv.second->tier1.store(false, std::memory_order_release);
        ++n;
      }
    }
    return n;
  }

  std::shared_ptr<const Entry> Find(const std::string& spec) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(spec);
    return it == map_.end() ? nullptr : it->second;
  }

  int64_t Size() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(map_.size());
  }

  // No tier-1 code waits for its upgrade (none held, none running): every kernel runs
  // its final code and no tiered compile is under way in this process.  One atomic
  // load: every StitchedAttention call asks.
  bool Settled() const { return settled_.load(std::memory_order_acquire); }

  void SetCompiler(CompilerFn fn) { compiler_.store(fn); }
  CompilerFn compiler() const { return compiler_.load(); }
  // The SavedModel assets installer (StitchedKernelAssets): a callback of its own, so
  // that no StitchedKernel spec, whatever it holds, can reach it.
  void SetInstaller(CompilerFn fn) { installer_.store(fn); }
  CompilerFn installer() const { return installer_.load(); }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const Entry>> map_;
  std::unordered_map<BodyFn, BodyFn> upgraded_;  // replaced code -> its replacement
  std::unordered_set<BodyFn> held_;              // tier-1 code whose nodes hold (Hold)
  std::unordered_set<BodyFn> tier1_;             // tier-1 code not upgraded yet (Tier1)
  std::atomic<bool> settled_{true};              // tier1_ and held_ empty (Settled)
  std::atomic<CompilerFn> compiler_{nullptr};
  std::atomic<CompilerFn> installer_{nullptr};
};

// The compiler callback reports a failure message through this thread-local buffer
// (stitching_set_compile_error); the callback runs on the thread that called it, so
// the message cannot be confused with another thread's.
thread_local std::string tls_compile_error;

absl::Status StatusFromCode(int code, const std::string& msg) {
  if (code <= 0 || code > static_cast<int>(absl::StatusCode::kUnauthenticated)) {
    code = static_cast<int>(absl::StatusCode::kInternal);
  }
  return absl::Status(static_cast<absl::StatusCode>(code), msg);
}

// Finds the entry for `spec`, asking the compiler callback on a miss.  The callback
// runs outside the registry mutex: it takes the Python GIL and calls back into
// stitching_register, which takes the mutex itself.
absl::Status Lookup(const std::string& spec, std::shared_ptr<const Entry>* out) {
  Registry& reg = Registry::Get();
  *out = reg.Find(spec);
  if (*out) return absl::OkStatus();

  CompilerFn compile = reg.compiler();
  if (compile != nullptr) {
    tls_compile_error.clear();
    int rc = compile(spec.c_str());
    if (rc != 0) {
      return StatusFromCode(
          rc, absl::StrCat("StitchedKernel: compiling the kernel spec failed: ",
                           tls_compile_error.empty() ? "(no message)"
                                                     : tls_compile_error));
    }
    *out = reg.Find(spec);
    if (*out) return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat(
      "StitchedKernel: no compiled kernel for this spec in this process",
      compile ? " (the compiler callback returned without registering it)" : "",
      "; import stitching and register the kernel (stitching.runtime.register) or "
      "install a compiler (stitching.runtime.set_compiler) before running this graph. "
      "Spec starts with: ",
      spec.substr(0, 120)));
}

std::string DtypesString(const DataTypeVector& v) {
  return absl::StrJoin(v, ",", [](std::string* s, DataType t) {
    absl::StrAppend(s, tensorflow::DataTypeString(t));
  });
}

// ---- Output pool --------------------------------------------------------------------
//
// Large outputs come from a process-wide caching allocator instead of TF's CPU
// allocator.  TF's default CPU allocator is glibc malloc: a buffer over malloc's mmap
// threshold (at most 32 MiB, often far less after a trim) is a fresh mmap on every
// call, and the kernel then pays one page fault per 4 KiB page on first write -- on
// the machines measured here that costs more than the fused kernel itself (a 32 MiB
// output: ~17 ms of faults against ~5 ms of work).  The pool keeps freed buffers by
// size class and hands them back to the next output of that class, so a steady-state
// step touches only warm pages.
//
// Only outputs of at least 32 MiB (STITCHING_OUTPUT_POOL_MIN_MB, at least 1) are
// pooled: glibc's mmap threshold adapts upwards to the sizes freed, up to 32 MiB, so
// smaller outputs come back from malloc's heap -- often the buffer the previous op just
// freed, still in cache.  A pooled 25.7 MB output was the colder one: squeeze-excite
// between other ops' runs took 2.96 ms pooled against 1.83 ms on TF's allocator, and
// bn_relu6 2.17 against 1.51 ms (2-core Xeon).  Idle cached bytes are capped
// (STITCHING_OUTPUT_POOL_MB, default 1024; 0 disables the pool); a buffer freed while
// the cache is full goes back to the OS.  Memory held here is not in TF's allocator
// statistics; stitching_pool_stats reports it.  The OpenBLAS op library (gemm.cc)
// takes its large outputs from this same pool (stitching_pool_for, blas_util.h
// AllocateOutput): one cap and one set of counters for both.
class OutputPool : public tensorflow::Allocator {
 public:
  static OutputPool& Get() {  // leaked on purpose, like the registry
    static OutputPool* p = new OutputPool;
    return *p;
  }

  static constexpr size_t kGranule = size_t{64} << 10;

  bool enabled() const { return cap_bytes_ > 0; }
  size_t min_bytes() const { return min_bytes_; }

  std::string Name() override { return "stitching_output_pool"; }

  void* AllocateRaw(size_t alignment, size_t num_bytes) override {
    const size_t cls = SizeClass(num_bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(cls);
      if (it != free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        idle_bytes_ -= cls;
        ++hits_;
        live_.emplace(p, cls);
        return p;
      }
      ++misses_;
    }
    void* p = nullptr;
    if (posix_memalign(&p, std::max<size_t>(alignment, 64), cls) != 0) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    live_.emplace(p, cls);
    held_bytes_ += cls;
    return p;
  }

  void DeallocateRaw(void* ptr) override {
    if (ptr == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(ptr);
      if (it == live_.end()) return;  // not ours: never happens, never free blindly
      const size_t cls = it->second;
      live_.erase(it);
      if (idle_bytes_ + cls <= cap_bytes_) {
        free_[cls].push_back(ptr);
        idle_bytes_ += cls;
        return;
      }
      held_bytes_ -= cls;
    }
    std::free(ptr);
  }

  // hits, misses, bytes held (live + idle), idle bytes, cap, smallest pooled output.
  void Stats(int64_t* out) {
    std::lock_guard<std::mutex> lock(mu_);
    out[0] = hits_;
    out[1] = misses_;
    out[2] = static_cast<int64_t>(held_bytes_);
    out[3] = static_cast<int64_t>(idle_bytes_);
    out[4] = static_cast<int64_t>(cap_bytes_);
    out[5] = static_cast<int64_t>(min_bytes_);
  }

  // Returns every idle buffer to the OS.
  void Trim() {
    std::vector<void*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& kv : free_) {
        for (void* p : kv.second) drop.push_back(p);
        held_bytes_ -= kv.first * kv.second.size();
      }
      free_.clear();
      idle_bytes_ = 0;
    }
    for (void* p : drop) std::free(p);
  }

 private:
  OutputPool() {
    cap_bytes_ = EnvMiB("STITCHING_OUTPUT_POOL_MB", 1024);
    min_bytes_ = std::max<size_t>(size_t{1} << 20, EnvMiB("STITCHING_OUTPUT_POOL_MIN_MB", 32));
  }

  // $name as a non-negative whole number of MiB, in bytes; `mib` when unset or invalid.
  static size_t EnvMiB(const char* name, int64_t mib) {
    if (const char* env = std::getenv(name)) {
      char* end = nullptr;
      const long long v = std::strtoll(env, &end, 10);
      if (end != env && *end == '\0' && v >= 0) mib = v;
    }
    return static_cast<size_t>(mib) << 20;
  }

  static size_t SizeClass(size_t n) { return (n + kGranule - 1) / kGranule * kGranule; }

  std::mutex mu_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> live_;
  size_t cap_bytes_ = 0, held_bytes_ = 0, idle_bytes_ = 0, min_bytes_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

// Allocates output i: from the pool when it is large enough to matter, else from TF.
absl::Status AllocateOutput(OpKernelContext* ctx, int i, const TensorShape& shape,
                            DataType dtype, Tensor** out) {
  OutputPool& pool = OutputPool::Get();
  const size_t bytes =
      static_cast<size_t>(shape.num_elements()) * tensorflow::DataTypeSize(dtype);
  if (!pool.enabled() || bytes < pool.min_bytes()) {
    return ctx->allocate_output(i, shape, out);  // not zero-filled
  }
  Tensor t(&pool, dtype, shape);
  if (!t.IsInitialized()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "StitchedKernel: could not allocate ", bytes, " bytes for output ", i));
  }
  ctx->set_output(i, t);
  *out = ctx->mutable_output(i);
  return absl::OkStatus();
}

// ---- Op -----------------------------------------------------------------------------

// Work below this estimated cost (shape_fn's units x cost per unit, roughly cycles)
// runs on the calling thread: waking a pool thread costs tens of microseconds on
// the machines measured, more than small kernels take.  STITCHING_INLINE_COST
// overrides it (read once).
int64_t InlineCost() {
  static const int64_t cost = [] {
    int64_t v = 400000;
    if (const char* env = std::getenv("STITCHING_INLINE_COST")) {
      char* end = nullptr;
      const long long x = std::strtoll(env, &end, 10);
      if (end != env && *end == '\0' && x >= 0) v = x;
    }
    return v;
  }();
  return cost;
}


// One phase of a kernel, units [0, total), shared by the calling thread and pool
// threads.  Each takes the next share of what is left (guided scheduling: 1/guide of
// the rest, at least `chunk` units) until nothing is left.  The caller starts at
// once; a pool thread joins when it wakes and takes only what is left, so a slow
// wake-up delays part of the work instead of all of it, and the shrinking shares end
// the threads together.  A pool thread that wakes after the last share was taken
// returns without touching the kernel's buffers (the queue itself is kept alive by
// its shared_ptr); the caller returns only when every unit is done.  Numerics do not
// depend on which thread runs a share: the caller is inside the executor's
// ScopedFlushDenormal (FTZ/DAZ, round to nearest) and TF's pool threads run under the
// same modes for their whole life.
//
// Why not ParallelFor: its Adaptive scheduling parks the caller while pool threads
// run every block.  logsumexp 8192x1024 took 1.5 ms through the op (0.2-0.3 ms of
// it thread hand-off, and fixed blocks ending unevenly) against 1.14 ms for the same
// body on two threads already running; with this queue, 1.42 ms, and far less
// run-to-run spread (tools/bench.py, stitching alone, 3 rounds each).
class UnitQueue {
 public:
  UnitQueue(BodyFn body, void** ins, void** outs, int64_t* params, int64_t total,
            int64_t chunk, int64_t guide)
      : body_(body), ins_(ins), outs_(outs), params_(params), total_(total),
        chunk_(chunk), guide_(guide) {}

  // Runs chunks until none is left to take.
  void Work() {
    for (;;) {
      int64_t begin = next_.load(std::memory_order_relaxed), end;
      do {
        if (begin >= total_) return;
        end = begin + std::max(chunk_, (total_ - begin) / guide_);
        end = std::min(total_, end);
      } while (!next_.compare_exchange_weak(begin, end, std::memory_order_relaxed));
      body_(begin, end, ins_, outs_, params_);
      if (done_.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) ==
          total_) {
        std::lock_guard<std::mutex> lock(mu_);  // so a waiter cannot miss it
        cv_.notify_all();
      }
    }
  }

  // Blocks until every unit has run (the last chunks may still be on pool threads).
  void Wait() {
    for (int spin = 0; spin < 2000; ++spin) {
      if (done_.load(std::memory_order_acquire) == total_) return;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_.load(std::memory_order_acquire) == total_; });
  }

 private:
  const BodyFn body_;
  void** const ins_;
  void** const outs_;
  int64_t* const params_;
  const int64_t total_, chunk_, guide_;
  std::atomic<int64_t> next_{0}, done_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

// Runs units [0, total) over the calling thread and NumThreads() - 1 pool threads
// (UnitQueue).
void RunUnits(tsl::thread::ThreadPool* pool, BodyFn body, void** ins, void** outs,
              int64_t* params, int64_t total, int64_t cost_per_unit) {
  const int64_t threads = std::max(1, pool->NumThreads());
  // guided: each take is a 1/(2 threads) share of what is left, at least `chunk`
  // units (~50k cycles of estimated cost, so a take outweighs its bookkeeping)
  const int64_t chunk = std::min((50000 + cost_per_unit - 1) / cost_per_unit,
                                 (total + threads - 1) / threads);
  auto queue =
      std::make_shared<UnitQueue>(body, ins, outs, params, total, chunk, 2 * threads);
  const int64_t helpers = std::min(threads - 1, (total + chunk - 1) / chunk - 1);
  for (int64_t i = 0; i < helpers; ++i) pool->Schedule([queue] { queue->Work(); });
  queue->Work();
  queue->Wait();
}

absl::Status StitchedShapeFn(tensorflow::shape_inference::InferenceContext* c) {
  std::vector<PartialTensorShape> shapes;
  DataTypeVector tout;
  TF_RETURN_IF_ERROR(c->GetAttr("output_shapes", &shapes));
  TF_RETURN_IF_ERROR(c->GetAttr("Tout", &tout));
  if (shapes.size() != tout.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("StitchedKernel: output_shapes has ", shapes.size(),
                     " entries but Tout has ", tout.size()));
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    tensorflow::shape_inference::ShapeHandle h;
    TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &h));
    c->set_output(static_cast<int>(i), h);
  }
  return absl::OkStatus();
}

// ---- spec_hash: SHA-256 of the spec, recorded at rewrite time ---------------------------
//
// A rewritten node records the first 24 hex digits of its spec's SHA-256 (the spec's
// own `hash`, ir/spec.py); a node whose spec was edited afterwards no longer matches
// and is refused at construction, whether or not a kernel for the edited spec is
// registered.  Plain FIPS 180-4 SHA-256: TF exports no hash that Python computes too.

std::string Sha256Hex(const std::string& msg) {
  static const uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
      0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
      0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
      0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
      0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
      0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
      0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
      0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
      0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string m = msg;
  const uint64_t bits = static_cast<uint64_t>(msg.size()) * 8;
  m.push_back(static_cast<char>(0x80));
  while (m.size() % 64 != 56) m.push_back('\0');
  for (int i = 7; i >= 0; --i) m.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (size_t off = 0; off < m.size(); off += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      const unsigned char* p = reinterpret_cast<const unsigned char*>(&m[off + 4 * i]);
      w[i] = (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
    }
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6],
             hh = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) +
                    k[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
  }
  static const char hex[] = "0123456789abcdef";
  std::string out;
  for (uint32_t v : h) {
    for (int i = 7; i >= 0; --i) out.push_back(hex[(v >> (4 * i)) & 0xf]);
  }
  return out;
}

REGISTER_OP("StitchedKernel")
    .Input("args: Tin")
    .Output("results: Tout")
    .Attr("spec: string")
    .Attr("Tin: list(type) >= 0")
    .Attr("Tout: list(type) >= 1")
    .Attr("output_shapes: list(shape) >= 1")
    .Attr("label: string = ''")
    .Attr("spec_hash: string = ''")
    .Attr("fallback: list(func) = []")
    .Attr("guard: list(func) = []")
    .SetShapeFn(StitchedShapeFn)
    .Doc(R"doc(
A fused region compiled to native code by stitching. `spec` is the serialized kernel
spec; the process resolves it to compiled code (stitching.runtime), so the graph stays
portable. `output_shapes` are static shapes for graph shape inference; `label` names the
region in reports and profiles. `spec_hash`, if set, is the first 24 hex digits of the
spec's SHA-256, checked before anything is looked up or compiled. `fallback`, if set,
is the region's original subgraph as a function, run instead when the kernel cannot be
built here (STITCHING_STRICT=1 makes that an error). `guard`, if set, is the same
function, run for a call whose inputs the kernel was not built for (a relaxed dim that
is 1 at run time and broadcasts, a rank the trace did not have): TF's answer, or TF's
error, where the kernel would have to refuse; and where the kernel cannot be built
and there is no `fallback`. Graphs written by stitching.function leave `guard` empty
and name that function in the string attr `_stitching_original` instead (a func attr
costs every instantiation of the graph an instantiation of the function).
)doc");

// ---- opt-in profiling -----------------------------------------------------------------
//
// STITCHING_PROFILE=1 (or stitching_profile_enable) counts, per node label, the calls,
// the wall time of Compute, its fastest call and the bytes of its inputs and outputs.
// Off, Compute pays one relaxed atomic load.  Slots live for the process (a label is a
// kernel node of a dumped function; there are few) so an op keeps a plain pointer to
// its own.  The fastest call is what a kernel costs on a machine other processes load:
// a call that waited for a descheduled pool thread moves the total, not the minimum.
struct ProfileSlot {
  std::string label;
  std::atomic<int64_t> calls{0}, nanos{0}, bytes{0}, min_nanos{kNoCall};
  static constexpr int64_t kNoCall = std::numeric_limits<int64_t>::max();
};

bool ProfileFromEnv() {
  const char* v = std::getenv("STITCHING_PROFILE");
  if (v == nullptr) return false;
  const std::string s(v);
  return s == "1" || s == "true" || s == "on" || s == "yes";
}

std::atomic<bool> g_profiling{ProfileFromEnv()};

class Profiles {
 public:
  static Profiles& Get() {
    static Profiles* p = new Profiles();  // never destroyed: ops may outlive statics
    return *p;
  }
  ProfileSlot* Slot(const std::string& label) {
    std::lock_guard<std::mutex> l(mu_);
    auto& s = slots_[label];
    if (!s) {
      s = std::make_unique<ProfileSlot>();
      s->label = label;
    }
    return s.get();
  }
  // "label\tcalls\tnanos\tbytes\tmin_nanos\n" per slot (min_nanos 0 before a call).
  std::string Text() {
    std::lock_guard<std::mutex> l(mu_);
    std::string out;
    for (const auto& kv : slots_) {
      const ProfileSlot& s = *kv.second;
      const int64_t fastest = s.min_nanos.load();
      absl::StrAppend(&out, s.label, "\t", s.calls.load(), "\t", s.nanos.load(), "\t",
                      s.bytes.load(), "\t", fastest == ProfileSlot::kNoCall ? 0 : fastest,
                      "\n");
    }
    return out;
  }
  void Reset() {
    std::lock_guard<std::mutex> l(mu_);
    for (auto& kv : slots_) {
      kv.second->calls = 0;
      kv.second->nanos = 0;
      kv.second->bytes = 0;
      kv.second->min_nanos = ProfileSlot::kNoCall;
    }
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::unique_ptr<ProfileSlot>> slots_;
};

// Times one Compute (every exit path) when profiling is on.
class ProfileScope {
 public:
  ProfileScope(OpKernelContext* ctx, const std::string& label,
               std::atomic<ProfileSlot*>* cached)
      : ctx_(ctx) {
    if (!g_profiling.load(std::memory_order_relaxed)) return;
    slot_ = cached->load(std::memory_order_acquire);
    if (slot_ == nullptr) {
      slot_ = Profiles::Get().Slot(label.empty() ? "?" : label);
      cached->store(slot_, std::memory_order_release);
    }
    t0_ = std::chrono::steady_clock::now();
  }
  ~ProfileScope() {
    if (slot_ == nullptr) return;
    const auto dt = std::chrono::steady_clock::now() - t0_;
    int64_t bytes = 0;
    for (int i = 0; i < ctx_->num_inputs(); ++i) bytes += ctx_->input(i).TotalBytes();
    for (int i = 0; i < ctx_->num_outputs(); ++i) {
      const Tensor* t = ctx_->mutable_output(i);
      if (t != nullptr) bytes += t->TotalBytes();
    }
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count();
    slot_->calls.fetch_add(1, std::memory_order_relaxed);
    slot_->nanos.fetch_add(ns, std::memory_order_relaxed);
    slot_->bytes.fetch_add(bytes, std::memory_order_relaxed);
    int64_t fastest = slot_->min_nanos.load(std::memory_order_relaxed);
    while (ns < fastest &&
           !slot_->min_nanos.compare_exchange_weak(fastest, ns, std::memory_order_relaxed)) {
    }
  }

 private:
  OpKernelContext* ctx_;
  ProfileSlot* slot_ = nullptr;
  std::chrono::steady_clock::time_point t0_;
};

// Kernels that run their fallback instead (stitching.runtime.stats()); the first time
// each label falls back, TF's log says why.
std::atomic<int64_t> g_fallbacks{0};
std::mutex g_fallback_mu;
std::string g_last_fallback;

void RecordFallback(const std::string& label, const std::string& why) {
  g_fallbacks.fetch_add(1);
  std::lock_guard<std::mutex> lock(g_fallback_mu);
  g_last_fallback = absl::StrCat(label, ": ", why);
  LOG(WARNING) << "StitchedKernel " << label << ": kernel unavailable (" << why
               << "); running the original subgraph instead";
}

// ---- autotune: the kernel or its native segment, decided by measurement --------------
//
// A node with the attr _stitching_autotune (Options(autotune=True) sets it where the
// cost model's predicted margin of fused over unfused is small) and a `fallback`
// function (its region's original TF ops) does not trust the model: on its first calls
// for each *shape class* (floor(log2(input bytes))) it runs the kernel and the native
// segment in turn, timing each (kTuneWarmup untimed runs of each way, then
// kTuneSamples timed ones), and from then on runs the way with the smaller median --
// cuDNN's autotuner, for fusion.  Every call still computes its outputs, whichever way
// ran.  Decisions are process-wide per (spec hash, class), so nodes sharing a spec
// measure together and decide once.
//
// Why here and not in Python at trace time: the op has the real inputs (a region deep
// in a model reads intermediate values that a trace-time measurement would have to
// fake), runs in the real surroundings (caches, pool threads, the other ops of the
// step), and already runs the native segment through the FunctionLibraryRuntime; no
// Python runs on the hot path (a decided class costs the node one atomic load).
//
// Persistence is Python's (runtime/autotune.py, the kernel cache's directory): the
// sink callback is told "load\t<hash>" when a tuned node for a spec is first built
// (Python answers with stitching_autotune_set for each class it has on disk) and
// "decided\t<hash>\t<class>\t<choice>\t<kernel ns>\t<native ns>" after a measurement.
constexpr int kTuneWarmup = 1;    // arbitrary: untimed runs of each way per class
constexpr int kTuneSamples = 5;   // arbitrary: timed runs of each way per class
constexpr int kTuneClasses = stitching_tune::kClasses;  // log2 of the input bytes
using stitching_tune::kKernel;
using stitching_tune::kNative;
using stitching_tune::kUndecided;

using TuneSink = int (*)(const char* msg);

std::atomic<int64_t> g_tune_measured{0};   // decisions made by measuring here
stitching_tune::Counters g_tune_counts;     // StitchedKernel nodes' (tune.h)

class Tuner {
 public:
  static Tuner& Get() {  // leaked on purpose, like the registry
    static Tuner* t = new Tuner;
    return *t;
  }

  void SetSink(TuneSink s) { sink_.store(s); }

  // Asks the sink once per spec hash for the decisions it keeps on disk.
  void Preload(const std::string& hash) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!asked_.insert(hash).second) return;
    }
    Tell(absl::StrCat("load\t", hash));
  }

  // The decision for (hash, cls), or kUndecided with the way to run now in *way and
  // whether to time it; *cached says a decision came from the cache.  With `measure`
  // false (the kernel runs tier-1 code) an undecided class runs the kernel untimed.
  int Next(const std::string& hash, int cls, bool measure, int* way, bool* timed,
           bool* cached) {
    std::lock_guard<std::mutex> lock(mu_);
    State& st = map_[Key(hash, cls)];
    if (st.choice != kUndecided) {
      *cached = st.from_cache;
      return st.choice;
    }
    if (!measure) {
      *way = kKernel;
      *timed = false;
      return kUndecided;
    }
    *way = st.kernel_runs <= st.native_runs ? kKernel : kNative;  // in turn, kernel first
    int& runs = *way == kKernel ? st.kernel_runs : st.native_runs;
    *timed = runs >= kTuneWarmup;
    ++runs;
    return kUndecided;
  }

  void Record(const std::string& hash, int cls, int way, int64_t ns) {
    std::string msg;
    {
      std::lock_guard<std::mutex> lock(mu_);
      State& st = map_[Key(hash, cls)];
      if (st.choice != kUndecided) return;
      (way == kKernel ? st.kernel_ns : st.native_ns).push_back(ns);
      if (st.kernel_ns.size() < kTuneSamples || st.native_ns.size() < kTuneSamples) return;
      st.kernel_med = Median(&st.kernel_ns);
      st.native_med = Median(&st.native_ns);
      st.choice = st.native_med < st.kernel_med ? kNative : kKernel;
      g_tune_measured.fetch_add(1);
      msg = absl::StrCat("decided\t", hash, "\t", cls, "\t", st.choice, "\t", st.kernel_med,
                         "\t", st.native_med);
    }
    Tell(msg);
  }

  // A decision from the cache; returns 1 when (hash, cls) was decided already (kept).
  int Set(const std::string& hash, int cls, int choice, int64_t kernel_ns,
          int64_t native_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    State& st = map_[Key(hash, cls)];
    if (st.choice != kUndecided) return 1;
    st.choice = choice;
    st.from_cache = true;
    st.kernel_med = kernel_ns;
    st.native_med = native_ns;
    return 0;
  }

  // "hash\tclass\tchoice\tkernel ns\tnative ns\tsource\n" per decided (hash, class);
  // choice 0 (undecided) for classes still being measured.
  std::string Text() {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out;
    for (const auto& kv : map_) {
      const State& st = kv.second;
      absl::StrAppend(&out, kv.first, "\t", st.choice, "\t", st.kernel_med, "\t",
                      st.native_med, "\t", st.from_cache ? "cache" : "measured", "\n");
    }
    return out;
  }

 private:
  struct State {
    int choice = kUndecided;
    bool from_cache = false;
    int kernel_runs = 0, native_runs = 0;
    std::vector<int64_t> kernel_ns, native_ns;
    int64_t kernel_med = 0, native_med = 0;
  };

  static std::string Key(const std::string& hash, int cls) {
    return absl::StrCat(hash, "\t", cls);
  }

  static int64_t Median(std::vector<int64_t>* v) {
    std::sort(v->begin(), v->end());
    return (*v)[v->size() / 2];
  }

  void Tell(const std::string& msg) {
    TuneSink s = sink_.load();
    if (s != nullptr) s(msg.c_str());  // outside the mutex: it takes the GIL
  }

  std::mutex mu_;
  std::unordered_map<std::string, State> map_;
  std::unordered_set<std::string> asked_;
  std::atomic<TuneSink> sink_{nullptr};
};

// The Tuner as tune.h's Api: what this library's nodes call, and what the OpenBLAS
// library's StitchedAttention calls through stitching_tune_api (runtime/blas.py).
int TuneNext(const char* hash, int cls, int measure, int* way, int* timed, int* cached) {
  bool t = false, c = false;
  const int d = Tuner::Get().Next(hash, cls, measure != 0, way, &t, &c);
  *timed = t;
  *cached = c;
  return d;
}
void TuneRecord(const char* hash, int cls, int way, int64_t ns) {
  Tuner::Get().Record(hash, cls, way, ns);
}
void TunePreload(const char* hash) { Tuner::Get().Preload(hash); }
int TuneSettled() { return Registry::Get().Settled() ? 1 : 0; }
const stitching_tune::Api kTuneApi{&TuneNext, &TuneRecord, &TunePreload, &TuneSettled};

class StitchedKernelOp : public OpKernel {
 public:
  explicit StitchedKernelOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string spec;
    DataTypeVector tin, tout;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spec", &spec));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label_));
    std::string spec_hash;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spec_hash", &spec_hash));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tin", &tin));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tout", &tout));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("output_shapes", &static_shapes_));
    OP_REQUIRES(ctx, static_shapes_.size() == tout.size(),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedKernel: output_shapes has ", static_shapes_.size(),
                    " entries but Tout has ", tout.size())));
    std::vector<tensorflow::NameAttrList> fallback;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fallback", &fallback));
    OP_REQUIRES_OK(ctx, CheckSpecText(ctx->def().name(), spec, spec_hash));
    // A node without a fallback of its own (a stitching.function's, saved and loaded
    // where its kernel cannot be built) runs its original function instead: the same
    // original ops.
    const bool has_fallback = !fallback.empty();
    if (!has_fallback) fallback = OriginalFunction(def());
    absl::Status found = Lookup(spec, &entry_);
    // InvalidArgument: the spec itself is bad (a corrupt or edited graph): an error,
    // never silently the fallback; anything else (no compiler, no Numba, a native
    // build failure) is this machine's, and the original subgraph serves instead.
    if (!found.ok() && found.code() != absl::StatusCode::kInvalidArgument &&
        !fallback.empty() && !StrictMode()) {
      OP_REQUIRES_OK(ctx, UseFallback(ctx, fallback[0], found));
      return;
    }
    if (!found.ok()) {   // which node of the graph, as the spec checks say
      absl::string_view msg = found.message();
      absl::ConsumePrefix(&msg, "StitchedKernel: ");
      OP_REQUIRES_OK(ctx, absl::Status(found.code(),
                                       absl::StrCat("StitchedKernel '", ctx->def().name(),
                                                    "' (", label_, "): ", msg)));
    }
    OP_REQUIRES_OK(ctx, CheckSignature(tin, tout));
    std::string tune;
    if (has_fallback &&
        tensorflow::TryGetNodeAttr(ctx->def(), "_stitching_autotune", &tune) &&
        !tune.empty()) {
      SetUpTuning(ctx, fallback[0], spec_hash);
    }
    // A held tier-1 kernel (Entry::hold): the region's original ops serve until its
    // tier-2 code is in; a node without them runs the tier-1 code.
    if (entry_->hold.load(std::memory_order_acquire) && !fallback.empty() &&
        ctx->function_library() != nullptr) {
      hold_ready_ = tune_ || InstantiateOriginal(ctx->function_library(), fallback[0],
                                                 &flib_, &fallback_handle_).ok();
    }
    OP_REQUIRES_OK(ctx, ReadForwards(ctx, tin, tout));
  }

  void Compute(OpKernelContext* ctx) override {
    // TF's profiler (TensorBoard's Profile tab): TF's executor traces an op that is not
    // IsExpensive only at its verbose level, which profiles leave off by default, so a
    // kernel's time would show as a gap.  An event of the executor's own form (node
    // name, op type, label) at the level expensive ops get; off, one atomic load.
    tsl::profiler::TraceMe trace(
        [&] { return TraceString(*ctx, tsl::profiler::TfOpDetailsEnabled()); },
        tsl::profiler::kInfo);
    ProfileScope profile(ctx, label_, &profile_slot_);  // no-op unless profiling is on
    if (entry_ == nullptr) {
      RunFallback(ctx);
      return;
    }
    if (hold_ready_ && entry_->hold.load(std::memory_order_acquire)) {
      RunFallback(ctx);
      return;
    }
    if (tune_ && Tuned(ctx)) return;
    RunKernel(ctx);
  }

  // The compiled kernel on this call's inputs.
  void RunKernel(OpKernelContext* ctx) {
    const Entry& e = *entry_;
    const int n_in = static_cast<int>(e.in_ranks.size());
    const int n_out = static_cast<int>(e.out_ranks.size());

    // Gather input dims (checking ranks: the graph's shapes are only claims).
    std::vector<int64_t> in_dims;
    in_dims.reserve(e.in_dims_total);
    std::vector<void*> ins(n_in + 1, nullptr);
    for (int i = 0; i < n_in; ++i) {
      const Tensor& t = ctx->input(i);
      if (t.dims() != e.in_ranks[i]) {
        Guard(ctx, absl::InvalidArgumentError(absl::StrCat(
                       "StitchedKernel ", label_, ": input ", i, " has shape ",
                       t.shape().DebugString(), " but the kernel expects rank ",
                       e.in_ranks[i])));
        return;
      }
      for (int d = 0; d < t.dims(); ++d) in_dims.push_back(t.dim_size(d));
      // No copy: the kernel reads the input tensor's own buffer (never written).
      ins[i] = const_cast<char*>(t.tensor_data().data());
    }

    // The spec's static dims (shape_fn of a generic kernel would accept others).
    for (int i = 0, k = 0; i < n_in && !e.in_static.empty(); ++i) {
      for (int d = 0; d < e.in_ranks[i]; ++d, ++k) {
        if (e.in_static[k] >= 0 && in_dims[k] != e.in_static[k]) {
          Guard(ctx, absl::InvalidArgumentError(absl::StrCat(
                         "StitchedKernel ", label_, ": input ", i, " dim ", d,
                         " must be ", e.in_static[k], "; input shapes: ",
                         ctx->input(i).shape().DebugString())));
          return;
        }
      }
    }

    // Shapes, kernel parameters and the work decomposition come from shape_fn.
    int64_t params[kMaxParams] = {0};
    std::vector<int64_t> out_dims(e.out_dims_total + 1, 0);
    int64_t sched[4] = {e.launch[0], e.launch[1], 1, 0};
    const int64_t rc =
        e.program.empty()
            ? e.shape_fn(in_dims.data(), params, out_dims.data(), sched)
            : e.interp(e.program.data(), in_dims.data(), params, out_dims.data(), sched);
    if (rc != 0) {
      Guard(ctx, ShapeFnStatus(ctx, rc));
      return;
    }
    OP_REQUIRES(ctx, sched[0] >= 0 && sched[2] >= 1 && sched[2] <= kMaxPhases &&
                         sched[3] >= 0,
                absl::InternalError(absl::StrCat(
                    "StitchedKernel ", label_, ": shape function returned ", sched[0],
                    " work units, ", sched[2], " phases, ", sched[3], " temp bytes")));

    std::vector<void*> outs(n_out + 1, nullptr);
    const int64_t* od = out_dims.data();
    for (int i = 0; i < n_out; ++i) {
      TensorShape shape;
      OP_REQUIRES_OK(ctx, OutputShape(i, od, &shape));
      od += e.out_ranks[i];
      Tensor* t = nullptr;
      // An element-wise kernel may write output i over input forward_from_[i] (the
      // rewrite's _stitching_forward), as TF's cwise ops do: only when TF says the
      // input buffer is this op's alone (last use, not a variable's) and the shapes
      // are equal, so element j is read before element j is written.
      const int src = forward_from_.empty() ? -1 : forward_from_[i];
      if (src < 0 || ctx->input(src).shape() != shape ||
          !ctx->forward_input_to_output_with_shape(src, i, shape, &t)) {
        OP_REQUIRES_OK(ctx, AllocateOutput(ctx, i, shape, e.out_dtypes[i], &t));
      }
      outs[i] = const_cast<char*>(t->tensor_data().data());
    }
    if (sched[0] == 0) return;  // zero-size tensors: nothing to do
    Tensor temp;
    if (sched[3] > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_INT8, TensorShape({sched[3]}),
                                             &temp));
      outs[n_out] = const_cast<char*>(temp.tensor_data().data());
    }

    // Split [0, total) across this thread and the intra-op pool (RunUnits); small
    // totals run inline on this thread.  One read of the code for the whole call
    // (Entry::body): its phases never mix two builds.
    const BodyFn body = e.body.load(std::memory_order_acquire);
    const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
    const int64_t cost = std::max<int64_t>(1, sched[1]);
    const bool inline_run = workers == nullptr || workers->workers == nullptr ||
                            workers->workers->NumThreads() < 2 ||
                            sched[0] * cost < InlineCost();
    for (int64_t phase = 0; phase < sched[2]; ++phase) {
      params[kPhaseSlot] = phase;  // each phase returns when every unit is done
      if (inline_run) {
        body(0, sched[0], ins.data(), outs.data(), params);
      } else {
        RunUnits(workers->workers, body, ins.data(), outs.data(), params, sched[0],
                 cost);
      }
    }
  }

  // Run on the executor's thread instead of being handed to the inter-op pool: the
  // work itself is split over the intra-op pool in Compute, and at small sizes the
  // hand-off (a thread wake-up) cost more than the kernel (8x1024 LayerNorm: 19.7 ->
  // 9.5 us per op measured).
  bool IsExpensive() override { return false; }

  // Profiles show the region's label next to the node name.
  std::string TraceString(const OpKernelContext& ctx, bool verbose) const override {
    std::string base = OpKernel::TraceString(ctx, verbose);
    if (label_.empty()) return base;
    return tsl::profiler::TraceMeEncode(std::move(base), {{"label", label_}});
  }

 private:
  // The node's declared signature must be exactly the compiled kernel's.
  absl::Status CheckSignature(const DataTypeVector& tin, const DataTypeVector& tout) {
    const Entry& e = *entry_;
    if (tin != e.in_dtypes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "StitchedKernel ", label_, ": node input dtypes [", DtypesString(tin),
          "] do not match the compiled kernel's [", DtypesString(e.in_dtypes), "]"));
    }
    if (tout != e.out_dtypes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "StitchedKernel ", label_, ": node output dtypes [", DtypesString(tout),
          "] do not match the compiled kernel's [", DtypesString(e.out_dtypes), "]"));
    }
    for (size_t i = 0; i < static_shapes_.size(); ++i) {
      const PartialTensorShape& s = static_shapes_[i];
      if (!s.unknown_rank() && s.dims() != e.out_ranks[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "StitchedKernel ", label_, ": output_shapes[", i, "] is ", s.DebugString(),
            " but the compiled kernel's output ", i, " has rank ", e.out_ranks[i]));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ShapeFnStatus(OpKernelContext* ctx, int64_t rc) const {
    if (rc == 0) return absl::OkStatus();
    const Entry& e = *entry_;
    // each input with the graph tensor it is (the kernel's inputs are its region's
    // inputs, not the model's: "input 2" alone named nothing a user could find)
    std::vector<std::string> shapes;
    for (int i = 0; i < ctx->num_inputs(); ++i) {
      shapes.push_back(absl::StrCat(i, ": ", def().input(i), " ",
                                    ctx->input(i).shape().DebugString()));
    }
    std::string what =
        (rc > 0 && rc <= static_cast<int64_t>(e.errors.size()))
            ? e.errors[rc - 1]
            : absl::StrCat("shape function returned unknown error code ", rc);
    return absl::InvalidArgumentError(absl::StrCat(
        "StitchedKernel ", label_, ": ", what, "; input shapes: ",
        absl::StrJoin(shapes, ", ")));
  }

  // Builds output i's shape from shape_fn's dims and checks it against the static
  // shape the graph was told about (shape inference downstream relied on it).
  absl::Status OutputShape(int i, const int64_t* dims, TensorShape* shape) const {
    const int rank = entry_->out_ranks[i];
    absl::Status s = TensorShape::BuildTensorShape(
        absl::Span<const int64_t>(dims, rank), shape);
    if (!s.ok()) {
      return absl::InternalError(absl::StrCat("StitchedKernel ", label_,
                                              ": shape function gave output ", i,
                                              " an invalid shape: ", s.message()));
    }
    if (!static_shapes_[i].IsCompatibleWith(*shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "StitchedKernel ", label_, ": output ", i, " has shape ",
          shape->DebugString(), ", incompatible with the declared ",
          static_shapes_[i].DebugString()));
    }
    return absl::OkStatus();
  }

  // What is checked of the spec before Python sees it (the spec is untrusted data):
  // its size, that it is all one C string (the compiler callback reads up to the first
  // NUL, so a spec with one would be checked in part and registered under a string
  // the node does not hold), and the spec_hash every rewritten node records, which
  // binds the spec to the rewrite that made it.  Each is an error, never the fallback.
  absl::Status CheckSpecText(const std::string& node, const std::string& spec,
                             const std::string& spec_hash) const {
    const std::string who = absl::StrCat("StitchedKernel '", node, "' (", label_, "): ");
    if (spec.size() > kMaxSpecBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "the spec is ", spec.size(), " bytes, limit ", kMaxSpecBytes));
    }
    const size_t nul = spec.find('\0');
    if (nul != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, "the spec holds a NUL byte at offset ", nul));
    }
    if (spec_hash.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "the node has no spec_hash (every rewritten node records its spec's); ",
          "rewrite the original model again"));
    }
    if (Sha256Hex(spec).substr(0, 24) != spec_hash) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, "the spec does not match its spec_hash ", spec_hash.substr(0, 40),
          " (the node was edited after rewriting); rewrite the original model again"));
    }
    return absl::OkStatus();
  }

  // ---- native-segment fallback: the region's original subgraph, run by TF ----------
  static bool StrictMode() {
    const char* v = std::getenv("STITCHING_STRICT");
    return v != nullptr && v[0] != '\0' && std::string(v) != "0";
  }

  absl::Status UseFallback(OpKernelConstruction* ctx,
                           const tensorflow::NameAttrList& fn, const absl::Status& why) {
    if (ctx->function_library() == nullptr) return why;
    absl::Status st = InstantiateOriginal(ctx->function_library(), fn, &flib_,
                                          &fallback_handle_);
    if (!st.ok()) return why;           // the kernel's reason, not the fallback's
    RecordFallback(label_, std::string(why.message()));
    return absl::OkStatus();
  }

  void RunFallback(OpKernelContext* ctx) { RunFunction(ctx, flib_, fallback_handle_); }

  void RunFunction(OpKernelContext* ctx, tensorflow::FunctionLibraryRuntime* flib,
                   tensorflow::FunctionLibraryRuntime::Handle handle) {
    OP_REQUIRES_OK(ctx, stitching_fn::RunInline(ctx, flib, handle,
                                                absl::StrCat("StitchedKernel ", label_)));
  }

  // The region's original function, where the node names one: `guard` (graphs
  // stitched before 2026-11-28), else the string attr `_stitching_original`, which is
  // what stitching.function writes.  A string, not a func attr: TF instantiates every
  // function a func-typed attr reaches (and optimizes it) when it instantiates the
  // graph, measured +1.4 ms (a softmax) to +2.6 ms (a Dense + LayerNorm + GELU) on the
  // first call of every trace, for a function the op runs only for a call its kernel
  // was not built for.  By name it is looked up when needed: in the graph's library
  // or the process's (stitching defines it there, tf/function.py _define_fallbacks;
  // a SavedModel's loader registers its library).
  static std::vector<tensorflow::NameAttrList> OriginalFunction(
      const tensorflow::NodeDef& def) {
    std::vector<tensorflow::NameAttrList> fn;
    if (tensorflow::GetNodeAttr(def, "guard", &fn).ok() && !fn.empty()) return fn;
    fn.clear();
    std::string name;
    if (tensorflow::TryGetNodeAttr(def, "_stitching_original", &name) && !name.empty()) {
      fn.emplace_back();
      fn.back().set_name(name);
    }
    return fn;
  }

  // Instantiates the original function `fn` (functions.h NamedFunctions: the graph's
  // library, else a copy of the process's, once per node, on a rare path: a call the
  // kernel was not built for, a kernel that cannot be built here).  Called by one
  // thread at a time: the constructor, or Guard under guard_mu_.
  absl::Status InstantiateOriginal(tensorflow::FunctionLibraryRuntime* flib,
                                   const tensorflow::NameAttrList& fn,
                                   tensorflow::FunctionLibraryRuntime** used,
                                   tensorflow::FunctionLibraryRuntime::Handle* handle) {
    return named_.Instantiate(flib, fn, used, handle);
  }

  // ---- run-time guard: inputs the kernel was not built for ---------------------------
  //
  // A trace's shapes are claims: TF runs a graph on inputs that break them (a relaxed
  // dim that is 1 at run time and broadcasts, a ConcreteFunction called with a scalar
  // where it was traced with [None]); TF's own kernels then broadcast or raise their
  // own error.  This kernel computes only the shapes it was built for, so such a call
  // runs the region's original ops (OriginalFunction, or `fallback`), which give TF's answer or TF's error; `why` is the error where the
  // node has no such function (a graph stitched before guards existed).
  void Guard(OpKernelContext* ctx, const absl::Status& why) {
    {
      std::lock_guard<std::mutex> lock(guard_mu_);
      if (!guard_tried_) {
        guard_tried_ = true;
        // `fallback` first where the node has one: a func attr, which a SavedModel's
        // loader renames with the function it names
        std::vector<tensorflow::NameAttrList> fn;
        if (!tensorflow::GetNodeAttr(def(), "fallback", &fn).ok()) fn.clear();
        for (auto& f : OriginalFunction(def())) fn.push_back(std::move(f));
        if (fn.empty() || ctx->function_library() == nullptr) {
          guard_status_ = absl::NotFoundError("the node names no original function");
        } else {
          for (const auto& f : fn) {      // the first that instantiates
            guard_status_ = InstantiateOriginal(ctx->function_library(), f,
                                                &guard_flib_, &guard_handle_);
            if (guard_status_.ok()) break;
          }
        }
      }
    }
    OP_REQUIRES(ctx, guard_status_.ok(),
                absl::InvalidArgumentError(absl::StrCat(
                    why.message(), " (and its original ops cannot serve this call: ",
                    guard_status_.message(), ")")));
    RunFunction(ctx, guard_flib_, guard_handle_);
  }

  // ---- autotune (see Tuner) --------------------------------------------------------
  void SetUpTuning(OpKernelConstruction* ctx, const tensorflow::NameAttrList& fn,
                   const std::string& hash) {
    flib_ = ctx->function_library();
    if (flib_ == nullptr) return;
    absl::Status st = flib_->Instantiate(fn.name(), tensorflow::AttrSlice(&fn.attr()),
                                         &fallback_handle_);
    if (!st.ok()) {   // the kernel serves; nothing to compare it with
      LOG(WARNING) << "StitchedKernel " << label_ << ": no autotuning, its native "
                   << "segment does not instantiate: " << st.message();
      return;
    }
    tune_hash_ = hash;
    tune_ = true;
    Tuner::Get().Preload(hash);
  }

  // Runs this call the tuned way and returns true, or returns false when the kernel
  // is the choice for this call's shape class (the caller runs it).
  bool Tuned(OpKernelContext* ctx) {
    // tier-1 code is not what will run: no measuring, no decision, until its upgrade
    const bool measure = !entry_->tier1.load(std::memory_order_acquire);
    return tune_node_.Run(kTuneApi, tune_hash_, ctx, measure, &g_tune_counts,
                          [&] { RunKernel(ctx); },
                          [&] {
                            RunFallback(ctx);
                            return true;
                          });
  }

  bool tune_ = false;
  bool hold_ready_ = false;   // the original ops are instantiated for a held entry
  std::string tune_hash_;
  stitching_tune::Node tune_node_;   // per shape class: a decision

  // _stitching_forward: [input, output, input, output, ...] pairs (tf/passes/forward.py);
  // checked here like any attr of a graph from outside (indices, dtypes, each at most
  // once).  forward_from_[output] = input, or -1.
  absl::Status ReadForwards(OpKernelConstruction* ctx, const DataTypeVector& tin,
                            const DataTypeVector& tout) {
    std::vector<int32_t> pairs;
    if (!tensorflow::TryGetNodeAttr(ctx->def(), "_stitching_forward", &pairs) ||
        pairs.empty()) {
      return absl::OkStatus();
    }
    const int n_in = static_cast<int>(tin.size()), n_out = static_cast<int>(tout.size());
    std::vector<int> from(n_out, -1);
    std::vector<bool> used(n_in, false);
    for (size_t k = 0; k < pairs.size(); k += 2) {
      const int in = pairs[k], out = k + 1 < pairs.size() ? pairs[k + 1] : -1;
      if (in < 0 || in >= n_in || out < 0 || out >= n_out || used[in] ||
          from[out] >= 0 || tin[in] != tout[out]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "StitchedKernel ", label_, ": bad _stitching_forward pair (", in, ", ", out,
            ") for ", n_in, " inputs and ", n_out, " outputs"));
      }
      used[in] = true;
      from[out] = in;
    }
    forward_from_ = std::move(from);
    return absl::OkStatus();
  }

  std::shared_ptr<const Entry> entry_;
  std::vector<int> forward_from_;
  std::vector<PartialTensorShape> static_shapes_;
  std::string label_;
  std::atomic<ProfileSlot*> profile_slot_{nullptr};  // set on the first profiled call
  tensorflow::FunctionLibraryRuntime* flib_ = nullptr;
  tensorflow::FunctionLibraryRuntime::Handle fallback_handle_ = 0;
  // where the graph's library lacks the original function (InstantiateOriginal)
  stitching_fn::NamedFunctions named_;
  std::mutex guard_mu_;         // the guard's function, instantiated on first need
  bool guard_tried_ = false;
  absl::Status guard_status_;
  tensorflow::FunctionLibraryRuntime* guard_flib_ = nullptr;
  tensorflow::FunctionLibraryRuntime::Handle guard_handle_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("StitchedKernel").Device(tensorflow::DEVICE_CPU),
                        StitchedKernelOp);

#if GOOGLE_CUDA
// ---- DEVICE_GPU: a thin shell over the launcher (gpu/launcher.h) ----------------------
//
// Built only into a CUDA build of the library (stitching/runtime/gpu_build.py, against
// the `tensorflow` wheel's headers with GOOGLE_CUDA); the CPU-only build above has none
// of it.  The constructor finds the spec's GPU module by its hash (asking the GPU
// compiler callback on a miss: Python compiles the kernels to PTX and registers them)
// and checks the node's dtypes and output ranks against it; Compute checks the inputs
// against the spec's signature, takes the launch plan for these input dims (a map
// lookup; the planner callback on a miss), allocates the outputs and the temp buffer
// from TF, and launches on TF's own stream in the device's context.  Nothing waits.

// The launcher's dtype names ("" for a dtype the kernels do not take).
std::string GpuDtypeName(DataType t) {
  switch (t) {
    case tensorflow::DT_HALF: return "float16";
    case tensorflow::DT_BFLOAT16: return "bfloat16";
    case tensorflow::DT_FLOAT: return "float32";
    case tensorflow::DT_DOUBLE: return "float64";
    case tensorflow::DT_INT32: return "int32";
    case tensorflow::DT_INT64: return "int64";
    case tensorflow::DT_BOOL: return "bool";
    default: return "";
  }
}

class StitchedKernelGpuOp : public OpKernel {
 public:
  explicit StitchedKernelGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    std::string spec, spec_hash;
    DataTypeVector tin, tout;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spec", &spec));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("spec_hash", &spec_hash));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tin", &tin));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tout", &tout));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("output_shapes", &static_shapes_));
    hash_ = Sha256Hex(spec).substr(0, 24);
    OP_REQUIRES(ctx, spec_hash.empty() || spec_hash == hash_,
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedKernel ", label_, ": the spec does not match its spec_hash ",
                    spec_hash.substr(0, 40), " (the node was edited after rewriting)")));
    module_ = gpu::Find(hash_);
    gpu::CompilerFn compile = gpu::GetCompiler();
    if (module_ == nullptr && compile != nullptr) {
      const int rc = compile(spec.c_str());
      OP_REQUIRES(ctx, rc == 0, StatusFromCode(rc, absl::StrCat(
                                    "StitchedKernel ", label_,
                                    ": compiling the GPU kernels of the spec failed")));
      module_ = gpu::Find(hash_);
    }
    OP_REQUIRES(ctx, module_ != nullptr,
                absl::NotFoundError(absl::StrCat(
                    "StitchedKernel ", label_, ": no GPU kernels for spec ", hash_,
                    " in this process; import stitching with a CUDA device so it can "
                    "compile them")));
    for (DataType t : tin) in_types_.push_back(GpuDtypeName(t));
    for (DataType t : tout) out_types_.push_back(GpuDtypeName(t));
    const gpu::Signature& sig = gpu::GetSignature(*module_);
    OP_REQUIRES(ctx, in_types_ == sig.in_dtypes && out_types_ == sig.out_dtypes,
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedKernel ", label_, ": node dtypes [", DtypesString(tin), "] -> [",
                    DtypesString(tout), "] do not match the GPU kernel's")));
    OP_REQUIRES(ctx, static_shapes_.size() == sig.out_ranks.size(),
                absl::InvalidArgumentError("StitchedKernel: output_shapes and Tout differ"));
    for (size_t i = 0; i < static_shapes_.size(); ++i) {
      OP_REQUIRES(ctx, static_shapes_[i].unknown_rank() ||
                           static_shapes_[i].dims() == sig.out_ranks[i],
                  absl::InvalidArgumentError(absl::StrCat(
                      "StitchedKernel ", label_, ": output_shapes[", i, "] has the wrong "
                      "rank for the GPU kernel")));
    }
  }

  void Compute(OpKernelContext* ctx) override {
    const int n_in = ctx->num_inputs(), n_out = ctx->num_outputs();
    std::vector<int64_t> dims;
    std::vector<int> ranks;
    std::vector<const void*> ins;
    for (int i = 0; i < n_in; ++i) {
      const Tensor& t = ctx->input(i);
      ranks.push_back(t.dims());
      for (int d = 0; d < t.dims(); ++d) dims.push_back(t.dim_size(d));
      ins.push_back(t.tensor_data().data());
    }
    OP_REQUIRES_OK(ctx, Status(gpu::CheckInputs(*module_, in_types_, ranks, dims, out_types_)));
    std::shared_ptr<const gpu::Plan> plan;
    OP_REQUIRES_OK(ctx, Status(gpu::GetPlan(*module_, hash_, dims, &plan)));
    std::vector<void*> outs(n_out, nullptr);
    for (int i = 0; i < n_out; ++i) {
      TensorShape shape;
      OP_REQUIRES_OK(ctx, TensorShape::BuildTensorShape(plan->out_dims[i], &shape));
      OP_REQUIRES(ctx, static_shapes_[i].IsCompatibleWith(shape),
                  absl::InvalidArgumentError(absl::StrCat(
                      "StitchedKernel ", label_, ": output ", i, " has shape ",
                      shape.DebugString(), ", incompatible with the declared ",
                      static_shapes_[i].DebugString())));
      Tensor* t = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shape, &t));
      outs[i] = const_cast<char*>(t->tensor_data().data());
    }
    if (plan->steps.empty()) return;   // zero-size tensors
    Tensor temp;
    void* temp_ptr = nullptr;
    if (plan->temp_bytes > 0) {
      OP_REQUIRES_OK(ctx, ctx->allocate_temp(tensorflow::DT_INT8,
                                             TensorShape({plan->temp_bytes}), &temp));
      temp_ptr = const_cast<char*>(temp.tensor_data().data());
    }
    OP_REQUIRES(ctx, ctx->op_device_context() != nullptr &&
                         ctx->op_device_context()->stream() != nullptr,
                absl::InternalError("StitchedKernel: no GPU stream for this op"));
    stream_executor::Stream* stream = ctx->op_device_context()->stream();
    // the driver API launches in the current context: make the device's current
    std::unique_ptr<stream_executor::ActivateContext> active = stream->parent()->Activate();
    OP_REQUIRES_OK(ctx, Status(gpu::Launch(*plan, ins.data(), outs.data(), temp_ptr,
                                           stream->platform_specific_handle().stream)));
  }

 private:
  absl::Status Status(const std::string& launcher_error) const {
    if (launcher_error.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("StitchedKernel ", label_, ": ",
                                                   launcher_error));
  }

  std::string hash_, label_;
  std::shared_ptr<gpu::Module> module_;
  std::vector<std::string> in_types_, out_types_;
  std::vector<PartialTensorShape> static_shapes_;
};

REGISTER_KERNEL_BUILDER(Name("StitchedKernel").Device(tensorflow::DEVICE_GPU),
                        StitchedKernelGpuOp);
#endif  // GOOGLE_CUDA

// ---- StitchedKernelAssets: kernels shipped inside a SavedModel ------------------------
//
// A rewritten SavedModel carries its kernels' shared objects as assets, and a resource
// whose initializer runs this op on their paths when the model is loaded (TF rewrites
// asset paths to where the model lies now).  The op hands the paths and the manifest
// hash recorded in the graph at rewrite time to the process's assets installer
// (Python: stitching/tf/kernel_assets.py), which checks every file against the
// recorded hashes and keeps them for this process's kernels.  The installer is a
// callback of its own (stitching_set_assets_installer), never the compiler's: a
// StitchedKernel spec cannot reach it.  Payload: the hash, then one path a line.

REGISTER_OP("StitchedKernelAssets")
    .Input("paths: string")
    .Attr("manifest_sha256: string")
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext*) {
      return absl::OkStatus();   // no outputs
    })
    .Doc(R"doc(
Makes the compiled kernels shipped with a rewritten model (asset files, checked against
`manifest_sha256`) available to the StitchedKernel nodes of this process.
)doc");

class StitchedKernelAssetsOp : public OpKernel {
 public:
  explicit StitchedKernelAssetsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("manifest_sha256", &manifest_sha256_));
  }

  void Compute(OpKernelContext* ctx) override {
    std::string payload = manifest_sha256_;
    auto paths = ctx->input(0).flat<tensorflow::tstring>();
    for (int64_t i = 0; i < paths.size(); ++i) {
      const std::string path(paths(i));
      OP_REQUIRES(ctx, path.find('\n') == std::string::npos &&
                           path.find('\0') == std::string::npos,
                  absl::InvalidArgumentError(absl::StrCat(
                      "StitchedKernelAssets '", ctx->op_kernel().name(),
                      "': an asset path holds a newline or NUL byte")));
      absl::StrAppend(&payload, "\n", path);
    }
    CompilerFn compile = Registry::Get().installer();
    OP_REQUIRES(ctx, compile != nullptr,
                absl::FailedPreconditionError(
                    "StitchedKernelAssets: no stitching runtime in this process; "
                    "`import stitching` before loading this model"));
    tls_compile_error.clear();
    int rc = compile(payload.c_str());
    OP_REQUIRES(ctx, rc == 0,
                StatusFromCode(rc, absl::StrCat("StitchedKernelAssets: ",
                                                tls_compile_error.empty()
                                                    ? "(no message)"
                                                    : tls_compile_error)));
  }

 private:
  std::string manifest_sha256_;
};

REGISTER_KERNEL_BUILDER(Name("StitchedKernelAssets").Device(tensorflow::DEVICE_CPU),
                        StitchedKernelAssetsOp);

// ---- Registration helpers for the C exports -----------------------------------------

bool SupportedDtype(int t) {
  switch (t) {
    case tensorflow::DT_HALF:
    case tensorflow::DT_BFLOAT16:
    case tensorflow::DT_FLOAT:
    case tensorflow::DT_DOUBLE:
    case tensorflow::DT_INT32:
    case tensorflow::DT_INT64:
    case tensorflow::DT_BOOL:
      return true;
    default:
      return false;
  }
}

// Copies one side of the signature (ranks + dtypes); returns a negative code on bad
// input so the Python side can name the problem.
int CopySignature(int n, const int* ranks, const int* dtypes, std::vector<int>* r,
                  DataTypeVector* d, int* total) {
  if (n < 0 || n > kMaxTensors || (n > 0 && (ranks == nullptr || dtypes == nullptr))) {
    return -2;
  }
  *total = 0;
  for (int i = 0; i < n; ++i) {
    if (ranks[i] < 0 || ranks[i] > kMaxRank) return -3;
    if (!SupportedDtype(dtypes[i])) return -4;
    r->push_back(ranks[i]);
    d->push_back(static_cast<DataType>(dtypes[i]));
    *total += ranks[i];
  }
  return 0;
}

}  // namespace
// The text tables the exports below hand to Python (profile counters, autotune
// decisions): written into buf with a NUL when it holds them; returns the length they
// need without the NUL (registry.py _read_text sizes, then reads).
int64_t CopyOut(const std::string& text, char* buf, int64_t cap) {
  const int64_t n = static_cast<int64_t>(text.size());
  if (buf != nullptr && cap > n) {
    std::copy(text.begin(), text.end(), buf);
    buf[n] = '\0';
  }
  return n;
}

}  // namespace stitching

// ---- C exports (ctypes) -------------------------------------------------------------

extern "C" {

// Version of the kernel ABI this library implements.
__attribute__((visibility("default"))) int stitching_abi_version() {
  return stitching::kAbiVersion;
}

// Registers a compiled kernel under the exact spec string.  Returns 0 if newly
// registered, 1 if the spec was already registered (the existing entry is kept),
// and a negative code on invalid arguments: -1 null spec/function, -2 bad tensor
// count, -3 bad rank, -4 unsupported dtype, -5 bad error list, -6 bad static dim,
// -7 bad launch hint, -8 bad shape program.
// `in_static` (may be NULL): the spec's static input dims, flattened, -1 unknown.
// `launch` (may be NULL): rows per unit and column block for shape_fn, 0 = its choice.
// `program` (may be NULL): the kernel's shape program; `shape_fn` is then the shared
// interpreter (InterpFn) run on it.
__attribute__((visibility("default"))) int stitching_register(
    const char* spec, void* body, void* shape_fn, int n_in, const int* in_ranks,
    const int* in_dtypes, int n_out, const int* out_ranks, const int* out_dtypes,
    const char* const* errors, int n_errors, const int64_t* in_static,
    const int64_t* launch, const int64_t* program, int64_t program_len) {
  using stitching::Entry;
  if (spec == nullptr || body == nullptr || shape_fn == nullptr) return -1;
  if (n_out < 1) return -2;
  auto e = std::make_shared<Entry>();
  e->body.store(reinterpret_cast<stitching::BodyFn>(body));
  if (program != nullptr) {
    if (program_len < 1 || program_len > stitching::kMaxProgram) return -8;
    e->interp = reinterpret_cast<stitching::InterpFn>(shape_fn);
    e->program.assign(program, program + program_len);
  } else {
    e->shape_fn = reinterpret_cast<stitching::ShapeFn>(shape_fn);
  }
  int rc = stitching::CopySignature(n_in, in_ranks, in_dtypes, &e->in_ranks,
                                    &e->in_dtypes, &e->in_dims_total);
  if (rc != 0) return rc;
  rc = stitching::CopySignature(n_out, out_ranks, out_dtypes, &e->out_ranks,
                                &e->out_dtypes, &e->out_dims_total);
  if (rc != 0) return rc;
  if (n_errors < 0 || (n_errors > 0 && errors == nullptr)) return -5;
  for (int i = 0; i < n_errors; ++i) {
    e->errors.emplace_back(errors[i] ? errors[i] : "");
  }
  if (in_static != nullptr) {
    for (int k = 0; k < e->in_dims_total; ++k) {
      if (in_static[k] < -1) return -6;
      e->in_static.push_back(in_static[k]);
    }
  }
  if (launch != nullptr) {
    for (int k = 0; k < 2; ++k) {
      if (launch[k] < 0) return -7;
      e->launch[k] = launch[k];
    }
  }
  return stitching::Registry::Get().Insert(spec, std::move(e)) ? 0 : 1;
}

// Kernels registered with code `from` run `to` from their next call on (and so do
// those registered with `from` later): a tiered compile's optimized build replacing
// its quick one.  Returns how many registered kernels were switched, -1 on NULL.
__attribute__((visibility("default"))) int64_t stitching_upgrade_body(void* from,
                                                                      void* to) {
  if (from == nullptr || to == nullptr) return -1;
  return stitching::Registry::Get().Upgrade(reinterpret_cast<stitching::BodyFn>(from),
                                            reinterpret_cast<stitching::BodyFn>(to));
}

// Kernels registered with code `body`, now or until its upgrade, run their nodes'
// original ops instead (tier-1 code expected to be slower than them).
__attribute__((visibility("default"))) void stitching_hold_body(void* body) {
  if (body != nullptr) {
    stitching::Registry::Get().Hold(reinterpret_cast<stitching::BodyFn>(body));
  }
}

// Kernels registered with code `body`, now or until its upgrade, run tier-1 code: the
// autotuner does not time them (Entry::tier1).
__attribute__((visibility("default"))) void stitching_tier1_body(void* body) {
  if (body != nullptr) {
    stitching::Registry::Get().Tier1(reinterpret_cast<stitching::BodyFn>(body));
  }
}

// 1 if the kernel registered under `spec` holds (stitching_hold_body), 0 if not, -1 if
// none is registered.
__attribute__((visibility("default"))) int stitching_is_held(const char* spec) {
  if (spec == nullptr) return -1;
  auto e = stitching::Registry::Get().Find(spec);
  return e ? static_cast<int>(e->hold.load(std::memory_order_acquire)) : -1;
}

// The code the kernel registered under `spec` runs now (NULL: none registered).
__attribute__((visibility("default"))) void* stitching_body_of(const char* spec) {
  if (spec == nullptr) return nullptr;
  auto e = stitching::Registry::Get().Find(spec);
  return e ? reinterpret_cast<void*>(e->body.load(std::memory_order_acquire)) : nullptr;
}

// Installs (or, with NULL, removes) the compiler called on a registry miss.  It must
// register the kernel under the exact string it was given and return 0, or call
// stitching_set_compile_error and return a nonzero absl::StatusCode.
__attribute__((visibility("default"))) void stitching_set_compiler(
    int (*cb)(const char* spec)) {
  stitching::Registry::Get().SetCompiler(cb);
}

// Installs (or, with NULL, removes) the StitchedKernelAssets installer: called with the
// manifest hash and the asset paths, one a line; returns 0 or an absl::StatusCode.
__attribute__((visibility("default"))) void stitching_set_assets_installer(
    int (*cb)(const char* payload)) {
  stitching::Registry::Get().SetInstaller(cb);
}

// Error message for the compiler callback's current failure (this thread only).
__attribute__((visibility("default"))) void stitching_set_compile_error(const char* msg) {
  stitching::tls_compile_error = msg ? msg : "";
}

__attribute__((visibility("default"))) int64_t stitching_num_registered() {
  return stitching::Registry::Get().Size();
}

// Output pool counters: hits, misses, bytes held, idle bytes, idle cap, smallest pooled
// output (6 int64s).
__attribute__((visibility("default"))) void stitching_pool_stats(int64_t* out) {
  if (out != nullptr) stitching::OutputPool::Get().Stats(out);
}

// Returns the output pool's idle buffers to the OS.
__attribute__((visibility("default"))) void stitching_pool_trim() {
  stitching::OutputPool::Get().Trim();
}

// The pool as an allocator for an output of `bytes`, or NULL where such an output
// stays on TF's allocator (the pool off, or the output under its line).  For the
// OpenBLAS op library (blas_util.h AllocateOutput): runtime/blas.py hands it this
// function when both libraries are loaded, so both share one pool and one set of
// counters.  The allocator lives as long as the process.
__attribute__((visibility("default"))) void* stitching_pool_for(int64_t bytes) {
  stitching::OutputPool& pool = stitching::OutputPool::Get();
  if (!pool.enabled() || bytes < 0 || static_cast<size_t>(bytes) < pool.min_bytes()) {
    return nullptr;
  }
  return static_cast<tensorflow::Allocator*>(&pool);
}

// Number of StitchedKernel nodes constructed to run their fallback; the last reason.
__attribute__((visibility("default"))) int64_t stitching_fallback_count() {
  return stitching::g_fallbacks.load();
}

__attribute__((visibility("default"))) const char* stitching_last_fallback() {
  std::lock_guard<std::mutex> lock(stitching::g_fallback_mu);
  static thread_local std::string copy;
  copy = stitching::g_last_fallback;
  return copy.c_str();
}

__attribute__((visibility("default"))) int stitching_is_registered(const char* spec) {
  return spec != nullptr && stitching::Registry::Get().Find(spec) != nullptr;
}

// Profiling (see ProfileScope): on/off for every StitchedKernel of the process.
__attribute__((visibility("default"))) void stitching_profile_enable(int on) {
  stitching::g_profiling.store(on != 0);
}

__attribute__((visibility("default"))) int stitching_profile_enabled() {
  return stitching::g_profiling.load() ? 1 : 0;
}

// Writes the counters as text ("label\tcalls\tnanos\tbytes\n" per label) into buf
// when it holds them with a NUL; returns the length they need (without the NUL).
__attribute__((visibility("default"))) int64_t stitching_profile_read(char* buf,
                                                                      int64_t cap) {
  return stitching::CopyOut(stitching::Profiles::Get().Text(), buf, cap);
}

// Autotune (see Tuner): the sink Python persists decisions through (NULL removes it),
// a decision read from the cache (choice 1 kernel, 2 native; returns 0 if set, 1 if
// already decided, -1 on bad arguments), the decisions as text (like
// stitching_profile_read) and the counters: decisions measured, (node, class)
// decisions adopted from the cache, calls timed while measuring, calls served by the
// native segment.
__attribute__((visibility("default"))) void stitching_autotune_set_sink(
    int (*cb)(const char*)) {
  stitching::Tuner::Get().SetSink(cb);
}

__attribute__((visibility("default"))) int stitching_autotune_set(const char* hash, int cls,
                                                                  int choice,
                                                                  int64_t kernel_ns,
                                                                  int64_t native_ns) {
  if (hash == nullptr || cls < 0 || cls >= stitching::kTuneClasses ||
      (choice != stitching::kKernel && choice != stitching::kNative) || kernel_ns < 0 ||
      native_ns < 0) {
    return -1;
  }
  return stitching::Tuner::Get().Set(hash, cls, choice, kernel_ns, native_ns);
}

__attribute__((visibility("default"))) int64_t stitching_autotune_read(char* buf,
                                                                       int64_t cap) {
  return stitching::CopyOut(stitching::Tuner::Get().Text(), buf, cap);
}

__attribute__((visibility("default"))) void stitching_autotune_counts(int64_t* out) {
  if (out == nullptr) return;
  out[0] = stitching::g_tune_measured.load();
  out[1] = stitching::g_tune_counts.cached.load();
  out[2] = stitching::g_tune_counts.timed.load();
  out[3] = stitching::g_tune_counts.native.load();
}

// The Tuner for the OpenBLAS library's StitchedAttention (tune.h Api; runtime/blas.py
// hands it over): the same table, sink and decisions as this library's nodes.
__attribute__((visibility("default"))) const stitching_tune::Api* stitching_tune_api() {
  return &stitching::kTuneApi;
}

__attribute__((visibility("default"))) void stitching_profile_reset() {
  stitching::Profiles::Get().Reset();
}

}  // extern "C"
