"""Op kinds as data.

Every op the fuser understands has one row here: its kind, arity, attribute
schema, which dtypes it accepts, and how its output dtype and shape follow from
its inputs.  Legality rules in plan/ are small predicates over ``OpDef.kind``;
code generation has one lowering per op name (codegen/lower/exprs.py).  An op type
missing from this table is OPAQUE: it stays a TF op.

Canonical names are TF's names where one exists.  The TF frontend maps aliases
(AddV2 -> Add, RealDiv -> Div, ExpandDims/Squeeze -> Reshape, ...) and expands
composites (Softmax, LogSoftmax, FusedBatchNorm, BiasAdd) into these.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from . import dtypes as dt
from .graph import GraphError, TensorType, broadcast_shapes


class Kind(enum.IntEnum):
    """Ordered like TVM's OpPatternKind: lower is easier to fuse."""
    ELEMENTWISE = 0   # per-element, NumPy broadcasting among inputs
    SOURCE = 1        # constants / fills: no data input read
    LAYOUT = 2        # index maps, no arithmetic: size-1 reshapes, transposes, slices,
                      # concatenations (schedule/layout.py folds them into loads)
    REDUCTION = 3     # reduces a set of axes
    CONTRACTION = 4   # a small matrix product of a per-row vector (SmallMatMul): its
                      # contracted and weight dims are outside the iteration domain
    WINDOW = 5        # reads its input through a window (DepthwiseConv2D): a stencil over
                      # a kernel input, whose H and W are outside the iteration domain
    OPAQUE = 9        # anything else: stays a TF op


FLOATS = frozenset(dt.FLOAT_DTYPES)
INTS = frozenset(dt.INT_DTYPES)
NUMERIC = FLOATS | INTS
BOOL = frozenset({"bool"})
ANY = NUMERIC | BOOL


# ---- attribute validators: each returns the canonical value or raises ValueError

def _float(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"expected a number, got {type(v).__name__}")
    return float(v)


def _bool(v):
    if not isinstance(v, bool):
        raise ValueError(f"expected a bool, got {type(v).__name__}")
    return v


def _dtype(v):
    if v not in dt.ALL_DTYPES:
        raise ValueError(f"unknown dtype {v!r}")
    return v


