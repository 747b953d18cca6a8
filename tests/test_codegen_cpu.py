"""CPU codegen end to end, TF-free: every op per dtype against float64 NumPy with
TF's semantics, the fused patterns, zero-size and unknown dims, shape-function
errors, vectorization, threads, and the on-disk cache in a fresh process.

Kernels are packed (many ops -> one multi-output kernel) to keep compiles few.
"""
import ctypes
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from stitching.compile import compile_kernel, compile_kernels
from stitching.ir.builder import SpecBuilder
from stitching.schedule import KernelKind, ScheduleError

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:                       # pragma: no cover
    BF16 = None

FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int32", "int64"]
NP = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
      "int32": np.int32, "int64": np.int64, "bool": np.bool_}
# relative / absolute tolerance of a kernel output against float64 rounded to its dtype
TOL = {"float32": (6e-7, 1e-37), "float64": (1e-13, 1e-300),
       "float16": (2.0 ** -10, 1.2e-7), "bfloat16": (2.0 ** -7, 1e-38)}
RNG = np.random.default_rng(1234)
# float32 vector loops: 8 lanes with AVX2, 16 where AVX-512 is used
WIDE = re.compile(r"<(8|16) x float>")
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 0.5, 1.5, 2.5, -0.5, -2.5, 1e-3, 100.0,
           -100.0, 3.0, -3.0, 1e-30, 7.0, 0.25]


def npdtype(d):
    return BF16 if d == "bfloat16" else np.dtype(NP[d])


def data(dtype, shape, special=True, scale=3.0):
    n = int(np.prod(shape))
    if dtype == "bool":
        return RNG.random(shape) < 0.5
    if dtype in INTS:
        v = RNG.integers(-1000, 1000, n).astype(np.int64)
        if special:
            info = np.iinfo(NP[dtype])
            ext = [info.min, info.max, 0, -1, 1, 65536, -65536, 7]
            v[:min(n, len(ext))] = ext[:n]
        return v.astype(NP[dtype]).reshape(shape)
    v = RNG.standard_normal(n) * scale
    if special:
        v[:min(n, len(SPECIAL))] = SPECIAL[:n]
    return v.astype(np.float32).astype(npdtype(dtype)).reshape(shape)


def f64(a):
    return np.asarray(a).astype(np.float32).astype(np.float64) \
        if np.asarray(a).dtype == BF16 else np.asarray(a).astype(np.float64)


def rounded(ref, dtype):
    """A float64 reference as the kernel's output dtype stores it."""
    with np.errstate(all="ignore"):
        if dtype == "bool":
            return np.asarray(ref).astype(bool)
        if dtype in INTS:
            return np.asarray(ref)
        return f64(np.asarray(ref, np.float64).astype(np.float32).astype(npdtype(dtype))
                   if dtype == "bfloat16" else np.asarray(ref).astype(npdtype(dtype)))


def assert_matches(out, ref, dtype, what, rtol=None, atol=None):
    ref = rounded(ref, dtype)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert out.dtype == npdtype(dtype), (what, out.dtype, dtype)
    if dtype == "bool" or dtype in INTS:
        bad = out != ref
        assert not bad.any(), f"{what}: {out[bad][:5]} != {ref[bad][:5]}"
        return
    o = f64(out)
    r_tol, a_tol = TOL[dtype]
    r_tol, a_tol = rtol or r_tol, atol or a_tol
    assert np.array_equal(np.isnan(o), np.isnan(ref)), \
        f"{what}: NaN mismatch at {np.argwhere(np.isnan(o) != np.isnan(ref))[:3].tolist()}"
    ok = ~np.isnan(ref)
    inf = np.isinf(ref) & ok
    assert np.array_equal(o[inf], ref[inf]), f"{what}: inf mismatch {o[inf]} {ref[inf]}"
    fin = ok & ~inf
    err = np.abs(o[fin] - ref[fin]) - (a_tol + r_tol * np.abs(ref[fin]))
    if err.size and err.max() > 0:
        i = int(np.argmax(err))
        raise AssertionError(f"{what}: got {o[fin][i]!r}, want {ref[fin][i]!r}")


def build(b, outs, **kw):
    return compile_kernel(b.build(outs, **kw))


# ---- reference semantics (TensorFlow's, in float64) -------------------------------------

def tf_softplus(x, dtype):
    eps = {"float64": 2.0 ** -52, "bfloat16": 2.0 ** -7}.get(dtype, 2.0 ** -23)
    t = math.log(eps) + 2.0
    return np.where(x > -t, x, np.where(x < t, np.exp(x), np.log1p(np.exp(x))))


SELU_S, SELU_A = 1.0507009873554804934193349852946, 1.6732632423543772848170429916717
_erf = np.vectorize(math.erf, otypes=[np.float64])
_erfc = np.vectorize(math.erfc, otypes=[np.float64])

UNARY_FLOAT = {
    "Neg": np.negative, "Abs": np.abs, "Square": np.square, "Sign": np.sign,
    "Sqrt": np.sqrt, "Rsqrt": lambda x: 1 / np.sqrt(x), "Reciprocal": lambda x: 1 / x,
    "Floor": np.floor, "Ceil": np.ceil, "Round": np.round,
    "Relu": lambda x: np.maximum(x, 0), "Relu6": lambda x: np.minimum(np.maximum(x, 0), 6),
    "Softsign": lambda x: x / (1 + np.abs(x)), "Exp": np.exp, "Expm1": np.expm1,
    "Log": np.log, "Log1p": np.log1p, "Tanh": np.tanh,
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "Elu": lambda x: np.where(x > 0, x, np.expm1(x)),
    "Selu": lambda x: SELU_S * np.where(x > 0, x, SELU_A * np.expm1(x)),
    "Erf": _erf, "Erfc": _erfc, "Sin": np.sin, "Cos": np.cos,
    "IsNan": np.isnan, "IsInf": np.isinf, "IsFinite": np.isfinite, "Identity": lambda x: x,
}


def floor_mod(x, y):
    m = np.fmod(x, y)
    return np.where((m != 0) & ((y < 0) != (m < 0)), m + y, m)


BINARY_FLOAT = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Maximum": np.maximum,
    "Minimum": np.minimum, "SquaredDifference": lambda x, y: (x - y) ** 2,
    "Div": np.divide, "DivNoNan": lambda x, y: np.where(y == 0, 0.0, x / y),
    "Pow": np.power, "FloorDiv": lambda x, y: np.floor(x / y), "FloorMod": floor_mod,
    "Equal": np.equal, "NotEqual": np.not_equal, "Less": np.less,
    "LessEqual": np.less_equal, "Greater": np.greater, "GreaterEqual": np.greater_equal,
}


# ---- every op, per dtype ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_float_ops(dtype):
    b = SpecBuilder()
    x = b.input(dtype, (-1, 37))
    ops = list(UNARY_FLOAT) + ["Softplus", "LeakyRelu"]
    outs = [b.op(op, x, **({"alpha": 0.2} if op == "LeakyRelu" else {})) for op in ops]
    k = build(b, outs)
    X = data(dtype, (5, 37))
    res = k(X)
    x64 = f64(X)
    with np.errstate(all="ignore"):
        for op, out in zip(ops, res):
            if op == "Softplus":
                ref = tf_softplus(x64, dtype)
            elif op == "LeakyRelu":
                ref = np.where(x64 > 0, x64, x64 * 0.2)
            else:
                ref = UNARY_FLOAT[op](x64)
            if op == "Erf" and dtype == "float64":     # TF's double Erf: NaN at +-inf
                ref = np.where(np.isinf(x64), np.nan, ref)
            out_dtype = "bool" if op in ("IsNan", "IsInf", "IsFinite") else dtype
            rtol = 2e-6 if dtype == "float32" and op in ("Sin", "Cos") else None
            assert_matches(out, ref, out_dtype, f"{op}[{dtype}]", rtol)


@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_and_ternary_float_ops(dtype):
    b = SpecBuilder()
    x = b.input(dtype, (-1, 37))
    y = b.input(dtype, (37,))                 # broadcast along rows
    c = b.input("bool", (-1, 1))              # broadcast along columns
    hi = b.input(dtype, ())
    ops = list(BINARY_FLOAT)
    outs = [b.op(op, x, y) for op in ops]
    outs += [b.Select(c, x, y), b.ClipByValue(x, y, hi)]
    k = build(b, outs)
    X, Y = data(dtype, (6, 37)), data(dtype, (37,))
    Y[3] = 0                                   # x / 0 and DivNoNan
    C, H = data("bool", (6, 1)), np.array(2.0, npdtype(dtype))
    res = k(X, Y, C, H)
    x64, y64, h64 = f64(X), f64(Y), f64(H)
    with np.errstate(all="ignore"):
        for op, out in zip(ops, res):
            cmp = op in ("Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual")
            assert_matches(out, BINARY_FLOAT[op](x64, y64), "bool" if cmp else dtype,
                           f"{op}[{dtype}]")
        assert_matches(res[-2], np.where(C, x64, y64), dtype, "Select")
        assert_matches(res[-1], np.minimum(np.maximum(x64, y64), h64), dtype, "Clip")


def wrap(v, dtype):
    return np.asarray(v).astype(NP[dtype])    # two's complement wrap, like TF


@pytest.mark.parametrize("dtype", INTS)
def test_integer_ops_wrap_like_tf(dtype):
    b = SpecBuilder()
    x = b.input(dtype, (-1, 16))
    y = b.input(dtype, (-1, 16))
    un = ["Neg", "Abs", "Square", "Sign", "Relu", "Relu6", "Identity"]
    bi = ["Add", "Sub", "Mul", "Maximum", "Minimum", "SquaredDifference", "Equal",
          "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual"]
    outs = [b.op(o, x) for o in un] + [b.op(o, x, y) for o in bi]
    outs.append(b.ClipByValue(x, b.const(-5, dtype), y))
    k = build(b, outs)
    X, Y = data(dtype, (3, 16)), data(dtype, (3, 16), special=False)
    res = k(X, Y)
    x, y = X.astype(object), Y.astype(object)          # exact Python ints
    sign = np.vectorize(lambda v: (v > 0) - (v < 0))
    refs = {"Neg": -x, "Abs": abs(x), "Square": x * x, "Sign": sign(x),
            "Relu": np.maximum(x, 0), "Relu6": np.minimum(np.maximum(x, 0), 6),
            "Identity": x, "Add": x + y, "Sub": x - y, "Mul": x * y,
            "Maximum": np.maximum(x, y), "Minimum": np.minimum(x, y),
            "SquaredDifference": (x - y) * (x - y)}
    bits = 32 if dtype == "int32" else 64
    for op, out in zip(un + bi, res):
        if op in refs:
            ref = np.vectorize(lambda v: (int(v) + 2 ** (bits - 1)) % 2 ** bits
                               - 2 ** (bits - 1))(refs[op]).astype(NP[dtype])
            assert_matches(out, ref, dtype, f"{op}[{dtype}]")
        else:
            assert_matches(out, BINARY_FLOAT[op](X, Y), "bool", f"{op}[{dtype}]")
    assert_matches(res[-1], np.minimum(np.maximum(X, -5), Y), dtype, "Clip")


def test_bool_ops():
    b = SpecBuilder()
    x = b.input("bool", (-1, 9))
    y = b.input("bool", (9,))
    outs = [b.LogicalNot(x), b.LogicalAnd(x, y), b.LogicalOr(x, y), b.Equal(x, y),
            b.NotEqual(x, y), b.Select(y, x, b.LogicalNot(x))]
    k = build(b, outs)
    X, Y = data("bool", (4, 9)), data("bool", (9,))
    for out, ref in zip(k(X, Y), [~X, X & Y, X | Y, X == Y, X != Y, np.where(Y, X, ~X)]):
        assert_matches(out, ref, "bool", "bool op")


ALL = FLOATS + INTS + ["bool"]


def cast_ref(x64, src, dst):
    if dst == "bool":
        return x64 != 0
    if dst in INTS:
        if src in FLOATS:
            bits = 32 if dst == "int32" else 64
            lo, hi = -2.0 ** (bits - 1), 2.0 ** (bits - 1)
            with np.errstate(invalid="ignore"):
                ok = (x64 >= lo) & (x64 < hi)
            return np.where(ok, np.trunc(np.where(ok, x64, 0)), lo).astype(NP[dst])
        return wrap(x64.astype(np.int64), dst)
    return x64


