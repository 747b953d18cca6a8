"""Composite TF ops, expanded into op-table primitives when a spec is built.

The planner sees one node per TF node (so a region never holds half a Softmax);
``expand`` turns a composite node into primitive spec nodes.  Each expansion is
the textbook formula TF's own kernel computes:

  Softmax(x)      = e * (1 / sum(e)),      e = exp(x - max(x))     (last axis;
                    TF's kernel multiplies by the inverse, it does not divide)
  LogSoftmax(x)   = s - log(sum(exp(s))),  s = x - max(x)
  BiasAdd(x, b)   = x + b                  (b broadcast on the channel axis)
  FusedBatchNorm  = x * k + (offset - mean * k),  k = scale * rsqrt(var + eps)
                    (inference; channel axis by data_format)
  FusedBatchNormTraining(x, scale, offset[, mean, var]) (fused_batch_norm_op.cc, the
                    CPU functor with is_training; five outputs, each computed only where
                    read): the statistics reduce every axis but the channel axis
                    (data_format), n their element count (a constant, or where a reduced
                    dim is known only at run time a sum of ones, exact below 2**24):
                       mean = sum(x) / n,  xc = x - mean,  v = sum(xc * xc) / n
                       y    = xc * (rsqrt(v + eps) * scale) + offset
                       batch_mean = mean, batch_variance = v * (n / max(n - 1, 1))
                                    (Bessel-corrected: TF's rest_size_adjust)
                       reserve_space_1 = mean, reserve_space_2 = v (not corrected)
                    (V3's reserve_space_3, a scalar 0 on the CPU, is no output: its
                    gradient reads a constant instead, tf/passes/bn_reserve.py)
                    with exponential_avg_factor f != 1 (V3) the running averages of the
                    old mean and var inputs: batch_mean = (1 - f) * mean_in + f * mean,
                    batch_variance = (1 - f) * var_in + (f * adj) * v
                    (sums accumulate in float64: never less accurate than TF's float32
                    sums; half-precision x is cast to the statistics' dtype first)

Training ops (TF's CPU functors: relu_op_functor.h, cwise_ops_gradients.h,
bias_op.cc, l2loss_op.cc, aggregate_ops.h), with TF's association order:

  ReluGrad(g, x)     = g * cast(x > 0)            (a NaN gradient stays NaN, as in TF)
  Relu6Grad(g, x)    = g * cast(x > 0 and x < 6)
  EluGrad(g, y)      = y < 0 ? g * (y + 1) : g
  SeluGrad(g, y)     = y < 0 ? g * (y + scale*alpha) : g * scale
  SoftplusGrad(g, x) = g / (exp(-x) + 1)
  SigmoidGrad(y, dy) = dy * y * (1 - y)
  TanhGrad(y, dy)    = dy * (1 - y * y)
  BiasAddGrad(g)     = sum of g over every axis but the channel axis
  L2Loss(x)          = sum(x * x * 0.5)
  SoftmaxCrossEntropyWithLogits(logits, labels) (xent_op.h; two outputs):
                       s = logits - max(logits), e = exp(s), z = sum(e)  (last axis)
                       loss = sum(labels * (log(z) - s)), backprop = e / z - labels
  Tile(x, multiples) = x * ones(output shape)     (only where every tiled axis of x
                       has size 1: a broadcast; x * 1 is exact, -0 and NaN included)
  Tile(x, s)         = x * ones_like(slice of s)  (a broadcast to dims known only at
                       run time: those of s, by ``like``; s's data is never read)
  SliceTo(x, s)      = Slice(x) * ones_like(slice of s)   (a Slice whose counts ``like``
                       dims of s give at run time, ops.RUN_TIME_COUNT: a position table
                       cut to a sequence length; the ones make the kernel read those
                       dims from s, as the Tile above does; x * 1 is exact)
  FusedBatchNormGrad(dy, x, scale, mean, var) (fused_batch_norm_op.cc, CPU functors;
                       three outputs; sums over every axis but the channel axis, as the
                       forward's below, n their element count, a constant or counted at
                       run time):
                       k0 = rsqrt(var + eps), xc = x - mean
                       scale_bp = sum(dy * (xc * k0)), offset_bp = sum(dy)
                       training:  x_bp = (scale * k0) * ((dy - offset_bp * (1/n))
                                         - xc * ((k0 * k0) * (sum(dy * xc) / n)))
                       inference (FreezeGrad): x_bp = dy * (k0 * scale),
                                         scale_bp = sum(dy * xc) * k0
                       (half-precision dy and x are cast to the statistics' dtype)
"""
from __future__ import annotations

