"""SparseSoftmaxCrossEntropyWithLogits (tf/passes/sparse_xent.py) and training-mode
FusedBatchNormGradV3 (ir/composites.py) fused: both outputs against stock TF and a
float64 oracle, float16, the kernel count, and TF's error on out-of-range labels."""
import numpy as np
import pytest
import tensorflow as tf

import stitching


def _kernels(sf):
    return len(sf.report.kernels)


def _xent_oracle(logits, labels):
    z = logits.astype(np.float64)
    s = z - z.max(axis=1, keepdims=True)
    e = np.exp(s)
    lse = np.log(e.sum(axis=1))
    loss = lse - s[np.arange(len(labels)), labels]
    bp = e / e.sum(axis=1, keepdims=True)
    bp[np.arange(len(labels)), labels] -= 1.0
    return loss, bp


def _xent_fn(x, y):
    logits = x * 1.5 + 0.25
    loss, bp = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=logits, labels=y)
    return loss * 2.0, bp * 3.0


@pytest.mark.parametrize("dtype,label_dtype", [("float32", "int32"), ("float32", "int64"),
                                               ("float16", "int32")])
def test_sparse_xent_matches_tf_and_float64_and_fuses_with_its_neighbours(dtype,
                                                                          label_dtype):
    rs = np.random.RandomState(0)
    xn = (rs.randn(64, 37) * 3).astype(dtype)
    yn = rs.randint(0, 37, 64).astype(label_dtype)
    x, y = tf.constant(xn), tf.constant(yn)
    sf = stitching.function(_xent_fn)
    got = [t.numpy() for t in sf(x, y)]
    want = [t.numpy() for t in tf.function(_xent_fn)(x, y)]
    loss64, bp64 = _xent_oracle(xn.astype(np.float64) * 1.5 + 0.25, yn)
    if dtype == "float32":
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        tol = dict(rtol=1e-5, atol=1e-5)
    else:   # no closer to float64 than TF's own float16 kernel, within rounding
        tol = dict(rtol=2e-2, atol=2e-2)
        for g, w, o in zip(got, want, (2 * loss64, 3 * bp64)):
            assert np.abs(g - o).max() <= 2 * np.abs(w - o).max() + 1e-2
    np.testing.assert_allclose(got[0], 2 * loss64, **tol)
    np.testing.assert_allclose(got[1], 3 * bp64, **tol)
    # the logits' scale-and-shift, the xent and both Muls: one kernel; the label range
    # check (a Gather) stays TF's
    assert _kernels(sf) == 1
    assert [op for _, op, _ in sf.report.unfused] == ["GatherV2"]


def test_sparse_xent_with_minus_inf_logits_is_tfs():
    """A -inf logit off the label (a masked class) leaves TF's loss finite: the loss
    picks the label's term (a select), never 0 * inf; on the label the loss is inf."""
    logits = tf.constant([[0.0, -np.inf, 1.0, 2.0], [3.0, -np.inf, -np.inf, 0.5],
                          [1.0, -np.inf, 0.0, 0.0]], tf.float32)
    y = tf.constant([0, 3, 1], tf.int32)

    def fn(x, y):
        loss, bp = tf.raw_ops.SparseSoftmaxCrossEntropyWithLogits(features=x, labels=y)
        return loss * 2.0, bp * 3.0
    sf = stitching.function(fn)
    got, want = [t.numpy() for t in sf(logits, y)], [t.numpy() for t in tf.function(fn)(
        logits, y)]
    assert np.isfinite(want[0][:2]).all() and np.isposinf(want[0][2])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert _kernels(sf) == 1


@pytest.mark.parametrize("bad", [37, -1])
def test_sparse_xent_out_of_range_label_is_tfs_error(bad):
    rs = np.random.RandomState(1)
    x = tf.constant(rs.randn(8, 37).astype("float32"))
    y = tf.constant(np.r_[rs.randint(0, 37, 7), bad].astype("int32"))
    ok = tf.constant(rs.randint(0, 37, 8).astype("int32"))
    sf = stitching.function(_xent_fn)
    sf(x, ok)
    with pytest.raises(tf.errors.InvalidArgumentError, match=rf"{bad} is not in \[0, 37\)"):
        sf(x, y)
    with pytest.raises(tf.errors.InvalidArgumentError):
        tf.function(_xent_fn)(x, y)


def test_sparse_xent_gradient_through_a_tape_matches_tf():
    rs = np.random.RandomState(2)
    w = tf.Variable(rs.randn(16, 10).astype("float32"))
    x = tf.constant(rs.randn(32, 16).astype("float32"))
    y = tf.constant(rs.randint(0, 10, 32))

    def step(x, y):
        with tf.GradientTape() as t:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y, tf.matmul(x, w)))
        return loss, t.gradient(loss, w)
    got = stitching.function(step)(x, y)
    want = tf.function(step)(x, y)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-5, atol=1e-6)


# ---- FusedBatchNormGradV3

def _bn_grad_oracle(dy, x, scale, mean, var, eps, training):
    dy, x = dy.astype(np.float64), x.astype(np.float64)
    scale, mean, var = (v.astype(np.float64) for v in (scale, mean, var))
    axes = tuple(range(x.ndim - 1))
    n = np.prod([x.shape[a] for a in axes])
    k0 = 1.0 / np.sqrt(var + eps)
    xc = x - mean
    offset_bp = dy.sum(axes)
    scale_bp = (dy * xc * k0).sum(axes)
    if not training:
        return dy * k0 * scale, scale_bp, offset_bp
    x_bp = scale * k0 * (dy - offset_bp / n - xc * k0 * k0 * (dy * xc).sum(axes) / n)
    return x_bp, scale_bp, offset_bp


