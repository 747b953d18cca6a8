// Matrix products through OpenBLAS: StitchedMatMul and StitchedBatchMatMul.
//
// Why: where TF's oneDNN is off (IsMklEnabled() False: the AMD EPYC machines), TF's
// MatMul and BatchMatMulV2 are Eigen's tensor contraction, and between our kernels
// those products are most of a Transformer's time (92% of the stitched op time at
// batch 1, tools/op_breakdown.py).  OpenBLAS's sgemm, from the scipy-openblas32 wheel
// the NumPy/SciPy project builds numpy with, ran the same products 0.75x-0.9x of TF's
// time (BENCHMARKS.md "gemm").  A well-kept GEMM library serves better than one we
// would write: its kernels are tuned per CPU core (DYNAMIC_ARCH picks Haswell,
// SkylakeX, Zen... at load time).
//
// The ops take TF's own attributes (transpose_a/b, adj_x/adj_y) and shape functions,
// so the graph pass (tf/passes/blas.py) only changes a node's op type; StitchedMatMul
// may also take the bias of a BiasAdd that read the product (the remapper's
// _FusedMatMul): the bias is written into the output first and the GEMM adds to it
// (beta = 1), so no pass over the product is left to run.
//
// Threads: OpenBLAS is set to one thread of its own, and a product is cut into a few
// pieces of rows or columns, each one plain strided sgemm/dgemm call on one thread.
// The calling thread and TF's intra-op pool take pieces from one counter (Shares, as
// op.cc's UnitQueue does for StitchedKernel's units), so OpenBLAS starts no pool of
// its own to compete with TF's.  A 2-D product is cut into rows of the output when
// M >= N, else columns: every piece packs the whole of the other operand, and that
// operand is the smaller.  A batch of products is shared out by whole products, and
// each product cut only when there are fewer products than threads.  Small products
// run inline on the calling thread (a pool wake-up costs more than they do).  A
// product or piece of fewer than 4 rows or columns is sgemv calls, one per row or
// column (blas_util.h kGemvLines: OpenBLAS's sgemm costs M = 1 as much as M = 4).
//
// Measured against one thread per product (each product inline, TF's inter-op
// threads running independent products side by side) on the 2-core AMD EPYC while
// another process kept one core busy: inline was 1.05-1.23x faster in median, the
// shared pieces 1.15-1.45x faster in the fastest calls (the machine's quiet moments): on a
// busy machine a piece's thread can be descheduled and the caller waits for it, as
// it waits for TF's own GEMM.  The pieces are for the design point, an idle machine.
//
// Numerics: each output element is one dot product of length K summed by OpenBLAS's
// kernel (FMA, in blocks of K), as TF's Eigen kernel does in its own order: equal
// within float rounding, not bitwise (tests/test_blas.py bounds both against float64).
// blasint is 32-bit in scipy-openblas32: a dimension or leading dimension of 2^31 or
// more is refused with a message rather than wrapped.

#include "blas_util.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tensorflow/core/util/matmul_bcast.h"