@pytest.mark.parametrize("src", ALL)
def test_casts(src):
    b = SpecBuilder()
    x = b.input(src, (-1, 24))
    dsts = [d for d in ALL if d != src]
    k = build(b, [b.Cast(x, to=d) for d in dsts])
    X = data(src, (3, 24))
    if src in INTS:
        X.flat[:4] = [2 ** 20 + 1, -77, 123456, 65505] if src == "int32" else \
            [2 ** 40 + 3, -77, 2 ** 33 + 5, 65505]
    src64 = X.astype(np.int64) if src in INTS else (X if src == "bool" else f64(X))
    for d, out in zip(dsts, k(X)):
        if src in INTS and d in FLOATS:
            ref = X.astype(np.float32 if d != "float64" else np.float64).astype(np.float64)
        else:
            ref = cast_ref(src64, src, d)
        assert_matches(out, ref, d, f"Cast {src}->{d}")


# ---- reductions -------------------------------------------------------------------------

def reduce_ref(op, x, axis, dtype):
    if dtype == "bool":
        return (np.all if op == "All" else np.any)(x, axis=axis)
    if dtype in INTS:
        bits = 32 if dtype == "int32" else 64
        info = np.iinfo(NP[dtype])
        xs = np.moveaxis(x, axis, -1)
        out = np.empty(xs.shape[:-1], NP[dtype])
        for idx in np.ndindex(out.shape):
            row = [int(v) for v in xs[idx]]
            if op == "Sum":
                r = sum(row)
            elif op == "Mean":   # TF: int32 sums do not wrap, int64 sums do; truncating
                s = sum(row)     # division; an empty mean is 0
                if bits == 64:
                    s = (s + 2 ** 63) % 2 ** 64 - 2 ** 63
                r = 0 if not row else (abs(s) // len(row)) * (1 if s >= 0 else -1)
            elif op == "Prod":
                r = math.prod(row)
            else:
                r = (max if op == "Max" else min)(row, default=info.min if op == "Max"
                                                  else info.max)
            out[idx] = (r + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)
        return out
    with np.errstate(all="ignore"):
        if op in ("Max", "Min") and x.shape[axis] == 0:
            return np.full(np.delete(x.shape, axis), -np.inf if op == "Max" else np.inf)
        return {"Sum": np.sum, "Mean": np.mean, "Prod": np.prod, "Max": np.max,
                "Min": np.min}[op](x, axis=axis)


@pytest.mark.parametrize("kind", ["row", "column"])
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning",
                            "ignore:invalid value encountered in divide:RuntimeWarning")
def test_reductions(dtype, kind):
    axis = 1 if kind == "row" else 0
    b = SpecBuilder()
    x = b.input(dtype, (-1, -1))
    ops = ["All", "Any"] if dtype == "bool" else ["Sum", "Mean", "Max", "Min"]
    outs = [b.op(o, x, axes=[axis]) for o in ops]
    if dtype != "bool":
        p = b.input(dtype, (-1, -1))
        same = b.Equal(x, x)                   # ties p's dims to x's (values unused)
        outs.append(b.Prod(b.Select(same, p, p), axes=[axis]))
        ops = ops + ["Prod"]
    k = build(b, outs)
    assert k.schedule.kind == (KernelKind.ROW if kind == "row" else KernelKind.COLUMN)
    for shape in [(4, 300), (37, 3), (0, 5), (5, 0), (1, 1)]:
        X = data(dtype, shape)
        if dtype in FLOATS:
            X.flat[len(SPECIAL):] = RNG.standard_normal(X.size - len(SPECIAL)).astype(
                np.float32) if X.size > len(SPECIAL) else X.flat[len(SPECIAL):]
        args = [X]
        if dtype != "bool":
            P = data(dtype, shape, special=False, scale=0.3)
            if dtype in FLOATS:
                P = (1 + f64(P)).astype(np.float32).astype(npdtype(dtype))
            args.append(P)
        res = k(*args)
        for op, out in zip(ops, res):
            src = args[1] if op == "Prod" else X
            src64 = src if dtype == "bool" else (src if dtype in INTS else f64(src))
            ref = reduce_ref(op, src64, axis, dtype)
            rtol = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 2e-6}.get(dtype)
            assert_matches(out, ref, dtype, f"{op}[{dtype}] {kind} {shape}", rtol)


def test_reductions_propagate_nan_and_inf():
    b = SpecBuilder()
    x = b.input("float32", (-1, 40))
    k = build(b, [b.Max(x, axes=[1]), b.Min(x, axes=[1]), b.Sum(x, axes=[1]),
                  b.Max(b.Neg(x), axes=[1])])
    X = np.ones((4, 40), np.float32)
    X[0, 17] = np.nan
    X[1, 3] = np.inf
    X[2, 5], X[2, 6] = np.inf, -np.inf
    X[3, 39] = np.nan
    mx, mn, s, nmx = k(X)
    assert np.isnan(mx[0]) and np.isnan(mn[0]) and np.isnan(s[0]) and np.isnan(mx[3])
    assert mx[1] == np.inf and s[1] == np.inf and np.isnan(s[2]) and nmx[2] == np.inf


# ---- fused patterns vs float64 ------------------------------------------------------------

def layernorm_spec(d=-1, dtype="float32", outs_stats=False, scale=None):
    b = SpecBuilder()
    x = b.input(dtype, (-1, d))
    g = b.input(dtype, (d,))
    be = b.input(dtype, (d,))
    m = b.Mean(x, axes=[1], keep_dims=True)
    c = b.Sub(x, m)
    v = b.Mean(b.Square(c), axes=[1], keep_dims=True)
    y = b.Add(b.Mul(b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-5, dtype)))), g), be)
    if scale is not None:
        y = b.Mul(y, b.const(scale, dtype))
    return b.build([y, m, v] if outs_stats else [y])


def layernorm_ref(x, g, be):
    x, g, be = f64(x), f64(g), f64(be)
    m = x.mean(1, keepdims=True)
    v = ((x - m) ** 2).mean(1, keepdims=True)
    return (x - m) / np.sqrt(v + 1e-5) * g + be, m, v


@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning",
                            "ignore:invalid value encountered in divide:RuntimeWarning")
def test_layernorm_unknown_dims_one_compile():
    k = compile_kernel(layernorm_spec(-1, outs_stats=True))
    assert k.schedule.kind == KernelKind.ROW
    for n, d in [(1, 1), (3, 7), (5, 1024), (2, 5000), (0, 8), (3, 0)]:
        X = RNG.standard_normal((n, d)).astype(np.float32) * 4 + 1
        G = RNG.standard_normal(d).astype(np.float32)
        B = RNG.standard_normal(d).astype(np.float32)
        y, m, v = k(X, G, B)
        ry, rm, rv = layernorm_ref(X, G, B)
        assert_matches(y, ry, "float32", f"LN y {n}x{d}", 5e-6, 3e-6)
        assert_matches(m, rm, "float32", "LN mean", 5e-6)
        assert_matches(v, rv, "float32", "LN var", 5e-6)
        assert compile_kernel(layernorm_spec(-1, outs_stats=True)) is k


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_layernorm_low_and_high_precision(dtype):
    k = compile_kernel(layernorm_spec(96, dtype))
    X, G, B = data(dtype, (7, 96), special=False), data(dtype, (96,), special=False), \
        data(dtype, (96,), special=False)
    (y,) = k(X, G, B)
    ry, _, _ = layernorm_ref(X, G, B)
    rtol = {"float16": 4e-3, "bfloat16": 3e-2, "float64": 1e-12}[dtype]
    assert_matches(y, ry, dtype, f"LN {dtype}", rtol)


def softmax_spec(shape, log=False, dtype="float32", scale=None, **sched):
    b = SpecBuilder()
    x = b.input(dtype, shape)
    ax = len(shape) - 1
    m = b.Max(x, axes=[ax], keep_dims=True)
    sh = b.Sub(x, m)
    e = b.Exp(sh)
    s = b.Sum(e, axes=[ax], keep_dims=True)
    y = b.Sub(sh, b.Log(s)) if log else b.Div(e, s)
    if scale is not None:
        y = b.Mul(y, b.const(scale, dtype))
    return b.build([y], **sched)


def softmax_ref(x, log=False):
    x = f64(x)
    sh = x - x.max(-1, keepdims=True)
    lse = np.log(np.exp(sh).sum(-1, keepdims=True))
    return sh - lse if log else np.exp(sh - lse)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("scratch", [None, 0])
def test_softmax_and_log_softmax(log, scratch):
    sched = {} if scratch is None else {"scratch": scratch}
    k = compile_kernel(softmax_spec((-1, -1, 100), log, **sched))
    assert bool(k.schedule.scratch) == (scratch is None and not log)
    for shape in [(2, 3, 100), (1, 1, 100), (4, 0, 100)]:
        X = RNG.standard_normal(shape).astype(np.float32) * 5
        (y,) = k(X)
        assert_matches(y, softmax_ref(X, log), "float32", f"softmax {shape}", 4e-6, 2e-6)
    X = np.zeros((1, 2, 100), np.float32)
    X[0, 0, 7] = np.nan
    X[0, 1, 9] = np.inf
    (y,) = k(X)
    assert np.isnan(y[0, 0]).all() and np.isnan(y[0, 1, 9])      # as TF


def test_softmax_rows_shorter_than_a_vector_and_rows_per_task():
    k = compile_kernel(softmax_spec((-1, 3), rows_per_task=5))
    X = RNG.standard_normal((23, 3)).astype(np.float32)
    assert_matches(k(X)[0], softmax_ref(X), "float32", "softmax 3", 4e-6)
    assert k.shapes([X.shape])[3] == 5        # ceil(23 / 5) units


def run_in_shards(k, X, cuts):
    """The kernel's units split at ``cuts`` (fractions), each shard one body call, in
    order, as the op's thread pool would split them."""
    rc, dims, shapes, units, *_ = k.shapes([X.shape])
    assert rc == 0
    out = [np.empty(s, np.float32) for s in shapes]
    ip = (ctypes.c_void_p * 1)(X.ctypes.data)
    op = (ctypes.c_void_p * (len(out) + 1))(*[o.ctypes.data for o in out], None)
    dp = dims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
    bounds = sorted({0, units, *(int(c * units) for c in cuts)})
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        k._body(lo, hi, ip, op, dp)
    return out


