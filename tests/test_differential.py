"""Differential testing: random DAGs of memory-intensive ops, stitched vs a float64 oracle.

Each example is a random program over x:[batch, R, C] (batch unknown), a row vector
w:[C] and a column tensor s:[batch, R, 1]: unary math, broadcasting binaries,
reductions along the last axis and along leading axes, selects and casts (through
float16 and bfloat16 too), with one or two outputs.  It runs under
stitching.function at several batch sizes (one trace).

The oracle (``Oracle``) evaluates the same program in float64 with NumPy and carries,
for every element, an error budget in the scale of the *operands* (first-order
error analysis, u = 2^-24 per float32 rounding):

  a + b, a - b      E(a) + E(b) + u (|a| + |b|)       survives cancellation: the
                                                     budget is the operands', not
                                                     the (near-zero) result's
  a * b             |b| E(a) + |a| E(b) + u |a b|
  f(a)              |f'(a)| E(a) + c_f u |f(a)|       c_f: our helpers' ulp bound
  sum / mean        sum of E + n u sum |x|            (mean: / n)
  max, min, relu    the larger E of the candidates
  select(a > b)     + |a - b/2| where the compare is within E of flipping
  cast to f16/bf16  E(a) + one 16-bit ulp at |a|     a rounding-boundary flip

A result passes if |got - exact| <= 4 E + 1e-30 (the factor: slack for the
first-order model), and NaN appears exactly where stock TF's float32 run has NaN.
A real error (wrong op, wrong broadcast, a lost rounding) is O(|value|), far above
E.  Stock TF's own float32 result must pass the same check: a program where it
does not is a defect of the budget, not of stitching.  Programs that once failed
are kept as explicit examples (``REGRESSIONS``).
"""
import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

import stitching  # noqa: E402

U = 2.0 ** -24
# the program tables and the TF function of a program live with the fuzzer
# (stitching/testing/fuzz.py), which tools/plan_audit.py draws from too
from stitching.testing.fuzz import (BINARY, CASTS, MAX_STEPS, MIN_STEPS,  # noqa: E402
                                    REDUCE_AXES, REDUCE_KINDS, STEP_KINDS, UNARY, build)


@st.composite
def programs(draw):
    steps = []
    n_vals = 3                                   # x, w, s
    for _ in range(draw(st.integers(MIN_STEPS, MAX_STEPS))):
        kind = draw(st.sampled_from(STEP_KINDS))
        a = draw(st.integers(0, n_vals - 1))
        if kind == "unary":
            steps.append(("unary", draw(st.integers(0, len(UNARY) - 1)), a))
        elif kind == "binary":
            steps.append(("binary", draw(st.integers(0, len(BINARY) - 1)), a,
                          draw(st.integers(0, n_vals - 1))))
        elif kind == "reduce":
            steps.append(("reduce", draw(st.sampled_from(REDUCE_KINDS)), a,
                          draw(st.sampled_from(REDUCE_AXES))))
        elif kind == "select":
            steps.append(("select", a, draw(st.integers(0, n_vals - 1))))
        else:
            steps.append(("cast", a, draw(st.integers(0, len(CASTS) - 1))))
        n_vals += 1
    outs = sorted(set(draw(st.lists(st.integers(3, n_vals - 1), min_size=1, max_size=2))))
    return steps, outs


# ---- the float64 oracle with error budgets ---------------------------------------

_ERF_C = 2.0 / math.sqrt(math.pi)
# (value, derivative, ulp bound of our float32 helper) per UNARY entry, in float64
_UNARY64 = [
    (np.tanh, lambda a, f: 1 - f * f, 4),
    (lambda a: 1 / (1 + np.exp(-a)), lambda a, f: f * (1 - f), 4),
    (np.abs, lambda a, f: np.ones_like(a), 0),
    (lambda a: np.maximum(a, 0.0), lambda a, f: (a > 0).astype(float), 0),
    (np.negative, lambda a, f: np.ones_like(a), 0),
    (lambda a: np.exp(-np.abs(a)), lambda a, f: f, 4),
    (lambda a: np.log1p(np.abs(a)), lambda a, f: 1 / (1 + np.abs(a)), 4),
    (np.vectorize(math.erf, otypes=[float]), lambda a, f: _ERF_C * np.exp(-a * a), 6),
    (np.square, lambda a, f: 2 * np.abs(a), 1),
]


def _ulp16(a, fmt):
    """One ulp of float16 / bfloat16 at |a| (subnormal spacing at the bottom)."""
    mant, emin = (10, -14) if fmt == 1 else (7, -126)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.maximum(np.abs(a), 2.0 ** emin)))
    return np.exp2(e - mant)


