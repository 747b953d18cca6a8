"""Gradients through StitchedKernel: a tape outside a stitched function and
tf.gradients over one give TF's gradients (the op's registered gradient differentiates
the region's original subgraph, kept as a function: stitching/tf/passes/original.py)."""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf.passes import original


def _rand(shape, seed, dtype="float32"):
    return tf.constant(np.random.RandomState(seed).randn(*shape).astype(dtype))


def _multi_output(x, b):          # broadcast, a row reduction (softmax), two outputs
    y = tf.nn.softmax(x + b, axis=-1)
    return tf.tanh(y) * 2.0 + x, tf.reduce_sum(tf.square(y - 0.1) * x, axis=-1)


def _layernorm(x, b):             # mean + variance over rows, broadcasts back
    mu = tf.reduce_mean(x, axis=-1, keepdims=True)
    var = tf.reduce_mean(tf.square(x - mu), axis=-1, keepdims=True)
    return ((x - mu) * tf.math.rsqrt(var + 1e-5) * b + b,)


def _column(x, b):                # a column reduction (batch statistics)
    mu = tf.reduce_mean(x, axis=0)
    return (tf.nn.relu((x - mu) * b) + tf.sigmoid(x),)


CASES = {"multi_output": _multi_output, "layernorm": _layernorm, "column": _column}


def _loss(outs):
    return sum(tf.reduce_sum(o * o * (k + 1.0)) for k, o in enumerate(outs))


def _tape_grads(fn, x, b):
    with tf.GradientTape() as t:
        t.watch([x, b])
        loss = _loss(fn(x, b))
    return [g.numpy() for g in t.gradient(loss, [x, b])]


def _kernels(sf):
    return sum(len(r.kernels) for r in sf.reports)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tape_outside_stitched_function_matches_tf(name):
    fn = CASES[name]
    sf = stitching.function(fn)
    x, b = _rand((8, 16), 0), _rand((16,), 1)
    got = _tape_grads(sf, x, b)
    assert _kernels(sf) >= 1
    want = _tape_grads(tf.function(fn), x, b)
    exact = _tape_grads(fn, tf.cast(x, tf.float64), tf.cast(b, tf.float64))
    for g, w, e in zip(got, want, exact):
        # no worse against float64 than TF's own float32 gradient, up to rounding
        tf_err = np.max(np.abs(w - e))
        assert np.max(np.abs(g - e)) <= 2 * tf_err + 1e-5 * np.max(np.abs(e)), name


def test_unknown_batch_dim_and_tf_gradients_in_a_graph():
    fn = CASES["layernorm"]
    sf = stitching.function(fn, input_signature=[tf.TensorSpec([None, 16], tf.float32),
                                                 tf.TensorSpec([16], tf.float32)])

    @tf.function
    def grads(x, b):
        return tf.gradients(_loss(sf(x, b)), [x, b])

    @tf.function
    def ref(x, b):
        return tf.gradients(_loss(fn(x, b)), [x, b])

    for rows in (3, 11):
        x, b = _rand((rows, 16), rows), _rand((16,), 2)
        for g, w in zip(grads(x, b), ref(x, b)):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-5)
    assert _kernels(sf) >= 1


def test_integer_outputs_and_stop_gradient_give_none_and_zero():
    def fn(x):
        y = tf.nn.relu(x * 2.0 + 1.0)
        idx = tf.cast(tf.round(y * 3.0), tf.int32) + 1
        return tf.tanh(y) * 3.0, idx, tf.stop_gradient(tf.sigmoid(y) * 2.0)

    sf = stitching.function(fn)
    x = _rand((4, 5), 3)
    with tf.GradientTape(persistent=True) as t:
        t.watch(x)
        a, i, s = sf(x)
        sum_a, sum_s = tf.reduce_sum(a), tf.reduce_sum(s)
    assert _kernels(sf) >= 1
    # tf.function itself answers zeros (not None) for an integer output of a function
    for g in (t.gradient(i, x), t.gradient(sum_s, x)):
        assert g is None or not np.any(g.numpy())
    with tf.GradientTape() as t2:
        t2.watch(x)
        ref = tf.reduce_sum(fn(x)[0])
    np.testing.assert_allclose(t.gradient(sum_a, x).numpy(),
                               t2.gradient(ref, x).numpy(), rtol=1e-5, atol=1e-6)


