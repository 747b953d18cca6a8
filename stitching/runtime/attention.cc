// StitchedAttention: out = softmax(scale * Q K^T [+ mask]) V per (batch, head), the
// scores kept per block of query rows.
//
// Why: unfused (as StitchedBatchMatMul -> StitchedKernel[softmax] ->
// StitchedBatchMatMul, tf/passes/attention.py's pattern) the [.., M, N] scores are
// written by the first product, read and written by the softmax kernel and read again
// by the second product: at the Llama decoder's batch 8 that is 4 MiB per layer passed
// over four times, ~2.5 ms of memory traffic per call.  Here each work unit is one
// block of query rows of one (batch, head): one sgemm writes its [rows, N] scores into
// a scratch of ~kBlockBytes (it stays in L1/L2), the row softmax runs over it in
// place, and one sgemm reads it into the output rows.  The scores never reach memory.
//
// Work units (batch x heads x row blocks) are shared by the calling thread and TF's
// intra-op pool as blas_util.h's RunProducts shares products (Shares: guided, the
// caller starts at once); OpenBLAS runs single-threaded inside each.
//
// Numerics: the softmax follows the stitched kernel's (and TF's) order of operations:
// t = x * scale (+ mask) (then cond ? t : fill), m = max(t), e = exp(t - m),
// s = sum(e), out = e * (1 / s).
// The sums and the products' dot products are summed in another order than TF's:
// equal within float rounding (tests/test_attention.py bounds both against float64).
// The float exp is the Cephes polynomial Eigen's pexp uses, 8 lanes of AVX2 + FMA
// where the CPU has them (build.py compiles for the baseline x86-64, so a function
// with its own target attribute, chosen at run time), else Eigen's exp on the
// baseline ISA (SSE2: 4 lanes).  TF's compile flags (build.py) name no -m option, so
// Eigen compiles to SSE2 here; timed on the Llama decoder's batch-8 attention ([8, 8,
// 128, 32] q, k, v, causal mask; load ~2, medians of 7): 2.97 ms with the AVX2 row
// softmax, 6.25 with Eigen's, 2.41 for the two products alone (batch 1: 0.79, 1.16,
// 0.73) -- Eigen's would lose to the stitched softmax kernel this replaces.
//
// Masks: an additive one (n_mask: 0 or 1) as an AddV2 to the scores, then a bool one
// (n_cond: 0 or 1; Keras's where(mask, scores, fill)): t where cond == cond_keeps,
// else the fill.  Both broadcast to the scores.  Keys that every row of a block masks
// away (a causal mask's upper triangle, padding) are skipped in both products and the
// softmax where their weights are exactly 0 in TF too (the rule at kUnderflow); on the
// GPT-2 decoder's batch-8 causal attention that took 0.77x the time (kStairRows).
//
// Layouts and attributes are the matched products' (gemm.cc's StitchedBatchMatMul):
// q and k as the first product's x and y (adj_q, adj_k, transpose_q, transpose_k), v as
// the second's y (adj_v, transpose_v), the output swapped under transpose_out.  Batch
// dims broadcast as BatchMatMulV2's do. tf/passes/attention.py fuses nothing whose
// softmax a backward reads; its registered gradient (a tape outside the stitched
// function) is TF's ops again.

#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>   // the AVX2 softmax below; other targets use Eigen's exp
#endif

#include <mutex>

#include "Eigen/Core"
#include "blas_util.h"
#include "functions.h"
#include "tune.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/util/matmul_bcast.h"

namespace {

using stitching_blas::BatchIndex;
using stitching_blas::FitsBlas;
using stitching_blas::InlineKernel;
using stitching_blas::Product;
using stitching_blas::Shares;
using stitching_blas::Swapped;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

// ---- autotune: fused, or the unfused products around the softmax kernel -------------
//
// Whether this op beats what it replaced -- TF's two batch products (oneDNN's, where TF
// runs it) around the stitched softmax kernel -- depends on the machine: on a Zen 4 EPYC
// it ran 1.10-1.37x the unfused graph, on a Zen 5 with OpenBLAS held to its AVX2
// kernels (OPENBLAS_CORETYPE=Haswell) 0.76-0.95x (BENCHMARKS.md attention@amd_avx512,
// attention@amd_avx512_zen5).  So a node the pass marked (attr _stitching_autotune: a
// hash of what it computes; _stitching_unfused: the name of a function computing the
// same with TF's products, tf/passes/attention.py unfused_function) times both ways on
// its first calls per shape class, as a StitchedKernel node marked for autotuning does
// (op.cc Tuner; the decisions go to the same table and the same disk cache), and from
// then on runs the faster.  Every call computes its output, whichever way ran.
//
// The function is instantiated on the first call that runs it (a decision read from
// the cache for the fused way never needs it).  Where it cannot be (a graph whose
// library lost it, an old SavedModel) or where op.cc's library gave no Tuner
// (runtime/blas.py), the node runs fused, as an unmarked one does: never an error.
std::atomic<const stitching_tune::Api*> g_tune_api{nullptr};   // op.cc's Tuner
stitching_tune::Counters g_tune_counts;      // native: calls run unfused once decided
std::atomic<int64_t> g_untuned{0};           // marked nodes that run fused untimed

// Bytes of one block's scores: query rows per block are as many as fit (at least
// kMinRows, or all of them); the block stays in the AMD EPYC's 512 KiB L2 between the
// products and the softmax.  Timed on the Llama decoder's batch-8 attention ([8, 8,
// 128, 32] q, k, v; load ~2.7, medians of 5): 64 KiB (a whole head's 128 rows) 2.93
// ms, 128 KiB 2.97, 32 KiB 3.11, 16 KiB 3.44, 8 KiB 3.74 -- fewer, larger sgemm calls
// (each packs K or V again) pay more than L1 residency saves.
constexpr int64_t kBlockBytes = int64_t{64} << 10;
// Fewer rows make the products' sgemm calls inefficient (and repack K and V per call).
constexpr int64_t kMinRows = 16;
// Multiply-adds below which a call runs inline on the calling thread (blas_util.h's
// kInlineMacs: a pool wake-up costs more).
constexpr int64_t kInlineMacs = stitching_blas::kInlineMacs;

#if defined(__x86_64__) && defined(__GNUC__)
#define STITCHING_AVX2 1

// exp of 8 floats: Cephes' expf as Eigen's pexp and sse_mathfun have it (clamp to
// +-88.376, n = floor(x log2(e) + 0.5), r = x - n ln 2 in two parts, a degree-5
// polynomial, times 2^n).  The clamps keep NaN (x is the operand _mm256_min/max
// return when either is NaN); below -88.376 the result is 0 (n = -127: a zero
// exponent field), as exp(-1e9) of a masked score should be.
__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
  x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x);
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) inline float Hmax(__m256 v) {
  __attribute__((aligned(32))) float a[8];
  _mm256_store_ps(a, v);
  float m = a[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, a[i]);
  return m;
}
#endif