from . import dtypes as dt
from .ops import MAX_VARIADIC, Kind

# composite op -> (kind, number of data inputs)
COMPOSITE_OPS = {
    "Softmax": (Kind.REDUCTION, 1),
    "LogSoftmax": (Kind.REDUCTION, 1),
    "BiasAdd": (Kind.ELEMENTWISE, 2),
    "FusedBatchNorm": (Kind.ELEMENTWISE, 5),
    "ReluGrad": (Kind.ELEMENTWISE, 2),
    "Relu6Grad": (Kind.ELEMENTWISE, 2),
    "EluGrad": (Kind.ELEMENTWISE, 2),
    "SeluGrad": (Kind.ELEMENTWISE, 2),
    "SoftplusGrad": (Kind.ELEMENTWISE, 2),
    "SigmoidGrad": (Kind.ELEMENTWISE, 2),
    "TanhGrad": (Kind.ELEMENTWISE, 2),
    "BiasAddGrad": (Kind.REDUCTION, 1),
    "L2Loss": (Kind.REDUCTION, 1),
    "Tile": (Kind.ELEMENTWISE, 1),          # a broadcast (frontend checks); [x, s]: _tile
    "SoftmaxCrossEntropyWithLogits": (Kind.REDUCTION, 2),    # two outputs
    "FusedBatchNormGrad": (Kind.REDUCTION, 5),               # three outputs
    "FusedBatchNormTraining": (Kind.REDUCTION, 5),           # five outputs; 3 or 5 inputs
    # TF's Split / SplitV / Unpack: one Slice per piece along ``axis`` (``sizes``), the
    # axis removed from each piece when ``squeeze`` (Unpack)
    "Split": (Kind.LAYOUT, 1),
    # TF's StridedSliceGrad with unit strides: dy reshaped to the sliced dims ``shape``
    # (shrunk axes back as size 1), then a Pad by ``paddings`` with zeros
    "SliceGrad": (Kind.LAYOUT, 1),
    # TF's GatherV2 by constant indices on ``axis``: per run [begin, count, step] of the
    # indices a strided Slice, concatenated (``squeeze``: a scalar index, the axis
    # removed)
    "Gather": (Kind.LAYOUT, 1),
    # TF's UnsortedSegmentSum by constant segment ids (the dense gradient of a Gather):
    # per piece [segment, row, count, step] a strided Slice of the rows, padded with
    # zeros to ``num_segments`` along axis 0, the pieces summed (_segment_sum)
    "SegmentSum": (Kind.LAYOUT, 1),
    # TF's Slice / StridedSlice whose counts are run-time dims of a second input s
    # (``like``: per output dim, its dim of s, or -1); begin, size (RUN_TIME_COUNT where
    # s gives it), strides and shape as the Slice primitive's
    "SliceTo": (Kind.LAYOUT, 1),
}

# composites with more than one output: expand returns a tuple, one ref per output
MULTI_OUTPUT = {"SoftmaxCrossEntropyWithLogits": 2, "FusedBatchNormGrad": 3,
                "FusedBatchNormTraining": 5, "Split": MAX_VARIADIC}

# SELU's constants as TF's kernel spells them (relu_op_functor.h)
_SELU_SCALE = 1.0507009873554804934193349852946
_SELU_SCALE_ALPHA = 1.7580993408473768599402175208123