def test_first_pass_of_the_next_row_runs_in_the_second_pass_and_stays_exact():
    """Row kernels whose second pass computes a transcendental (softmax, logsumexp)
    run row r + 1's first pass (the max) inside row r's second (the exps), across the
    rows of a body call; LayerNorm's passes do not, nor does a first pass that sums.
    Results equal float64 whatever the shards: one row, rows with NaN, +Inf and -Inf
    at a shard's first and last row, one shard per unit or one for all."""
    k = compile_kernel(softmax_spec((-1, 700), rows_per_task=3))
    assert "rn = r + 1 if r + 1 < r1 else r" in k.source and "an0 = h.acc_max" in k.source
    assert "h.prefetch" not in k.source
    assert "an0" not in compile_kernel(layernorm_spec(700)).source
    lse = SpecBuilder()
    x = lse.input("float32", (-1, -1))
    m = lse.Max(x, axes=[1], keep_dims=True)
    fm = lse.Select(lse.IsFinite(m), m, lse.const(0.0))
    out = lse.Add(lse.Log(lse.Sum(lse.Exp(lse.Sub(x, fm)), axes=[1], keep_dims=True)), fm)
    kl = build(lse, [out], rows_per_task=2)
    assert "an0" in kl.source
    for rows in (1, 2, 7, 12):
        X = RNG.standard_normal((rows, 700)).astype(np.float32) * 4
        if rows > 2:
            X[0, 3], X[rows // 2, 9], X[-1, 0] = np.nan, np.inf, -np.inf
            X[1, :] = -np.inf
        x64 = f64(X)
        with np.errstate(all="ignore"):
            mx = x64.max(1, keepdims=True)
            fm = np.where(np.isfinite(mx), mx, 0)
            ref = np.log(np.exp(x64 - fm).sum(1, keepdims=True)) + fm
        for cuts in ([], [0.5], [0.25, 0.5, 0.75], [i / 12 for i in range(12)]):
            with np.errstate(all="ignore"):
                want = softmax_ref(X)
            assert_matches(run_in_shards(k, X, cuts)[0], want, "float32",
                           f"softmax {rows} {cuts}", 4e-6, 2e-6)
            assert_matches(run_in_shards(kl, X, cuts)[0], ref, "float32",
                           f"logsumexp {rows} {cuts}", 4e-6, 2e-6)


def test_float_operand_constants_are_opaque_and_reduction_starts_literal():
    """Loop constants go through h.opaque (hoisted, not re-made each iteration);
    a reduction's start value stays a literal the vectorizer can split."""
    k = compile_kernel(softmax_spec((-1, 1024), scale=0.37))
    src = k.source
    scale = next(line.split()[0] for line in src.splitlines()
                 if line.startswith("_K") and "0.37" in line)
    start = next(line.split()[0] for line in src.splitlines()
                 if line.startswith("_K") and "-math.inf" in line)
    assert f"{scale[1:]} = h.opaque({scale})" in src
    assert f"{start[1:]} = {start}" in src


def test_specs_differing_only_in_launch_parameters_share_one_compiled_kernel():
    """rows_per_task / col_block are the cost model's per-shape choice: the op hands
    them to the shape function at run time, so they never make a new compile."""
    k5 = compile_kernel(softmax_spec((-1, 3), rows_per_task=5))
    k7 = compile_kernel(softmax_spec((-1, 3), rows_per_task=7, col_block=3))
    assert k5.body_address == k7.body_address and k5.spec.hash != k7.spec.hash
    assert (k5.launch, k7.launch) == ((5, 0), (7, 3))
    X = RNG.standard_normal((23, 3)).astype(np.float32)
    assert k5.shapes([X.shape])[3] == 5 and k7.shapes([X.shape])[3] == 4
    assert_matches(k7(X)[0], softmax_ref(X), "float32", "softmax 3, 7 rows a unit", 4e-6)


def test_shape_function_is_a_program_run_by_one_interpreter():
    """A kernel's shape function is the shared interpreter (one address for every
    kernel) on the kernel's int64 program; no shape code is generated per kernel.  The
    compiled interpreter and its plain-Python form agree, launch hint included, and a
    word that is no opcode stops it with -1."""
    from stitching.codegen.lower import shape_interp, shape_program
    spec = layernorm_spec(-1)
    k = compile_kernel(spec)
    assert "shape_fn" not in k.source and k.shape_program[-1] == shape_program.END
    assert k.shape_address == compile_kernel(softmax_spec((-1, 5))).shape_address
    prog = k.shape_program
    cases = [(((9, 40), (40,), (40,)), (0, 0)), (((9, 40), (40,), (41,)), (3, 0)),
             (((0, 7), (7,), (7,)), (2, 0))]
    for shapes, hint in cases:
        in_dims = np.array([d for s in shapes for d in s] + [0], np.int64)
        outs = []
        for run in (shape_interp.run, shape_interp.run.py_func):
            dims, od = np.zeros(32, np.int64), np.zeros(3, np.int64)
            sched = np.array(list(hint) + [1, 0], np.int64)     # the ABI's 4 words
            outs.append((run(prog, in_dims, dims, od, sched), dims.tolist(), od.tolist(),
                         sched.tolist()))
        assert outs[0] == outs[1]
        rc, dims, _, sched = outs[0]
        if shapes[2][0] != shapes[0][1]:
            assert k.errors[rc - 1].startswith("input 2 dim 0 differs from input 0 dim 1")
        else:
            assert rc == 0 and dims[:2] == list(shapes[0])
            if hint[0]:
                assert dims[2] == hint[0] and sched[0] == 0   # 0 rows: no units
    bad = np.array([99], np.int64)
    z = np.zeros(4, np.int64)
    assert shape_interp.run(bad, z, z.copy(), z.copy(), z.copy()) == -1
    assert outs[0][3][2:] == [1, 0]           # not split: one phase, no temp memory


@pytest.mark.parametrize("L,cb,rows", [(1025, 100, 1), (1000, 333, 3), (7, 2, 3),
                                       (5000, 1024, 2)])
def test_split_rows_run_in_phases_and_match_float64(L, cb, rows):
    """split_rows=1 with a column-block hint shorter than the row: each row is cut into
    nb pieces, one unit each, run in (passes + 1) phases with partial reductions in a
    temp buffer; results equal float64 (statistics outputs included), NaN stays in its
    row, and a hint as long as the row runs the same code unsplit."""
    k = compile_kernel(layernorm_spec(L, outs_stats=True).with_schedule(
        split_rows=1, col_block=cb, rows_per_task=1))
    assert k.schedule.split_rows and not k.schedule.scratch
    x = RNG.standard_normal((rows, L)).astype(np.float32) * 3 + 1
    g, b = RNG.standard_normal(L).astype(np.float32), RNG.standard_normal(L).astype(np.float32)
    rc, _, _, units, _, phases, temp = k.shapes([x.shape, g.shape, b.shape])
    nb = -(-L // cb)
    assert (rc, units, phases, temp) == (0, rows * nb, 4, 2 * rows * nb * 8)
    y, m, v = k(x, g, b)
    ry, rm, rv = layernorm_ref(x, g, b)
    assert_matches(y, ry, "float32", f"split layernorm {L}/{cb}", 5e-6, 3e-6)
    assert_matches(m, rm, "float32", "split mean", 5e-6, 3e-6)
    assert_matches(v, rv, "float32", "split variance", 5e-6, 3e-6)
    ks = compile_kernel(softmax_spec((-1, L), log=True).with_schedule(
        split_rows=1, col_block=cb, rows_per_task=1))
    xs = RNG.standard_normal((rows + 1, L)).astype(np.float32)
    xs[-1, L // 2] = np.nan
    out = ks(xs)[0]
    assert_matches(out[:-1], softmax_ref(xs[:-1], log=True), "float32", "split log_softmax",
                   4e-6)
    assert np.isnan(out[-1]).all()
    whole = compile_kernel(softmax_spec((-1, L), log=True).with_schedule(
        split_rows=1, col_block=L, rows_per_task=1))
    assert whole.body_address == ks.body_address and whole.shapes([xs.shape])[5] == 1
    assert_matches(whole(xs)[0][:-1], softmax_ref(xs[:-1], log=True), "float32",
                   "log_softmax, hint as long as the row", 4e-6)


def test_rmsnorm():
    b = SpecBuilder()
    x = b.input("float32", (-1, 512))
    g = b.input("float32", (512,))
    ms = b.Mean(b.Square(x), axes=[1], keep_dims=True)
    y = b.Mul(b.Mul(x, b.Rsqrt(b.Add(ms, b.const(1e-6)))), g)
    k = build(b, [y])
    X, G = RNG.standard_normal((9, 512)).astype(np.float32), RNG.standard_normal(512).astype(
        np.float32)
    x64 = f64(X)
    ref = x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-6) * G
    assert_matches(k(X, G)[0], ref, "float32", "rmsnorm", 4e-6)


@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_bias_gelu(form):
    b = SpecBuilder()
    x = b.input("float32", (-1, 256))
    bias = b.input("float32", (256,))
    h = b.Add(x, bias)
    if form == "erf":
        t = b.Erf(b.Mul(h, b.const(0.7071067811865476)))
    else:
        cube = b.Pow(h, b.const(3.0))
        t = b.Tanh(b.Mul(b.const(0.7978845608028654),
                         b.Add(h, b.Mul(b.const(0.044715), cube))))
    y = b.Mul(b.Mul(h, b.const(0.5)), b.Add(t, b.const(1.0)))
    k = build(b, [y])
    X = RNG.standard_normal((33, 256)).astype(np.float32) * 3
    B = RNG.standard_normal(256).astype(np.float32)
    h64 = f64(X) + f64(B)
    if form == "erf":
        ref = 0.5 * h64 * (1 + _erf(h64 / math.sqrt(2)))
    else:
        ref = 0.5 * h64 * (1 + np.tanh(0.7978845608028654 * (h64 + 0.044715 * h64 ** 3)))
    (y,) = k(X, B)
    # 1 + erf cancels for x << 0: the output carries erf's absolute error (3.2e-7)
    # times |x| / 2, as in any float32 GELU built on erf
    np.testing.assert_allclose(y, ref, rtol=2e-6, atol=2e-6 if form == "erf" else 3e-7)


@pytest.mark.filterwarnings("ignore:Mean of empty slice:RuntimeWarning",
                            "ignore:invalid value encountered in divide:RuntimeWarning")
def test_column_reduction_with_consumers_batchnorm():
    b = SpecBuilder()
    x = b.input("float32", (-1, -1, 300))
    g = b.input("float32", (300,))
    m = b.Mean(x, axes=[0, 1], keep_dims=True)
    c = b.Sub(x, m)
    v = b.Mean(b.Square(c), axes=[0, 1], keep_dims=True)
    y = b.Add(b.Mul(b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-3)))), g), b.const(0.5))
    k = build(b, [y, m, v], col_block=64)
    assert k.schedule.kind == KernelKind.COLUMN and len(k.schedule.passes) == 3
    for shape in [(8, 50, 300), (1, 1, 300), (0, 4, 300)]:
        X = RNG.standard_normal(shape).astype(np.float32) * 2 + 3
        G = RNG.standard_normal(300).astype(np.float32)
        x64 = f64(X)
        with np.errstate(all="ignore"):
            rm = x64.mean((0, 1), keepdims=True)
            rv = ((x64 - rm) ** 2).mean((0, 1), keepdims=True)
            ry = (x64 - rm) / np.sqrt(rv + 1e-3) * G + 0.5
        yo, mo, vo = k(X, G)
        assert_matches(yo, ry, "float32", f"bn y {shape}", 5e-6, 3e-6)
        assert_matches(mo, rm, "float32", "bn mean", 5e-6)
        assert_matches(vo, rv, "float32", "bn var", 5e-6)


@pytest.mark.parametrize("dtype", ["float32", "int32", "bool"])
def test_column_reductions_with_few_columns_split_their_rows_in_phases(dtype):
    """Fewer column units than COL_UNITS and >= 2 x COL_CHUNK_ROWS rows: the shape
    function cuts the rows into chunks of full-width blocks (rpt > 1), run in
    passes + 1 phases with 8-byte partials per reduction, chunk and column; results
    equal float64 / exact integers, NaN and Inf included; a short column stays whole."""
    from stitching.schedule.schedule import COL_CHUNK_ROWS, COL_SPLIT_UNITS
    b = SpecBuilder()
    x = b.input(dtype, (-1, -1))
    ops = ["All", "Any"] if dtype == "bool" else ["Sum", "Mean", "Max", "Min"]
    k = build(b, [b.op(o, x, axes=[0]) for o in ops])
    assert k.schedule.kind == KernelKind.COLUMN
    for shape in [(1000, 33), (4099, 3), (300, 40), (257, 1), (255, 7), (300, 0)]:
        X = data(dtype, shape)
        if dtype == "float32" and X.size:
            X.flat[len(SPECIAL):] = RNG.standard_normal(X.size - len(SPECIAL))
            X[:, -1] = RNG.standard_normal(shape[0]) * 1e3      # a column without NaN
        rc, dims, _, units, _, phases, temp = k.shapes([shape])
        chunks = min(COL_SPLIT_UNITS, shape[0] // COL_CHUNK_ROWS)
        if shape[1] == 0:
            assert (rc, units) == (0, 0)
        elif shape[0] >= 2 * COL_CHUNK_ROWS:
            assert (rc, units, phases, temp) == (0, chunks, 2, len(ops) * chunks * shape[1] * 8)
            assert dims[2] == chunks and dims[3] == shape[1], dims[:6]
        else:
            assert (units, phases, temp) == (1, 1, 0), (units, phases, temp)
        src = X if dtype != "float32" else f64(X)
        for op, out in zip(ops, k(X)):
            assert_matches(out, reduce_ref(op, src, 0, dtype), dtype,
                           f"{op}[{dtype}] split column {shape}", 2e-6)


def test_column_kernel_with_few_kept_indices_cuts_rows_for_balanced_units():
    """Squeeze-excite over NHWC [5, 57*57, 256]: 5 kept indices of one 256-column block
    would be 5 units, one thread of two idle for a sixth of the call; with fewer than
    COL_UNITS column units the shape function cuts the rows into chunks (4 per index:
    20 units, partials combined in a second phase), from 8 indices on it does not; the
    results equal float64, NaN included."""
    from stitching.schedule.schedule import COL_SPLIT_UNITS, COL_UNITS
    b = SpecBuilder()
    x = b.input("float32", (-1, -1, 256))
    y = b.Mul(x, b.Sigmoid(b.Mean(x, axes=[1], keep_dims=True)))
    k = build(b, [y])
    assert k.schedule.kind == KernelKind.COLUMN
    assert COL_UNITS == 8
    for n, want, phases in [(1, 16, 2), (3, 18, 2), (5, 20, 2), (8, 8, 1), (16, 16, 1)]:
        rc, dims, _, units, _, ph, _ = k.shapes([(n, 3249, 256)])
        assert (rc, units, ph) == (0, want, phases), (n, units, ph)
        if n < COL_UNITS:
            assert dims[3] == -(-COL_SPLIT_UNITS // n)          # row chunks per index
    for n in (5, 8):
        X = RNG.standard_normal((n, 300, 256)).astype(np.float32)
        X[2, 7, 5] = np.nan
        ref = f64(X) / (1 + np.exp(-f64(X).mean(1, keepdims=True)))
        assert_matches(k(X)[0], ref, "float32", f"squeeze-excite [{n}, 300, 256]", 2e-6)


def test_split_column_kernel_with_consumers_matches_float64():
    """Batch-norm statistics (3 passes, mean and variance stored: a last phase) and
    centring (2 passes, nothing stored per column: no last phase), chunked."""
    b = SpecBuilder()
    x = b.input("float32", (-1, 300))
    m = b.Mean(x, axes=[0], keep_dims=True)
    c = b.Sub(x, m)
    v = b.Mean(b.Square(c), axes=[0], keep_dims=True)
    y = b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-3))))
    k = build(b, [y, m, v])
    b2 = SpecBuilder()
    x2 = b2.input("float32", (-1, -1))
    k2 = build(b2, [b2.Sub(x2, b2.Mean(x2, axes=[0], keep_dims=True))])
    X = RNG.standard_normal((2000, 300)).astype(np.float32) * 2 + 3
    X[77, 5] = np.nan
    x64 = f64(X)
    with np.errstate(all="ignore"):
        rm = x64.mean(0, keepdims=True)
        rv = ((x64 - rm) ** 2).mean(0, keepdims=True)
        ry = (x64 - rm) / np.sqrt(rv + 1e-3)
    assert k.shapes([X.shape])[5] == 4 and k2.shapes([X.shape])[5] == 2
    yo, mo, vo = k(X)
    assert_matches(yo, ry, "float32", "split bn y", 5e-6, 3e-6)
    assert_matches(mo, rm, "float32", "split bn mean", 5e-6)
    assert_matches(vo, rv, "float32", "split bn var", 5e-6)
    assert np.isnan(yo[:, 5]).all() and np.isnan(mo[0, 5])
    assert_matches(k2(X)[0], x64 - rm, "float32", "split centring", 5e-6, 3e-6)