def test_second_order_gradient_matches_tf():
    def fn(x):
        return tf.reduce_sum(tf.tanh(x * 1.5) * tf.sigmoid(x), axis=-1)

    sf = stitching.function(fn)
    x = _rand((4, 6), 4)

    def hess_diag(f):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(f(x))
            g = inner.gradient(y, x)
        return outer.gradient(g, x).numpy()

    got = hess_diag(sf)
    assert _kernels(sf) >= 1
    np.testing.assert_allclose(got, hess_diag(fn), rtol=1e-4, atol=1e-5)


def test_kernel_without_original_subgraph_names_the_op():
    sf = stitching.function(lambda x: tf.tanh(x * 2.0) + 1.0)
    x = _rand((3, 4), 5)
    cf = sf.get_concrete_function(tf.TensorSpec([3, 4], tf.float32))
    gdef = cf.graph.as_graph_def()
    kernels = [n for n in gdef.node if n.op == "StitchedKernel"]
    assert kernels and all(original.ATTR in n.attr for n in kernels)
    for n in kernels:
        del n.attr[original.ATTR]
    g = tf.Graph()
    with g.as_default():
        xp = tf.compat.v1.placeholder(tf.float32, [3, 4], name="x_feed")
        out = tf.graph_util.import_graph_def(
            gdef, input_map={cf.inputs[0].name: xp},
            return_elements=[cf.outputs[0].name])[0]
        with pytest.raises(LookupError, match=r"StitchedKernel node '.*kernel_0'"):
            tf.gradients(out, xp)
    del x


def test_backward_is_stitched_and_matches_tf_backward_as_tf_ops():
    """Options.stitch_backward (default): the backward of each kernel is a function of
    its own (original ops recomputed + TF's gradient), planned and stitched: here the
    softmax's backward fuses with the tanh's."""
    from stitching.tf import function as stitched_function

    def fn(x, b):
        return (tf.tanh(tf.nn.softmax(x + b, axis=-1)) * 2.0 + x,)

    x, b = _rand((128, 256), 6), _rand((256,), 7)
    before = len(stitched_function.backward_reports())
    got = _tape_grads(stitching.function(fn), x, b)
    reports = stitched_function.backward_reports()[before:]
    # the softmax's recompute and the tanh's backward share one kernel (since Grappler's
    # rewrites run first the whole row part is one kernel; the bias's column Sum is
    # left to TF by the cost model)
    assert reports and any({"TanhGrad", "Softmax"} <= {t for _, t in k.ops}
                           for r in reports for k in r.kernels)
    as_tf = _tape_grads(stitching.function(fn, options=stitching.Options(
        stitch_backward=False)), x, b)
    exact = _tape_grads(fn, tf.cast(x, tf.float64), tf.cast(b, tf.float64))
    want = _tape_grads(tf.function(fn), x, b)
    for g, t, w, e in zip(got, as_tf, want, exact):
        np.testing.assert_allclose(t, w, rtol=1e-5, atol=1e-6)
        assert np.max(np.abs(g - e)) <= 2 * np.max(np.abs(w - e)) + 1e-6 * np.max(np.abs(e))


