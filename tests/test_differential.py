"""Differential testing: random DAGs of memory-intensive ops, stitched vs stock TF.

Each example is a random program over x:[batch, R, C] (batch unknown), a row vector
w:[C] and a column tensor s:[batch, R, 1]: unary math, broadcasting binaries,
reductions along the last axis and along leading axes, selects and casts, with one or
two outputs.  It runs under stitching.function at several batch sizes (one trace), and
its error against a float64 run of the same program must be within a small multiple
of stock TF's float32 error.
"""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import stitching  # noqa: E402

UNARY = [tf.tanh, tf.sigmoid, tf.abs, tf.nn.relu, tf.negative, lambda v: tf.exp(-tf.abs(v)),
         lambda v: tf.math.log1p(tf.abs(v)), tf.math.erf, tf.square]
BINARY = [tf.add, tf.subtract, tf.multiply, tf.maximum, tf.minimum]


def _reduce(kind, v, axis):
    op = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max}[kind]
    return op(v, axis=axis, keepdims=True)


@st.composite
def programs(draw):
    steps = []
    n_vals = 3                                   # x, w, s
    for _ in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(["unary", "binary", "binary", "reduce", "select", "cast"]))
        a = draw(st.integers(0, n_vals - 1))
        if kind == "unary":
            steps.append(("unary", draw(st.integers(0, len(UNARY) - 1)), a))
        elif kind == "binary":
            steps.append(("binary", draw(st.integers(0, len(BINARY) - 1)), a,
                          draw(st.integers(0, n_vals - 1))))
        elif kind == "reduce":
            steps.append(("reduce", draw(st.sampled_from(["sum", "mean", "max"])), a,
                          draw(st.sampled_from([-1, -1, 0, 1]))))
        elif kind == "select":
            steps.append(("select", a, draw(st.integers(0, n_vals - 1))))
        else:
            steps.append(("cast", a))
        n_vals += 1
    outs = sorted(set(draw(st.lists(st.integers(3, n_vals - 1), min_size=1, max_size=2))))
    return steps, outs


def build(program, dtype):
    steps, outs = program

    def fn(x, w, s):
        vals = [x, w, s]
        for step in steps:
            kind = step[0]
            if kind == "unary":
                v = UNARY[step[1]](vals[step[2]])
            elif kind == "binary":
                v = BINARY[step[1]](vals[step[2]], vals[step[3]])
            elif kind == "reduce":
                src = vals[step[2]]
                axis = step[3] if src.shape.rank == 3 else -1
                v = _reduce(step[1], src, axis)
            elif kind == "select":
                a, b = vals[step[1]], vals[step[2]]
                v = tf.where(a > b, a, b * 0.5)
            else:
                v = tf.cast(tf.cast(vals[step[1]], tf.float64), dtype)
            vals.append(v)
        return [vals[i] for i in outs]
    return fn


def _inputs(batch, r, c, rng):
    return (rng.standard_normal((batch, r, c)), rng.standard_normal(c),
            rng.standard_normal((batch, r, 1)))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs(), st.integers(1, 5), st.integers(1, 70))
def test_random_programs_match_tf(program, r, c):
    sig32 = [tf.TensorSpec([None, r, c]), tf.TensorSpec([c]), tf.TensorSpec([None, r, 1])]
    sig64 = [tf.TensorSpec(s.shape, tf.float64) for s in sig32]
    stitched = stitching.function(build(program, tf.float32), input_signature=sig32)
    stock = tf.function(build(program, tf.float32), input_signature=sig32)
    exact = tf.function(build(program, tf.float64), input_signature=sig64)
    rng = np.random.default_rng(r * 1000 + c)
    for batch in (1, 3, 8):
        args64 = _inputs(batch, r, c, rng)
        args32 = [a.astype(np.float32) for a in args64]
        for got, ref, ex in zip(stitched(*args32), stock(*args32), exact(*args64)):
            got, ref, ex = (np.asarray(v, np.float64) for v in (got, ref, ex))
            assert got.shape == ref.shape
            np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
            tf_err = np.nan_to_num(np.abs(ref - ex), nan=0.0)
            st_err = np.nan_to_num(np.abs(got - ex), nan=0.0)
            scale = 1e-5 * (1 + np.abs(np.nan_to_num(ex, nan=0.0, posinf=0, neginf=0)))
            assert np.all(st_err <= 4 * tf_err + scale), (program, batch)
    assert len(stitched.reports) == 1            # one trace served every batch size