def _bn_grad_fn(training, fmt="NHWC"):
    def f(dy, x, scale, mean, var):
        r = tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=dy * 1.5, x=x, scale=scale, reserve_space_1=mean,
            reserve_space_2=var, reserve_space_3=mean, epsilon=1e-3, data_format=fmt,
            is_training=training)
        return r[0] + 1.0, r[1] * 2.0, r[2] * 3.0
    return f


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fused_batch_norm_grad_matches_tf_and_float64_in_one_kernel(training, dtype):
    rs = np.random.RandomState(3)
    shape = (8, 6, 6, 16)
    dyn = rs.randn(*shape).astype(dtype)
    xn = (rs.randn(*shape) * 2 + 1).astype(dtype)
    sc = (rs.rand(16) + 0.5).astype("float32")
    mean = xn.astype(np.float64).mean((0, 1, 2)).astype("float32")
    var = xn.astype(np.float64).var((0, 1, 2)).astype("float32")
    args = [tf.constant(v) for v in (dyn, xn, sc, mean, var)]
    fn = _bn_grad_fn(training)
    sf = stitching.function(fn)
    got = [t.numpy().astype(np.float64) for t in sf(*args)]
    want = [t.numpy().astype(np.float64) for t in tf.function(fn)(*args)]
    xb, sb, ob = _bn_grad_oracle(dyn * np.float64(1.5), xn, sc, mean, var, 1e-3, training)
    oracle = [xb + 1.0, sb * 2.0, ob * 3.0]
    for g, w, o in zip(got, want, oracle):
        scale = np.abs(o).max()
        if dtype == "float32":
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale)
            np.testing.assert_allclose(g, o, rtol=1e-4, atol=1e-5 * scale)
        else:   # float16 x_backprop: within twice TF's own distance from float64
            assert np.abs(g - o).max() <= 2 * np.abs(w - o).max() + 1e-3 * scale
    assert len(sf.report.kernels) == 1 and not sf.report.unfused


def test_fused_batch_norm_grad_nchw_stays_tfs_with_the_reason():
    rs = np.random.RandomState(4)
    x = tf.constant(rs.randn(2, 16, 4, 4).astype("float32"))
    v = tf.constant(np.ones(16, np.float32))
    fn = _bn_grad_fn(True, "NCHW")
    sf = stitching.function(fn)
    try:
        tf.function(fn)(x, x, v, v, v)
    except tf.errors.OpError:     # TF's CPU kernel may refuse NCHW itself: then so may we
        pytest.skip("TF's CPU FusedBatchNormGradV3 runs no NCHW here")
    got = sf(x, x, v, v, v)
    np.testing.assert_allclose(got[0], tf.function(fn)(x, x, v, v, v)[0], rtol=1e-5,
                               atol=1e-5)
    assert any(op == "FusedBatchNormGradV3" and "channel-last" in why
               for _, op, why in sf.report.unfused)


def test_training_step_through_fused_batch_norm_matches_tf():
    """tf.compat.v1's fused batch norm in training mode, differentiated by a tape: the
    FusedBatchNormGradV3 of the backward is fused and the gradients equal TF's."""
    rs = np.random.RandomState(5)
    x = tf.constant(rs.randn(4, 8, 8, 8).astype("float32"))
    w = tf.Variable(rs.randn(3, 3, 8, 8).astype("float32") * 0.2)
    scale = tf.Variable(np.ones(8, np.float32))
    offset = tf.Variable(np.zeros(8, np.float32))

    def step(x):
        with tf.GradientTape() as t:
            h = tf.nn.conv2d(x, w, 1, "SAME")
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True)
            loss = tf.reduce_sum(tf.nn.relu(y) * 0.1)
        return [loss] + t.gradient(loss, [w, scale, offset])
    sf = stitching.function(step)
    got = sf(x)
    for g, h in zip(got, tf.function(step)(x)):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)
    fused = {op for k in sf.report.kernels for _, op in k.ops}
    assert "FusedBatchNormGradV3" in fused


def _variance_grad_step(x, w):
    """A BatchNorm's statistics differentiated by a tape: TF's SquaredDifference
    gradient makes its constant 2 under a control dependency on the incoming gradient
    (``with control_dependencies([grad]): scalar = constant(2.0)``)."""
    with tf.GradientTape() as t:
        t.watch(x)
        mean = tf.reduce_mean(x, [0, 1, 2], keepdims=True)
        var = tf.reduce_mean(tf.math.squared_difference(x, tf.stop_gradient(mean)),
                             [0, 1, 2], keepdims=True)
        y = (x - mean) * tf.math.rsqrt(var + 1e-3)
        loss = tf.reduce_sum(tf.nn.relu(y) * w)
    return t.gradient(loss, x)


def test_a_constant_under_a_gradients_control_dependency_splits_no_kernel(machine):
    """The variance gradient's broadcast (Tile, divided by the count) and its product
    with ``2 (x - mean)`` in one kernel: the Const's control input orders its readers,
    not a path out of the kernel and back (tf/frontend.py _lift_const_controls).  It was
    two kernels, the first writing the full-size broadcast for the second to read."""
    rs = np.random.RandomState(6)
    x = tf.constant(rs.randn(4, 8, 8, 16).astype("float32"))
    w = tf.constant(rs.rand(16).astype("float32"))
    sf = stitching.function(_variance_grad_step)
    got = sf(x, w)
    np.testing.assert_allclose(got, tf.function(_variance_grad_step)(x, w), rtol=1e-4,
                               atol=1e-5)
    ops = [sorted({op for _, op in k.ops}) for k in sf.report.kernels]
    assert len(ops) == 2, ops            # was 3: [Mul, Tile] alone between the others
    assert not any(set(k) <= {"Tile", "Mul", "Identity"} for k in ops), ops