// A row's logits in place, t = x * scale [+ mask] [then: cond kept ? t : fill], and
// their max.  The mask's and the condition's elements are `step`s apart along the row
// (0: one value broadcast), `keep` the condition's value that keeps a score (Keras
// writes where(mask, scores, fill); the other order swaps it).
template <typename T>
struct RowMask {
  const T* add = nullptr;            // additive mask row, or nullptr
  int64_t add_step = 0;
  const bool* cond = nullptr;        // bool mask row, or nullptr
  int64_t cond_step = 0;
  bool keep = true;
  T fill = 0;
};

template <typename T>
T LogitsScalar(T* x, const RowMask<T>& rm, int64_t j, int64_t n, T scale, T m) {
  for (; j < n; ++j) {
    T t = x[j] * scale;
    if (rm.add != nullptr) t += rm.add[j * rm.add_step];
    if (rm.cond != nullptr && rm.cond[j * rm.cond_step] != rm.keep) t = rm.fill;
    x[j] = t;
    m = std::max(m, t);
  }
  return m;
}

// exp(x - m) in place, then times 1 / their sum (Eigen's exp on the baseline ISA).
template <typename T>
void NormalizeEigen(T* x, int64_t n, T m) {
  Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> row(x, n);
  row = (row - m).exp();
  const T r = T(1) / row.sum();
  row *= r;
}

#ifdef STITCHING_AVX2
// The logits 8 lanes at a time where the mask and condition rows are contiguous (or
// absent); the rest scalar, same formulas.  Everything a row's softmax runs stays in
// functions compiled for AVX2: with the tail a call into baseline code (LogitsScalar)
// the unmasked op took 1.4x its time on the AMD EPYC (one thread, Llama's [8, 8, 128,
// 32]: 3.64 ms against 2.60), the softmax ~2.5x (perf); the likely cause, the
// AVX-to-SSE switch without vzeroupper, was not confirmed.
__attribute__((target("avx2,fma"))) inline float LogitsAvx2(float* x, const RowMask<float>& rm,
                                                            int64_t n, float scale) {
  const float* add = rm.add;
  const bool* cond = rm.cond;
  const int64_t add_step = rm.add_step, cond_step = rm.cond_step;
  const bool keep = rm.keep;
  const float fill = rm.fill;
  int64_t j = 0;
  float m = -std::numeric_limits<float>::infinity();
  if ((add == nullptr || add_step == 1) && (cond == nullptr || cond_step == 1)) {
    const __m256 vs = _mm256_set1_ps(scale), vfill = _mm256_set1_ps(fill);
    const __m256i vkeep = _mm256_set1_epi32(keep ? 1 : 0);
    __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
      __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + j), vs);
      if (add != nullptr) t = _mm256_add_ps(t, _mm256_loadu_ps(add + j));
      if (cond != nullptr) {   // 8 bools (0 or 1) widened to lanes; kept: t, else fill
        int64_t bytes;
        std::memcpy(&bytes, cond + j, 8);
        const __m256i c = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
        t = _mm256_blendv_ps(vfill, t, _mm256_castsi256_ps(_mm256_cmpeq_epi32(c, vkeep)));
      }
      _mm256_storeu_ps(x + j, t);
      vm = _mm256_max_ps(vm, t);
    }
    m = Hmax(vm);
  }
  for (; j < n; ++j) {
    float t = x[j] * scale;
    if (add != nullptr) t += add[j * add_step];
    if (cond != nullptr && cond[j * cond_step] != keep) t = fill;
    x[j] = t;
    m = std::max(m, t);
  }
  return m;
}