namespace {

using stitching_blas::AllocateOutput;
using stitching_blas::BatchIndex;
using stitching_blas::FitsBlas;
using stitching_blas::InlineKernel;
using stitching_blas::Product;
using stitching_blas::RunProducts;
using stitching_blas::Swapped;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;

template <typename T>
class MatMulOp : public InlineKernel {
 public:
  explicit MatMulOp(OpKernelConstruction* ctx) : InlineKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_a", &ta_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_b", &tb_));
    int n_bias;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("n_bias", &n_bias));
    OP_REQUIRES(ctx, n_bias <= 1,
                absl::InvalidArgumentError("StitchedMatMul takes at most one bias"));
  }

  void Run(OpKernelContext* ctx) override {
    const Tensor& a = ctx->input(0);
    const Tensor& b = ctx->input(1);
    OP_REQUIRES(ctx, a.dims() == 2 && b.dims() == 2,
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedMatMul: both operands must be matrices, got shapes ",
                    a.shape().DebugString(), " and ", b.shape().DebugString())));
    Product<T> p{ta_, tb_, a.dim_size(ta_ ? 1 : 0), b.dim_size(tb_ ? 0 : 1),
                 a.dim_size(ta_ ? 0 : 1), nullptr, true, 1, 0, 0, 0};
    p.lda = ta_ ? p.m : p.k;
    p.ldb = tb_ ? p.k : p.n;
    p.ldc = p.n;
    const int64_t kb = b.dim_size(tb_ ? 1 : 0);
    OP_REQUIRES(ctx, p.k == kb,
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedMatMul: inner dimensions differ: ", a.shape().DebugString(),
                    " (transpose_a=", ta_, ") and ", b.shape().DebugString(),
                    " (transpose_b=", tb_, ")")));
    OP_REQUIRES(ctx, FitsBlas(p.m) && FitsBlas(p.n) && FitsBlas(p.k),
                absl::InvalidArgumentError("StitchedMatMul: a dimension is 2^31 or more, "
                                           "beyond 32-bit OpenBLAS"));
    if (ctx->num_inputs() == 3) {
      const Tensor& bias = ctx->input(2);
      OP_REQUIRES(ctx, bias.dims() == 1 && bias.dim_size(0) == p.n,
                  absl::InvalidArgumentError(absl::StrCat(
                      "StitchedMatMul: the bias must have shape [", p.n, "], got ",
                      bias.shape().DebugString())));
      p.bias = bias.flat<T>().data();
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, AllocateOutput(ctx, 0, TensorShape({p.m, p.n}), &out));
    if (p.m == 0 || p.n == 0) return;
    const T* ap = a.flat<T>().data();
    const T* bp = b.flat<T>().data();
    T* cp = out->flat<T>().data();
    const Product<T>* pp = &p;   // RunProducts sets the split first; lives till it returns
    RunProducts(ctx, &p, 1, [pp, ap, bp, cp](int64_t, int64_t lo, int64_t hi) {
      pp->Run(lo, hi, ap, bp, cp);
    });
  }


 private:
  bool ta_ = false, tb_ = false;
};

template <typename T>
class BatchMatMulOp : public InlineKernel {
 public:
  explicit BatchMatMulOp(OpKernelConstruction* ctx) : InlineKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("adj_x", &ax_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("adj_y", &ay_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_x", &tx_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_y", &ty_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("transpose_out", &to_));
  }

