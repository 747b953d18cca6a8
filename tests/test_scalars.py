"""New Python scalars: f(x, 1.0), f(x, 2.0), ... (issue 38, item 4).

A constant that is one of the arguments and only feeds element-wise arithmetic is
planned as an input (tf/scalars.py): each value's trace reuses the function's stitched
graph, its result equal to TF's.  Constants that steer a decision stay constants."""
import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import stitching  # noqa: E402
from stitching.tf import pipeline, scalars  # noqa: E402


@pytest.fixture
def plans(monkeypatch):
    """How many times the pipeline planned a graph (a template hit plans nothing).
    Every trace reaches the pipeline: a graph stitched by an earlier test would be
    served whole by the result cache (tf/results.py) first."""
    from stitching.tf import results
    monkeypatch.setattr(results, "probe", lambda key, traced: None)
    calls = []
    real = pipeline._stitch

    def counted(*args, **kwargs):
        calls.append(args[4])                    # the graph's name
        return real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "_stitch", counted)
    return calls


def _graph(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs).graph.as_graph_def()


def _abstracted(graph_def, values):
    abstraction = scalars.abstract(graph_def, frozenset(values))
    return [] if abstraction is None else sorted(abstraction.abstracted)


def test_a_new_value_reuses_the_stitched_graph(plans):
    @stitching.function
    def f(x, scale, shift):
        return tf.nn.softmax(x * scale) * scale + shift

    x = tf.random.normal([16, 32])
    values = [(1.5, 0.5), (2.0, -3.0), (0.0, 1.0), (1.0, 0.0), (-0.25, 7.0),
              (math.inf, 0.0)]
    for scale, shift in values:
        want = tf.nn.softmax(x * scale) * scale + shift
        np.testing.assert_allclose(f(x, scale, shift), want, rtol=1e-6, atol=1e-6)
    assert len(plans) == 1, plans
    assert len(f.reports) == len(values)
    assert all(r.kernels for r in f.reports)
    specs = {n.attr["spec"].s for n in f.get_concrete_function(x, 9.0, 9.0).graph
             .as_graph_def().node if n.op == "StitchedKernel"}
    assert len(specs) == 1 and b"9.0" not in next(iter(specs))


def test_a_nan_value_is_a_constant_and_propagates(plans):
    f = stitching.function(lambda x, s: tf.nn.softmax(x) * s + x)
    x = tf.random.normal([8, 16])
    f(x, 2.0)
    got = f(x, math.nan)
    assert np.isnan(got.numpy()).all()
    assert len(plans) == 2        # NaN equals no value: traced as TF traces it


def test_values_in_a_narrow_float_match_as_the_constant_holds_them(plans):
    f = stitching.function(lambda x, s: tf.nn.softmax(x) * s)
    x = tf.random.normal([8, 16], dtype=tf.float16)
    for s in (0.1, 0.3):
        want = tf.nn.softmax(x) * s
        np.testing.assert_allclose(np.float32(f(x, s)), np.float32(want), rtol=2e-3,
                                   atol=1e-3)
    assert len(plans) == 1


def test_only_plain_operands_of_arithmetic_are_abstracted():
    def steering(x, axis, alpha, d):
        s = tf.reduce_sum(x, axis=axis)                  # an int axis
        r = tf.reshape(x, [-1, axis + 1])               # a shape
        return s, r, tf.nn.leaky_relu(x, alpha=alpha), x / d, x * alpha
    g = _graph(steering, tf.TensorSpec([4, 6]), 1, 0.5, 3.0)
    # the axis, the reshape target, leaky_relu's alpha (an attr) and the divisor stay
    assert _abstracted(g, {1.0, 0.5, 3.0}) == ["mul/y"]


def test_a_dividend_and_a_subtrahend_are_operands():
    g = _graph(lambda x, a, b: (a / x) - b * x, tf.TensorSpec([4]), 2.0, 3.0)
    assert len(_abstracted(g, {2.0, 3.0})) == 2
    g = _graph(lambda x: x * 2.0, tf.TensorSpec([4]))
    assert _abstracted(g, {5.0}) == []                  # the user's own constant


def test_python_branches_on_the_value_trace_apart(plans):
    @stitching.function
    def f(x, s):
        y = tf.nn.softmax(x) * s
        return tf.tanh(y) if s > 1.0 else y + s
    x = tf.random.normal([8, 16])
    for s in (0.5, 2.0, 0.75, 3.0):
        y = tf.nn.softmax(x) * s
        want = tf.tanh(y) if s > 1.0 else y + s
        np.testing.assert_allclose(f(x, s), want, rtol=1e-6, atol=1e-6)
    assert len(plans) == 2