// exp(x - m) in place 8 lanes at a time, then times 1 / their sum.  NaN anywhere in
// the row makes the sum NaN, so the whole row NaN, as TF's is.
__attribute__((target("avx2,fma"))) inline void NormalizeAvx2(float* x, int64_t n,
                                                               float m) {
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vmax));
    _mm256_storeu_ps(x + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  __attribute__((aligned(32))) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  float s = 0;
  for (float l : lanes) s += l;
  if (j < n) {   // the tail through the same exp, 8 lanes padded
    __attribute__((aligned(32))) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = j; i < n; ++i) tail[i - j] = x[i] - m;
    _mm256_store_ps(tail, Exp8(_mm256_load_ps(tail)));
    for (int64_t i = j; i < n; ++i) {
      x[i] = tail[i - j];
      s += x[i];
    }
  }
  const __m256 vr = _mm256_set1_ps(1.0f / s);
  for (j = 0; j + 8 <= n; j += 8) {
    _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), vr));
  }
  for (; j < n; ++j) x[j] *= 1.0f / s;
}

__attribute__((target("avx2,fma"))) void SoftmaxRowAvx2(float* x, const RowMask<float>& rm,
                                                        int64_t n, float scale) {
  NormalizeAvx2(x, n, LogitsAvx2(x, rm, n, scale));
}

__attribute__((target("avx2,fma"))) float LogitsRowAvx2(float* x, const RowMask<float>& rm,
                                                        int64_t n, float scale) {
  return LogitsAvx2(x, rm, n, scale);
}

__attribute__((target("avx2,fma"))) void NormalizeRowAvx2(float* x, int64_t n, float m) {
  NormalizeAvx2(x, n, m);
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif

// A row's softmax in two steps (the logits and their max, then exp and the sum), so
// that the block can check the max before it keeps the columns it skipped (Run).
template <typename T>
T Logits(T* x, const RowMask<T>& rm, int64_t n, T scale) {
  return LogitsScalar(x, rm, 0, n, scale, -std::numeric_limits<T>::infinity());
}

template <typename T>
void Normalize(T* x, int64_t n, T m) {
  NormalizeEigen(x, n, m);
}

template <typename T>
void SoftmaxRow(T* x, const RowMask<T>& rm, int64_t n, T scale) {
  NormalizeEigen(x, n, Logits(x, rm, n, scale));
}

#ifdef STITCHING_AVX2
template <>
float Logits<float>(float* x, const RowMask<float>& rm, int64_t n, float scale) {
  if (kHasAvx2) return LogitsRowAvx2(x, rm, n, scale);
  return LogitsScalar(x, rm, 0, n, scale, -std::numeric_limits<float>::infinity());
}

template <>
void Normalize<float>(float* x, int64_t n, float m) {
  if (kHasAvx2) return NormalizeRowAvx2(x, n, m);
  NormalizeEigen(x, n, m);
}

template <>
void SoftmaxRow<float>(float* x, const RowMask<float>& rm, int64_t n, float scale) {
  if (kHasAvx2) return SoftmaxRowAvx2(x, rm, n, scale);
  NormalizeEigen(x, n, Logits(x, rm, n, scale));
}
#endif

// Where matrix i of an operand starts and how far apart its rows are: a swapped
// layout's matrix is one head's columns of rows `heads` times wider (gemm.cc's rule).
struct Operand {
  int64_t heads = 1, size = 0, len = 0;   // heads (1: plain), rows * len, row length
  int64_t ld() const { return heads * len; }
  int64_t At(int64_t i) const { return i / heads * heads * size + i % heads * len; }
};

Operand MakeOperand(const TensorShape& unswapped, bool swapped) {
  const int r = unswapped.dims();
  Operand o;
  o.heads = swapped ? unswapped.dim_size(r - 3) : 1;
  o.len = unswapped.dim_size(r - 1);
  o.size = unswapped.dim_size(r - 2) * o.len;
  return o;
}

// The element strides of a tensor of shape `from` broadcast to `to` (0 along the dims
// it broadcasts along, as BatchMatMulV2 or AddV2 would), or false where it does not.
bool BroadcastStrides(const TensorShape& from, const TensorShape& to,
                      std::vector<int64_t>* strides) {
  strides->assign(to.dims(), 0);
  if (from.dims() > to.dims()) return false;
  int64_t step = 1;
  for (int i = 1; i <= from.dims(); ++i) {
    const int64_t dm = from.dim_size(from.dims() - i), ds = to.dim_size(to.dims() - i);
    if (dm != 1 && dm != ds) return false;
    if (dm != 1) (*strides)[to.dims() - i] = step;
    step *= dm;
  }
  return true;
}

// Skipping the masked tail of a block (keys past the last one any of its rows keeps).
//
// TF computes those keys' weights exp(t - max) and they come out exactly 0 where
// t - max < ln of half the smallest denormal (float: -103.97; double: -745.13): below
// these lines exp rounds to +0.0 (Eigen's clamps sooner), and 0 * v adds nothing to the
// second product.  So a block may drop the keys [w, n) where, for every row, each
// dropped logit t is provably below max - kUnderflow<T>:
//  - a bool mask: t is the fill exactly; the row's max over [0, w) must exceed the fill
//    by the margin (it fails on a row with no kept key: TF's answer is then uniform over
//    all n keys, which only the whole block gives);
//  - an additive mask (a key is a candidate where mask <= kDropMask): t = x * scale +
//    mask with |x| <= |q| |k| (Cauchy-Schwarz, plus the dot product's rounding); the
//    bound over the block must stay below every row's max by the margin;
// and the dropped rows of v must be finite (TF's 0 * inf is NaN).  Anything else (NaN
// or inf in q or k, large scores, a fully masked row) runs the whole block: the rule
// never changes a result, it only saves the work.
template <typename T>
constexpr double kUnderflow = 104.0;
template <>
constexpr double kUnderflow<double> = 746.0;
// Arbitrary: an additive mask entry above this cannot be a "masked" key worth testing
// (exp(-128) is 0 in float; a key masked by less is kept and computed).
constexpr double kDropMask = -128.0;
// Query rows per block where the kept extents differ between rows (a causal mask): a
// block computes up to its last row's extent, so smaller blocks skip more of the
// triangle (1/2 + rows / 2n of the scores) but call sgemm more often.  Timed with one
// thread (load ~2, min of 15 rounds of 10 calls), causal masks, against the same op
// unmasked in whole-head blocks: GPT-2's [8, 4, 128, 64] q, k, v: 32 rows 1.65 ms
// (bool mask; additive 1.74), 16 rows 1.78, 64 rows 1.77, unmasked 2.14; Llama's [8, 8,
// 128, 32]: 2.06 (2.19), 2.26, 2.22, unmasked 2.67.  Skipping 37% of the work saves
// ~20%: the products' smaller sgemm calls give back the rest.
constexpr int64_t kStairRows = 32;

template <typename T>
bool Kept(const RowMask<T>& rm, int64_t c) {
  if (rm.cond != nullptr) return rm.cond[c * rm.cond_step] == rm.keep;
  return !(rm.add[c * rm.add_step] <= kDropMask);   // NaN: kept
}

// 1 + the last key at or past `floor` that the row keeps, else `floor`; `*dropped`
// rises to the largest additive mask value it passed over (keys it does not keep).
struct Extent {
  int64_t w;          // keys [w, n) are dropped
  double dropped;     // the largest additive mask value among them
};

template <typename T>
int64_t RowExtent(const RowMask<T>& rm, int64_t n, int64_t floor, double* dropped) {
  for (int64_t c = n - 1; c >= floor; --c) {
    if (Kept(rm, c)) return c + 1;
    if (rm.cond == nullptr) *dropped = std::max(*dropped, double(rm.add[c * rm.add_step]));
  }
  return floor;
}

// The sum of the squares of `len` elements `step` apart, in T: inf or NaN where one
// is not finite (or the sum overflows).  Within (len + 1) eps of the exact sum.
template <typename T>
T SumSquares(const T* p, int64_t len, int64_t step) {
  T s = 0;
  for (int64_t c = 0; c < len; ++c) s += p[c * step] * p[c * step];
  return s;
}

#ifdef STITCHING_AVX2
// 8 lanes at a time: the skipped keys' checks read as much as a block's logits, and
// scalar they took ~10% of the GPT-2 decoder's causal attention.
__attribute__((target("avx2,fma"))) float SumSquaresAvx2(const float* p, int64_t len) {
  __m256 acc = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= len; c += 8) {
    const __m256 x = _mm256_loadu_ps(p + c);
    acc = _mm256_fmadd_ps(x, x, acc);
  }
  __attribute__((aligned(32))) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float s = 0;
  for (float l : lanes) s += l;
  for (; c < len; ++c) s += p[c] * p[c];
  return s;
}

