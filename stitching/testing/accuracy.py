"""Accuracy of stitched kernels against stock TF, both measured against float64.

For every op in the op table (ir/ops.py) and common composites, over input ranges
that matter, one row: max and mean error in ulps of the result's dtype for
``stitching.function`` and for stock ``tf.function``, both against a float64 run of
the same TF graph (TF's float64 kernels: the oracle the issue asks for), plus
whether NaN and Inf come out where TF's do.

Error of one element (``ulps``):  the float64 reference is rounded to the result's
dtype; an output equal to that rounding, or NaN where the reference is NaN, is 0;
otherwise |got - ref| divided by the spacing of the result dtype at |rounded ref|
(at least the smallest subnormal's).  A finite output where the rounded reference
overflows, or the opposite, is infinitely wrong.  Booleans and integers count
mismatches instead (any mismatch is reported as an infinite error).

How it runs: each (range, group of ops) is one stitched function with one output
per op (``Options(min_ops=1)``: even a lone op becomes a kernel), so the whole table
costs a few compiles.  ``table(quick=True)`` is a subset small enough for the test
suite (tests/test_accuracy.py); tools/accuracy.py writes docs/internals/accuracy.md.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

import stitching

OPTS = stitching.Options(min_ops=1, background_compile=False)   # outputs of the first call
F32_MAX = float(np.finfo(np.float32).max)

# ---- input ranges: name -> (description, sampler(rng, n) -> float64 values) --------


def _logu(rng, n, lo, hi, signed=True):
    v = np.exp(rng.uniform(math.log(lo), math.log(hi), n))
    return v * rng.choice([-1.0, 1.0], n) if signed else v


SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, F32_MAX, -F32_MAX, 1e-45, -1e-45,
                     1.0, -1.0, 88.7, -88.7, 1e30, -1e30])

RANGES = {
    "tiny": ("1e-30 <= |x| <= 1e-3", lambda r, n: _logu(r, n, 1e-30, 1e-3)),
    "~1": ("0.1 <= |x| <= 10", lambda r, n: _logu(r, n, 0.1, 10.0)),
    "large": ("10 <= |x| <= 1e30", lambda r, n: _logu(r, n, 10.0, 1e30)),
    "near overflow": ("1e36 <= |x| <= FLT_MAX", lambda r, n: _logu(r, n, 1e36, F32_MAX)),
    "subnormal": ("1e-45 <= |x| < 1.2e-38", lambda r, n: _logu(r, n, 1.4e-45, 1.1e-38)),
    "nan/inf": ("NaN, +-Inf, +-0, +-FLT_MAX, +-1e-45 among ~1 values",
                lambda r, n: np.concatenate([SPECIALS, _logu(r, n - len(SPECIALS), 0.1, 10.0)])),
}
QUICK_RANGES = ("tiny", "~1", "large", "subnormal", "nan/inf")

# ---- ops: name -> fn over float32 tensors (x [, y]); grouped by arity ----------------

UNARY = {
    "Neg": tf.negative, "Abs": tf.abs, "Square": tf.square, "Sign": tf.sign,
    "Sqrt": tf.sqrt, "Rsqrt": tf.math.rsqrt, "Reciprocal": tf.math.reciprocal,
    "Floor": tf.floor, "Ceil": tf.math.ceil, "Round": tf.round, "Relu": tf.nn.relu,
    "Relu6": tf.nn.relu6, "Softsign": tf.nn.softsign, "Exp": tf.exp, "Expm1": tf.math.expm1,
    "Log": tf.math.log, "Log1p": tf.math.log1p, "Tanh": tf.tanh, "Sigmoid": tf.sigmoid,
    "Elu": tf.nn.elu, "Selu": tf.nn.selu, "Softplus": tf.nn.softplus, "Erf": tf.math.erf,
    "Erfc": tf.math.erfc, "Sin": tf.sin, "Cos": tf.cos,
    "LeakyRelu": lambda x: tf.nn.leaky_relu(x, 0.15), "Identity": tf.identity,
    "IsNan": tf.math.is_nan, "IsInf": tf.math.is_inf, "IsFinite": tf.math.is_finite,
    "LogicalNot": lambda x: tf.logical_not(x > 0.5),
    "Cast f32->f16": lambda x: tf.cast(x, tf.float16),
    "Cast f32->bf16": lambda x: tf.cast(x, tf.bfloat16),
    "Cast f32->f64": lambda x: tf.cast(x, tf.float64),
    "Cast f32->i32": lambda x: tf.cast(tf.clip_by_value(x, -2e9, 2e9), tf.int32),
    "Cast f32->bool": lambda x: tf.cast(x, tf.bool),
}
BINARY = {
    "Add": tf.add, "Sub": tf.subtract, "Mul": tf.multiply, "Maximum": tf.maximum,
    "Minimum": tf.minimum, "SquaredDifference": tf.math.squared_difference,
    "Div": tf.math.truediv, "DivNoNan": tf.math.divide_no_nan, "Pow": tf.pow,
    "FloorDiv": tf.math.floordiv, "FloorMod": tf.math.floormod,
    "Equal": tf.equal, "NotEqual": tf.not_equal, "Less": tf.less,
    "LessEqual": tf.less_equal, "Greater": tf.greater, "GreaterEqual": tf.greater_equal,
    "LogicalAnd": lambda x, y: tf.logical_and(x > 0, y > 0),
    "LogicalOr": lambda x, y: tf.logical_or(x > 0, y > 0),
    "Select": lambda x, y: tf.where(x > y, x, y),
    "ClipByValue": lambda x, y: tf.clip_by_value(x, -tf.abs(y), tf.abs(y)),
}


def _layernorm(x):
    m = tf.reduce_mean(x, -1, keepdims=True)
    v = tf.reduce_mean(tf.square(x - m), -1, keepdims=True)
    return (x - m) * tf.math.rsqrt(v + 1e-5)


def _batch_norm(x):
    """Inference FusedBatchNorm; TF has no float64 kernel, so the float64 run (the
    oracle) computes its formula, (x - mean) * rsqrt(var + eps) * scale + offset."""
    c = [tf.constant(v, x.dtype, [ROW]) for v in (1.5, 0.25, 0.5, 2.0)]
    if x.dtype == tf.float64:
        return (x - c[2]) * tf.math.rsqrt(c[3] + 1e-3) * c[0] + c[1]
    y = tf.compat.v1.nn.fused_batch_norm(tf.reshape(x, [-1, 1, 1, ROW]), c[0], c[1],
                                         mean=c[2], variance=c[3], epsilon=1e-3,
                                         is_training=False)[0]
    return tf.reshape(y, [-1, ROW])


def _batch_norm_training(x):
    """Training-mode FusedBatchNorm (statistics of each of the ROW channels over the
    rows); the float64 run computes TF's CPU formula, (x - mean) * (rsqrt(var + eps) *
    scale) + offset with the batch's mean and (biased) variance."""
    c = [tf.constant(v, x.dtype, [ROW]) for v in (1.5, 0.25)]
    if x.dtype == tf.float64:
        mean = tf.reduce_mean(x, 0)
        var = tf.reduce_mean(tf.square(x - mean), 0)
        return (x - mean) * (tf.math.rsqrt(var + 1e-3) * c[0]) + c[1]
    y = tf.compat.v1.nn.fused_batch_norm(tf.reshape(x, [-1, 1, 1, ROW]), c[0], c[1],
                                         epsilon=1e-3, is_training=True)[0]
    return tf.reshape(y, [-1, ROW])