def test_a_loop_body_takes_the_value_as_an_input():
    """(The loop stays a loop, ``unroll_loops=0``: a loop of 3 steps is unrolled by
    default, tests/test_unroll.py.)"""
    def f(x, s):
        for _ in tf.range(3):
            x = tf.nn.softmax(x * s) + s
        return x
    f = stitching.function(f, options=stitching.Options(unroll_loops=0))

    x = tf.random.normal([8, 16])
    for s in (0.5, 2.0):
        want = x
        for _ in range(3):
            want = tf.nn.softmax(want * s) + s
        np.testing.assert_allclose(f(x, s), want, rtol=1e-5, atol=1e-6)
    bodies = [r for _, r, _ in f.report.bodies if r is not None]
    assert any(r.kernels for r in bodies)


def test_a_value_equal_to_a_constant_of_the_function_shares_the_template(plans):
    """GELU holds 0.5 and 1.0: f(x, 1.0, 0.5) abstracts them too, f(x, 2.0, -1.5)
    does not; both serve each other's values (the kept constants hold the same
    values), in either order."""
    def body(x, alpha, beta):
        return tf.nn.gelu(tf.nn.softmax(x)) * alpha + beta

    x = tf.random.normal([8, 16])
    for order in ([(1.0, 0.5), (2.0, -1.5), (3.0, 4.0)],
                  [(2.0, -1.5), (1.0, 0.5), (3.0, 4.0)]):
        plans.clear()
        f = stitching.function(body)
        for a, b in order:
            np.testing.assert_allclose(f(x, a, b), body(x, a, b), rtol=1e-6, atol=1e-6)
        assert len(plans) == 1, (order, plans)


def test_a_kept_constant_of_another_value_is_a_new_template(plans):
    """A candidate the template kept with another value than this trace's: not
    served (here, the user's own 0.25 kept, then the same graph position holding
    the argument)."""
    f = stitching.function(lambda x, s, c: tf.nn.softmax(x) * s + (0.25 if c else s))
    x = tf.random.normal([8, 16])
    for s, c in ((2.0, True), (3.0, False), (4.0, False)):
        want = tf.nn.softmax(x) * s + (0.25 if c else s)
        np.testing.assert_allclose(f(x, s, c), want, rtol=1e-6, atol=1e-6)
    assert len(plans) == 2


def test_a_new_value_inside_a_loop_reuses_the_template(plans):
    """AutoGraph names a loop's body anew on each trace (while_body_40, then
    while_body_205): the template's key leaves function names out, so a second and a
    third value plan nothing; each gets stitched bodies of its own (a function is kept
    by name: two contents never share one), equal to TF, gradient included.  (The
    loop stays a loop: ``unroll_loops=0``.)"""
    def f(x, s):
        for _ in tf.range(3):
            x = tf.nn.softmax(x * s) + s
        return x
    f = stitching.function(f, options=stitching.Options(unroll_loops=0))

    def reference(x, s):
        for _ in range(3):
            x = tf.nn.softmax(x * s) + s
        return x

    x = tf.random.normal([8, 16], seed=3)
    bodies, planned = set(), []
    for s in (0.5, 2.0, -1.25):
        np.testing.assert_allclose(f(x, s), reference(x, s), rtol=1e-5, atol=1e-6)
        planned.append(len(plans))
        library = f.get_concrete_function(x, s).graph.as_graph_def().library
        bodies |= {fn.signature.name for fn in library.function
                   if "_stitched_" in fn.signature.name}
    assert planned[0] >= 2 and planned == planned[:1] * 3, plans  # body(s) + graph, once
    assert len(bodies) == 3, bodies
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        got, want = f(x, -1.25), reference(x, -1.25)
    np.testing.assert_allclose(tape.gradient(got, x), tape.gradient(want, x),
                               rtol=1e-4, atol=1e-5)


def test_a_new_value_inside_a_cond_reuses_the_template(plans):
    @stitching.function
    def f(x, s):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.nn.softmax(x * s) + s,
                       lambda: tf.nn.softmax(x) * s)

    x = tf.abs(tf.random.normal([4, 8], seed=5))
    planned = []
    for s in (1.5, 3.0, 0.25):
        np.testing.assert_allclose(f(x, s), tf.nn.softmax(x * s) + s, rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(f(-x, s), tf.nn.softmax(-x) * s, rtol=1e-6,
                                   atol=1e-6)
        planned.append(len(plans))
    assert planned[0] >= 2 and planned == planned[:1] * 3, plans  # only the first value