  void Run(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& y = ctx->input(1);
    OP_REQUIRES(ctx, x.dims() >= (tx_ ? 3 : 2) && y.dims() >= (ty_ ? 3 : 2),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedBatchMatMul: operands must have rank >= 2 (3 with "
                    "transpose_x/transpose_y), got shapes ", x.shape().DebugString(),
                    " and ", y.shape().DebugString())));
    // the operands as BatchMatMulV2 would see them (a transposed one's heads before
    // its rows)
    const TensorShape xs = Swapped(x.shape(), tx_), ys = Swapped(y.shape(), ty_);
    const int rx = xs.dims(), ry = ys.dims();
    Product<T> p{ax_, ay_, xs.dim_size(ax_ ? rx - 1 : rx - 2),
                 ys.dim_size(ay_ ? ry - 2 : ry - 1), xs.dim_size(ax_ ? rx - 2 : rx - 1),
                 nullptr, true, 1, 0, 0, 0};
    OP_REQUIRES(ctx, p.k == ys.dim_size(ay_ ? ry - 1 : ry - 2),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedBatchMatMul: inner dimensions differ: ",
                    x.shape().DebugString(), " (adj_x=", ax_, ", transpose_x=", tx_,
                    ") and ", y.shape().DebugString(), " (adj_y=", ay_,
                    ", transpose_y=", ty_, ")")));
    tensorflow::MatMulBCast bcast(xs.dim_sizes(), ys.dim_sizes());
    OP_REQUIRES(ctx, bcast.IsValid(),
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedBatchMatMul: batch dimensions do not broadcast: ",
                    x.shape().DebugString(), " and ", y.shape().DebugString())));
    OP_REQUIRES(ctx, FitsBlas(p.m) && FitsBlas(p.n) && FitsBlas(p.k),
                absl::InvalidArgumentError("StitchedBatchMatMul: a dimension is 2^31 or "
                                           "more, beyond 32-bit OpenBLAS"));
    TensorShape shape = bcast.output_batch_shape();
    OP_REQUIRES(ctx, !to_ || shape.dims() >= 1,
                absl::InvalidArgumentError(absl::StrCat(
                    "StitchedBatchMatMul: transpose_out needs a batch dimension, got "
                    "shapes ", x.shape().DebugString(), " and ", y.shape().DebugString())));
    shape.AddDim(p.m);
    shape.AddDim(p.n);
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, AllocateOutput(ctx, 0, Swapped(shape, to_), &out));
    const int64_t count = bcast.output_batch_size();
    if (count == 0 || p.m == 0 || p.n == 0) return;
    // A matrix of a swapped layout is one head's columns of rows `heads` times wider:
    // matrix i of [.., heads, rows, len] sits at i / heads * heads * rows * len +
    // i % heads * len, its rows heads * len apart (heads = 1: plain matrices)
    const int64_t hx = tx_ ? xs.dim_size(rx - 3) : 1, hy = ty_ ? ys.dim_size(ry - 3) : 1;
    const int64_t hc = to_ ? shape.dim_size(shape.dims() - 3) : 1;
    const int64_t lx = ax_ ? p.m : p.k, ly = ay_ ? p.k : p.n;
    p.lda = hx * lx;
    p.ldb = hy * ly;
    p.ldc = hc * p.n;
    const T* xp = x.flat<T>().data();
    const T* yp = y.flat<T>().data();
    T* cp = out->flat<T>().data();
    const int64_t sx = p.m * p.k, sy = p.k * p.n, sc = p.m * p.n;
    // which matrices of x and y each product reads (the broadcast's index maps)
    auto xi = std::make_shared<std::vector<int64_t>>(count);
    auto yi = std::make_shared<std::vector<int64_t>>(count);
    for (int64_t i = 0; i < count; ++i) {
      (*xi)[i] = BatchIndex(bcast, true, i);
      (*yi)[i] = BatchIndex(bcast, false, i);
    }
    const Product<T>* pp = &p;   // RunProducts sets the split first; lives till it returns
    RunProducts(ctx, &p, count, [=](int64_t i, int64_t lo, int64_t hi) {
      const int64_t ix = (*xi)[i], iy = (*yi)[i];
      pp->Run(lo, hi, xp + ix / hx * hx * sx + ix % hx * lx,
              yp + iy / hy * hy * sy + iy % hy * ly,
              cp + i / hc * hc * sc + i % hc * p.n);
    });
  }


 private:
  bool ax_ = false, ay_ = false, tx_ = false, ty_ = false, to_ = false;
};

constexpr char kSwapAttrs[] =
    "StitchedBatchMatMul: transpose_x, transpose_y and transpose_out";