# Row ops over x reshaped to [rows, ROW]: reductions and composites (last axis).
ROW = 64
ROWWISE = {
    "Sum (rows)": lambda x: tf.reduce_sum(x, -1), "Sum (columns)": lambda x: tf.reduce_sum(x, 0),
    "Mean (rows)": lambda x: tf.reduce_mean(x, -1),
    "Mean (columns)": lambda x: tf.reduce_mean(x, 0),
    "Prod (rows of 8)": lambda x: tf.reduce_prod(tf.reshape(x, [-1, 8]), -1),
    "Max (rows)": lambda x: tf.reduce_max(x, -1), "Min (columns)": lambda x: tf.reduce_min(x, 0),
    "All (rows)": lambda x: tf.reduce_all(x > 0, -1), "Any (rows)": lambda x: tf.reduce_any(x > 0, -1),
    "Softmax": tf.nn.softmax, "LogSoftmax": tf.nn.log_softmax,
    "logsumexp": lambda x: tf.reduce_logsumexp(x, -1),
    "layernorm": _layernorm,
    "BiasAdd": lambda x: tf.nn.bias_add(x, tf.range(ROW, dtype=x.dtype) * 0.1 - 3.0),
    "FusedBatchNorm": lambda x: _batch_norm(x),
    "FusedBatchNorm (training)": _batch_norm_training,
    "GELU exact": lambda x: tf.nn.gelu(x, approximate=False),
    "GELU tanh": lambda x: tf.nn.gelu(x, approximate=True),
    "swish": tf.nn.silu,
    "softplus (by hand)": lambda x: tf.math.log(1.0 + tf.exp(x)),
    "variance": lambda x: tf.math.reduce_variance(x, -1),
}
QUICK_ROWWISE = ("Sum (rows)", "Sum (columns)", "Mean (rows)", "Max (rows)", "Softmax",
                 "layernorm", "logsumexp", "GELU exact", "GELU tanh", "swish",
                 "softplus (by hand)", "variance")