def expand(op: str, attrs: dict, args: list, types: list, emit) -> int:
    """Emit primitives for one composite node.

    ``args`` are spec refs of the inputs, ``types`` their TensorTypes and
    ``emit(op, args, attrs) -> ref`` appends one primitive node (its type is
    inferred by the caller).  Returns the ref of the composite's (first) output, or
    for an op in MULTI_OUTPUT a tuple of one ref per output.
    """
    x = types[0]
    rank = len(x.shape)
    if op == "Split":
        return _split(args[0], x, attrs, emit)
    if op == "Gather":
        return _gather(args[0], x, attrs, emit)
    if op == "SegmentSum":
        return _segment_sum(args[0], x, attrs, emit)
    if op == "SliceTo":
        v = emit("Slice", [args[0]], {k: attrs[k] for k in ("begin", "size", "strides",
                                                              "shape")})
        return emit("Mul", [v, _ones_like(args[1], types[1], attrs["like"], x.dtype, emit)],
                    {})
    if op == "SliceGrad":
        r = emit("Reshape", [args[0]], {"shape": attrs["shape"]})
        return emit("Pad", [r], {"paddings": attrs["paddings"],
                                 "value": 0.0 if dt.is_float(x.dtype) else 0})
    if op in ("Softmax", "LogSoftmax"):
        last = {"axes": [rank - 1], "keep_dims": True}
        m = emit("Max", [args[0]], last)
        s = emit("Sub", [args[0], m], {})
        e = emit("Exp", [s], {})
        z = emit("Sum", [e], last)
        if op == "Softmax":
            return emit("Mul", [e, emit("Reciprocal", [z], {})], {})
        return emit("Sub", [s, emit("Log", [z], {})], {})
    if op == "BiasAdd":
        b = _to_channel(args[1], types[1], rank, attrs["data_format"], emit)
        return emit("Add", [args[0], b], {})
    if op == "FusedBatchNorm":
        scale, offset, mean, var = (
            _to_channel(a, t, rank, attrs["data_format"], emit)
            for a, t in zip(args[1:], types[1:]))
        eps = emit("Const", [], {"value": float(attrs["epsilon"]), "dtype": types[1].dtype,
                                 "shape": []})
        k = emit("Mul", [scale, emit("Rsqrt", [emit("Add", [var, eps], {})], {})], {})
        shift = emit("Sub", [offset, emit("Mul", [mean, k], {})], {})
        xin = args[0]
        if x.dtype != types[1].dtype:   # half-precision activations, float32 statistics
            xin = emit("Cast", [xin], {"to": types[1].dtype})
        y = emit("Add", [emit("Mul", [xin, k], {}), shift], {})
        if x.dtype != types[1].dtype:
            y = emit("Cast", [y], {"to": x.dtype})
        return y
    if op in _TRAINING:
        return _TRAINING[op](attrs, args, types, emit)
    raise ValueError(f"not a composite op: {op}")


def _const(emit, value, dtype):
    return emit("Const", [], {"value": float(value), "dtype": dtype, "shape": []})


def _mask_mul(emit, g, cond, dtype):
    return emit("Mul", [g, emit("Cast", [cond], {"to": dtype})], {})


def _relu_grad(attrs, a, t, emit):
    d = t[0].dtype
    return _mask_mul(emit, a[0], emit("Greater", [a[1], _const(emit, 0, d)], {}), d)


def _relu6_grad(attrs, a, t, emit):
    d = t[0].dtype
    inside = emit("LogicalAnd", [emit("Greater", [a[1], _const(emit, 0, d)], {}),
                                 emit("Less", [a[1], _const(emit, 6, d)], {})], {})
    return _mask_mul(emit, a[0], inside, d)


def _elu_like_grad(neg_shift, pos_scale):
    def grad(attrs, a, t, emit):
        g, y, d = a[0], a[1], t[0].dtype
        neg = emit("Less", [y, _const(emit, 0, d)], {})
        below = emit("Mul", [g, emit("Add", [y, _const(emit, neg_shift, d)], {})], {})
        above = g if pos_scale == 1 else emit("Mul", [g, _const(emit, pos_scale, d)], {})
        return emit("Select", [neg, below, above], {})
    return grad


def _softplus_grad(attrs, a, t, emit):
    d = t[0].dtype
    e = emit("Exp", [emit("Neg", [a[1]], {})], {})
    return emit("Div", [a[0], emit("Add", [e, _const(emit, 1, d)], {})], {})


def _sigmoid_grad(attrs, a, t, emit):
    y, dy, d = a[0], a[1], t[0].dtype
    return emit("Mul", [emit("Mul", [dy, y], {}),
                        emit("Sub", [_const(emit, 1, d), y], {})], {})