// BatchMatMulV2's shape rule over the operands' unswapped shapes, the output swapped
// under transpose_out.
absl::Status BatchMatMulShape(tensorflow::shape_inference::InferenceContext* c) {
  using tensorflow::shape_inference::DimensionHandle;
  using tensorflow::shape_inference::ShapeHandle;
  bool ax = false, ay = false, tx = false, ty = false, to = false;
  TF_RETURN_IF_ERROR(c->GetAttr("adj_x", &ax));
  TF_RETURN_IF_ERROR(c->GetAttr("adj_y", &ay));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_x", &tx));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_y", &ty));
  TF_RETURN_IF_ERROR(c->GetAttr("transpose_out", &to));
  ShapeHandle x, y, out;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), tx ? 3 : 2, &x));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), ty ? 3 : 2, &y));
  TF_RETURN_IF_ERROR(stitching_blas::SwappedShape(c, x, tx, &x, kSwapAttrs));
  TF_RETURN_IF_ERROR(stitching_blas::SwappedShape(c, y, ty, &y, kSwapAttrs));
  if (!c->RankKnown(x) || !c->RankKnown(y)) {
    c->set_output(0, c->UnknownShape());
    return absl::OkStatus();
  }
  const int rx = c->Rank(x), ry = c->Rank(y);
  DimensionHandle kx = c->Dim(x, ax ? rx - 2 : rx - 1);
  DimensionHandle ky = c->Dim(y, ay ? ry - 1 : ry - 2), k;
  TF_RETURN_IF_ERROR(c->Merge(kx, ky, &k));
  ShapeHandle bx, by, batch;
  TF_RETURN_IF_ERROR(c->Subshape(x, 0, rx - 2, &bx));
  TF_RETURN_IF_ERROR(c->Subshape(y, 0, ry - 2, &by));
  TF_RETURN_IF_ERROR(tensorflow::shape_inference::BroadcastBinaryOpOutputShapeFnHelper(
      c, bx, by, true, &batch));
  TF_RETURN_IF_ERROR(c->Concatenate(
      batch, c->Matrix(c->Dim(x, ax ? rx - 1 : rx - 2), c->Dim(y, ay ? ry - 2 : ry - 1)),
      &out));
  TF_RETURN_IF_ERROR(stitching_blas::SwappedShape(c, out, to, &out, kSwapAttrs));
  c->set_output(0, out);
  return absl::OkStatus();
}

REGISTER_OP("StitchedMatMul")
    .Input("a: T")
    .Input("b: T")
    .Input("bias: n_bias * T")
    .Output("product: T")
    .Attr("transpose_a: bool = false")
    .Attr("transpose_b: bool = false")
    .Attr("n_bias: int >= 0 = 0")
    .Attr("inline: bool = false")
    .Attr("T: {float, double}")
    .SetShapeFn(tensorflow::shape_inference::MatMulShape)
    .Doc("MatMul (TF's attributes and shapes) by OpenBLAS, plus an optional bias [N] "
         "(a BiasAdd that read the product), split over TF's intra-op threads.");

REGISTER_OP("StitchedBatchMatMul")
    .Input("x: T")
    .Input("y: T")
    .Output("output: T")
    .Attr("adj_x: bool = false")
    .Attr("adj_y: bool = false")
    .Attr("transpose_x: bool = false")
    .Attr("transpose_y: bool = false")
    .Attr("transpose_out: bool = false")
    .Attr("inline: bool = false")
    .Attr("T: {float, double}")
    .SetShapeFn(BatchMatMulShape)
    .Doc("BatchMatMulV2 (TF's attributes, broadcast and shapes) by OpenBLAS, split over "
         "TF's intra-op threads.  transpose_x / transpose_y: the operand arrives with its "
         "last batch dim after its rows ([.., M, H, K] for [.., H, M, K]: an attention's "
         "head transpose before the product), each product reading its columns of the "
         "wider rows; transpose_out writes the output so ([.., M, H, N]).");

#define REGISTER(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                            \
      Name("StitchedMatMul").Device(tensorflow::DEVICE_CPU).TypeConstraint<T>("T"),   \
      MatMulOp<T>);                                                                   \
  REGISTER_KERNEL_BUILDER(Name("StitchedBatchMatMul")                                 \
                              .Device(tensorflow::DEVICE_CPU)                         \
                              .TypeConstraint<T>("T"),                                \
                          BatchMatMulOp<T>);
REGISTER(float)
REGISTER(double)
#undef REGISTER

}  // namespace

// For the Python side's report: OpenBLAS's build and the core it picked.
extern "C" const char* stitching_blas_config() {
  (void)stitching_blas::kOneThread;
  return scipy_openblas_get_config();
}
extern "C" const char* stitching_blas_corename() { return scipy_openblas_get_corename(); }

// Where large outputs come from (blas_util.h AllocateOutput): op.cc's
// stitching_pool_for, or NULL for TF's allocator alone.
extern "C" void stitching_blas_set_pool(stitching_blas::PoolFor pool_for) {
  stitching_blas::g_pool_for.store(pool_for, std::memory_order_release);
}
