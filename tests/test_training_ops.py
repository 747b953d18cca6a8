"""SparseSoftmaxCrossEntropyWithLogits (tf/sparse_xent.py) and training-mode
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