def _tanh_grad(attrs, a, t, emit):
    y, dy, d = a[0], a[1], t[0].dtype
    return emit("Mul", [dy, emit("Sub", [_const(emit, 1, d),
                                         emit("Mul", [y, y], {})], {})], {})


def _bias_add_grad(attrs, a, t, emit):
    rank = len(t[0].shape)
    channel = 1 if attrs["data_format"].startswith("NC") and rank > 2 else rank - 1
    axes = [i for i in range(rank) if i != channel]
    return emit("Sum", [a[0]], {"axes": axes, "keep_dims": False})


def _l2_loss(attrs, a, t, emit):
    sq = emit("Mul", [emit("Square", [a[0]], {}), _const(emit, 0.5, t[0].dtype)], {})
    return emit("Sum", [sq], {"axes": list(range(len(t[0].shape))), "keep_dims": False})


def _tile(attrs, a, t, emit):
    if len(a) == 1:
        one = 1 if t[0].dtype.startswith("int") else 1.0
        ones = emit("Const", [], {"value": one, "dtype": t[0].dtype,
                                  "shape": list(attrs["shape"])})
        return emit("Mul", [a[0], ones], {})
    # a broadcast to run-time dims of a second input (``like``: per output dim, its
    # dim there, or -1)
    return emit("Mul", [a[0], _ones_like(a[1], t[1], attrs["like"], t[0].dtype, emit)], {})


def _ones_like(ref, t, like, dtype, emit) -> int:
    """Ones shaped by the dims ``like`` takes of ``ref`` (type ``t``; per output dim,
    its dim of ref, or -1), which the kernel reads from ref's shape, not its data: a
    slice of ref keeps the dims taken whole and the first element of the others
    (size-1 dims in the output's place: the slice's target shape)."""
    src = t.shape
    if list(like) != list(range(len(src))):
        keep = set(like)
        ref = emit("Slice", [ref], {
            "begin": [0] * len(src), "strides": [1] * len(src),
            "size": [(-1 if n < 0 else n) if k in keep else 1 for k, n in enumerate(src)],
            "shape": [src[k] if k >= 0 else 1 for k in like]})
    one = 1 if dtype.startswith("int") else 1.0
    return emit("FillLike", [ref], {"value": one, "dtype": dtype})


def _xent(attrs, a, t, emit):
    last = {"axes": [len(t[0].shape) - 1], "keep_dims": True}
    s = emit("Sub", [a[0], emit("Max", [a[0]], last)], {})
    e = emit("Exp", [s], {})
    z = emit("Sum", [e], last)
    per = emit("Mul", [a[1], emit("Sub", [emit("Log", [z], {}), s], {})], {})
    loss = emit("Sum", [per], {"axes": last["axes"], "keep_dims": False})
    return loss, emit("Sub", [emit("Div", [e, z], {}), a[1]], {})


def _batch_norm_grad(attrs, a, t, emit):
    dy, x, scale, mean, var = a
    u = t[2].dtype                                   # the statistics' dtype
    if t[0].dtype != u:
        dy = emit("Cast", [dy], {"to": u})
    if t[1].dtype != u:
        x = emit("Cast", [x], {"to": u})
    fmt, rank = attrs.get("data_format", "NHWC"), len(t[1].shape)
    if fmt.startswith("NC"):      # per-channel vectors on axis 1, sums kept there
        scale, mean, var = (_to_channel(r, ty, rank, fmt, emit)
                            for r, ty in zip(a[2:], t[2:]))
        sums = {"axes": _bn_axes(t[1].shape, fmt), "keep_dims": True}
    else:
        sums = {"axes": list(range(rank - 1)), "keep_dims": False}
    k0 = emit("Rsqrt", [emit("Add", [var, _const(emit, attrs["epsilon"], u)], {})], {})
    xc = emit("Sub", [x, mean], {})
    offset_bp = emit("Sum", [dy], sums)
    if attrs["is_training"]:
        n = _count(x, attrs["n"], sums, u, emit)
        scale_bp = emit("Sum", [emit("Mul", [dy, emit("Mul", [xc, k0], {})], {})], sums)
        # TF: rest_size_inv = 1.0f / rest_size in float32, then cast to U
        inv_n = emit("Reciprocal", [n], {}) if attrs["n"] < 0 else \
            _const(emit, float(_f32(1.0 / _f32(attrs["n"]))), u)
        centered = emit("Sub", [dy, emit("Mul", [offset_bp, inv_n], {})], {})
        dyxc_mean = emit("Div", [emit("Sum", [emit("Mul", [dy, xc], {})], sums), n], {})
        coef1 = emit("Mul", [scale, k0], {})
        coef2 = emit("Mul", [emit("Mul", [k0, k0], {}), dyxc_mean], {})
        x_bp = emit("Mul", [coef1, emit("Sub", [centered, emit("Mul", [xc, coef2], {})],
                                        {})], {})
    else:
        scale_bp = emit("Mul", [emit("Sum", [emit("Mul", [dy, xc], {})], sums), k0], {})
        x_bp = emit("Mul", [dy, emit("Mul", [k0, scale], {})], {})
    if t[0].dtype != u:
        x_bp = emit("Cast", [x_bp], {"to": t[0].dtype})
    if sums["keep_dims"]:
        vec = {"shape": [t[2].shape[0]]}
        scale_bp, offset_bp = (emit("Reshape", [v], vec) for v in (scale_bp, offset_bp))
    return x_bp, scale_bp, offset_bp


