// What the OpenBLAS op files (gemm.cc, and any other op of this library) share: the
// Gemm wrappers, one product cut into pieces (Product), the pieces shared by the calling
// thread and TF's intra-op pool (Shares, RunProducts), and OpenBLAS held to one thread of
// its own.  gemm.cc's header comment says why each is so.  build.py compiles the files
// of the library together and hashes this header with them.
#ifndef STITCHING_RUNTIME_BLAS_UTIL_H_
#define STITCHING_RUNTIME_BLAS_UTIL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "cblas.h"   // scipy_openblas32's, prefixed: scipy_cblas_sgemm
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tensorflow/core/util/matmul_bcast.h"
#include "tsl/profiler/lib/traceme.h"

namespace stitching_blas {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// OpenBLAS runs on the thread that calls it: TF's pool is the only one.  Set once
// when the library loads, before any product runs (inline: one for the library).
inline const bool kOneThread = [] {
  scipy_openblas_set_num_threads(1);
  return true;
}();

// Multiply-adds below which a product runs inline on the calling thread.  Tuned
// (loosely) on the 2-core AMD EPYC: a pool wake-up and hand-off costs ~5-10 us; a
// [1, 256] x [256, 1024] product (2^18, reading 1 MiB of weights: bandwidth-bound)
// took 0.066 ms inline against TF's 0.035 on two threads, so the line sits lower.
constexpr int64_t kInlineMacs = int64_t{1} << 16;
// Pieces of a product start at a multiple of this many rows or columns: the widest
// register block of OpenBLAS's Haswell/SkylakeX sgemm kernels (16), so no piece ends
// in a partial block where a whole one would do.
constexpr int64_t kShardAlign = 16;
// Multiply-adds in the smallest share a thread takes (arbitrary, ~2-4 us of one
// core): a share is one GEMM call that packs the other operand again.
constexpr int64_t kShareMacs = int64_t{1} << 16;
// Pieces a product is cut into, per thread (see RunProducts).  Tuned on the 2-core
// AMD EPYC (chains of [M, 256] x [256, 1024] x [1024, 256] as in tools/gemm_probe.py):
// 2 gave 440 us per product at M = 128 where 4 gave 465 and guided shares of
// 16-column blocks 485 (TF's MatMul 530); later, interleaved in one process at load
// ~1 (another process on a core part of the time), 1 gave 442 us against 2's 453
// (M = 128), 66 against 68 (M = 8) and 416 against 430 ([512, 128] x [128, 512]):
// every piece packs the other operand again, and a second piece per thread pays
// that more often than it saves on a thread that starts late.
constexpr int64_t kPiecesPerThread = 1;
// A product (or piece) with fewer rows or columns than this runs as that many
// matrix-vector products (sgemv) instead of one sgemm.  OpenBLAS's Haswell sgemm
// (the kernel it picks on the AMD EPYC; this build has no small-matrix path) packs
// the larger operand and runs a register block at least 4 lines wide whatever M is,
// so M = 1, 2 or 3 cost it as much as M = 4: single-threaded [1, 1280] x [1280,
// 1000] took 353 us by sgemm, 77 by sgemv, [2, 256] x [256, 1024] 79 against 2 x 17,
// [3, 1280] x [1280, 1000] 540 against 3 x 76, while at 4 lines sgemm wins (275
// against 4 x 77; 0.9-1.3x by transpose).
constexpr int64_t kGemvLines = 4;
// A product whose other operand (the one every piece packs) is at most
// kSmallOtherBytes is cut into pieces of at most kPieceOutBytes of output, whatever
// the threads.  OpenBLAS's gemm first scales C by beta (beta = 0: writes zeros over
// it) and then adds the product into it, so C is written twice; with a small K that
// second pass over memory is much of the work (a 1x1 convolution as [100352, 16] x
// [16, 96]).  A piece whose C fits in L2 keeps both passes there, and packing a
// small other operand again per piece costs little.  Tuned (loosely) on the 2-core
// AMD EPYC (512 KiB L2), load ~3, the fastest of 40 interleaved calls (median in
// brackets): [100352, 16] x [16, 96] took 6.2 ms (13.8) in pieces of at most 128 KiB
// against 13.5 ms (21.9) in one piece per thread; [25088, 24] x [24, 144] 2.09 (3.18)
// against 2.23 (3.54); smaller outputs equal within noise.
constexpr int64_t kSmallOtherBytes = int64_t{32} << 10;
constexpr int64_t kPieceOutBytes = int64_t{128} << 10;

inline void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  scipy_cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                    tb ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, beta,
                    c, ldc);
}