def test_private_block_renames_only_its_own_names():
    """The second of two exclusive paths gets its own names: what it assigns before
    reading, and nothing read after it or coming in from before it."""
    from stitching.codegen.lower.emitter import Writer as _Writer
    w = _Writer()
    w("L = 3")
    with w.block("if x:"):
        w("a = 0")
        with w.block("for j in range(L):"):
            w("a = h.acc_add(a, j)")
        w("y = a")
    with w.private_block("else:", "_w"):
        w("a = L")
        with w.block("for j in range(L):"):
            w("a = h.acc_add(a, j)")
        w("t = t + 1")            # t comes in from before: read first, not its own
        w("z = a + y")
        w("y = z")               # y is read after the block
    w("return y + t")
    assert w.text()[7:] == ["    a_w = L", "    for j_w in range(L):",
                            "        a_w = h.acc_add(a_w, j_w)", "    t = t + 1",
                            "    z_w = a_w + y", "    y = z_w", "return y + t"]


def test_split_and_whole_row_paths_assign_disjoint_names():
    """A row kernel with a split path (rows in phases) and a whole one assigns no name
    on both (Numba would rebuild SSA form for each such name).  That both paths
    compute the same is test_split_rows_run_in_phases_and_match_float64's business."""
    import ast
    k = compile_kernel(softmax_spec((-1, 1000), log=True).with_schedule(
        split_rows=1, col_block=300, rows_per_task=1))
    body = next(n for n in ast.parse(k.source).body if isinstance(n, ast.FunctionDef))
    split = next(n for n in ast.walk(body) if isinstance(n, ast.If) and n.orelse and
                 ast.unparse(n.test) == "nb > 1")

    def assigned(stmts):
        return {t.id for st in stmts for n in ast.walk(st)
                for t in ([n.target] if isinstance(n, ast.For) else
                          n.targets if isinstance(n, ast.Assign) else [])
                if isinstance(t, ast.Name)}
    assert assigned(split.body) and assigned(split.orelse)
    assert not assigned(split.body) & assigned(split.orelse)


def test_column_kernel_writes_each_pass_once():
    """Split (chunked rows, phases) and whole column kernels share one copy of each
    pass: its row loop appears once unrolled and once for the remaining rows, or once
    where the pass stores its rows too (here the last pass, the normalized output: an
    unrolled storing loop stays scalar, emitter._column_pass).  The normalized output,
    stored by the last pass alone, may be written over x (schedule/inplace.py): the
    whole loop nest twice, once storing through x's pointer."""
    from stitching.schedule.inplace import pairs
    b = SpecBuilder()
    x = b.input("float32", (-1, 300))
    m = b.Mean(x, axes=[0], keep_dims=True)
    c = b.Sub(x, m)
    v = b.Mean(b.Square(c), axes=[0], keep_dims=True)
    k = build(b, [b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-3)))), m, v])
    assert k.schedule.kind == KernelKind.COLUMN and len(k.schedule.passes) == 3
    assert pairs(k.spec, k.schedule) == [(0, 0)]
    assert k.source.count("for t0 in range(") == 2 * (2 + 2 + 1)


def test_column_pass_that_stores_its_rows_sums_through_float32_partials():
    """A squeeze-excite's BatchNorm + swish + mean: the pass stores every row and sums
    it.  Its float32 sum runs through a float32 partial per COL_PART_ROWS rows, merged
    into the float64 sum (a float64 accumulator in the loop made it 4 lanes wide);
    200 rows cross three merges and a short last block.  Equal to float64 within the
    bounds of the other column sums; NaN and Inf reach the output and the mean."""
    b = SpecBuilder()
    x = b.input("float32", (-1, 200, 40))
    y = b.Mul(x, b.Sigmoid(x))
    k = build(b, [y, b.Mean(y, axes=[1], keep_dims=True)])
    assert k.schedule.kind == KernelKind.COLUMN
    assert "pt" in k.source and "tb + 64" in k.source
    X = (RNG.standard_normal((3, 200, 40)) * 4).astype(np.float32)
    X[1, 7, 3], X[2, 150, 5] = np.nan, np.inf
    yo, mo = k(X)
    ref = f64(X) / (1 + np.exp(-f64(X)))
    ref[2, 150, 5] = np.inf
    assert_matches(yo, ref, "float32", "swish", 4e-7, 1e-7)
    assert_matches(mo, ref.mean(1, keepdims=True), "float32", "mean", 4e-6, 1e-6)


def test_nhwc_global_pool_and_scale():
    b = SpecBuilder()
    x = b.input("float32", (-1, 7, 7, 64))
    s = b.input("float32", (-1, 1, 1, 64))
    m = b.Mean(b.Mul(x, s), axes=[1, 2])
    mx = b.Max(x, axes=[1, 2], keep_dims=True)
    k = build(b, [m, mx])
    X = RNG.standard_normal((3, 7, 7, 64)).astype(np.float32)
    S = RNG.standard_normal((3, 1, 1, 64)).astype(np.float32)
    mo, mxo = k(X, S)
    assert_matches(mo, (f64(X) * f64(S)).mean((1, 2)), "float32", "pool", 4e-6, 1e-6)
    assert_matches(mxo, X.max((1, 2), keepdims=True), "float32", "maxpool")


def test_multi_output_mixed_dtypes_and_broadcasts():
    b = SpecBuilder()
    x = b.input("float32", (-1, 4, 16))
    y = b.input("float16", (-1, 1, 16))
    h = b.Cast(y, to="float32")
    s = b.Add(x, h)
    outs = [s, b.Cast(s, to="bfloat16"), b.Greater(s, b.const(0.0)),
            b.Cast(b.Mul(s, b.const(8.0)), to="int32"), b.Reshape(s, shape=[-1, 4, 1, 16])]
    k = build(b, outs)
    X = RNG.standard_normal((3, 4, 16)).astype(np.float32)
    Y = RNG.standard_normal((3, 1, 16)).astype(np.float16)
    r = f64(X) + f64(Y)
    o = k(X, Y)
    assert_matches(o[0], r, "float32", "add")
    assert_matches(o[1], r, "bfloat16", "bf16 out")
    assert_matches(o[2], r > 0, "bool", "greater")
    assert_matches(o[3], np.trunc(r.astype(np.float32) * 8).astype(np.int32), "int32", "i32")
    assert o[4].shape == (3, 4, 1, 16) and np.array_equal(o[4][:, :, 0], o[0])


def test_pow_by_small_constants_and_consts_of_every_dtype():
    b = SpecBuilder()
    x = b.input("float32", (-1,))
    outs = [b.Pow(x, b.const(v)) for v in (0.0, 1.0, 2.0, 3.0, -1.0, 0.5)]
    outs += [b.Add(x, b.FillLike(x, value="nan", dtype="float32")),
             b.Add(b.FillLike(x, value=0.0, dtype="float32"),
                   b.Cast(b.const(70000.0, "float16"), to="float32"))]
    k = build(b, outs)
    X = np.array([np.nan, 0.0, -0.0, 2.0, -3.0, np.inf, 1e20], np.float32)
    res = k(X)
    with np.errstate(all="ignore"):
        for v, out in zip((0.0, 1.0, 2.0, 3.0, -1.0, 0.5), res):
            assert_matches(out, np.power(f64(X), v), "float32", f"pow {v}")
    assert np.isnan(res[6]).all() and (res[7] == np.inf).all()   # 70000 overflows float16


def test_int32_mean_uses_wide_accumulator_and_truncates():
    b = SpecBuilder()
    x = b.input("int32", (-1, -1))
    k = build(b, [b.Mean(x, axes=[1]), b.Sum(x, axes=[1])])
    X = np.array([[2 ** 31 - 1, 1], [-7, 0], [-2 ** 31, -1]], np.int32)
    mean, total = k(X)
    assert mean.tolist() == [2 ** 30, -3, -2 ** 30]            # TF: no wrap, truncation
    assert total.tolist() == [-2 ** 31, -7, 2 ** 31 - 1]       # TF: int32 wraps


def test_scalar_and_zero_size_domains():
    b = SpecBuilder()
    x = b.input("float32", ())
    k = build(b, [b.Mul(x, b.const(2.0))])
    assert k(np.array(3.0, np.float32))[0] == 6.0
    b = SpecBuilder()
    x = b.input("float32", (-1, 37))
    k = build(b, [b.Exp(x), b.Sum(b.Exp(x), axes=[0])])
    e, s = k(np.zeros((0, 37), np.float32))
    assert e.shape == (0, 37) and s.shape == (37,) and (s == 0).all()


# ---- shape function -----------------------------------------------------------------------

def test_shape_fn_errors_name_the_problem():
    k = compile_kernel(layernorm_spec(768))
    rc, *_ = k.shapes([(4, 767), (768,), (768,)])
    assert rc > 0 and "input 0 dim 1 must be 768" in k.errors[rc - 1]
    with pytest.raises(ValueError, match="input 0 dim 1 must be 768.*input shapes"):
        k(np.zeros((4, 767), np.float32), np.zeros(768, np.float32),
          np.zeros(768, np.float32))
    b = SpecBuilder()
    x = b.input("float32", (-1, -1))
    y = b.input("float32", (-1, -1))
    k = build(b, [b.Add(x, y)])
    rc, *_ = k.shapes([(3, 4), (3, 5)])
    assert "input 1 dim 1 differs from input 0 dim 1: shapes do not broadcast" in \
        k.errors[rc - 1]
    rc, _, shapes, units, cost, *_ = k.shapes([(3, 4), (3, 4)])
    assert rc == 0 and shapes == [(3, 4)] and units >= 1 and cost >= 1
    with pytest.raises(TypeError, match="dtype"):
        k(np.zeros((3, 4), np.float64), np.zeros((3, 4), np.float32))


def test_shape_fn_checks_dims_pinned_to_one():
    b = SpecBuilder()
    x = b.input("float32", (-1, 5))
    k = build(b, [b.Neg(x, out_shape=(1, 5))])
    assert k(np.ones((1, 5), np.float32))[0].shape == (1, 5)
    with pytest.raises(ValueError, match="must be 1"):
        k(np.ones((2, 5), np.float32))


def test_refused_spec_raises_schedule_error():
    b = SpecBuilder()
    x = b.input("float32", (4, 5, 6))
    with pytest.raises(ScheduleError, match="neither a row"):
        build(b, [b.Sum(x, axes=[0, 2])])


# ---- machine code, threads, caching ---------------------------------------------------------

@pytest.mark.parametrize("which", ["layernorm", "softmax"])
def test_hot_loops_are_vectorized(which):
    # a constant of their own: a fresh compile that keeps its IR
    k = compile_kernel(layernorm_spec(1024, scale=0.33) if which == "layernorm" else
                       softmax_spec((-1, 1024), scale=0.33))
    ir = k.inspect_llvm()
    if ir is None:
        pytest.skip("kernel came from a pre-existing disk cache")
    assert WIDE.search(ir)
    assert '"prefer-vector-width"="512"' in ir      # intrinsics.wide_vectors
    asm = k.inspect_asm()
    assert ("ymm" in asm or "zmm" in asm) and ("vfmadd" in asm or "vmulps" in asm)


