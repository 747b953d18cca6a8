"""Random programs of memory-intensive ops: the project's fuzzer, as data.

A program is ``(steps, outputs)`` over three inputs, x:[batch, R, C], a row vector
w:[C] and a column tensor s:[batch, R, 1]; each step appends one value:

    ("unary",  k, a)          UNARY[k](v[a])
    ("binary", k, a, b)       BINARY[k](v[a], v[b])      (broadcasting)
    ("reduce", kind, a, axis) sum / mean / max over axis -1, 0 or 1, keepdims
    ("select", a, b)          where(v[a] > v[b], v[a], v[b] * 0.5)
    ("cast",   a, k)          float32 -> CASTS[k] -> float32

``outputs`` index the values returned (one or two).  ``build(program)`` is the TF
function.  tests/test_differential.py draws programs with Hypothesis and checks them
against a float64 oracle (which indexes the same tables); tools/plan_audit.py draws
them with ``random_program`` (a seeded NumPy generator, the same distribution) to
audit the cost model's decisions on graphs nobody wrote by hand.
"""
from __future__ import annotations

import tensorflow as tf

UNARY = [tf.tanh, tf.sigmoid, tf.abs, tf.nn.relu, tf.negative, lambda v: tf.exp(-tf.abs(v)),
         lambda v: tf.math.log1p(tf.abs(v)), tf.math.erf, tf.square]
BINARY = [tf.add, tf.subtract, tf.multiply, tf.maximum, tf.minimum]
CASTS = [tf.float64, tf.float16, tf.bfloat16]
REDUCE_KINDS = ["sum", "mean", "max"]
REDUCE_AXES = [-1, -1, 0, 1]           # last axis twice as often: rows are commoner
STEP_KINDS = ["unary", "binary", "binary", "reduce", "select", "cast"]
MIN_STEPS, MAX_STEPS = 2, 9


def _reduce(kind, v, axis):
    op = {"sum": tf.reduce_sum, "mean": tf.reduce_mean, "max": tf.reduce_max}[kind]
    return op(v, axis=axis, keepdims=True)


def build(program):
    """The TF function ``fn(x, w, s) -> [outputs]`` of a program."""
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
                v = tf.cast(tf.cast(vals[step[1]], CASTS[step[2] if len(step) > 2 else 0]),
                            tf.float32)
            vals.append(v)
        return [vals[i] for i in outs]
    return fn


def random_program(rng):
    """One program drawn with ``rng`` (numpy.random.Generator), the distribution of
    tests/test_differential.py's Hypothesis strategy."""
    def pick(seq):
        return seq[int(rng.integers(len(seq)))]

    steps, n_vals = [], 3                        # x, w, s
    for _ in range(int(rng.integers(MIN_STEPS, MAX_STEPS + 1))):
        kind = pick(STEP_KINDS)
        a = int(rng.integers(n_vals))
        if kind == "unary":
            steps.append(("unary", int(rng.integers(len(UNARY))), a))
        elif kind == "binary":
            steps.append(("binary", int(rng.integers(len(BINARY))), a,
                          int(rng.integers(n_vals))))
        elif kind == "reduce":
            steps.append(("reduce", pick(REDUCE_KINDS), a, pick(REDUCE_AXES)))
        elif kind == "select":
            steps.append(("select", a, int(rng.integers(n_vals))))
        else:
            steps.append(("cast", a, int(rng.integers(len(CASTS)))))
        n_vals += 1
    outs = sorted({int(rng.integers(3, n_vals)) for _ in range(int(rng.integers(1, 3)))})
    return steps, outs


def describe(program) -> str:
    """A one-line name of a program: its steps, then the outputs."""
    steps, outs = program
    return " ".join(f"{s[0]}{list(s[1:])}".replace(" ", "") for s in steps) + f" -> {outs}"