inline void Gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const double* a,
          int64_t lda, const double* b, int64_t ldb, double beta, double* c,
          int64_t ldc) {
  scipy_cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                    tb ? CblasTrans : CblasNoTrans, m, n, k, 1.0, a, lda, b, ldb, beta, c,
                    ldc);
}

// y (+)= op(M) x, M row-major [rows, cols] with rows `ld` apart, x and y `incx` and
// `incy` elements apart.
inline void Gemv(bool t, int64_t rows, int64_t cols, const float* a, int64_t ld,
                 const float* x, int64_t incx, float beta, float* y, int64_t incy) {
  scipy_cblas_sgemv(CblasRowMajor, t ? CblasTrans : CblasNoTrans, rows, cols, 1.0f, a, ld,
                    x, incx, beta, y, incy);
}

inline void Gemv(bool t, int64_t rows, int64_t cols, const double* a, int64_t ld,
                 const double* x, int64_t incx, double beta, double* y, int64_t incy) {
  scipy_cblas_dgemv(CblasRowMajor, t ? CblasTrans : CblasNoTrans, rows, cols, 1.0, a, ld,
                    x, incx, beta, y, incy);
}

// One row-major product C[m, n] (+)= op(A) op(B) + bias, cut into `pieces` equal
// ranges of rows (by_rows) or columns, each a multiple of kShardAlign long.  The rows
// of A, B and C as stored are `lda`, `ldb` and `ldc` elements apart: their lengths,
// or more where a matrix is one head's slice of wider rows.
template <typename T>
struct Product {
  bool ta, tb;
  int64_t m, n, k;
  const T* bias;          // [n] added to C, or nullptr
  bool by_rows;           // pieces of rows (else of columns)
  int64_t pieces;         // pieces per product (1: products are not cut)
  int64_t lda, ldb, ldc;  // row strides of A, B and C as stored

  // Where piece `i` starts (i == pieces: the end).
  int64_t Edge(int64_t i) const {
    const int64_t len = by_rows ? m : n;
    if (i >= pieces) return len;
    return std::min(len, (len * i / pieces + kShardAlign - 1) / kShardAlign * kShardAlign);
  }

  // Pieces [lo, hi) of the product of A (at a) and B (at b) into C (at c): one
  // strided GEMM call.
  void Run(int64_t lo, int64_t hi, const T* a, const T* b, T* c) const {
    const int64_t begin = Edge(lo), end = Edge(hi);
    if (end <= begin) return;
    int64_t rows = m, cols = n;
    if (by_rows) {
      a += ta ? begin : begin * lda;   // op(A)'s rows: columns of a stored A^T
      c += begin * ldc;
      rows = end - begin;
    } else {
      b += tb ? begin * ldb : begin;   // op(B)'s columns: rows of a stored B^T
      c += begin;
      cols = end - begin;
    }
    const T* bias_part = bias == nullptr ? nullptr : bias + (by_rows ? 0 : begin);
    if (bias_part != nullptr) {
      for (int64_t i = 0; i < rows; ++i) std::copy(bias_part, bias_part + cols, c + i * ldc);
    }
    if (k == 0) {            // BLAS wants lda >= 1; the product of nothing is zero
      if (bias_part == nullptr) {
        for (int64_t i = 0; i < rows; ++i) std::fill(c + i * ldc, c + i * ldc + cols, T(0));
      }
      return;
    }
    const T beta = bias_part != nullptr ? T(1) : T(0);
    if (rows < kGemvLines) {
      // row i of C is op(A)'s row i times op(B): op(B)^T x, reading B once
      for (int64_t i = 0; i < rows; ++i) {
        Gemv(!tb, tb ? cols : k, tb ? k : cols, b, ldb, ta ? a + i : a + i * lda,
             ta ? lda : 1, beta, c + i * ldc, 1);
      }
    } else if (cols < kGemvLines) {
      // column j of C is op(A) times op(B)'s column j, written ldc apart
      for (int64_t j = 0; j < cols; ++j) {
        Gemv(ta, ta ? k : rows, ta ? rows : k, a, lda, tb ? b + j * ldb : b + j,
             tb ? 1 : ldb, beta, c + j, ldc);
      }
    } else {
      Gemm(ta, tb, rows, cols, k, a, lda, b, ldb, beta, c, ldc);
    }
  }
};