class Oracle:
    """Evaluates a program in float64, with per-element error budgets (module doc)."""

    def __init__(self, program):
        self.steps, self.outs = program

    def __call__(self, x, w, s):
        vals = [(v.astype(np.float64), np.zeros(v.shape)) for v in (x, w, s)]
        for step in self.steps:
            vals.append(getattr(self, "_" + step[0])(vals, *step[1:]))
        return [vals[i] for i in self.outs]

    def _unary(self, vals, i, a):
        (v, e) = vals[a]
        f, df, c = _UNARY64[i]
        with np.errstate(over="ignore", invalid="ignore"):
            y = f(v)
            return y, np.abs(df(v, y)) * e + c * U * np.abs(y)

    def _binary(self, vals, i, a, b):
        (va, ea), (vb, eb) = vals[a], vals[b]
        if i in (0, 1):
            y = va + vb if i == 0 else va - vb
            return y, ea + eb + U * (np.abs(va) + np.abs(vb))
        if i == 2:
            return va * vb, np.abs(vb) * ea + np.abs(va) * eb + U * np.abs(va * vb)
        y = np.maximum(va, vb) if i == 3 else np.minimum(va, vb)
        return y, np.maximum(ea, eb)

    def _reduce(self, vals, kind, a, axis):
        (v, e) = vals[a]
        ax = axis if v.ndim == 3 else -1
        if kind == "max":
            return v.max(ax, keepdims=True), e.max(ax, keepdims=True)
        n = v.shape[ax]
        y = v.sum(ax, keepdims=True)
        err = e.sum(ax, keepdims=True) + n * U * np.abs(v).sum(ax, keepdims=True)
        if kind == "mean":
            return y / max(n, 1), err / max(n, 1)
        return y, err

    def _select(self, vals, a, b):
        (va, ea), (vb, eb) = vals[a], vals[b]
        va, vb, ea, eb = np.broadcast_arrays(va, vb, ea, eb)
        y = np.where(va > vb, va, 0.5 * vb)
        err = np.where(va > vb, ea, 0.5 * eb)
        flip = np.abs(va - vb) <= ea + eb + U * (np.abs(va) + np.abs(vb))
        return y, np.where(flip, np.maximum(ea, 0.5 * eb) + np.abs(va - 0.5 * vb), err)

    def _cast(self, vals, a, fmt=0):
        (v, e) = vals[a]
        if fmt == 0:
            return v, e
        dtype = np.float16 if fmt == 1 else tf.bfloat16.as_numpy_dtype
        with np.errstate(over="ignore"):
            y = v.astype(np.float32).astype(dtype).astype(np.float64)
        err = e + _ulp16(v, fmt)
        # within a budget of the float16 overflow threshold: inf or not, either is right
        err = np.where((fmt == 1) & (np.abs(v) + err >= 65504.0), np.inf, err)
        return y, err


def check_against_oracle(got, tf_got, exact, budget):
    got, tf_got = np.asarray(got, np.float64), np.asarray(tf_got, np.float64)
    assert got.shape == tf_got.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(tf_got))
    exact = np.broadcast_to(exact, got.shape)
    bound = 4 * np.broadcast_to(budget, got.shape) + 1e-30
    ok = np.isnan(exact) | np.isnan(got) | (got == exact)
    with np.errstate(invalid="ignore"):
        ok |= np.abs(got - exact) <= bound
        tf_ok = np.isnan(exact) | np.isnan(tf_got) | (tf_got == exact) | (
            np.abs(tf_got - exact) <= bound)
    return ok, tf_ok


REGRESSIONS = [
    # found by this test (issue 28): x + x became Mul(Const(2) ^x, x) in Grappler's
    # arithmetic optimizer; the control edge on the argument survived the rewrite
    # and the stitched graph asked for the old Placeholder to be fed
    (([("binary", 0, 0, 0), ("unary", 0, 0)], [3]), 1, 1),
    # kept as a boundary case: x * w rounded to bfloat16 lands on the other side of
    # a rounding boundary in float32 than in float64 for some elements (8192 float32
    # ulps apart), which the cast's budget has to carry, and a sum over them
    (([("binary", 2, 0, 1), ("cast", 3, 2), ("reduce", "sum", 4, -1)], [5]), 3, 33),
]


def _run_program(program, r, c):
    sig = [tf.TensorSpec([None, r, c]), tf.TensorSpec([c]), tf.TensorSpec([None, r, 1])]
    stitched = stitching.function(build(program), input_signature=sig)
    stock = tf.function(build(program), input_signature=sig)
    oracle = Oracle(program)
    rng = np.random.default_rng(r * 1000 + c)
    for batch in (1, 3, 8):
        args = [rng.standard_normal(shape).astype(np.float32)
                for shape in ((batch, r, c), (c,), (batch, r, 1))]
        for got, ref, (exact, budget) in zip(stitched(*args), stock(*args), oracle(*args)):
            ok, tf_ok = check_against_oracle(got, ref, exact, budget)
            assert np.all(ok), (program, batch, np.argwhere(~ok)[:3].tolist())
            # stock TF passing too shows the budget is not tighter than float32 allows
            assert np.all(tf_ok), ("budget too tight for TF itself", program, batch)
    assert len(stitched.reports) == 1            # one trace served every batch size


@pytest.mark.parametrize("program,r,c", REGRESSIONS)
def test_regression_programs(program, r, c):
    _run_program(program, r, c)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(), st.integers(1, 5), st.integers(1, 70))
def test_random_programs_match_float64_oracle(program, r, c):
    _run_program(program, r, c)


def test_oracle_budget_catches_a_real_error():
    """The budget is not a blanket tolerance: a 1e-4 relative error in one element of
    a sum (a lost term's rounding is ~1e-7) is caught, a flip at a bfloat16 boundary
    is not."""
    program = ([("binary", 0, 0, 1), ("reduce", "sum", 3, -1)], [4])
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    w = np.ones(8, np.float32)
    s = np.zeros((2, 3, 1), np.float32)
    (exact, budget), = Oracle(program)(x, w, s)
    good = exact.astype(np.float32)
    assert check_against_oracle(good, good, exact, budget)[0].all()
    bad = good.copy()
    bad[0, 0, 0] *= 1 + 1e-4
    assert not check_against_oracle(bad, good, exact, budget)[0].all()
    cast = ([("cast", 0, 2)], [3])
    v = np.float32(1.0 + 2.0 ** -8)                # exactly between two bfloat16 values
    xs = np.full((1, 1, 1), v, np.float32)
    (exact, budget), = Oracle(cast)(xs, np.ones(1, np.float32), xs)
    flipped = np.full((1, 1, 1), 1.0 + 2.0 ** -7, np.float32)   # the other neighbour
    assert check_against_oracle(flipped, flipped, exact, budget)[0].all()