def test_units_run_in_parallel_threads_like_the_op():
    k = compile_kernel(softmax_spec((-1, 700)))
    X = RNG.standard_normal((64, 700)).astype(np.float32)
    rc, dims, shapes, units, *_ = k.shapes([X.shape])
    out = np.empty(shapes[0], np.float32)
    ip = (ctypes.c_void_p * 1)(X.ctypes.data)
    op = (ctypes.c_void_p * 1)(out.ctypes.data)
    dp = dims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))
    cuts = np.linspace(0, units, 5).astype(int)
    ts = [threading.Thread(target=k._body, args=(int(a), int(c), ip, op, dp))
          for a, c in zip(cuts[:-1], cuts[1:])]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert_matches(out, softmax_ref(X), "float32", "threaded softmax", 4e-6)


def test_compile_kernels_dedupes_and_reports_progress():
    specs = [softmax_spec((-1, 11)), layernorm_spec(11), softmax_spec((-1, 11))]
    seen = []
    ks = compile_kernels(specs, progress=lambda i, n, s: seen.append((i, n, s.hash)))
    assert ks[0] is ks[2] and ks[0] is not ks[1]
    assert [(i, n) for i, n, _ in seen] == [(0, 2), (1, 2)]


def test_uncached_kernels_compile_in_worker_processes(tmp_path, monkeypatch):
    """Cold batches go to worker processes that fill the disk cache; this process
    then loads every kernel from it, and the kernels compute the right thing."""
    from stitching.compile import is_cached, parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    # structurally different (their generic twins differ), and never compiled before
    # (a constant of their own: launch parameters would not make new code)
    specs = [softmax_spec((-1, 13), scale=0.977), softmax_spec((-1, 13), log=True, scale=0.977),
             layernorm_spec(13, scale=0.977), layernorm_spec(13, outs_stats=True, scale=0.977)]
    assert not any(is_cached(s) for s in specs)
    seen = []
    assert parallel.warm_cache(specs, jobs=2, progress=lambda d, n: seen.append((d, n))) == 4
    assert seen[-1] == (4, 4) and all(is_cached(s) for s in specs)
    ks = compile_kernels(specs, jobs=2)
    assert all(k.cache_hits for k in ks)             # loaded, not compiled, here
    x = np.random.default_rng(0).standard_normal((5, 13)).astype(np.float32)
    assert_matches(ks[0](x)[0], softmax_ref(x) * 0.977, "float32", "worker-built softmax",
                   4e-6)
    assert parallel.warm_cache(specs, jobs=2) == 0   # nothing left to compile


def test_a_lone_early_worker_gets_company_for_three_kernels(tmp_path, monkeypatch):
    """Handed one pre-started worker (an early worker, a small graph) and three codes
    to compile, warm_cache starts the others (up to ``jobs``), which join the queue;
    every kernel is then in the disk cache."""
    from stitching.compile import is_cached, parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    spawned = []
    real = parallel._spawn
    monkeypatch.setattr(parallel, "_spawn", lambda: spawned.append(1) or real())
    specs = [softmax_spec((-1, 17), scale=0.931), layernorm_spec(17, scale=0.931),
             softmax_spec((-1, 17), log=True, scale=0.931)]
    early = parallel.Workers(1)
    assert parallel.warm_cache(specs, jobs=2, workers=early) == 3
    assert len(spawned) == 2 and all(is_cached(s) for s in specs)
    assert early.procs == []                        # handed over, nothing left open


def test_specs_differing_in_static_sizes_share_one_compiled_kernel():
    """LayerNorm at D=624 and D=640 run the code of one shape-generic twin, and each
    still enforces its own static sizes."""
    k24, k40 = compile_kernel(layernorm_spec(624)), compile_kernel(layernorm_spec(640))
    assert k24.body_address == k40.body_address and k24.generic == k40.generic
    assert k24.spec.hash != k40.spec.hash
    rng = np.random.default_rng(1)
    for k, d in ((k24, 624), (k40, 640)):
        x, g, b = (rng.standard_normal(s).astype(np.float32) for s in ((6, d), (d,), (d,)))
        assert_matches(k(x, g, b)[0], layernorm_ref(x, g, b)[0], "float32",
                       f"generic layernorm D={d}", 5e-6, 3e-6)
    rc, *_ = k24.shapes([(4, 640), (640,), (640,)])
    assert k24.format_error(rc, []).startswith("input 0 dim 1 must be 624")
    with pytest.raises(ValueError, match="input 0 dim 1 must be 624"):
        k24(np.zeros((2, 640), np.float32), np.zeros(640, np.float32),
            np.zeros(640, np.float32))


def _bn_add_relu_spec(residual_first):
    """Inference BN over a residual sum, its nodes listed in one of two orders (as two
    ResNet50 blocks came out of the planner): the per-channel scale and shift are
    hoisted in front of the element loop either way, so only the numbering differs."""
    b = SpecBuilder()
    x, r = b.input("float32", (-1, 40)), b.input("float32", (-1, 40))
    g, mu, var, beta = (b.input("float32", (40,)) for _ in range(4))
    eps = b.const(1e-3, "float32")
    if residual_first:
        s = b.Add(x, r)
    sc = b.Mul(b.Rsqrt(b.Add(var, eps)), g)
    sh = b.Sub(beta, b.Mul(mu, sc))
    if not residual_first:
        s = b.Add(x, r)
    return b.build([b.Relu(b.Add(b.Mul(s, sc), sh))])


def test_specs_equal_up_to_node_numbering_share_one_compiled_kernel(tmp_path, monkeypatch):
    """Code is cached by its canonical text (comments dropped, emitter-made names
    renumbered in order of appearance): two specs whose kernels differ only in node
    numbering compile once, and the shared code is right for both."""
    from stitching.codegen.cpu import emitter as cpu
    from stitching.codegen.lower.emitter import canonical
    from stitching.compile import kernel
    from stitching.schedule import build_schedule
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    a, b = _bn_add_relu_spec(False), _bn_add_relu_spec(True)
    ta, tb = (cpu.emit(build_schedule(s)).text for s in (a, b))
    assert a.hash != b.hash and ta != tb            # really two texts
    assert canonical(ta) == canonical(tb)
    assert kernel.code_name(ta) == kernel.code_name(tb)
    ka = compile_kernel(a)
    kb = compile_kernel(b)                          # loaded: a built its code
    assert not ka.cache_hits and kb.cache_hits
    assert ka.body_address == kb.body_address and ka.source != kb.source
    rng = np.random.default_rng(3)
    x, r = (rng.standard_normal((9, 40)).astype(np.float32) for _ in range(2))
    g, mu, beta = (rng.standard_normal(40).astype(np.float32) for _ in range(3))
    var = rng.uniform(0.5, 2, 40).astype(np.float32)
    want = np.maximum((f64(x) + r - mu) / np.sqrt(f64(var) + 1e-3) * g + beta, 0)
    for k in (ka, kb):
        assert_matches(k(x, r, g, mu, var, beta)[0], want, "float32", "bn+add+relu", 4e-6,
                       4e-6)


def test_canonical_text_renames_within_families_only():
    """Renaming is per family of names (the letters before the number), leaves
    attributes and numbers alone, and a text it cannot rename safely (a string
    literal) is kept as it is."""
    from stitching.codegen.lower.emitter import canonical
    text = ("# spec abc\nK7 = np.float32(1e-05)\ndef body():\n    v12 = v3 + K7\n"
            "    v3_w = h.exp_f32(v12)\n    hz12 = v3\n")
    assert canonical(text) == ("K0 = np.float32(1e-05)\ndef body():\n    v0 = v1 + K0\n"
                               "    v1_w = h.exp_f32(v0)\n    hz0 = v1")
    assert canonical("x1 = 'v2'") == "x1 = 'v2'"


def _add_layernorm_spec(affine=True):
    b = SpecBuilder()
    x, r = b.input("float32", (-1, 256)), b.input("float32", (-1, 256))
    h = b.Add(x, r)
    m = b.Mean(h, axes=[1], keep_dims=True)
    c = b.Sub(h, m)
    v = b.Mean(b.Square(c), axes=[1], keep_dims=True)
    y = b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-12, "float32"))))
    if affine:
        y = b.Add(b.Mul(y, b.input("float32", (256,))), b.input("float32", (256,)))
    return b.build([y])


def test_work_estimate_counts_streamed_bytes_once_and_runs_small_work_inline():
    """The per-element cost the shape function reports (the op's smallest share, and
    op.cc's inline threshold of 400000) counts a row's bytes once, not once per pass,
    and not the per-channel vectors: the Transformer's add + LayerNorm at batch 1
    (128 x 256) runs on the calling thread, at batch 8 it goes to the pool."""
    from stitching.codegen.lower import exprs as lower
    from stitching.schedule import build_schedule
    k = compile_kernel(_add_layernorm_spec())
    inline_cost = 400000
    for rows, inline in ((128, True), (1024, False)):
        rc, _, _, units, cost, phases, _ = k.shapes([(rows, 256), (rows, 256), (256,),
                                                     (256,)])
        assert rc == 0 and phases == 1
        assert (units * cost < inline_cost) == inline, (rows, units, cost)
    plain = _add_layernorm_spec(affine=False)
    with_affine = _add_layernorm_spec()
    per = [lower.cycles_per_element(s, build_schedule(s).passes) for s in (plain, with_affine)]
    assert per[1] - per[0] <= 1 and per[1] <= 8, per    # gamma, beta: cached, not streamed


def test_exp_of_logits_minus_their_max_skips_the_overflow_steps():
    """Softmax's exp(x - max(x)) lowers to exp_nonpos (no overflow path); an exp of
    x minus the max of another tensor keeps the full exp; TF's reduce_logsumexp,
    exp(x - where(is_finite(max), max, 0)), takes exp_nonpos in the rows whose max is
    finite and the full exp in the others (+Inf, NaN: x itself is the argument)."""
    assert "h.exp_nonpos_f32(" in compile_kernel(softmax_spec((-1, 40))).source
    b = SpecBuilder()
    x, y = b.input("float32", (-1, 40)), b.input("float32", (-1, 40))
    m = b.Max(y, axes=[1], keep_dims=True)
    e = b.Exp(b.Sub(x, m))
    mx = b.Max(x, axes=[1], keep_dims=True)
    guarded = b.Select(b.IsFinite(mx), mx, b.const(0.0, "float32"))
    k = compile_kernel(b.build([e, b.Exp(b.Sub(x, guarded))]))
    assert k.schedule.kind == KernelKind.ROW
    body = k.source.split("def body(")[1]
    assert body.count("h.exp_nonpos_f32(") == 1 and body.count("h.exp_f32(") == 2
    assert re.search(r"= h\.exp_nonpos_f32\((v\d+)\) if v\d+ else h\.exp_f32\(\1\)$",
                     body, re.M)
    xs = np.array([[np.inf] + [1.0] * 39, [2.0] * 40, [np.nan] + [3.0] * 39,
                   RNG.standard_normal(40)], np.float32)
    ys = np.zeros((4, 40), np.float32)
    out = k(xs, ys)
    assert np.isinf(out[0][0, 0]) and np.isinf(out[1][0, 0])     # large x stays exp(x)
    np.testing.assert_allclose(out[1][1], np.ones(40), rtol=0)
    # the NaN row: max NaN -> not finite -> exp(x): exp(3) in the full exp, not 1
    assert np.isnan(out[1][2, 0])
    np.testing.assert_allclose(out[1][2, 1:], np.exp(np.float32(3)), rtol=2e-7)
    np.testing.assert_array_max_ulp(out[1][3], np.exp(xs[3] - xs[3].max()), maxulp=2)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_division_by_a_constant_multiplies_by_its_reciprocal(dtype):
    """x / c lowers to x * (1/c) when 1/c is a normal number: bit-exact for a power
    of two, within 2 ulp otherwise, NaN/Inf/0/subnormal x included; a zero, Inf,
    subnormal or huge c keeps the division (identical to TF's)."""
    nt = npdtype(dtype)
    tiny, huge = float(np.finfo(nt).tiny), float(np.finfo(nt).max) / 2
    consts = [1.4142135623730951, -4.0, 0.0, tiny / 8, huge, math.inf]
    b = SpecBuilder()
    x = b.input(dtype, (-1, 33))
    k = compile_kernel(b.build([b.Div(x, b.const(c, dtype)) for c in consts]))
    body = k.source.split("def body(")[1]
    # distinct lines: an element-wise kernel has its in-place loop nest too
    assert len(set(re.findall(r"= x0 \* K\d+$", body, re.M))) == 2
    assert len(set(re.findall(r"= x0 / v\d+$", body, re.M))) == 4
    xs = data(dtype, (5, 33))
    xs[0, :6] = [tiny / 4, -tiny * 3, huge, -0.0, np.inf, np.nan]
    outs = k(xs)
    with np.errstate(all="ignore"):
        refs = [xs / nt.type(c) for c in consts]
    np.testing.assert_array_max_ulp(outs[0], refs[0], maxulp=2)
    for out, ref in zip(outs[1:], refs[1:]):
        np.testing.assert_array_equal(out, ref)