template <>
float SumSquares<float>(const float* p, int64_t len, int64_t step) {
  if (kHasAvx2 && step == 1) return SumSquaresAvx2(p, len);
  float s = 0;
  for (int64_t c = 0; c < len; ++c) s += p[c * step] * p[c * step];
  return s;
}
#endif

// The largest sum of squares of the vectors [first, last) of a row-major matrix with
// rows `ld` apart: its rows (each `len` long) or else its columns; +inf where one is
// not finite.
template <typename T>
double MaxSquares(const T* p, int64_t first, int64_t last, int64_t len, bool rows,
                  int64_t ld) {
  double best = 0;
  for (int64_t i = first; i < last; ++i) {
    const double s = rows ? SumSquares(p + i * ld, len, 1) : SumSquares(p + i, len, ld);
    if (!std::isfinite(s)) return std::numeric_limits<double>::infinity();
    best = std::max(best, s);
  }
  return best;
}

template <typename T>
class AttentionOp : public InlineKernel {
 public:
  explicit AttentionOp(OpKernelConstruction* ctx) : InlineKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("scale", &scale_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("adj_q", &aq_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("adj_k", &ak_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("adj_v", &av_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_q", &tq_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_k", &tk_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_v", &tv_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_out", &to_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n_mask", &n_mask_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n_cond", &n_cond_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("fill", &fill_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("cond_keeps", &keep_));
    OP_REQUIRES(ctx, n_mask_ <= 1 && n_cond_ <= 1,
                absl::InvalidArgumentError("StitchedAttention takes at most one mask and "
                                           "one condition"));
    std::string fn;
    if (tensorflow::TryGetNodeAttr(ctx->def(), "_stitching_autotune", &tune_hash_) &&
        !tune_hash_.empty() &&
        tensorflow::TryGetNodeAttr(ctx->def(), "_stitching_unfused", &fn) && !fn.empty()) {
      tune_api_ = g_tune_api.load(std::memory_order_acquire);
      if (tune_api_ == nullptr) {
        g_untuned.fetch_add(1);
      } else {
        unfused_.set_name(fn);
        tune_api_->preload(tune_hash_.c_str());
      }
    }
  }

  void Run(OpKernelContext* ctx) override {
    // Measured only once the process's kernels run their final code: the unfused
    // function's softmax kernel may run tier-1 code, or hold for its upgrade, on the
    // first calls, and a tiered compile takes a core meanwhile.  Timed then, the
    // unfused way measured 2.4-3.3x its steady time and lost every decision it won
    // warm, and the decision is kept on disk (BENCHMARKS.md attention@amd_avx512_zen5,
    // session 26).  Until then an undecided shape class runs fused, untimed.
    const bool measure = tune_api_ != nullptr && tune_api_->settled() != 0;
    if (tune_api_ != nullptr && !unfused_failed_.load(std::memory_order_acquire) &&
        tune_node_.Run(*tune_api_, tune_hash_, ctx, measure, &g_tune_counts,
                       [&] { RunFused(ctx); }, [&] { return RunUnfused(ctx); })) {
      return;
    }
    RunFused(ctx);
  }

 private:
  // The unfused function on this call's inputs, and true; the fused op where it cannot
  // be had or fails, and false.
  bool RunUnfused(OpKernelContext* ctx) {
    tensorflow::FunctionLibraryRuntime* flib = nullptr;
    tensorflow::FunctionLibraryRuntime::Handle handle = 0;
    bool ok = false;
    {
      std::lock_guard<std::mutex> lock(unfused_mu_);
      if (!unfused_tried_) {
        unfused_tried_ = true;
        unfused_status_ =
            ctx->function_library() == nullptr
                ? absl::NotFoundError("no function library")
                : named_.Instantiate(ctx->function_library(), unfused_, &unfused_flib_,
                                     &unfused_handle_);
        if (!unfused_status_.ok()) {
          g_untuned.fetch_add(1);
          unfused_failed_.store(true, std::memory_order_release);
          LOG(WARNING) << "StitchedAttention " << ctx->op_kernel().name()
                       << ": not autotuned, it runs fused: its unfused function "
                       << unfused_.name() << " is not here (" << unfused_status_.message()
                       << ")";
        }
      }
      ok = unfused_status_.ok();
      flib = unfused_flib_;
      handle = unfused_handle_;
    }
    if (ok) {
      const absl::Status run = stitching_fn::RunInline(
          ctx, flib, handle, absl::StrCat("StitchedAttention ", ctx->op_kernel().name()));
      if (run.ok()) return true;
      // (no output is set then): the fused op answers, and serves from now on
      if (!unfused_failed_.exchange(true)) {
        g_untuned.fetch_add(1);
        LOG(WARNING) << "StitchedAttention " << ctx->op_kernel().name()
                     << ": not autotuned, it runs fused: its unfused function failed ("
                     << run.message() << ")";
      }
    }
    RunFused(ctx);
    return false;
  }

  void RunFused(OpKernelContext* ctx) {
    const Tensor& q = ctx->input(0);
    const Tensor& k = ctx->input(1);
    const Tensor& v = ctx->input(2);
    OP_REQUIRES(ctx, q.dims() >= (tq_ ? 3 : 2) && k.dims() >= (tk_ ? 3 : 2) &&
                         v.dims() >= (tv_ ? 3 : 2),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedAttention: q, k and v must have rank >= 2 (3 where "
                    "transposed), got shapes ", q.shape().DebugString(), ", ",
                    k.shape().DebugString(), " and ", v.shape().DebugString())));
    const TensorShape qs = Swapped(q.shape(), tq_), ks = Swapped(k.shape(), tk_),
                      vs = Swapped(v.shape(), tv_);
    const int rq = qs.dims(), rk = ks.dims(), rv = vs.dims();
    // scores [.., M, N] = op(Q) [M, D] op(K) [D, N]; out [.., M, E] = P [M, N] op(V) [N, E]
    const int64_t m = qs.dim_size(aq_ ? rq - 1 : rq - 2), d = qs.dim_size(aq_ ? rq - 2 : rq - 1);
    const int64_t n = ks.dim_size(ak_ ? rk - 2 : rk - 1);
    const int64_t e = vs.dim_size(av_ ? rv - 2 : rv - 1);
    OP_REQUIRES(ctx, d == ks.dim_size(ak_ ? rk - 1 : rk - 2) &&
                         n == vs.dim_size(av_ ? rv - 1 : rv - 2),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedAttention: inner dimensions differ: q ", q.shape().DebugString(),
                    ", k ", k.shape().DebugString(), ", v ", v.shape().DebugString(),
                    " (adj_q=", aq_, ", adj_k=", ak_, ", adj_v=", av_, ")")));
    OP_REQUIRES(ctx, FitsBlas(m) && FitsBlas(n) && FitsBlas(d) && FitsBlas(e),
                absl::InvalidArgumentError("StitchedAttention: a dimension is 2^31 or "
                                           "more, beyond 32-bit OpenBLAS"));
    tensorflow::MatMulBCast b1(qs.dim_sizes(), ks.dim_sizes());
    OP_REQUIRES(ctx, b1.IsValid(),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedAttention: batch dimensions of q and k do not broadcast: ",
                    q.shape().DebugString(), " and ", k.shape().DebugString())));
    TensorShape scores = b1.output_batch_shape();
    const int batch_rank = scores.dims();
    scores.AddDim(m);
    scores.AddDim(n);
    tensorflow::MatMulBCast b2(scores.dim_sizes(), vs.dim_sizes());
    OP_REQUIRES(ctx, b2.IsValid(),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedAttention: batch dimensions of the scores ",
                    scores.DebugString(), " and v ", v.shape().DebugString(),
                    " do not broadcast")));
    // the mask's and the condition's element strides along the scores' dims
    std::vector<int64_t> mstride, cstride;
    const T* mp = nullptr;
    const bool* cp = nullptr;
    for (int i = 0; i < n_mask_ + n_cond_; ++i) {
      const Tensor& t = ctx->input(3 + i);
      const bool is_cond = i == n_mask_;
      OP_REQUIRES(ctx, BroadcastStrides(t.shape(), scores, is_cond ? &cstride : &mstride),
                  absl::InvalidArgumentError(absl::StrCat(
                      "StitchedAttention: the ", is_cond ? "condition " : "mask ",
                      t.shape().DebugString(), " does not broadcast to the scores ",
                      scores.DebugString())));
      if (is_cond) {
        cp = t.flat<bool>().data();
      } else {
        mp = t.flat<T>().data();
      }
    }
    TensorShape shape = b2.output_batch_shape();
    OP_REQUIRES(ctx, !to_ || shape.dims() >= 1,
                absl::InvalidArgumentError("StitchedAttention: transpose_out needs a batch "
                                           "dimension"));
    shape.AddDim(m);
    shape.AddDim(e);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, Swapped(shape, to_), &out));
    const int64_t count = b2.output_batch_size();
    if (count == 0 || m == 0 || e == 0) return;

    const Operand oq = MakeOperand(qs, tq_), ok = MakeOperand(ks, tk_), ov = MakeOperand(vs, tv_);
    Operand oo;
    oo.heads = to_ ? shape.dim_size(shape.dims() - 3) : 1;
    oo.len = e;
    oo.size = m * e;
    // per scores matrix: its q and k matrices and where its mask and condition start
    const int64_t nscores = b1.output_batch_size();
    std::vector<int64_t> qi(nscores), ki(nscores), mbase(nscores, 0), cbase(nscores, 0);
    for (int64_t s = 0; s < nscores; ++s) {
      qi[s] = BatchIndex(b1, true, s);
      ki[s] = BatchIndex(b1, false, s);
      for (int64_t i = batch_rank - 1, rest = s; i >= 0; --i) {
        if (mp != nullptr) mbase[s] += rest % scores.dim_size(i) * mstride[i];
        if (cp != nullptr) cbase[s] += rest % scores.dim_size(i) * cstride[i];
        rest /= scores.dim_size(i);
      }
    }
    std::vector<int64_t> si(count), vi(count);
    for (int64_t j = 0; j < count; ++j) {
      si[j] = BatchIndex(b2, true, j);
      vi[j] = BatchIndex(b2, false, j);
    }
    const T scale = static_cast<T>(scale_);
    // row `i` of scores matrix `s`: where its mask and condition elements are
    auto row_mask = [&](int64_t s, int64_t i) {
      RowMask<T> rm;
      if (mp != nullptr) {
        rm.add = mp + mbase[s] + i * mstride[batch_rank];
        rm.add_step = mstride[batch_rank + 1];
      }
      if (cp != nullptr) {
        rm.cond = cp + cbase[s] + i * cstride[batch_rank];
        rm.cond_step = cstride[batch_rank + 1];
        rm.keep = keep_;
        rm.fill = static_cast<T>(fill_);
      }
      return rm;
    };
    const bool skip = mp != nullptr || cp != nullptr;
    int64_t rows = std::min(m, std::max(kMinRows, kBlockBytes / std::max<int64_t>(
                                                      1, n * int64_t(sizeof(T)))));
    if (skip && rows > kStairRows) {   // do the first matrix's rows keep different tails?
      int64_t lo = n, hi = 0;
      for (int64_t i = 0; i < m && lo >= hi; ++i) {
        double unused = 0;
        const int64_t x = RowExtent(row_mask(0, i), n, 0, &unused);
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
      if (lo < hi) rows = kStairRows;
    }
    const int64_t blocks = (m + rows - 1) / rows;
    // The kept extent of rows [r0, r0 + r) of scores matrix s: the keys [w, n) no row
    // keeps, and the largest additive mask value among them (each row's scan passes
    // over [w, n) as w ends).
    auto extent = [&](int64_t s, int64_t r0, int64_t r) {
      Extent x{0, -std::numeric_limits<double>::infinity()};
      for (int64_t i = 0; i < r && x.w < n; ++i) {
        x.w = RowExtent(row_mask(s, r0 + i), n, x.w, &x.dropped);
      }
      return x;
    };
    // A mask the same for every matrix (a causal [T, T] or [1, 1, T, T]): its blocks'
    // extents once, not per matrix (the scans cost ~15% of the causal attention).
    bool same = true;
    for (int i = 0; i < batch_rank; ++i) {
      same = same && (mp == nullptr || mstride[i] == 0) && (cp == nullptr || cstride[i] == 0);
    }
    std::vector<Extent> extents;
    for (int64_t b = 0; skip && same && b < blocks; ++b) {
      extents.push_back(extent(0, b * rows, std::min(rows, m - b * rows)));
    }
    const T* qp = q.flat<T>().data();
    const T* kp = k.flat<T>().data();
    const T* vp = v.flat<T>().data();
    T* op = out->flat<T>().data();
    const bool aq = aq_, ak = ak_, av = av_, cond = cp != nullptr;
    const double fill = static_cast<T>(fill_);
    // units [lo, hi): unit u is row block u % blocks of output matrix u / blocks
    auto run = [&, n, d, e, m, rows, blocks](int64_t lo, int64_t hi) {
      std::vector<T> buf(rows * n), top(rows);
      for (int64_t u = lo; u < hi; ++u) {
        const int64_t j = u / blocks, r0 = u % blocks * rows, r = std::min(rows, m - r0);
        const int64_t s = si[j];
        const T* a = qp + oq.At(qi[s]) + (aq ? r0 : r0 * oq.ld());
        const T* kb = kp + ok.At(ki[s]);
        const T* vb = vp + ov.At(vi[j]);
        const Extent x = !skip ? Extent{n, 0} : same ? extents[u % blocks] : extent(s, r0, r);
        const int64_t w = x.w;
        const double dropped = x.dropped;
        // whether dropping keys [w, n) changes nothing (the rule above), once the
        // logits of keys [0, w) and their row maxima are in
        auto exact = [&]() {
          if (!std::isfinite(MaxSquares(vb, w, n, e, !av, ov.ld()))) return false;
          double bound = fill;                       // the largest dropped logit
          if (!cond) {
            const double eps = std::numeric_limits<T>::epsilon();
            // (the sums of squares and the dot product each within (d + 2) eps)
            const double x = std::abs(double(scale)) * (1 + 4 * (d + 2) * eps) *
                             std::sqrt(MaxSquares(a, 0, r, d, !aq, oq.ld()) *
                                       MaxSquares(kb, w, n, d, ak, ok.ld()));
            bound = x + dropped;
            bound += 2 * eps * std::abs(bound);      // the rounding of x * scale + mask
          }
          for (int64_t i = 0; i < r; ++i) {
            if (!(bound < double(top[i]) - kUnderflow<T>)) return false;
          }
          return true;
        };
        // the block over keys [0, width): false (nothing written) where width = w < n
        // is not exact
        auto block = [&](int64_t width) {
          Product<T>{aq, ak, r, width, d, nullptr, true, 1, oq.ld(), ok.ld(), width}.Run(
              0, 1, a, kb, buf.data());
          if (width == n) {      // each row at once, while it is in L1
            for (int64_t i = 0; i < r; ++i) {
              SoftmaxRow<T>(buf.data() + i * width, row_mask(s, r0 + i), width, scale);
            }
          } else {               // all the maxima first: they decide whether to skip
            for (int64_t i = 0; i < r; ++i) {
              top[i] = Logits<T>(buf.data() + i * width, row_mask(s, r0 + i), width, scale);
            }
            if (!exact()) return false;
            for (int64_t i = 0; i < r; ++i) Normalize<T>(buf.data() + i * width, width, top[i]);
          }
          Product<T>{false, av, r, e, width, nullptr, true, 1, width, ov.ld(), oo.ld()}.Run(
              0, 1, buf.data(), vb, op + oo.At(j) + r0 * oo.ld());
          return true;
        };
        if (w == 0 || w == n || !block(w)) block(n);
      }
    };
    const int64_t total = count * blocks;
    tsl::thread::ThreadPool* pool = stitching_blas::Pool(ctx);
    const int64_t threads = pool == nullptr ? 1 : std::max(1, pool->NumThreads());
    if (threads < 2 || total < 2 || count * m * n * (d + e) < kInlineMacs) {
      run(0, total);
      return;
    }
    // The state outlives this call only in a pool thread that woke after the last
    // share was taken, and such a thread touches nothing (Shares' comment): `run`'s
    // references to this frame are read only while shares run.
    auto shares = std::make_shared<Shares>(run, total, 1, 2 * threads);
    const int64_t helpers = std::min(threads - 1, total - 1);
    for (int64_t i = 0; i < helpers; ++i) pool->Schedule([shares] { shares->Work(); });
    shares->Work();
    shares->Wait();
  }

  // autotune (see g_tune_api): the Tuner where the node is marked, else nullptr
  const stitching_tune::Api* tune_api_ = nullptr;
  std::string tune_hash_;
  stitching_tune::Node tune_node_;
  tensorflow::NameAttrList unfused_;
  std::mutex unfused_mu_;                  // the function, instantiated on first need
  bool unfused_tried_ = false;
  std::atomic<bool> unfused_failed_{false};
  absl::Status unfused_status_;
  stitching_fn::NamedFunctions named_;
  tensorflow::FunctionLibraryRuntime* unfused_flib_ = nullptr;
  tensorflow::FunctionLibraryRuntime::Handle unfused_handle_ = 0;

  float scale_ = 1.0f, fill_ = 0.0f;
  int n_mask_ = 0, n_cond_ = 0;
  bool aq_ = false, ak_ = false, av_ = false, tq_ = false, tk_ = false, tv_ = false,
       to_ = false, keep_ = true;
};