// How long a caller whose shares are done spins for the others before it sleeps.
constexpr std::chrono::microseconds kWaitSpin{50};

// Units [0, total) shared by the calling thread and pool threads.  Each takes the
// next share (guided: 1/guide of what is left, at least `chunk` units) until none is
// left, as op.cc's UnitQueue does for StitchedKernel: the caller starts at once, a
// pool thread that wakes late takes only what is left, so a slow wake-up (a busy
// machine) delays part of the product instead of half of it.  A pool thread that
// wakes after the last share was taken returns without touching the call's buffers
// (the state is kept alive by its shared_ptr); the caller returns when all is done.
class Shares {
 public:
  using Fn = std::function<void(int64_t, int64_t)>;
  Shares(Fn run, int64_t total, int64_t chunk, int64_t guide)
      : run_(std::move(run)), total_(total), chunk_(chunk), guide_(guide) {}

  void Work() {
    for (;;) {
      int64_t begin = next_.load(std::memory_order_relaxed), end;
      do {
        if (begin >= total_) return;
        end = std::min(total_, begin + std::max(chunk_, (total_ - begin) / guide_));
      } while (!next_.compare_exchange_weak(begin, end, std::memory_order_relaxed));
      run_(begin, end);
      if (done_.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) ==
          total_) {
        std::lock_guard<std::mutex> lock(mu_);   // so a waiter cannot miss it
        cv_.notify_all();
      }
    }
  }

  void Wait() {
    // Spin a while before sleeping: the shares end at about the same time, and a
    // caller put to sleep waits for a futex wake-up besides.  Measured interleaved
    // (chains as kPiecesPerThread's, load ~0.7-1.1): 74.0 us per product against
    // 78.5 without the spin at M = 8, 132.8 against 134.8 at [128, 256] x [256, 256],
    // equal within noise at M = 128, N = 1024.
    const auto until = std::chrono::steady_clock::now() + kWaitSpin;
    for (int i = 1; done_.load(std::memory_order_acquire) != total_; ++i) {
      if (i % 64 == 0 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return done_.load(std::memory_order_acquire) == total_; });
  }

 private:
  const Fn run_;
  const int64_t total_, chunk_, guide_;
  std::atomic<int64_t> next_{0}, done_{0};
  std::mutex mu_;
  std::condition_variable cv_;
};

// The product ops run on the thread that made their inputs ready, as StitchedKernel
// does (op.cc), where their node says ``inline`` (tf/passes/inline.py: graphs without
// a backward pass).  TF's executor hands an op it deems expensive to an inter-op
// thread, and in a Transformer's forward every hand-off is a thread wake-up between
// ops that run strictly one after another.  A training step keeps TF's scheduling:
// its independent products (weight and input gradients) then run side by side.
class InlineKernel : public OpKernel {
 public:
  explicit InlineKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("inline", &inline_));
  }
  bool IsExpensive() override { return !inline_; }

  // TF's executor traces an op that is not IsExpensive only at its profiler's verbose
  // level, off by default: an inline op traces itself as the executor would an expensive
  // one (node name, op type), or TensorBoard's profile shows a gap where it ran.
  void Compute(OpKernelContext* ctx) final {
    if (!inline_) {
      Run(ctx);
      return;
    }
    tsl::profiler::TraceMe trace(
        [&] { return TraceString(*ctx, tsl::profiler::TfOpDetailsEnabled()); },
        tsl::profiler::kInfo);
    Run(ctx);
  }
  virtual void Run(OpKernelContext* ctx) = 0;

 private:
  bool inline_ = false;
};