def test_rewrite_drops_colocation_with_fused_nodes():
    """Regression: tf.gradients colocates grad_ys' Identity with the forward output
    (``_class: loc:@y``); once y was fused away the import failed with "expects to be
    colocated with unknown node"."""
    def fn(x, g):
        y = tf.tanh(x * 2.0) + 1.0
        return tf.gradients(y, x, grad_ys=g)[0] * 3.0

    x, g = _rand((64, 64), 8), _rand((64, 64), 9)
    sf = stitching.function(fn)
    want = tf.function(fn)(x, g).numpy()     # 1 - tanh^2 cancels: float32 rounding
    np.testing.assert_allclose(sf(x, g).numpy(), want, rtol=1e-5,
                               atol=1e-5 * np.max(np.abs(want)))
    assert _kernels(sf) >= 1


@pytest.mark.parametrize("s0,s1", [([2, 1, 3], [1, 1, 3]), ([1], [1]), ([4, 1], [1]),
                                   ([3], [2, 3]), ([1, 1], [5, 1]), ([2, 3], [2, 3]),
                                   ([], [4, 2])])
def test_broadcast_gradient_args_folding_matches_tf_on_static_shapes(s0, s1):
    from stitching.tf.passes.bcast import reduce_axes
    r0, r1 = tf.raw_ops.BroadcastGradientArgs(s0=tf.constant(s0, tf.int32),
                                              s1=tf.constant(s1, tf.int32))
    assert reduce_axes(s0, s1) == (r0.numpy().tolist(), r1.numpy().tolist())


def test_broadcast_gradient_args_with_unknown_dims():
    from stitching.tf.passes.bcast import reduce_axes
    assert reduce_axes([None, 32], [32]) == ([], [0])           # x[?,32] * gamma[32]
    assert reduce_axes([None, 1], [None, 32]) == ([1], [])      # ? vs ?: assumed equal
    assert reduce_axes([None, 32], [4, 32]) is None             # ? may be 1: left to TF
    assert reduce_axes(None, [3]) is None


def test_row_scale_gradient_with_unknown_batch_is_fused():
    """Regression: with an unknown batch dim, the Sum reducing d(x * s) to the shape of
    a per-row scale s[?,1] (LayerNorm's rsqrt(var)) took its axes from
    BroadcastGradientArgs at run time and stayed a TF op ("... is not a constant")."""
    def fn(x):
        with tf.GradientTape() as t:
            t.watch(x)
            s = tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=1, keepdims=True) + 1.0)
            y = tf.reduce_sum(tf.tanh(x * s))
        return t.gradient(y, x)

    sig = [tf.TensorSpec([None, 32], tf.float32)]
    sf = stitching.function(fn, input_signature=sig)
    x = _rand((24, 32), 10)
    np.testing.assert_allclose(sf(x).numpy(), tf.function(fn, input_signature=sig)(x).numpy(),
                               rtol=1e-4, atol=1e-5)
    summary = sf.report.summary()
    assert "is not a constant" not in summary, summary


def test_reshape_to_the_shape_of_an_outside_value_keeps_its_original():
    """Regression: a fused Reshape whose target is Shape() of a value outside the region
    (gradients reshape to Shape(x)) left its kernel without an original subgraph, so
    without a gradient; the body now takes the IR's static target."""
    def fn(x, y):
        return (tf.reshape(tf.tanh(y) * 2.0, tf.shape(x)) + 1.0) * 3.0

    sig = [tf.TensorSpec([None, 32], tf.float32), tf.TensorSpec([None, 32], tf.float32)]
    sf = stitching.function(fn, input_signature=sig)
    x, y = _rand((5, 32), 11), _rand((5, 32), 12)
    with tf.GradientTape() as t:
        t.watch(y)
        out = tf.reduce_sum(sf(x, y))
    got = t.gradient(out, y)
    with tf.GradientTape() as t:
        t.watch(y)
        out = tf.reduce_sum(fn(x, y))
    np.testing.assert_allclose(got.numpy(), t.gradient(out, y).numpy(), rtol=1e-5, atol=1e-6)
    assert _kernels(sf) >= 1
    assert not any("cannot recompute" in n for n in sf.report.notes), sf.report.notes