# Where TF's float64 kernel is not an accurate oracle: its Elu and Selu compute
# exp(x) - 1, which loses every digit for |x| < 1e-17 even in float64.
_SELU = (1.0507009873554804934193349852946, 1.6732632423543772848170429916717)
ORACLE = {
    "Elu": lambda x: np.where(x < 0, np.expm1(np.minimum(x, 0)), x),
    "Selu": lambda x: _SELU[0] * np.where(x < 0, _SELU[1] * np.expm1(np.minimum(x, 0)), x),
}


@dataclass
class Row:
    op: str
    range: str
    st_max: float
    st_mean: float
    tf_max: float
    tf_mean: float
    nonfinite_like_tf: bool     # NaN/+-Inf where TF's are (or where the exact result is)
    ulp_bar: bool = True        # False: only NaN/Inf propagation is held (see table())
    st_scaled: float | None = None   # cancelling ops: max error in ulps of the operand
    tf_scaled: float | None = None   # scale (SCALED), where the bar is applied

    def within(self) -> bool:
        """The bar the test holds: max ulp within 2x TF's, or 4 ulp -- in ulps of the
        operand scale for the ops in SCALED."""
        if not self.ulp_bar:
            return True
        if self.st_scaled is not None:
            return self.st_scaled <= max(2.0 * self.tf_scaled, 4.0)
        return self.st_max <= max(2.0 * self.tf_max, 4.0)


# ---- error measure ------------------------------------------------------------------

_FMT = {"float32": (23, -126), "float16": (10, -14), "bfloat16": (7, -126),
        "float64": (52, -1022)}


def ulps(got, ref64, dtype: str) -> np.ndarray:
    """Per-element error of ``got`` (values of ``dtype``) against a float64 reference,
    in ulps of ``dtype`` (module docstring); 0/inf per element for bool and ints."""
    got = np.asarray(got)
    ref = np.asarray(ref64)
    if dtype not in _FMT:
        return np.where(got == ref.astype(got.dtype), 0.0, np.inf)
    mant, emin = _FMT[dtype]
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    rr = _round_to(r, dtype)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        e = np.floor(np.log2(np.abs(rr)))
        spacing = np.exp2(np.maximum(np.nan_to_num(e, nan=emin, neginf=emin), emin) - mant)
        err = np.abs(g - r) / spacing
    same = (g == rr) | (np.isnan(g) & np.isnan(r))
    err = np.where(same, 0.0, err)
    bad_inf = np.isinf(g) != np.isinf(rr)             # overflow where the true value does not
    return np.where(bad_inf & ~same, np.inf, np.nan_to_num(err, nan=np.inf))