inline tsl::thread::ThreadPool* Pool(OpKernelContext* ctx) {
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  return workers == nullptr ? nullptr : workers->workers;
}

// Runs `count` products of shape `p` (run(i, lo, hi): pieces [lo, hi) of product i)
// over the calling thread and the intra-op pool, or inline when small.
template <typename T>
void RunProducts(OpKernelContext* ctx, Product<T>* p, int64_t count,
                 std::function<void(int64_t, int64_t, int64_t)> run) {
  tsl::thread::ThreadPool* pool = Pool(ctx);
  const int64_t threads = pool == nullptr ? 1 : std::max(1, pool->NumThreads());
  const int64_t macs = p->m * p->n * p->k;
  // Cut products only when there are fewer of them than threads, along the longer
  // side of the output (each piece packs all of the other operand), into
  // kPiecesPerThread pieces per thread: few and large, because every piece is a GEMM
  // call of its own that packs the other operand again (a pool thread that starts
  // late finds its piece taken by the caller, and returns); a product whose other
  // operand is small, into pieces whose output fits in L2 (kSmallOtherBytes).
  p->by_rows = p->m >= p->n;
  const int64_t len = p->by_rows ? p->m : p->n;
  p->pieces = count >= threads ? 1
                               : std::max<int64_t>(1, std::min(kPiecesPerThread * threads,
                                                               len / kShardAlign));
  if (count == 1 && p->k * (p->by_rows ? p->n : p->m) * int64_t{sizeof(T)} <=
                        kSmallOtherBytes) {
    const int64_t out = p->m * p->n * int64_t{sizeof(T)};
    p->pieces = std::max(p->pieces, std::min((out + kPieceOutBytes - 1) / kPieceOutBytes,
                                             len / kShardAlign));
  }
  if (threads < 2 || count * macs < kInlineMacs || count * p->pieces < 2) {
    for (int64_t i = 0; i < count; ++i) run(i, 0, p->pieces);
    return;
  }
  const int64_t pieces = p->pieces;
  const int64_t total = count * pieces;
  // whole products: guided shares of at least ~kShareMacs; pieces: one at a time
  const int64_t chunk = pieces > 1 ? 1
                                   : std::max<int64_t>(1, kShareMacs / std::max<int64_t>(
                                                              1, macs));
  const int64_t guide = pieces > 1 ? total : 2 * threads;
  auto shares = std::make_shared<Shares>(
      [run, pieces](int64_t lo, int64_t hi) {
        for (int64_t u = lo; u < hi;) {   // a share may span products
          const int64_t i = u / pieces, end = std::min(hi, (i + 1) * pieces);
          run(i, u - i * pieces, end - i * pieces);
          u = end;
        }
      },
      total, std::min(chunk, (total + threads - 1) / threads), guide);
  const int64_t helpers = std::min(threads - 1, (total + chunk - 1) / chunk - 1);
  for (int64_t i = 0; i < helpers; ++i) pool->Schedule([shares] { shares->Work(); });
  shares->Work();
  shares->Wait();
}