// The output shape: BatchMatMulV2's rule twice (q k -> scores, scores v -> out), the
// operands unswapped first and the output swapped under transpose_out.
absl::Status AttentionShape(tensorflow::shape_inference::InferenceContext* c) {
  using tensorflow::shape_inference::DimensionHandle;
  using tensorflow::shape_inference::ShapeHandle;
  bool aq, ak, av, tq, tk, tv, to;
  TF_RETURN_IF_ERROR(c->GetAttr("adj_q", &aq));
  TF_RETURN_IF_ERROR(c->GetAttr("adj_k", &ak));
  TF_RETURN_IF_ERROR(c->GetAttr("adj_v", &av));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_q", &tq));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_k", &tk));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_v", &tv));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_out", &to));
  auto swap = [c](ShapeHandle s, bool swapped, ShapeHandle* out) {
    return stitching_blas::SwappedShape(c, s, swapped, out,
                                        "StitchedAttention: transpose_q/k/v/out");
  };
  ShapeHandle q, k, v, out;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), tq ? 3 : 2, &q));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), tk ? 3 : 2, &k));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(2), tv ? 3 : 2, &v));
  TF_RETURN_IF_ERROR(swap(q, tq, &q));
  TF_RETURN_IF_ERROR(swap(k, tk, &k));
  TF_RETURN_IF_ERROR(swap(v, tv, &v));
  if (!c->RankKnown(q) || !c->RankKnown(k) || !c->RankKnown(v)) {
    c->set_output(0, c->UnknownShape());
    return absl::OkStatus();
  }
  const int rq = c->Rank(q), rk = c->Rank(k), rv = c->Rank(v);
  DimensionHandle unused;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(q, aq ? rq - 2 : rq - 1), c->Dim(k, ak ? rk - 1 : rk - 2),
                              &unused));
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(k, ak ? rk - 2 : rk - 1), c->Dim(v, av ? rv - 1 : rv - 2),
                              &unused));
  ShapeHandle bq, bk, bv, b1, batch;
  TF_RETURN_IF_ERROR(c->Subshape(q, 0, rq - 2, &bq));
  TF_RETURN_IF_ERROR(c->Subshape(k, 0, rk - 2, &bk));
  TF_RETURN_IF_ERROR(c->Subshape(v, 0, rv - 2, &bv));
  TF_RETURN_IF_ERROR(tensorflow::shape_inference::BroadcastBinaryOpOutputShapeFnHelper(
      c, bq, bk, true, &b1));
  TF_RETURN_IF_ERROR(tensorflow::shape_inference::BroadcastBinaryOpOutputShapeFnHelper(
      c, b1, bv, true, &batch));
  TF_RETURN_IF_ERROR(c->Concatenate(
      batch, c->Matrix(c->Dim(q, aq ? rq - 1 : rq - 2), c->Dim(v, av ? rv - 2 : rv - 1)),
      &out));
  TF_RETURN_IF_ERROR(swap(out, to, &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

REGISTER_OP("StitchedAttention")
    .Input("q: T")
    .Input("k: T")
    .Input("v: T")
    .Input("mask: n_mask * T")
    .Input("cond: n_cond * bool")
    .Output("output: T")
    .Attr("scale: float = 1.0")
    .Attr("adj_q: bool = false")
    .Attr("adj_k: bool = false")
    .Attr("adj_v: bool = false")
    .Attr("transpose_q: bool = false")
    .Attr("transpose_k: bool = false")
    .Attr("transpose_v: bool = false")
    .Attr("transpose_out: bool = false")
    .Attr("n_mask: int >= 0 = 0")
    .Attr("n_cond: int >= 0 = 0")
    .Attr("fill: float = 0.0")
    .Attr("cond_keeps: bool = true")
    .Attr("inline: bool = false")
    .Attr("T: {float, double}")
    .SetShapeFn(AttentionShape)
    .Doc("softmax(t) op(v) along the last axis with t = scale * op(q) op(k) [+ mask], "
         "then where cond is given, t where cond == cond_keeps else fill; per batch "
         "matrix (BatchMatMulV2's broadcast and StitchedBatchMatMul's adj_ and transpose_ "
         "layouts), the scores kept per block of query rows; the mask and cond broadcast "
         "to the scores.  Keys a block's rows all mask away are skipped where that is "
         "exact (their weights are 0 in TF too).");

REGISTER_KERNEL_BUILDER(
    Name("StitchedAttention").Device(tensorflow::DEVICE_CPU).TypeConstraint<float>("T"),
    AttentionOp<float>);
REGISTER_KERNEL_BUILDER(
    Name("StitchedAttention").Device(tensorflow::DEVICE_CPU).TypeConstraint<double>("T"),
    AttentionOp<double>);

}  // namespace

// op.cc's Tuner (runtime/blas.py hands it over with the output pool; NULL: none, the
// marked nodes built from then on run fused untimed).
extern "C" void stitching_blas_set_tuner(const stitching_tune::Api* api) {
  g_tune_api.store(api, std::memory_order_release);
}

// StitchedAttention's autotune counters: (node, class) decisions adopted from the
// cache, calls timed while measuring, calls run unfused once decided, marked nodes
// that run fused untimed (no Tuner, or their unfused function is not here).
extern "C" void stitching_attention_tune_counts(int64_t* out) {
  if (out == nullptr) return;
  out[0] = g_tune_counts.cached.load();
  out[1] = g_tune_counts.timed.load();
  out[2] = g_tune_counts.native.load();
  out[3] = g_untuned.load();
}