def _round_to(r, dtype):
    if dtype == "float64":
        return r
    np_dt = {"float32": np.float32, "float16": np.float16,
             "bfloat16": tf.bfloat16.as_numpy_dtype}[dtype]
    with np.errstate(over="ignore", invalid="ignore"):
        return r.astype(np_dt).astype(np.float64)


def _dtype_name(t) -> str:
    return tf.as_dtype(t.dtype).name


# ---- running ------------------------------------------------------------------------

# Ops whose result can cancel far below their operands (a signed sum near 0, x - mean
# for x near the mean): there the error in ulps of the result measures the luck of
# one rounding of the mean (both TF's and ours are heavy-tailed: one element in 2^18
# sets the max), so the bar uses ulps of the operand scale: sum |x| for sums, mean
# |x| for means, the row's largest |result| for the normalizers.
SCALED = {
    "Sum (rows)": lambda x, ref: np.abs(x).sum(-1),
    "Sum (columns)": lambda x, ref: np.abs(x).sum(0),
    "Mean (rows)": lambda x, ref: np.abs(x).mean(-1),
    "Mean (columns)": lambda x, ref: np.abs(x).mean(0),
    "layernorm": lambda x, ref: _row_max(ref),
    "LogSoftmax": lambda x, ref: _row_max(ref),
    "FusedBatchNorm": lambda x, ref: _row_max(ref),
    "FusedBatchNorm (training)": lambda x, ref: _row_max(ref),
}


def _row_max(ref):
    """Each row's largest finite magnitude (NaN for a row with none)."""
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "All-NaN slice encountered", RuntimeWarning)
        return np.nanmax(np.where(np.isinf(ref), np.nan, np.abs(ref)), -1, keepdims=True)


def scaled_ulps(got, ref64, scale) -> np.ndarray:
    """|got - ref| in float32 ulps of max(|ref|, scale); NaN/Inf as ``ulps``."""
    base = ulps(got, ref64, "float32")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        big = np.maximum(np.abs(np.asarray(ref64, np.float64)), np.nan_to_num(scale))
        e = np.floor(np.log2(big))
        spacing = np.exp2(np.maximum(np.nan_to_num(e, nan=-126, neginf=-126), -126) - 23)
        err = np.abs(np.asarray(got, np.float64) - ref64) / spacing
    return np.where(np.isfinite(base) & (base > 0), err, base)


def _run_group(fns: dict, args64: list) -> list:
    """One stitched function and one tf.function over every op of ``fns``; returns
    [(name, stitched, tf, float64 ref, dtype name)]."""
    names = list(fns)
    # the oracle sees exactly the float32 inputs (rounding the inputs is not an error)
    args64 = [np.asarray(a, np.float32).astype(np.float64) for a in args64]

    def prog(*a):
        return [fns[n](*a) for n in names]
    args32 = [tf.constant(a.astype(np.float32)) for a in args64]
    st_out = stitching.function(prog, options=OPTS, autograph=False)(*args32)
    tf_out = tf.function(prog, autograph=False)(*args32)
    ref_out = tf.function(prog, autograph=False)(*[tf.constant(a, tf.float64) for a in args64])
    ref_out = [ORACLE[n](*args64) if n in ORACLE else r for n, r in zip(names, ref_out)]
    return [(n, np.asarray(s), np.asarray(t), np.asarray(r), _dtype_name(t))
            for n, s, t, r in zip(names, st_out, tf_out, ref_out)]