def _bn_axes(shape, fmt) -> list:
    """The axes a batch norm's statistics reduce: all but the channel axis (by
    data_format), less those of size 1, which reduce to themselves (a [1, R, C, 1]
    NCHW input, tf_keras' LayerNormalization, is then a reduction over its rows' last
    axis)."""
    channel = 1 if fmt.startswith("NC") else len(shape) - 1
    rest = [i for i in range(len(shape)) if i != channel]
    return [i for i in rest if shape[i] != 1] or rest


def _count(x, n, sums, u, emit) -> int:
    """The element count of each statistic of ``x`` reduced by ``sums``, as a value of
    dtype ``u``: the constant n, or where a reduced dim is known only at run time
    (n < 0) a sum of ones, exact below 2**24 in float32 as TF's static_cast<U>(n)."""
    if n >= 0:
        return _const(emit, n, u)
    return emit("Sum", [emit("FillLike", [x], {"value": 1.0, "dtype": u})], sums)


def _batch_norm_training(attrs, a, t, emit):
    x, scale, offset = a[:3]
    u, rank, fmt = t[1].dtype, len(t[0].shape), attrs["data_format"]
    if t[0].dtype != u:
        x = emit("Cast", [x], {"to": u})
    keep = {"axes": _bn_axes(t[0].shape, fmt), "keep_dims": True}
    scale, offset = (_to_channel(r, ty, rank, fmt, emit) for r, ty in zip(a[1:3], t[1:3]))
    mean = emit("Mean", [x], keep)
    xc = emit("Sub", [x, mean], {})
    var = emit("Mean", [emit("Mul", [xc, xc], {})], keep)
    k = emit("Mul", [emit("Rsqrt", [emit("Add", [var, _const(emit, attrs["epsilon"], u)],
                                         {})], {}), scale], {})
    y = emit("Add", [emit("Mul", [xc, k], {}), offset], {})
    if t[0].dtype != u:
        y = emit("Cast", [y], {"to": t[0].dtype})
    vec = {"shape": [t[1].shape[0]]}
    mean_c, var_c = (emit("Reshape", [v], vec) for v in (mean, var))
    n = attrs["n"]
    if n > 0:                                   # TF: static_cast<U>(n) / (n - 1)
        adj = _const(emit, _f32(_f32(n) / _f32(max(n - 1, 1))), u)
    else:
        cnt = emit("Reshape", [_count(x, n, keep, u, emit)], vec)
        adj = emit("Div", [cnt, emit("Maximum", [emit("Sub", [cnt, _const(emit, 1, u)], {}),
                                                 _const(emit, 1, u)], {})], {})
    f = attrs["exponential_avg_factor"]
    if f == 1.0:
        out_mean, out_var = mean_c, emit("Mul", [var_c, adj], {})
    else:
        g = _const(emit, _f32(1.0 - _f32(f)), u)
        fc = _const(emit, f, u)
        out_mean = emit("Add", [emit("Mul", [g, a[3]], {}), emit("Mul", [fc, mean_c], {})],
                        {})
        out_var = emit("Add", [emit("Mul", [g, a[4]], {}),
                               emit("Mul", [emit("Mul", [fc, adj], {}), var_c], {})], {})
    return y, out_mean, out_var, mean_c, var_c


