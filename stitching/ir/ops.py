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
    LAYOUT = 2        # reshape that only inserts or removes size-1 dims
    REDUCTION = 3     # reduces a set of axes
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


def _int_list(v):
    if not isinstance(v, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError("expected a list of ints")
    if len(v) > 8:
        raise ValueError("more than 8 entries")
    return tuple(int(x) for x in v)


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

_reg("Reshape", Kind.LAYOUT, 1, attrs={"shape": _int_list})
# Const: a scalar value splatted to a static shape (usually ()).
_reg("Const", Kind.SOURCE, 0, attrs={"value": _scalar_value, "dtype": _dtype,
                                      "shape": _int_list})
# FillLike: a scalar value in the shape of its input (ZerosLike, OnesLike).
_reg("FillLike", Kind.SOURCE, 1, attrs={"value": _scalar_value, "dtype": _dtype})


def kind_of(op: str) -> Kind:
    d = OPS.get(op)
    return Kind.OPAQUE if d is None else d.kind


# ---- dtype and shape inference (used by the frontend and by spec validation)

def infer(op: str, attrs: dict, in_types: list) -> TensorType:
    """Output type of one node; raises ValueError naming the problem."""
    d = OPS.get(op)
    if d is None:
        raise ValueError(f"op {op!r} is not in the op table")
    if len(in_types) != d.arity:
        raise ValueError(f"{op} takes {d.arity} input(s), got {len(in_types)}")
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


def _check_value_dtype(value, dtype):
    if dtype == "bool" and not isinstance(value, bool):
        raise ValueError("bool constant must be true/false")
    if dt.is_int(dtype) and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{dtype} constant must be an integer")
    if dt.is_float(dtype) and isinstance(value, bool):
        raise ValueError(f"{dtype} constant must be a number")
    if isinstance(value, float) and dt.is_float(dtype) and not math.isnan(value):
        pass
