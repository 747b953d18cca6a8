"""A float64 NumPy interpreter of the op table: the reference CUDA kernels are checked
against (tests/test_codegen_cuda.py, tools/gpu_bench.py).

    evaluate(spec, arrays) -> [output arrays]

Floating values are computed in float64 whatever their dtype (a float32 kernel is then
compared with a tolerance); integers and bools keep their dtype.  Explicit Casts to
float16 / bfloat16 still round, because that rounding is the op's meaning.  TF's
semantics as lower/exprs.py documents them: NaN propagates through Maximum/Minimum/Relu/
ClipByValue and reductions, Round is half-to-even, float->int casts truncate with NaN
and out of range giving INT_MIN, DivNoNan(x, 0) = 0, Softplus is log(1 + e^x).

Independent of the generated code on purpose: whole-array NumPy, no helper shared with
the kernels, so a bug in lower/exprs.py does not hide itself.
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from ...ir import dtypes as dt

_erf = np.frompyfunc(math.erf, 1, 1)
_erfc = np.frompyfunc(math.erfc, 1, 1)
_SELU_A, _SELU_S = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _np(dtype: str):
    return np.float64 if dt.is_float(dtype) else np.dtype(dt.COMPUTE[dtype]).type


def evaluate(spec, arrays) -> list:
    vals = {}
    for j, (t, a) in enumerate(zip(spec.inputs, arrays)):
        a = np.asarray(a)
        if t.dtype == "bfloat16" and a.dtype == np.uint16:
            a = (a.astype(np.uint32) << 16).view(np.float32)
        vals[-(j + 1)] = a.astype(_np(t.dtype))
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)      # mean of an empty slice
        for k, n in enumerate(spec.nodes):
            vals[k] = np.asarray(_node(n, [vals[a] for a in n.args]),
                                 dtype=_np(n.type.dtype))
    return [vals[o] for o in spec.outputs]


def _node(n, a):
    op = n.op
    if op in _REDUCE:
        x = a[0]
        axes, keep = tuple(n.attrs["axes"]), n.attrs["keep_dims"]
        return _REDUCE[op](x, axis=axes, keepdims=keep)
    if op == "Reshape":
        from .launch import reshape_target
        return a[0].reshape(reshape_target(a[0].shape, n.attrs["shape"]))
    if op == "Const":
        return np.full(n.attrs["shape"], n.attrs["value"])
    if op == "FillLike":
        return np.full(a[0].shape, n.attrs["value"])
    if op == "Cast":
        return _cast(a[0], n.attrs["to"])
    if op == "LeakyRelu":
        return np.where(a[0] > 0, a[0], a[0] * n.attrs["alpha"])
    if op == "Softplus":
        return np.logaddexp(0.0, a[0])
    return _EW[op](*a)


def _cast(x, to):
    if to == "bool":
        return x != 0
    if dt.is_int(to):
        if x.dtype.kind == "f":
            info = np.iinfo(to)
            ok = (x >= info.min) & (x < -float(info.min))      # NaN fails both
            return np.where(ok, np.trunc(np.where(ok, x, 0)), info.min).astype(np.int64)
        return x.astype(to).astype(np.int64)                   # wraps like TF
    if to == "float16":
        return x.astype(np.float16).astype(np.float64)
    if to == "bfloat16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        out = r.astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isnan(x), x, out)
    if to == "float32":
        return x.astype(np.float32).astype(np.float64)
    return x.astype(np.float64)


def _mean(x, axis, keepdims):
    if x.dtype.kind in "iu":   # TF: truncating integer mean, 0 for an empty one
        n = math.prod(x.shape[a] for a in axis)
        s = x.astype(np.int64).sum(axis=axis, keepdims=keepdims)
        return np.trunc(s / n).astype(np.int64) if n else np.zeros_like(s)
    return x.mean(axis=axis, keepdims=keepdims)


def _extreme(fn, lowest: bool):
    """Max / Min starting from TF's value for an empty reduction (lowest / highest)."""
    def red(x, axis, keepdims):
        if x.dtype.kind == "f":
            init = -np.inf if lowest else np.inf
        else:
            info = np.iinfo(x.dtype)
            init = info.min if lowest else info.max
        return fn(x, axis=axis, keepdims=keepdims, initial=init)
    return red


_REDUCE = {"Sum": np.sum, "Mean": _mean, "Prod": np.prod, "Max": _extreme(np.max, True),
           "Min": _extreme(np.min, False), "All": np.all, "Any": np.any}


def _floordiv(x, y):
    return np.floor_divide(x, y) if x.dtype.kind in "iu" else np.floor(x / y)


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


_EW = {
    "Neg": np.negative, "Abs": np.abs, "Square": np.square, "Sign": np.sign,
    "Sqrt": np.sqrt, "Rsqrt": lambda x: 1.0 / np.sqrt(x), "Reciprocal": lambda x: 1.0 / x,
    "Floor": np.floor, "Ceil": np.ceil, "Round": np.rint,
    "Relu": lambda x: np.maximum(x, 0), "Relu6": lambda x: np.minimum(np.maximum(x, 0), 6),
    "Softsign": lambda x: x / (1.0 + np.abs(x)),
    "Exp": np.exp, "Expm1": np.expm1, "Log": np.log, "Log1p": np.log1p, "Tanh": np.tanh,
    "Sigmoid": _sigmoid, "Elu": lambda x: np.where(x > 0, x, np.expm1(x)),
    "Selu": lambda x: _SELU_S * np.where(x > 0, x, _SELU_A * np.expm1(x)),
    "Erf": lambda x: _erf(x).astype(np.float64), "Erfc": lambda x: _erfc(x).astype(np.float64),
    "Sin": np.sin, "Cos": np.cos,
    "IsNan": np.isnan, "IsInf": np.isinf, "IsFinite": np.isfinite,
    "LogicalNot": np.logical_not, "Identity": lambda x: x,
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Maximum": np.maximum,
    "Minimum": np.minimum, "SquaredDifference": lambda x, y: np.square(x - y),
    "Div": np.divide, "DivNoNan": lambda x, y: np.where(y == 0, 0.0, x / np.where(y == 0, 1, y)),
    "Pow": np.power, "FloorDiv": _floordiv, "FloorMod": np.mod,
    "Equal": np.equal, "NotEqual": np.not_equal, "Less": np.less, "LessEqual": np.less_equal,
    "Greater": np.greater, "GreaterEqual": np.greater_equal,
    "LogicalAnd": np.logical_and, "LogicalOr": np.logical_or,
    "Select": lambda c, x, y: np.where(c, x, y),
    "ClipByValue": lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi),
}


def compare(out, ref, rtol=2e-5, atol=2e-6) -> float:
    """Worst |out - ref| / (atol + rtol |ref|) over the elements (<= 1 passes); NaN must
    match NaN, an Inf the same Inf; exact for integers and bools."""
    out = np.asarray(out)
    if out.dtype.kind in "biu":
        return 0.0 if np.array_equal(out.astype(ref.dtype), ref) else math.inf
    o, r = out.astype(np.float64), ref.astype(np.float64)
    if o.shape != r.shape:
        return math.inf
    if not np.array_equal(np.isnan(o), np.isnan(r)):
        return math.inf
    fin = np.isfinite(r)
    if not np.array_equal(o[~fin & ~np.isnan(r)], r[~fin & ~np.isnan(r)]):
        return math.inf
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(o[fin] - r[fin]) / (atol + rtol * np.abs(r[fin]))))