def _int_list(v, most=8):
    if not isinstance(v, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError("expected a list of ints")
    if len(v) > most:
        raise ValueError(f"more than {most} entries")
    return tuple(int(x) for x in v)


def _pairs(v):
    """(lo, hi) per dim, flattened: two entries per dim of a rank-8 tensor at most."""
    return _int_list(v, 16)


def _int(v):
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an int, got {type(v).__name__}")
    return int(v)


def _scalar_value(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        if not -(2 ** 63) <= v < 2 ** 63:
            raise ValueError("integer constant out of int64 range")
        return v
    if isinstance(v, float):
        return v
    if isinstance(v, str) and v in ("nan", "inf", "-inf"):  # JSON has no NaN/Inf literals
        return float(v)
    raise ValueError(f"expected a scalar number, got {type(v).__name__}")


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: Kind
    arity: int
    in_dtypes: frozenset = ANY
    attrs: dict = field(default_factory=dict)   # name -> validator
    out_dtype: str | None = None                # fixed output dtype (e.g. bool for compares)
    transcendental: bool = False                # costs a polynomial evaluation per element
    same_dtype: bool = True                     # all data inputs share one dtype
    # arity VARIADIC: one or more inputs, at most MAX_VARIADIC (ConcatV2, Pack)

    def validate_attrs(self, attrs: dict) -> dict:
        extra = set(attrs) - set(self.attrs)
        if extra:
            raise ValueError(f"{self.name}: unknown attribute(s) {sorted(extra)}")
        missing = set(self.attrs) - set(attrs)
        if missing:
            raise ValueError(f"{self.name}: missing attribute(s) {sorted(missing)}")
        out = {}
        for k, check in self.attrs.items():
            try:
                out[k] = check(attrs[k])
            except ValueError as e:
                raise ValueError(f"{self.name}.{k}: {e}") from None
        return out


OPS: dict[str, OpDef] = {}
VARIADIC = -1
MAX_VARIADIC = 64      # arbitrary: a concatenation of more pieces stays a TF op


def _reg(name, kind, arity, **kw):
    OPS[name] = OpDef(name, kind, arity, **kw)


E = Kind.ELEMENTWISE
for _n in ("Neg", "Abs", "Square", "Sign"):
    _reg(_n, E, 1, in_dtypes=NUMERIC)
for _n in ("Sqrt", "Rsqrt", "Reciprocal", "Floor", "Ceil", "Round", "Relu", "Relu6",
           "Softsign"):
    _reg(_n, E, 1, in_dtypes=FLOATS if _n not in ("Relu", "Relu6") else NUMERIC)
for _n in ("Exp", "Expm1", "Log", "Log1p", "Tanh", "Sigmoid", "Elu", "Selu", "Softplus",
           "Erf", "Erfc", "Sin", "Cos"):
    _reg(_n, E, 1, in_dtypes=FLOATS, transcendental=True)
_reg("LeakyRelu", E, 1, in_dtypes=FLOATS, attrs={"alpha": _float})
for _n in ("IsNan", "IsInf", "IsFinite"):
    _reg(_n, E, 1, in_dtypes=FLOATS, out_dtype="bool")
_reg("LogicalNot", E, 1, in_dtypes=BOOL)
_reg("Identity", E, 1)
_reg("Cast", E, 1, attrs={"to": _dtype})
for _n in ("Add", "Sub", "Mul", "Maximum", "Minimum", "SquaredDifference"):
    _reg(_n, E, 2, in_dtypes=NUMERIC)
for _n in ("Div", "DivNoNan", "Pow"):
    _reg(_n, E, 2, in_dtypes=FLOATS, transcendental=(_n == "Pow"))
# Floats only: TF raises "Integer division by zero" for int FloorDiv/FloorMod, which
# a kernel body cannot do, so integer ones stay TF ops.
for _n in ("FloorDiv", "FloorMod"):
    _reg(_n, E, 2, in_dtypes=FLOATS)
for _n in ("Equal", "NotEqual"):
    _reg(_n, E, 2, in_dtypes=ANY, out_dtype="bool")
for _n in ("Less", "LessEqual", "Greater", "GreaterEqual"):
    _reg(_n, E, 2, in_dtypes=NUMERIC, out_dtype="bool")
for _n in ("LogicalAnd", "LogicalOr"):
    _reg(_n, E, 2, in_dtypes=BOOL)
_reg("Select", E, 3, same_dtype=False)        # (cond: bool, then, else), broadcasting
_reg("ClipByValue", E, 3, in_dtypes=NUMERIC)  # (x, lo, hi)

R = Kind.REDUCTION
for _n in ("Sum", "Mean", "Prod"):
    _reg(_n, R, 1, in_dtypes=NUMERIC, attrs={"axes": _int_list, "keep_dims": _bool})
for _n in ("Max", "Min"):
    _reg(_n, R, 1, in_dtypes=NUMERIC, attrs={"axes": _int_list, "keep_dims": _bool})
for _n in ("All", "Any"):
    _reg(_n, R, 1, in_dtypes=BOOL, attrs={"axes": _int_list, "keep_dims": _bool})

# SmallMatMul(x[..., K], w[1.., K, M]) -> [..., M]: y[..., m] = sum_k x[..., k] w[k, m].
# A 1x1 convolution over a 1x1 image (a squeeze-excite block's two products on its
# pooled [N, 1, 1, C] vector, tf/frontend.py).  The weight is a small static matrix read
# whole (schedule/domain.py keeps K and the weight's dims out of the iteration domain);
# the CPU backend computes the product once per row group (codegen/cpu/emitter.py).
_reg("SmallMatMul", Kind.CONTRACTION, 2, in_dtypes=frozenset({"float32", "float64"}))
SMALL_MATMUL_MAX_WEIGHTS = 1 << 16   # arbitrary: a weight matrix of at most 256 KiB of
                                     # float32 (half the smallest L2 of this project's
                                     # machines), re-read once per row group

# DepthwiseConv2D(x[N, H, W, C], f[KH, KW, C, 1]) -> [N, Ho, Wo, C], NHWC, depth
# multiplier 1, no dilation: y[n, i, j, c] = sum over (kh, kw) of
# x[n, i*sh - top + kh, j*sw - left + kw, c] * f[kh, kw, c, 0], taps outside x are zeros.
# ``pads`` = [top, bottom, left, right] (TF's SAME/VALID/EXPLICIT made explicit,
# tf/frontend.py).  A stencil: x is a kernel input read through the window, f a static
# weight read whole (schedule/domain.py, step 5); the CPU emitter sums the taps per
# output row (codegen/cpu/emitter.py, _windows).
_reg("DepthwiseConv2D", Kind.WINDOW, 2, in_dtypes=frozenset({"float32", "float64"}),
     attrs={"strides": _int_list, "pads": _int_list})
WINDOW_MAX_TAPS = 64     # arbitrary: up to 8x8 windows (the models' are 3x3 and 5x5)

_reg("Reshape", Kind.LAYOUT, 1, attrs={"shape": _int_list})
# Index maps (schedule/layout.py): the element at output index i is an input element at
# an affine function of i (no arithmetic, so a fused layout op changes no bits).
_reg("Transpose", Kind.LAYOUT, 1, attrs={"perm": _int_list})
# Slice: per input dim, ``size`` elements from ``begin`` in steps of ``strides``.  Size
# -1 is the whole dim (begin 0, stride 1); on a dim known only at run time only that, or
# one element, may be taken: element ``begin``, or for a negative begin element n +
# begin (``x[:, -1]``), which the kernel's shape function checks exists.  Size
# RUN_TIME_COUNT is a count known only at run time, from a static dim of at least 2,
# that the kernel's shape function checks fits (composite SliceTo).  A size of
# ``rest_size(e)`` (RUN_TIME_REST - e, e >= 0) on a dim known only at run time is the
# rest of it from ``begin`` less its last e elements, max(n - begin - e, 0) as
# StridedSlice clamps (``x[:, 1:]``, ``x[:, :-1]``, ``x[:, b:-e]``; stride 1, begin and
# e at most MAX_SHIFT): a run-time dim class "n - c" (schedule/layout.py View.less).
# The sliced dims are then reshaped to ``shape`` by inserting or removing size-1 dims
# (StridedSlice's shrink and new axes).  TF's Slice, StridedSlice, Split, SplitV and
# Unpack become these.
RUN_TIME_COUNT = -2
RUN_TIME_REST = -3
MAX_SHIFT = 1 << 12     # arbitrary: the models' shifts are 1 or 2 elements
_MAX_INDEX = 1 << 40    # arbitrary sanity bound on an index into a run-time dim


def rest_size(e: int) -> int:
    """The Slice size entry of a run-time dim's rest less its last ``e`` elements."""
    return RUN_TIME_REST - e


def rest_drop(k: int):
    """e of a rest_size(e) size entry, else None."""
    return RUN_TIME_REST - k if k <= RUN_TIME_REST else None
_reg("Slice", Kind.LAYOUT, 1, attrs={"begin": _int_list, "size": _int_list,
                                      "strides": _int_list, "shape": _int_list})
# ConcatV2 on a constant axis; Pack stacks its inputs along a new axis ``axis``.
_reg("ConcatV2", Kind.LAYOUT, VARIADIC, attrs={"axis": _int})
_reg("Pack", Kind.LAYOUT, VARIADIC, attrs={"axis": _int})
# Pad: ``paddings`` = (lo, hi) per dim, flattened; new elements are ``value``.  Reverse:
# the dims ``axes`` read backwards.  Neither applies to a dim known only at run time.
_reg("Pad", Kind.LAYOUT, 1, attrs={"paddings": _pairs, "value": _scalar_value})
_reg("Reverse", Kind.LAYOUT, 1, attrs={"axes": _int_list})
# The layout ops that are index maps (folded into loads, schedule/layout.py), as opposed
# to Reshape, which only adds or removes size-1 dims.
INDEX_MAPS = frozenset({"Transpose", "Slice", "ConcatV2", "Pack", "Pad", "Reverse"})
# Const: a scalar value splatted to a static shape (usually ()).
_reg("Const", Kind.SOURCE, 0, attrs={"value": _scalar_value, "dtype": _dtype,
                                      "shape": _int_list})
# FillLike: a scalar value in the shape of its input (ZerosLike, OnesLike).
_reg("FillLike", Kind.SOURCE, 1, attrs={"value": _scalar_value, "dtype": _dtype})


def arity_ok(d: OpDef, n: int) -> bool:
    return 1 <= n <= MAX_VARIADIC if d.arity == VARIADIC else n == d.arity


def arity_text(d: OpDef) -> str:
    return f"1 to {MAX_VARIADIC}" if d.arity == VARIADIC else str(d.arity)


def kind_of(op: str) -> Kind:
    d = OPS.get(op)
    return Kind.OPAQUE if d is None else d.kind


# ---- dtype and shape inference (used by the frontend and by spec validation)

def infer(op: str, attrs: dict, in_types: list) -> TensorType:
    """Output type of one node; raises ValueError naming the problem."""
    d = OPS.get(op)
    if d is None:
        raise ValueError(f"op {op!r} is not in the op table")
    if not arity_ok(d, len(in_types)):
        raise ValueError(f"{op} takes {arity_text(d)} input(s), got {len(in_types)}")
    data = in_types[1:] if op == "Select" else in_types
    for t in data:
        if t.dtype not in d.in_dtypes:
            raise ValueError(f"{op} does not support dtype {t.dtype}")
    if op == "Select" and in_types[0].dtype != "bool":
        raise ValueError("Select condition must be bool")
    if d.same_dtype or op == "Select":
        if len({t.dtype for t in data}) > 1:
            raise ValueError(f"{op} inputs have different dtypes "
                             f"{[t.dtype for t in data]}")
    if any(t.shape is None for t in in_types):
        raise ValueError(f"{op}: input of unknown rank")

    if d.kind == Kind.ELEMENTWISE:
        shape = ()
        for t in in_types:
            try:
                shape = broadcast_shapes(shape, t.shape)
            except GraphError as e:
                raise ValueError(f"{op}: {e}") from None
        if op == "Cast":
            out = attrs["to"]
        elif d.out_dtype:
            out = d.out_dtype
        else:
            out = data[0].dtype
        return TensorType(out, shape)
    if d.kind == Kind.REDUCTION:
        (x,) = in_types
        r = len(x.shape)
        axes = attrs["axes"]
        if any(not 0 <= a < r for a in axes) or list(axes) != sorted(set(axes)):
            raise ValueError(f"{op}: axes {list(axes)} must be sorted, unique and in "
                             f"[0, {r}) for rank {r}")
        if attrs["keep_dims"]:
            shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
        else:
            shape = tuple(s for i, s in enumerate(x.shape) if i not in axes)
        return TensorType(x.dtype, shape)
    if d.kind == Kind.CONTRACTION:
        return _infer_small_matmul(*in_types)
    if d.kind == Kind.WINDOW:
        return _infer_depthwise(attrs, *in_types)
    if op in _LAYOUT_INFER:
        return _LAYOUT_INFER[op](attrs, in_types)
    if op == "Reshape":
        (x,) = in_types
        target = attrs["shape"]
        if any(s < -1 for s in target):
            raise ValueError(f"Reshape: bad target shape {list(target)}")
        # Only size-1 insertion/removal is representable inside a kernel.
        if [s for s in x.shape if s != 1] != [s for s in target if s != 1]:
            raise ValueError(f"Reshape {list(x.shape)} -> {list(target)} regroups "
                             "dimensions (only size-1 dims may be added or removed)")
        return TensorType(x.dtype, target)
    if op == "Const":
        shape = attrs["shape"]
        if any(s < 0 for s in shape):
            raise ValueError("Const shape must be static")
        _check_value_dtype(attrs["value"], attrs["dtype"])
        return TensorType(attrs["dtype"], shape)
    if op == "FillLike":
        _check_value_dtype(attrs["value"], attrs["dtype"])
        return TensorType(attrs["dtype"], in_types[0].shape)
    raise AssertionError(op)


def _infer_small_matmul(x: TensorType, w: TensorType) -> TensorType:
    """x [..., K] times a static weight [1.., K, M] (size-1 leading dims, as a 1x1
    convolution's filter [1, 1, K, M]): [..., M]."""
    ws = w.shape
    if len(ws) < 2 or any(d != 1 for d in ws[:-2]) or any(d < 2 for d in ws[-2:]):
        raise ValueError(f"SmallMatMul: the weight {format_dims(ws)} must be a static "
                         "[K, M] matrix (size-1 leading dims allowed), K and M >= 2")
    k, m = ws[-2:]
    if k * m > SMALL_MATMUL_MAX_WEIGHTS:
        raise ValueError(f"SmallMatMul: a {k}x{m} weight is over "
                         f"{SMALL_MATMUL_MAX_WEIGHTS} elements (a product that large "
                         "stays TF's)")
    if not x.shape or x.shape[-1] != k:
        raise ValueError(f"SmallMatMul: x {format_dims(x.shape)} does not end in the "
                         f"weight's K = {k}")
    return TensorType(x.dtype, tuple(x.shape[:-1]) + (m,))


def _infer_depthwise(attrs: dict, x: TensorType, f: TensorType) -> TensorType:
    """x [N, H, W, C] (H, W, C static) through a static filter [KH, KW, C, 1] with
    ``strides`` [sh, sw] and ``pads`` [top, bottom, left, right]: [N, Ho, Wo, C]."""
    strides, pads = list(attrs["strides"]), list(attrs["pads"])
    if len(strides) != 2 or any(s < 1 for s in strides) or len(pads) != 4 or \
            any(p < 0 for p in pads):
        raise ValueError(f"DepthwiseConv2D: strides {strides} must be two values >= 1 "
                         f"and pads {pads} four values >= 0")
    if len(x.shape) != 4 or any(d < 1 for d in x.shape[1:]):
        raise ValueError(f"DepthwiseConv2D: x {format_dims(x.shape)} must be NHWC with "
                         "static H, W and C")
    fs = f.shape
    if len(fs) != 4 or any(d < 1 for d in fs) or fs[2] != x.shape[3] or fs[3] != 1:
        raise ValueError(f"DepthwiseConv2D: the filter {format_dims(fs)} must be a static "
                         f"[KH, KW, {x.shape[3]}, 1] (depth multiplier 1)")
    if fs[0] * fs[1] > WINDOW_MAX_TAPS:
        raise ValueError(f"DepthwiseConv2D: a {fs[0]}x{fs[1]} window is over "
                         f"{WINDOW_MAX_TAPS} taps")
    n, h, w, c = x.shape
    ho = (h + pads[0] + pads[1] - fs[0]) // strides[0] + 1
    wo = (w + pads[2] + pads[3] - fs[1]) // strides[1] + 1
    if ho < 1 or wo < 1 or max(pads[:2]) >= fs[0] or max(pads[2:]) >= fs[1]:
        raise ValueError(f"DepthwiseConv2D: a {fs[0]}x{fs[1]} window over {h}x{w} with "
                         f"pads {pads} (each below the window) has no output")
    return TensorType(x.dtype, (n, ho, wo, c))


def _check_value_dtype(value, dtype):
    if dtype == "bool" and not isinstance(value, bool):
        raise ValueError("bool constant must be true/false")
    if dt.is_int(dtype) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{dtype} constant must be an integer")
    if dt.is_float(dtype) and isinstance(value, bool):
        raise ValueError(f"{dtype} constant must be a number")
    if isinstance(value, float) and dt.is_float(dtype) and not math.isnan(value):
        pass


# ---- index maps: shapes (their index maps live in schedule/layout.py)

def _infer_transpose(attrs, in_types) -> TensorType:
    (x,) = in_types
    perm = attrs["perm"]
    if sorted(perm) != list(range(len(x.shape))):
        raise ValueError(f"Transpose: perm {list(perm)} is not a permutation of the "
                         f"{len(x.shape)} dims of {format_dims(x.shape)}")
    return TensorType(x.dtype, tuple(x.shape[p] for p in perm))


def slice_sizes(x_shape, begin, size, strides) -> tuple:
    """The sliced dims of Slice (before its reshape); raises ValueError naming the
    dim that is out of range."""
    r = len(x_shape)
    if not len(begin) == len(size) == len(strides) == r:
        raise ValueError(f"Slice: begin, size and strides need {r} entries each")
    for i, (n, b, k, s) in enumerate(zip(x_shape, begin, size, strides)):
        if k == -1:
            if (b, s) != (0, 1):
                raise ValueError(f"Slice: dim {i}: size -1 (the whole dim) needs "
                                 "begin 0 and stride 1")
            continue
        if k <= RUN_TIME_REST:
            if n >= 0 or s != 1 or not 0 <= b <= MAX_SHIFT or rest_drop(k) > MAX_SHIFT:
                raise ValueError(f"Slice: dim {i}: the rest of a dim (size {k}: all but "
                                 f"the last {rest_drop(k)} from begin {b}) needs a dim "
                                 "known only at run time, stride 1, and a begin and a "
                                 f"drop from 0 to {MAX_SHIFT}")
            continue
        if k == RUN_TIME_COUNT:
            # at most n - b elements, at run time; a dim of size 1 would be broadcast
            # by the index maps (schedule/layout.py), not checked
            if n < 2 or s < 1 or not 0 <= b < n:
                raise ValueError(f"Slice: dim {i}: a run-time count needs a static dim "
                                 "of at least 2, a positive stride and a begin inside it")
            continue
        if n < 0 and (k != 1 or not -_MAX_INDEX < b < _MAX_INDEX):
            raise ValueError(f"Slice: dim {i} is known only at run time; only the whole "
                             f"dim or one element of it (an index below 2^40) may be taken")
        if n < 0:
            continue        # element b (b < 0: n + b), checked at run time (layout.py)
        if s == 0 or k < 0:
            raise ValueError(f"Slice: dim {i}: stride must be non-zero, size >= 0")
        last = b + (k - 1) * s
        if k and not (0 <= b < n and 0 <= last < n):
            raise ValueError(f"Slice: dim {i}: elements {b}..{last} of {n} are out of "
                             "range")
    return tuple(n if k == -1 else -1 if k == RUN_TIME_COUNT or k <= RUN_TIME_REST
                 else k for n, k in zip(x_shape, size))


def _infer_slice(attrs, in_types) -> TensorType:
    (x,) = in_types
    sizes = slice_sizes(x.shape, attrs["begin"], attrs["size"], attrs["strides"])
    target = attrs["shape"]
    if any(s < -1 for s in target) or \
            [s for s in sizes if s != 1] != [s for s in target if s != 1]:
        raise ValueError(f"Slice: shape {list(target)} does not hold the sliced dims "
                         f"{list(sizes)} (only size-1 dims may be added or removed)")
    return TensorType(x.dtype, target)


def _check_pieces(op, in_types):
    if len({t.dtype for t in in_types}) > 1:
        raise ValueError(f"{op} inputs have different dtypes "
                         f"{[t.dtype for t in in_types]}")
    if len({len(t.shape) for t in in_types}) > 1:
        raise ValueError(f"{op} inputs have different ranks")


def _infer_concat(attrs, in_types) -> TensorType:
    _check_pieces("ConcatV2", in_types)
    r, a = len(in_types[0].shape), attrs["axis"]
    if not 0 <= a < r:
        raise ValueError(f"ConcatV2: axis {a} is not in [0, {r})")
    total = 0
    for t in in_types:
        if t.shape[a] < 0:
            raise ValueError(f"ConcatV2: axis {a} of a piece is known only at run time")
        total += t.shape[a]
    out = list(in_types[0].shape)
    for i in range(r):
        if i == a:
            continue
        dims = {t.shape[i] for t in in_types}
        if len(dims - {-1}) > 1:
            raise ValueError(f"ConcatV2: pieces differ in dim {i}: {sorted(dims)}")
        out[i] = max(dims)
    out[a] = total
    return TensorType(in_types[0].dtype, tuple(out))


def _infer_pack(attrs, in_types) -> TensorType:
    _check_pieces("Pack", in_types)
    r, a = len(in_types[0].shape), attrs["axis"]
    if not 0 <= a <= r:
        raise ValueError(f"Pack: axis {a} is not in [0, {r}]")
    shapes = {t.shape for t in in_types}
    if len(shapes) > 1:
        raise ValueError(f"Pack: pieces differ in shape {sorted(shapes)}")
    s = in_types[0].shape
    return TensorType(in_types[0].dtype, s[:a] + (len(in_types),) + s[a:])


def format_dims(shape) -> str:
    return "[" + ",".join("?" if d < 0 else str(d) for d in shape) + "]"


def _infer_pad(attrs, in_types) -> TensorType:
    (x,) = in_types
    p = attrs["paddings"]
    if len(p) != 2 * len(x.shape) or any(v < 0 for v in p):
        raise ValueError(f"Pad: paddings need 2 non-negative entries per dim of "
                         f"{format_dims(x.shape)}, got {list(p)}")
    _check_value_dtype(attrs["value"], x.dtype)
    out = []
    for d, n in enumerate(x.shape):
        lo, hi = p[2 * d], p[2 * d + 1]
        if n < 0 and (lo or hi):
            raise ValueError(f"Pad: dim {d} is known only at run time; it cannot be padded")
        out.append(n if n < 0 else n + lo + hi)
    return TensorType(x.dtype, tuple(out))


def _infer_reverse(attrs, in_types) -> TensorType:
    (x,) = in_types
    axes = attrs["axes"]
    if len(set(axes)) != len(axes) or any(not 0 <= a < len(x.shape) for a in axes):
        raise ValueError(f"Reverse: axes {list(axes)} are not distinct dims of "
                         f"{format_dims(x.shape)}")
    if any(x.shape[a] < 0 for a in axes):
        raise ValueError("Reverse: a dim known only at run time cannot be reversed")
    return x


_LAYOUT_INFER = {"Transpose": _infer_transpose, "Slice": _infer_slice,
                 "ConcatV2": _infer_concat, "Pack": _infer_pack, "Pad": _infer_pad,
                 "Reverse": _infer_reverse}