def test_division_by_a_row_scalar_takes_its_reciprocal_once_per_row():
    """x / sum(x) in a row kernel multiplies by 1/sum, taken once per row, within
    2 ulp of the division; rows whose sum is 0, subnormal, above 2^126, Inf or NaN
    divide, exactly as TF does."""
    b = SpecBuilder()
    x = b.input("float32", (-1, 40))
    s = b.Sum(x, axes=[1], keep_dims=True)
    k = compile_kernel(b.build([b.Div(x, s), s]))
    assert k.schedule.kind == KernelKind.ROW
    assert re.search(r"^ +rc\d+ = K\d+ / v\d+$", k.source, re.M)
    assert re.search(r"= x0 \* rc\d+ if ok\d+ else x0 / v\d+$", k.source, re.M)
    xs = np.abs(RNG.standard_normal((9, 40))).astype(np.float32) + 0.1
    xs[1] = 0.0
    xs[2] = 1e-41                                       # subnormal sum
    xs[3] = 3e36                                        # sum 1.2e38 > 2^126
    xs[4, 5], xs[5, 7], xs[6, 0] = np.inf, np.nan, -np.inf
    xs[7] = np.linspace(-1, 1, 40, dtype=np.float32)    # sum ~0, both signs
    y, sums = k(xs)
    with np.errstate(all="ignore"):
        ref = xs / sums
    plain = [1, 2, 3, 4, 5, 6]
    np.testing.assert_array_equal(y[plain], ref[plain])
    fast = [0, 7, 8]
    np.testing.assert_array_max_ulp(y[fast], ref[fast], maxulp=2)


def test_short_static_rows_compile_with_their_length():
    """Row kernels over static rows of at most STATIC_ROW_MAX elements are compiled
    concrete (known trip counts), so softmax at 128 and 100 are two code objects."""
    from stitching.codegen.lower.specialize import STATIC_ROW_MAX
    k128 = compile_kernel(softmax_spec((-1, 128)))
    k100 = compile_kernel(softmax_spec((-1, 100)))
    assert k128.body_address != k100.body_address and k128.generic is None
    assert "D1 = 128" in k128.source
    long_a = compile_kernel(softmax_spec((-1, STATIC_ROW_MAX + 16)))
    long_b = compile_kernel(softmax_spec((-1, STATIC_ROW_MAX + 32)))
    assert long_a.body_address == long_b.body_address
    for k, n in ((k128, 128), (k100, 100)):
        x = RNG.standard_normal((7, n)).astype(np.float32)
        assert_matches(k(x)[0], softmax_ref(x), "float32", f"softmax {n}", 4e-6)


def test_per_channel_parameter_math_is_hoisted_out_of_the_element_loop():
    """Inference batch norm + swish: rsqrt(var + eps) * gamma and beta - mean * scale
    vary along the channel only; they are computed once per call into a per-column
    scratch, and the kernel still matches float64 (NaN in a parameter included)."""
    b = SpecBuilder()
    x = b.input("float32", (-1, 7, 16))
    g, be, mu, var = (b.input("float32", (16,)) for _ in range(4))
    scale = b.Mul(g, b.Rsqrt(b.Add(var, b.const(1e-3, "float32"))))
    y = b.Add(b.Mul(x, scale), b.Sub(be, b.Mul(mu, scale)))
    k = compile_kernel(b.build([b.Mul(y, b.Sigmoid(y))]))
    hoist, front = k.schedule.hoisted()
    assert len(front) == 2 and "per column" in k.schedule.describe()
    assert "hz" in k.source
    rng = np.random.default_rng(2)
    X = rng.standard_normal((5, 7, 16)).astype(np.float32)
    G, B, M = (rng.standard_normal(16).astype(np.float32) for _ in range(3))
    V = rng.random(16).astype(np.float32)
    V[3] = np.nan
    s64 = f64(G) / np.sqrt(f64(V) + np.float32(1e-3))
    y64 = f64(X) * s64 + (f64(B) - f64(M) * s64)
    ref = y64 / (1 + np.exp(-y64))
    out = k(X, G, B, M, V)[0]
    assert np.isnan(out[..., 3]).all() and not np.isnan(np.delete(out, 3, -1)).any()
    assert_matches(out, ref, "float32", "hoisted BN + swish", 2e-6, 1e-6)


def _image_normalization_spec(channels, rows_per_task=None, hw=(5, 7)):
    """Keras' Rescaling + Normalization of an image: (x / 255 - mean) * rsqrt(var + eps)
    over [N, H, W, C] with per-channel mean and variance (a [rows, C] domain)."""
    b = SpecBuilder()
    x = b.input("float32", (-1, *hw, channels))
    mean, var = (b.input("float32", (channels,)) for _ in range(2))
    scale = b.Rsqrt(b.Add(var, b.const(1e-3, "float32")))
    y = b.Mul(b.Sub(b.Mul(x, b.const(1 / 255, "float32")), mean), scale)
    sched = {} if rows_per_task is None else {"rows_per_task": rows_per_task}
    return b.build([y], **sched)


def _normalization_ref(X, M, V):
    return (f64(X) * f64(np.float32(1 / 255)) - f64(M)) / np.sqrt(f64(V) + f64(np.float32(1e-3)))


@pytest.mark.parametrize("channels, rows_per_task", [(3, None), (3, 3), (3, 100), (5, None),
                                                     (15, 7)])