def _f32(v):
    import struct
    return struct.unpack("f", struct.pack("f", v))[0]


_TRAINING = {
    "ReluGrad": _relu_grad, "Relu6Grad": _relu6_grad,
    "EluGrad": _elu_like_grad(1.0, 1),
    "SeluGrad": _elu_like_grad(_SELU_SCALE_ALPHA, _SELU_SCALE),
    "SoftplusGrad": _softplus_grad, "SigmoidGrad": _sigmoid_grad, "TanhGrad": _tanh_grad,
    "BiasAddGrad": _bias_add_grad, "L2Loss": _l2_loss, "Tile": _tile,
    "SoftmaxCrossEntropyWithLogits": _xent, "FusedBatchNormGrad": _batch_norm_grad,
    "FusedBatchNormTraining": _batch_norm_training,
}


def _to_channel(ref, t, rank, data_format, emit):
    """A per-channel vector reshaped so it broadcasts on the channel axis."""
    if data_format.startswith("NC") and rank > 2:
        shape = [t.shape[0]] + [1] * (rank - 2)
        return emit("Reshape", [ref], {"shape": shape})
    return ref


def _gather(x, t, attrs, emit) -> int:
    """GatherV2 by constant indices: a Slice per run of the indices, concatenated
    (schedule/layout.py folds both)."""
    axis = attrs["axis"]
    pieces = [_slice_along(x, t, axis, begin, count, step, attrs["squeeze"], emit)
              for begin, count, step in attrs["runs"]]
    return pieces[0] if len(pieces) == 1 else emit("ConcatV2", pieces, {"axis": axis})


def _segment_sum(g, t, attrs, emit) -> int:
    """UnsortedSegmentSum by constant ids without a scatter: out[j] is the sum of the
    rows g[i] with ids[i] == j, in increasing i (TF's CPU functor adds row after row
    into zeros).  The frontend splits the ids into layers (layer k maps each segment to
    its k-th row) and each layer into pieces, runs of consecutive segments that read
    rows in one step; a piece is a strided Slice of g padded to every segment with
    zeros, and the pieces are summed layer after layer.  At a segment a piece does not
    cover it adds +0, which changes no sum but a -0 to +0; the last + 0 does that
    where a piece covers the segment alone, as TF's sum into zeros does, so the result
    has TF's bits."""
    n, rank = attrs["num_segments"], len(t.shape)
    zero = 0.0 if dt.is_float(t.dtype) else 0
    acc = None
    for segment, row, count, step in attrs["pieces"]:
        piece = _slice_along(g, t, 0, row, count, step, False, emit)
        if count != n:
            pads = [segment, n - segment - count] + [0, 0] * (rank - 1)
            piece = emit("Pad", [piece], {"paddings": pads, "value": zero})
        acc = piece if acc is None else emit("Add", [acc, piece], {})
    if dt.is_float(t.dtype):
        acc = emit("Add", [acc, _const(emit, 0, t.dtype)], {})
    return acc


def _split(x, t, attrs, emit) -> tuple:
    """Split / SplitV / Unpack: a Slice per piece (schedule/layout.py folds them)."""
    axis, begin, out = attrs["axis"], 0, []
    for size in attrs["sizes"]:
        out.append(_slice_along(x, t, axis, begin, size, 1, attrs["squeeze"], emit))
        begin += size
    return tuple(out)


def _slice_along(x, t, axis, begin, count, step, squeeze, emit) -> int:
    """The Slice of ``x`` (type ``t``) taking ``count`` elements from ``begin`` in
    steps of ``step`` along ``axis``, the other dims whole; ``squeeze``: the axis
    removed (its count is 1)."""
    rank = len(t.shape)
    shape = [count if d == axis else s for d, s in enumerate(t.shape)]
    if squeeze:
        del shape[axis]
    return emit("Slice", [x], {
        "begin": [begin if d == axis else 0 for d in range(rank)],
        "size": [count if d == axis else -1 for d in range(rank)],
        "strides": [step if d == axis else 1 for d in range(rank)], "shape": shape})