// ---- Outputs: op.cc's pool ------------------------------------------------------
//
// A large output from TF's CPU allocator (glibc malloc) is a fresh mmap on every call
// and one page fault per 4 KiB page on first write (op.cc "Output pool").  For a
// product that is most of its time: a 1x1 convolution as a [100352, 16] x [16, 96]
// product (MobileNetV2's block_1_expand at batch 8, 38.5 MB out) took numpy's sgemm
// 18.2 ms into fresh pages against 4.3 ms into a buffer already touched.  So outputs
// of at least the pool's line come from op.cc's OutputPool, the one StitchedKernel
// uses: one pool, not one per library, so its cap (STITCHING_OUTPUT_POOL_MB) bounds
// all the idle memory held, a buffer a kernel freed serves the next product of its
// size class and back, and stitching.runtime.pool_stats() / pool_trim() cover both.
//
// The two libraries are loaded RTLD_LOCAL (tf.load_op_library), so this one cannot
// resolve op.cc's symbols itself: runtime/blas.py hands it op.cc's
// stitching_pool_for once both are loaded.  Until then, or without op.cc's library,
// every output comes from TF's allocator.
using PoolFor = void* (*)(int64_t bytes);   // a tensorflow::Allocator*, or NULL
inline std::atomic<PoolFor> g_pool_for{nullptr};

// Allocates output i of `shape`: from the pool when it takes an output that large,
// else from TF (neither zero-fills it).
inline absl::Status AllocateOutput(OpKernelContext* ctx, int i, const TensorShape& shape,
                                   Tensor** out) {
  const tensorflow::DataType dtype = ctx->expected_output_dtype(i);
  const int64_t bytes = shape.num_elements() * tensorflow::DataTypeSize(dtype);
  const PoolFor pool_for = g_pool_for.load(std::memory_order_acquire);
  auto* pool = static_cast<tensorflow::Allocator*>(pool_for ? pool_for(bytes) : nullptr);
  if (pool == nullptr) return ctx->allocate_output(i, shape, out);
  Tensor t(pool, dtype, shape);
  if (!t.IsInitialized()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        ctx->op_kernel().type_string(), ": could not allocate ", bytes,
        " bytes for output ", i));
  }
  ctx->set_output(i, t);
  *out = ctx->mutable_output(i);
  return absl::OkStatus();
}

inline bool FitsBlas(int64_t v) { return v < std::numeric_limits<int32_t>::max(); }

// The swap of a shape's last batch dim and its rows ([.., H, M, K] <-> [.., M, H, K]),
// when `swapped`: the head layout of StitchedBatchMatMul's transpose_x, transpose_y and
// transpose_out and of StitchedAttention's transpose_ attributes.
inline TensorShape Swapped(TensorShape s, bool swapped) {
  if (swapped && s.dims() >= 3) {
    const int r = s.dims();
    const int64_t h = s.dim_size(r - 3);
    s.set_dim(r - 3, s.dim_size(r - 2));
    s.set_dim(r - 2, h);
  }
  return s;
}

// Swapped's rule in a shape function; `what` names the attributes in the error (a
// swap needs a batch dimension).
inline absl::Status SwappedShape(tensorflow::shape_inference::InferenceContext* c,
                                 tensorflow::shape_inference::ShapeHandle s, bool swapped,
                                 tensorflow::shape_inference::ShapeHandle* out,
                                 const char* what) {
  *out = s;
  if (!swapped || !c->RankKnown(s)) return absl::OkStatus();
  const int r = c->Rank(s);
  if (r < 3) return absl::InvalidArgumentError(absl::StrCat(what, " need a batch dimension"));
  std::vector<tensorflow::shape_inference::DimensionHandle> dims;
  for (int i = 0; i < r; ++i) dims.push_back(c->Dim(s, i));
  std::swap(dims[r - 3], dims[r - 2]);
  *out = c->MakeShape(dims);
  return absl::OkStatus();
}

// Which matrix of x (else y) product i of a broadcast batch reads.
inline int64_t BatchIndex(const tensorflow::MatMulBCast& b, bool x, int64_t i) {
  if (b.IsBroadcastingRequired()) return (x ? b.x_batch_indices() : b.y_batch_indices())[i];
  return (x ? b.x_batch_size() : b.y_batch_size()) == 1 ? 0 : i;
}

}  // namespace stitching_blas

#endif  // STITCHING_RUNTIME_BLAS_UTIL_H_