def test_stitched_backward_inherits_the_forwards_options(tmp_path):
    """Options.dump_dir (and the planner...) of the forward apply to its backward: the
    backward's trace is dumped beside the forward's."""
    opts = stitching.Options(dump_dir=str(tmp_path), planner="greedy", min_ops=2)
    sf = stitching.function(lambda x: tf.tanh(x * 3.0) * x + 1.0, options=opts)
    x = _rand((4, 8), 11)
    with tf.GradientTape() as t:
        t.watch(x)
        y = tf.reduce_sum(sf(x) * 0.5)
    t.gradient(y, x)
    dumped = sorted(p.name for p in tmp_path.iterdir())
    assert any("backward_of_" in d for d in dumped), dumped
    from stitching.tf.function import _BACKWARDS
    used = [f.options for f in _BACKWARDS.values() if f.options.dump_dir == str(tmp_path)]
    assert used and all(o.planner == "greedy" and not o.background_compile for o in used)


class _FakeOp:
    name = "k"

    def __init__(self, raw):
        self.raw = raw

    def get_attr(self, name):
        if name == original.OPTIONS_ATTR:
            return self.raw
        raise ValueError(name)


def test_backward_options_from_a_graph_are_checked():
    import json
    got = original.backward_options(_FakeOp(json.dumps(
        {"planner": "baseline", "dump_dir": "/somewhere", "bogus": 1}).encode()))
    assert got.planner == "baseline" and got.dump_dir is None   # not written here
    with pytest.raises(ValueError, match="_stitching_options.*not valid Options"):
        original.backward_options(_FakeOp(b'{"planner": "no-such-planner"}'))
    with pytest.raises(ValueError, match="StitchedKernel node 'k'"):
        original.backward_options(_FakeOp(b"[1, 2"))


def test_an_eagerly_run_kernel_names_itself_when_differentiated():
    from stitching import runtime
    sf = stitching.function(lambda x: tf.tanh(x * 2.0) + 1.0)
    cf = sf.get_concrete_function(tf.TensorSpec([3, 4], tf.float32))
    node = next(n for n in cf.graph.as_graph_def().node if n.op == "StitchedKernel")
    x = _rand((3, 4), 12)
    with tf.GradientTape() as t:
        t.watch(x)
        y = runtime.stitched_kernel([x], node.attr["spec"].s.decode(), label="my_region")[0]
    np.testing.assert_allclose(y, np.tanh(x * 2.0) + 1.0, rtol=1e-6)
    with pytest.raises(LookupError, match="StitchedKernel 'my_region' executed eagerly"):
        t.gradient(y, x)


def test_an_input_only_reached_through_ops_without_gradient_gets_none_as_in_tf():
    """Regression: a tape outside, through a kernel whose output depends on an input
    only through Round (no gradient in TF), gave zeros where TF gives None: the
    stitched backward returns a tensor per input; positions TF leaves unconnected
    are None again.  An input reached through Round and another path still gets
    TF's gradient."""
    def rounded(x, b):
        return tf.nn.relu(tf.round(x)) * 2.0 + tf.exp(b)

    def mixed(x, b):
        return x * tf.round(x) + b * 3.0

    for fn in (rounded, mixed):
        x = tf.Variable(tf.constant([[-1.2, 0.4, 0.7, 2.6]]))
        b = tf.Variable(tf.constant([0.5, -0.5, 1.0, 2.0]))
        got, want = [], []
        for f, out in ((stitching.function(fn), got), (tf.function(fn), want)):
            with tf.GradientTape() as tape:
                y = tf.reduce_sum(f(x, b) ** 2)
            out.extend(tape.gradient(y, [x, b]))
        assert [g is None for g in got] == [g is None for g in want], fn.__name__
        for g, w in zip(got, want):
            if w is not None:
                np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5)
    assert want[0] is not None          # mixed: x * round(x) has a gradient