def _rows_of(results, range_name, ulp_bar=True, x=None) -> list[Row]:
    rows = []
    for name, s, t, ref, dtype in results:
        es, et = ulps(s, ref, dtype), ulps(t, ref, dtype)
        row = Row(name, range_name, float(es.max(initial=0)), float(es.mean()),
                  float(et.max(initial=0)), float(et.mean()),
                  nonfinite_like(s, t, ref, dtype), ulp_bar)
        if name in SCALED and x is not None:
            scale = SCALED[name](np.asarray(x, np.float32).astype(np.float64), ref)
            row.st_scaled = float(scaled_ulps(s, ref, scale).max(initial=0))
            row.tf_scaled = float(scaled_ulps(t, ref, scale).max(initial=0))
        rows.append(row)
    return rows


def nonfinite_like(st, tf_, ref64, dtype) -> bool:
    """Each element of ``st`` is NaN / +Inf / -Inf / finite as TF's is, or as the exact
    result rounded to ``dtype`` is (a sum TF overflows but float64 accumulation does
    not; a row oneDNN's Softmax leaves partly finite beside a NaN)."""
    st, tf_ = np.asarray(st), np.asarray(tf_)
    if st.dtype.kind in "biu":
        return True                     # no NaN/Inf: value mismatches are ulps' job
    c_st, c_tf = _classes(st), _classes(tf_)
    c_ref = _classes(_round_to(np.asarray(ref64, np.float64), dtype)) if dtype in _FMT \
        else c_tf
    return bool(np.all((c_st == c_tf) | (c_st == c_ref)))


def _classes(v):
    v = np.asarray(v).astype(np.float64)
    return np.select([np.isnan(v), np.isposinf(v), np.isneginf(v)], [1, 2, 3], 0)


def table(quick: bool = False, n: int = 4096, seed: int = 0) -> list[Row]:
    """Every (op, range) row; ``quick``: fewer ranges and composites, n=1024 (for the
    test suite: a few seconds of compiling, cached after the first run)."""
    rng = np.random.default_rng(seed)
    n = 1024 if quick else n
    rows = []
    for rname in (QUICK_RANGES if quick else RANGES):
        sample = RANGES[rname][1]
        x = sample(rng, n)
        y = rng.permutation(sample(rng, n))
        rows += _rows_of(_run_group(UNARY, [x]), rname)
        rows += _rows_of(_run_group(BINARY, [x, y]), rname)
        # composites over rows of ROW elements; x shuffled so specials spread over rows
        xr = rng.permutation(x).reshape(-1, ROW)
        fns = {k: v for k, v in ROWWISE.items() if not quick or k in QUICK_ROWWISE}
        # Rows holding +-FLT_MAX and +-1e30 beside ~1 values cancel catastrophically:
        # any float32 order of summation is hundreds of ulps off the small result
        # (TF's too), so that range holds row ops to NaN/Inf propagation only.
        rows += _rows_of(_run_group(fns, [xr]), rname, ulp_bar=rname != "nan/inf", x=xr)
    return rows


def markdown(rows: list[Row]) -> str:
    out = ["| op | range | stitched max | stitched mean | TF max | TF mean | "
           "scaled max: stitched / TF | NaN/Inf like TF |",
           "|---|---|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        flag = "" if r.within() else " **(>2x TF)**"
        flag += "" if r.ulp_bar else " (NaN/Inf only)"
        scaled = "" if r.st_scaled is None else f"{_f(r.st_scaled)} / {_f(r.tf_scaled)}"
        out.append(f"| {r.op} | {r.range} | {_f(r.st_max)}{flag} | {_f(r.st_mean)} | "
                   f"{_f(r.tf_max)} | {_f(r.tf_mean)} | {scaled} | "
                   f"{'yes' if r.nonfinite_like_tf else 'NO'} |")
    return "\n".join(out)


def _f(v: float) -> str:
    if math.isinf(v):
        return "inf"
    return f"{v:.3g}" if v < 1e4 else f"{v:.2e}"