def test_short_rows_run_as_one_flat_loop(channels, rows_per_task):
    """Element-wise rows shorter than SHORT_ROW (an image's 3 channels, any row under a
    vector) run as one flat loop over blocks of whole vectors, the per-channel values
    tiled (the hoisted rsqrt(var + eps) and the mean input alike): equal to float64 at
    batch sizes whose elements do not fill a block, with NaN in one channel's parameter
    reaching that channel only, and through an output that is its input (the op's
    in-place forwarding)."""
    from stitching.codegen.cpu.emitter import SHORT_BLOCK
    k = compile_kernel(_image_normalization_spec(channels, rows_per_task))
    assert f"D1 = {channels}" in k.source and "t = j - b" in k.source
    assert "tp_i1" in k.source and "hp" in k.source
    rng = np.random.default_rng(5)
    M = rng.random(channels).astype(np.float32)
    V = (rng.random(channels).astype(np.float32) * 0.2) ** 2
    for n in (1, 2, 9):
        X = (rng.random((n, 5, 7, channels)) * 255).astype(np.float32)
        assert X.size % SHORT_BLOCK
        assert_matches(k(X, M, V)[0], _normalization_ref(X, M, V), "float32",
                       f"normalization batch {n}", 2e-6, 1e-6)
    Vn = V.copy()
    Vn[1] = np.nan
    X = (rng.random((2, 5, 7, channels)) * 255).astype(np.float32)
    X[1, 4, 6, 2] = np.inf
    out = k(X, M, Vn)[0]
    assert np.isnan(out[..., 1]).all() and not np.isnan(np.delete(out, 1, -1)).any()
    assert out[1, 4, 6, 2] == np.inf
    # in place: the output buffer is input 0's
    rc, dims, _, units, *_ = k.shapes([X.shape, M.shape, V.shape])
    assert rc == 0
    Y = X.copy()
    ip = (ctypes.c_void_p * 3)(Y.ctypes.data, M.ctypes.data, V.ctypes.data)
    op = (ctypes.c_void_p * 2)(Y.ctypes.data, None)
    k._body(0, units, ip, op, dims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
    assert_matches(Y, _normalization_ref(X, M, V), "float32", "in place", 2e-6, 1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_short_rows_tile_values_of_every_float_dtype(dtype):
    """The flat loop's tiles hold an input's own storage (16-bit floats as their bits)
    and the hoisted values' compute dtype: a per-channel offset and scale of 3
    channels equal float64 rounded to the dtype."""
    if dtype == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes not installed")
    b = SpecBuilder()
    x = b.input(dtype, (-1, 4, 3))
    mean, var = (b.input(dtype, (3,)) for _ in range(2))
    y = b.Mul(b.Sub(x, mean), b.Rsqrt(b.Add(var, b.const(1e-3, dtype))))
    k = compile_kernel(b.build([y]))
    assert "t = j - b" in k.source
    X = data(dtype, (5, 4, 3), special=False)
    M = data(dtype, (3,), special=False)
    V = np.abs(data(dtype, (3,), special=False)).astype(npdtype(dtype))
    ref = (f64(X) - f64(M)) / np.sqrt(f64(V) + f64(np.asarray(1e-3, npdtype(dtype))))
    tol = {"float16": (4e-3, 1e-3), "bfloat16": (3e-2, 1e-2), "float64": (1e-13, 1e-13)}
    assert_matches(k(X, M, V)[0], ref, dtype, f"short rows {dtype}", *tol[dtype])


def test_short_rows_share_code_per_row_length():
    """A short-row kernel's code keeps its row length and nothing else: two image sizes
    at 3 channels share one compiled body, 3 and 5 channels do not, and SHORT_ROW
    channels (a vector: not short) keep the shape-generic loop per row, shared with 128."""
    from stitching.codegen.lower.specialize import SHORT_ROW
    a = compile_kernel(_image_normalization_spec(3, hw=(5, 7)))
    b = compile_kernel(_image_normalization_spec(3, hw=(9, 4)))
    c = compile_kernel(_image_normalization_spec(5))
    assert a.body_address == b.body_address != c.body_address
    wide = compile_kernel(_image_normalization_spec(SHORT_ROW))
    assert "t = j - b" not in wide.source and "D1 = dims[1]" in wide.source
    assert wide.body_address == compile_kernel(_image_normalization_spec(128)).body_address
    rng = np.random.default_rng(6)
    X = (rng.random((2, 5, 7, SHORT_ROW)) * 255).astype(np.float32)
    M = rng.random(SHORT_ROW).astype(np.float32)
    V = rng.random(SHORT_ROW).astype(np.float32) + 0.1
    assert_matches(wide(X, M, V)[0], _normalization_ref(X, M, V), "float32",
                   f"{SHORT_ROW} channels", 2e-6, 1e-6)


def test_node_pinned_to_a_size_keeps_the_spec_concrete():
    from stitching.codegen.lower.specialize import compile_target, generic_twin
    b = SpecBuilder()
    x = b.input("float32", (-1, 5))
    pinned = b.build([b.Neg(x, out_shape=(7, 5))])
    assert generic_twin(pinned) is None and compile_target(pinned) is pinned
    b = SpecBuilder()
    x = b.input("float32", (-1, 5))
    ones = b.build([b.Neg(x, out_shape=(1, 5))])
    assert [n.type.shape for n in generic_twin(ones).nodes] == [(1, -1)]


def test_workers_past_their_budget_are_killed_and_work_is_done_here(tmp_path, monkeypatch):
    from stitching.compile import parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(parallel, "WORKER_SECONDS_PER_KERNEL", 0.001)
    specs = [softmax_spec((-1, 17), scale=0.979), softmax_spec((-1, 17), log=True, scale=0.979),
             layernorm_spec(17, scale=0.979)]
    ks = compile_kernels(specs, jobs=2)              # workers killed; compiled here
    x = np.random.default_rng(3).standard_normal((4, 17)).astype(np.float32)
    assert_matches(ks[0](x)[0], softmax_ref(x) * 0.979, "float32",
                   "softmax after killed workers", 4e-6)


def test_worker_compiles_kernels_with_a_lean_numba(tmp_path):
    """A compile worker hides SciPy from Numba (whose import probes SciPy's BLAS) and
    turns Numba's error highlighting off, and still compiles a kernel with
    transcendental helpers into the cache.  (Without SciPy installed the SciPy half
    cannot fail.)"""
    code = textwrap.dedent("""
        import sys
        from stitching.compile import worker
        worker._lean_numba()
        import numba.core.errors
        assert type(numba.core.errors.termcolor()).__name__ == "NOPColorScheme"
        from stitching.compile import compile_kernel
        from stitching.ir.builder import SpecBuilder
        import numpy as np
        b = SpecBuilder()
        x = b.input("float32", (-1, 16))
        k = compile_kernel(b.build([b.Erfc(b.Exp(x))]))
        y = k(np.zeros((2, 16), np.float32))[0]
        assert abs(float(y[0, 0]) - 0.15729921) < 1e-6, y[0, 0]
        assert "scipy.linalg" not in sys.modules
        print("ok")
    """)
    env = dict(os.environ, STITCHING_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_worker_answers_every_spec_then_exits_cleanly(tmp_path, monkeypatch):
    """A worker leaves with os._exit (no interpreter teardown): every answer written
    before stdin closed still reaches the parent, a bad spec is answered with its
    error, and the exit status is 0."""
    from stitching.compile import is_cached, parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    spec = softmax_spec((-1, 21), scale=0.971)
    p = parallel._spawn()
    out, _ = p.communicate(json.dumps(spec.to_json()) + "\n" + json.dumps({"op": "x"}) + "\n",
                           timeout=300)
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert p.returncode == 0
    assert [a["ok"] for a in answers] == [True, False]
    assert answers[0]["hash"] == spec.hash and is_cached(spec)
    assert "expected a JSON string" in answers[1]["error"]


def test_prestarted_workers_compile_what_is_missing_and_are_closed(tmp_path, monkeypatch):
    """Workers started before the specs exist (parallel.prestart) take the uncached
    specs, however few; handed a batch with nothing to compile, they are closed."""
    from stitching.compile import is_cached, parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    specs = [softmax_spec((-1, 19), scale=0.983), layernorm_spec(19, scale=0.983)]
    w = parallel.prestart(2)
    procs = list(w.procs)
    assert parallel.warm_cache(specs, workers=w) == 2 and all(is_cached(s) for s in specs)
    assert all(p.wait(timeout=60) == 0 for p in procs) and not w.procs
    w = parallel.prestart(2)
    procs = list(w.procs)
    assert parallel.warm_cache(specs, workers=w) == 0        # all cached: closed unused
    assert all(p.wait(timeout=60) == 0 for p in procs)
    # both pipes closed: an open one was a ResourceWarning at the user's exit
    assert all(p.stdin.closed and p.stdout.closed for p in procs)
    x = np.random.default_rng(4).standard_normal((3, 19)).astype(np.float32)
    k = compile_kernels(specs[:1])[0]
    assert k.cache_hits
    assert_matches(k(x)[0], softmax_ref(x) * 0.983, "float32", "prestarted softmax", 4e-6)


def test_compile_kernels_on_error_keeps_going(monkeypatch):
    from stitching.compile import kernel
    bad, good = softmax_spec((-1, 15)), layernorm_spec(15)
    real = kernel.compile_kernel

    def flaky(spec, tier=2):
        if spec.hash == bad.hash:
            raise RuntimeError("boom")
        return real(spec, tier)
    monkeypatch.setattr(kernel, "compile_kernel", flaky)
    errors = []
    ks = compile_kernels([bad, good], jobs=1, on_error=lambda s, e: errors.append((s.hash, e)))
    assert ks[0] is None and ks[1] is not None
    assert [h for h, _ in errors] == [bad.hash] and "boom" in str(errors[0][1])
    with pytest.raises(RuntimeError, match="boom"):
        compile_kernels([bad], jobs=1)


def test_disk_cache_hits_in_a_new_process(tmp_path):
    script = textwrap.dedent("""
        import json, sys, time
        t0 = time.perf_counter()
        import numpy as np
        from stitching.compile import compile_kernel
        from stitching.ir.builder import SpecBuilder
        b = SpecBuilder()
        x = b.input("float32", (-1, 48))
        m = b.Max(x, axes=[1], keep_dims=True)
        e = b.Exp(b.Sub(x, m))
        y = b.Div(e, b.Sum(e, axes=[1], keep_dims=True))
        t1 = time.perf_counter()
        k = compile_kernel(b.build([y]))
        t2 = time.perf_counter()
        out = k(np.zeros((2, 48), np.float32))[0]
        print(json.dumps({"hits": k.cache_hits, "compile": t2 - t1,
                          "ok": bool(np.allclose(out, 1 / 48)),
                          "numba": "numba" in sys.modules}))
    """)
    env = dict(os.environ, STITCHING_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["ok"] and warm["ok"]
    assert cold["hits"] == 0 and warm["hits"] == 1       # the body from disk
    assert cold["numba"] and not warm["numba"]           # loaded as shared objects
    for ext in ("py", "so", "ll"):
        assert list(tmp_path.glob(f"kernels/*/k_*.{ext}")), ext


def test_the_installed_shape_interpreter_serves_any_cache_dir(tmp_path):
    """The interpreter is an install-time product like the op library: built into
    the default cache, a process with another STITCHING_CACHE_DIR loads it from there
    (no Numba) instead of building its own."""
    script = ("import sys; from stitching.compile.kernel import interp_address; "
              "interp_address(); print('numba' in sys.modules)")
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    env.pop("STITCHING_CACHE_DIR", None)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for cache in (None, tmp_path / "elsewhere"):
        if cache is not None:
            env["STITCHING_CACHE_DIR"] = str(cache)
        p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300, cwd=repo)
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(p.stdout.split()[-1])
    assert runs == ["True", "False"]          # built (Numba), then loaded
    assert list(tmp_path.glob("home/.cache/stitching/kernels/*/interp.so"))
    assert not list(tmp_path.glob("elsewhere/kernels/*/interp.so"))


def test_installed_helpers_include_what_big_helpers_call(tmp_path):
    """The install step (helper_cache.prebuild) types the big helpers too, so a process
    with an empty STITCHING_CACHE_DIR compiling an Erfc kernel (exact GELU) loads
    erfc_f32's _erfc_pos from the installed cache instead of compiling it."""
    prebuild = "from stitching.compile import helper_cache, kernel\n" \
        "kernel.use_helper_cache()\nhelper_cache.prebuild()"
    script = textwrap.dedent("""
        import json
        from stitching.codegen.cpu import fastmath
        from stitching.compile import compile_kernel
        from stitching.ir.builder import SpecBuilder
        b = SpecBuilder()
        x = b.input("float32", (-1, 64))
        compile_kernel(b.build([b.Mul(x, b.Erfc(x))]))
        [d] = [d for d in fastmath.HELPERS if d.py_func.__name__ == "_erfc_pos"]
        print(json.dumps([sum(d._cache_hits.values()), sum(d._cache_misses.values())]))
    """)
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    env.pop("STITCHING_CACHE_DIR", None)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for code, cache in ((prebuild, None), (script, tmp_path / "empty")):
        if cache is not None:
            env["STITCHING_CACHE_DIR"] = str(cache)
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=300, cwd=repo)
        assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [1, 0]     # loaded, not compiled


# One kernel calling exp, tanh and erf, compiled in a fresh process: its assembly's
# hash, whether it vectorized, each helper's (disk cache hits, misses), the helper dir.
_HELPERS_SCRIPT = textwrap.dedent("""
    import hashlib, json, re
    from stitching.codegen.cpu import fastmath
    from stitching.compile import compile_kernel, helper_cache
    from stitching.ir.builder import SpecBuilder
    b = SpecBuilder()
    x = b.input("float32", (-1, 64))
    k = compile_kernel(b.build([b.Add(b.Mul(b.Exp(x), b.Tanh(x)), b.Erf(x))]))
    asm = re.sub(r"B\\d+v\\d+B", "B_v_B", k._code.assembly())
    used = {d.py_func.__name__: (sum(d._cache_hits.values()),
                                 sum(d._cache_misses.values()))
            for d in fastmath.HELPERS if d.py_func.__name__ in
            ("exp_f32", "tanh_f32", "erf_f32")}
    print(json.dumps({"asm": hashlib.sha256(asm.encode()).hexdigest(),
                      "vector": "zmm" in asm or "ymm" in asm, "used": used,
                      "dir": str(helper_cache.enabled_dir())}))
""")


def _helpers_run(tmp_path, cache=None):
    """_HELPERS_SCRIPT in a fresh process whose HOME is under ``tmp_path`` (its
    default cache the installed one), with ``cache`` as STITCHING_CACHE_DIR; the
    kernel itself is compiled each time."""
    env = dict(os.environ, HOME=str(tmp_path / "home"))
    env.pop("STITCHING_CACHE_DIR", None)
    if cache is not None:
        env["STITCHING_CACHE_DIR"] = str(cache)
    for so in tmp_path.glob("home/.cache/stitching/kernels/*/k_*.so"):
        so.unlink()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", _HELPERS_SCRIPT], env=env,
                       capture_output=True, text=True, timeout=300, cwd=repo)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_math_helpers_load_from_their_disk_cache_into_the_same_machine_code(tmp_path):
    """helper_cache.py: a process compiles exp/tanh/erf once and saves them; the next
    one loads them and inlines them into the very same kernel assembly; a process
    with another STITCHING_CACHE_DIR reads the default (installed) cache without
    writing to it."""
    first, again, elsewhere = (_helpers_run(tmp_path), _helpers_run(tmp_path),
                               _helpers_run(tmp_path, tmp_path / "elsewhere"))
    installed = str(next(tmp_path.glob("home/.cache/stitching/kernels/*/helpers")))
    assert first["dir"] == again["dir"] == elsewhere["dir"] == installed
    assert all(hits == 0 and misses == 1 for hits, misses in first["used"].values())
    for run in (again, elsewhere):
        assert all(hits == 1 and misses == 0 for hits, misses in run["used"].values())
        assert run["asm"] == first["asm"]
    assert first["vector"]
    assert not list(tmp_path.glob("elsewhere/kernels/*/helpers"))
    for f in tmp_path.glob("home/.cache/stitching/kernels/*/helpers/*.nbc"):
        f.write_bytes(f.read_bytes()[:40])      # truncated: a miss, compiled again
    broken = _helpers_run(tmp_path)
    assert broken["asm"] == first["asm"]
    assert all(misses == 1 for hits, misses in broken["used"].values())


def test_one_helpers_code_under_anothers_name_is_a_miss_not_a_wrong_kernel(tmp_path):
    """Numba trusts its cache files' names: exp_f32's compiled code copied over
    tanh_f32's (and back) loaded as tanh, and the kernel built on it computed the
    wrong function.  Each data file is sealed to its helper: both are compiled again,
    into the first run's very kernel."""
    first = _helpers_run(tmp_path)
    (helpers,) = tmp_path.glob("home/.cache/stitching/kernels/*/helpers")
    (exp,) = helpers.glob("fastmath.exp_f32-*.nbc")
    (tanh,) = helpers.glob("fastmath.tanh_f32-*.nbc")
    a, b = exp.read_bytes(), tanh.read_bytes()
    exp.write_bytes(b)
    tanh.write_bytes(a)
    swapped = _helpers_run(tmp_path)
    assert swapped["used"]["exp_f32"][1] == swapped["used"]["tanh_f32"][1] == 1
    assert swapped["used"]["erf_f32"] == [1, 0]
    assert swapped["asm"] == first["asm"]


def test_native_build_refuses_code_that_needs_numbas_runtime(tmp_path):
    """A function that can raise needs Numba's exception machinery at run time: the
    build names it instead of writing a shared object that would not load.  (Through
    Numba's default pipeline: the lean one generated kernels take has no pass for
    ``raise``, which they never contain, and refuses it as a typing error.)"""
    from numba import types
    from stitching.compile import native
    sig = types.int64(types.int64)

    def check(n):
        if n < 0:
            raise ValueError("negative")
        return n

    with pytest.raises(native.NativeError, match="Numba's runtime.*numba_"):
        native.build(check, sig, {"error_model": "numpy"}, tmp_path / "check", "check",
                     lean=False)
    assert not native.built(tmp_path / "check")
    with pytest.raises(native.NativeError, match="compiling check ahead of time failed"):
        native.build(check, sig, {"error_model": "numpy"}, tmp_path / "check", "check")

    def twice(n):
        return 2 * n

    native.build(twice, sig, {"error_model": "numpy"}, tmp_path / "twice", "twice")
    f = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(native.load(tmp_path / "twice",
                                                                     "twice"))
    assert f(21) == 42
    with pytest.raises(native.NativeError, match="no symbol nope"):
        native.load(tmp_path / "twice", "nope")
    with pytest.raises(native.NativeError, match="compiling bad ahead of time failed"):
        native.build(lambda n: n.nope, sig, {}, tmp_path / "bad", "bad")


def _representative_kernels():
    """(body, cfunc signature, options) of every kind of kernel -- pipelined row
    passes, staged non-temporal outputs, split and column schedules, casts to
    bfloat16/int32/bool, GELU's erf and a tanh -- for machine-code comparisons."""
    from stitching.compile import kernel

    b = SpecBuilder()
    x = b.input("float32", (-1, -1))
    centre = b.build([b.Sub(x, b.Mean(x, axes=[0], keep_dims=True))])
    b = SpecBuilder()
    x = b.input("float32", (-1, 1000))
    s = b.Mul(x, b.const(3.0))
    casts = b.build([b.Cast(s, to="bfloat16"), b.Greater(s, b.const(0.0)),
                     b.Cast(s, to="int32")])
    b = SpecBuilder()
    x = b.input("float32", (-1, 64))
    act = b.build([b.Mul(b.Erf(x), b.Tanh(x))])
    specs = [softmax_spec((-1, 700), rows_per_task=3), layernorm_spec(outs_stats=True),
             layernorm_spec().with_schedule(split_rows=1, col_block=333, rows_per_task=1),
             centre, casts, act]
    funcs = []
    for spec in specs:
        text = compile_kernel(spec).source
        m = kernel._load_module(text, kernel.code_name(text))
        funcs.append((m.body, m.h.BODY_SIG, m.h.BODY_OPTIONS))
    return funcs


def _assembly(f, sig, options, pipeline=None):
    from numba.core.compiler_lock import global_compiler_lock

    from stitching.compile import native
    lib, _ = native._compile(f, sig, options, pipeline)
    with global_compiler_lock:
        return re.sub(r"B\d+v\d+B", "B_v_B", lib.get_asm_str())


def test_lean_numba_pipeline_gives_the_default_pipelines_machine_code(stream_everything):
    """native.py compiles generated code through a shortened Numba pipeline (no
    closure inlining, rewrites, SSA...): for every kind of kernel the assembly is the
    very same as Numba's default pipeline gives (up to the per-compile counter in the
    mangled names)."""
    from numba.core.compiler import Compiler

    for f, sig, options in _representative_kernels():
        lean = _assembly(f, sig, options)
        assert len(lean) > 2000
        assert lean == _assembly(f, sig, options, Compiler), f.__module__


def test_memoized_scalar_typing_gives_the_same_machine_code(stream_everything,
                                                           monkeypatch):
    """native._compile memoizes the typing of builtin operators on scalars: every kind
    of kernel compiles to the very same assembly as with Numba typing each use."""
    import contextlib

    from stitching.compile import native

    funcs = _representative_kernels()
    with monkeypatch.context() as m:
        m.setattr(native, "_memo_scalar_typing", contextlib.nullcontext)
        plain = [_assembly(*f) for f in funcs]
    assert native._SCALAR_OPS, "the memo was used"
    for f, want in zip(funcs, plain):
        assert _assembly(*f) == want, f[0].__module__


def test_without_a_linker_kernels_run_from_numbas_code_with_a_warning(tmp_path,
                                                                       monkeypatch):
    from stitching.compile import kernel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(kernel, "_TOOLCHAIN", None)
    monkeypatch.setattr(kernel, "_warned", set())
    with pytest.warns(RuntimeWarning, match="linking stitching_body failed.*nonexistent"):
        k = compile_kernel(softmax_spec((-1, 23), scale=0.77))
    assert not k.cache_hits and not list(tmp_path.glob("kernels/*/k_*.so"))
    x = RNG.standard_normal((4, 23)).astype(np.float32)
    assert_matches(k(x)[0], softmax_ref(f64(x)) * 0.77, "float32", "no linker", 4e-6)


def test_kernels_link_with_the_linker_the_compiler_driver_names(tmp_path, monkeypatch):
    """native.link_command: the driver's own linker called directly; the driver itself
    where CXX carries flags of its own (they may choose the linker)."""
    import shutil

    from stitching.compile import native
    if shutil.which("g++") is None:
        pytest.skip("no g++ here")
    out, obj = tmp_path / "k.so", tmp_path / "k.o"
    monkeypatch.setenv("CXX", "g++")
    ld = subprocess.run(["g++", "-print-prog-name=ld"], capture_output=True,
                        text=True).stdout.strip()
    assert native.link_command(out, obj) == [shutil.which(ld), "-shared", "--eh-frame-hdr",
                                             "-o", str(out), str(obj)]
    monkeypatch.setenv("CXX", "g++ -fuse-ld=gold")
    assert native.link_command(out, obj) == ["g++", "-fuse-ld=gold", "-shared", "-nostdlib",
                                             "-o", str(out), str(obj)]


def test_row_kernel_with_two_outer_axes_and_broadcasts():
    """x[A,B,L] * s[A,1,L] keeps A and B apart (s does not carry B): each row's
    index is split into (a, b) and s is read at (a, j)."""
    b = SpecBuilder()
    x = b.input("float32", (-1, -1, 40))
    s = b.input("float32", (-1, 1, 40))
    t = b.input("float32", (-1, 1))             # per-b column, broadcast over A and L
    h = b.Add(b.Mul(x, s), t)
    m = b.Max(h, axes=[2], keep_dims=True)
    e = b.Exp(b.Sub(h, m))
    y = b.Div(e, b.Sum(e, axes=[2], keep_dims=True))
    k = build(b, [y, m])
    assert k.schedule.kind == KernelKind.ROW and k.schedule.rank == 3
    X = RNG.standard_normal((3, 5, 40)).astype(np.float32)
    S = RNG.standard_normal((3, 1, 40)).astype(np.float32)
    T = RNG.standard_normal((5, 1)).astype(np.float32)
    h64 = f64(X * S + T)                        # float32 ops, each rounded (as TF)
    yo, mo = k(X, S, T)
    assert_matches(yo, softmax_ref(h64), "float32", "row 2 outer axes", 4e-6, 1e-7)
    assert_matches(mo, h64.max(2, keepdims=True), "float32", "row max", 2e-7)
    b = SpecBuilder()
    x = b.input("float32", (2, 3, 4, 5))
    y = b.input("float32", (2, 1, 4, 1))
    z = b.input("float32", (3, 1, 5))
    k = build(b, [b.Sub(b.Mul(x, y), z)])
    assert k.schedule.kind == KernelKind.ELEMENTWISE and k.schedule.rank == 4
    X, Y, Z = (RNG.standard_normal(s).astype(np.float32) for s in
               [(2, 3, 4, 5), (2, 1, 4, 1), (3, 1, 5)])
    # the product rounded to float32 first, as TF computes it: x*y - z cancels, so the
    # exact float64 value can sit many float32 ulps of the result away from TF's
    assert_matches(k(X, Y, Z)[0], f64(X * Y) - f64(Z), "float32", "4-d broadcast")


@pytest.mark.parametrize("op", ["Exp", "Expm1", "Log", "Log1p", "Tanh", "Sigmoid", "Erf",
                                "Erfc", "Elu", "Selu", "Softplus"])
def test_transcendental_kernels_vectorize(op):
    """Regression: helpers too big for LLVM's inliner (Erfc, Softplus) stayed calls
    and the loop ran scalar (22 cycles/element instead of 3.8)."""
    b = SpecBuilder()
    x = b.input("float32", (-1,))
    k = build(b, [b.Mul(b.op(op, x), b.const(0.4099))])   # a fresh compile
    ir = k.inspect_llvm()
    if ir is None:
        pytest.skip("kernel came from a pre-existing disk cache")
    assert WIDE.search(ir)


# ---- non-temporal stores of large outputs ----------------------------------------------------

@pytest.fixture
def stream_everything(monkeypatch):
    """Kernels built with a 1-byte streaming threshold (every vector output streamed),
    in a fresh in-memory kernel table (the threshold is part of the generated text)."""
    from stitching.compile import kernel
    monkeypatch.setattr(kernel, "_kernels", {})
    monkeypatch.setenv("STITCHING_STREAM_MIN_MIB", "1e-6")


def test_streamed_short_rows_stage_each_block(stream_everything):
    """The flat loop of short rows (_short_rows) stages a streamed output per block and
    copies it out: the same results as float64 with the image's 3 channels, for a batch
    that fills blocks and one that ends inside a block."""
    k = compile_kernel(_image_normalization_spec(3))
    assert "t = j - b" in k.source and "h.stream(p_o0, 0 + b, sb_o0, 0, e - b)" in k.source
    rng = np.random.default_rng(8)
    M = rng.random(3).astype(np.float32)
    V = (rng.random(3).astype(np.float32) * 0.2) ** 2
    for n in (96, 7):
        X = (rng.random((n, 5, 7, 3)) * 255).astype(np.float32)
        assert_matches(k(X, M, V)[0], _normalization_ref(X, M, V), "float32",
                       f"streamed normalization batch {n}", 2e-6, 1e-6)


def test_streamed_outputs_match_float64_in_every_kernel_kind(stream_everything):
    """Row (whole and split), element-wise (flat and broadcast, outputs of four dtypes)
    and column (whole and split) kernels staging their outputs and copying them out
    with non-temporal stores: the same results as float64, for rows shorter than a
    64-byte line, ragged against the staging chunk and spanning several chunks."""
    ln = compile_kernel(layernorm_spec(-1, "float64", outs_stats=True))
    split = compile_kernel(layernorm_spec(-1, outs_stats=True).with_schedule(
        split_rows=1, col_block=333, rows_per_task=1))
    for k in (ln, split):
        assert "h.stream(p_o0" in k.source and "h.store_fence()" in k.source
        assert "h.stream(p_o1" not in k.source       # row statistics are not streamed
    for n, d in [(3, 1000), (5, 37), (2, 5000), (4, 3)]:
        X = RNG.standard_normal((n, d)) * 4 + 1
        G, B = RNG.standard_normal(d), RNG.standard_normal(d)
        ry, rm, rv = layernorm_ref(X, G, B)
        y, m, v = ln(X, G, B)
        assert_matches(y, ry, "float64", f"streamed LN {n}x{d}", 1e-12, 1e-13)
        X32, G32, B32 = (a.astype(np.float32) for a in (X, G, B))
        ry, _, _ = layernorm_ref(X32, G32, B32)
        assert_matches(split(X32, G32, B32)[0], ry, "float32", f"split LN {n}x{d}", 5e-6, 3e-6)

    b = SpecBuilder()
    x = b.input("float32", (-1, -1, 1000))
    y = b.input("float16", (-1, 1, 1000))
    s = b.Add(x, b.Cast(y, to="float32"))
    bc = build(b, [s, b.Cast(s, to="bfloat16"), b.Greater(s, b.const(0.0)),
                   b.Cast(b.Mul(s, b.const(8.0)), to="int32")])
    X = data("float32", (3, 5, 1000))
    Y = RNG.standard_normal((3, 1, 1000)).astype(np.float16)
    r = f64(X) + f64(Y)
    o = bc(X, Y)
    assert bc.source.count("h.stream(") == 4
    assert_matches(o[0], r, "float32", "streamed add")
    assert_matches(o[1], r, "bfloat16", "streamed bf16")
    assert_matches(o[2], r > 0, "bool", "streamed greater")
    with np.errstate(invalid="ignore"):
        want = np.trunc(r.astype(np.float32) * 8)
    fin = np.isfinite(want)
    assert np.array_equal(o[3][fin], want[fin].astype(np.int32)), "streamed int32"

    b = SpecBuilder()
    x = b.input("float64", (-1,))
    flat = build(b, [b.Add(b.Mul(x, b.const(3.0, "float64")), b.const(1.0, "float64"))])
    X = data("float64", (40000,))
    assert "h.stream(" in flat.source
    assert_matches(flat(X)[0], f64(X) * 3 + 1, "float64", "streamed flat")

    b = SpecBuilder()
    x = b.input("float32", (-1, -1))
    centre = build(b, [b.Sub(x, b.Mean(x, axes=[0], keep_dims=True))])
    assert centre.schedule.kind == KernelKind.COLUMN and "h.stream(" in centre.source
    for shape in [(2000, 300), (7, 5), (1031, 2100)]:
        X = RNG.standard_normal(shape).astype(np.float32) * 2 + 3
        X[3, 1] = np.nan
        rc, _, _, units, _, phases, _ = centre.shapes([shape])
        x64 = f64(X)
        assert_matches(centre(X)[0], x64 - x64.mean(0, keepdims=True), "float32",
                       f"streamed centring {shape} ({phases} phases)", 5e-6, 3e-6)


def test_only_memory_bound_kernels_stream_and_the_threshold_is_a_setting(monkeypatch):
    """An element loop computing a transcendental keeps ordinary stores (staging costs
    it more than it saves); a kernel whose outputs are statically below the threshold
    has no staging code; 0 turns streaming off; a bad value is refused by name."""
    from stitching.codegen.cpu import emitter as cpu
    from stitching.compile import kernel
    from stitching.schedule import build_schedule
    monkeypatch.setattr(kernel, "_kernels", {})
    monkeypatch.setenv("STITCHING_STREAM_MIN_MIB", "1e-6")
    text = cpu.emit(build_schedule(softmax_spec((-1, 1000)))).text
    assert "h.stream(" not in text
    monkeypatch.delenv("STITCHING_STREAM_MIN_MIB")
    assert cpu._stream_min_bytes() == 16 << 20
    assert "ns_o0 = D0 * D1 >= 4194304" in cpu.emit(build_schedule(layernorm_spec(-1))).text
    b = SpecBuilder()
    x = b.input("float32", (2048, 2047))             # just under 16 MiB
    below = b.build([b.Mul(x, b.const(2.0))])
    assert "h.stream(" not in cpu.emit(build_schedule(below)).text
    monkeypatch.setenv("STITCHING_STREAM_MIN_MIB", "0")
    assert "h.stream(" not in cpu.emit(build_schedule(layernorm_spec(-1))).text
    monkeypatch.setenv("STITCHING_STREAM_MIN_MIB", "lots")
    with pytest.raises(ValueError, match="STITCHING_STREAM_MIN_MIB"):
        cpu.emit(build_schedule(layernorm_spec(-1)))
