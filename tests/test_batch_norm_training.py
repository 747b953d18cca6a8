"""Training-mode FusedBatchNorm / V2 / V3 (ir/composites.py, FusedBatchNormTraining):
its outputs against stock TF and a float64 oracle (TF has no float64 kernel), the
kernel counts of tf_keras' LayerNormalization form and of BatchNormalization + ReLU, a
training step through it, NaN and Inf, and the reasons of the forms left to TF."""
import numpy as np
import pytest
import tensorflow as tf

import stitching


def _oracle(x, scale, offset, mean_in, var_in, eps, factor, fmt):
    """TF's CPU functor's formula in float64: y, batch_mean, batch_variance (Bessel-
    corrected, averaged with the inputs when factor != 1), reserve_space_1 and _2."""
    x = x.astype(np.float64)
    channel = 1 if fmt.startswith("NC") else x.ndim - 1
    axes = tuple(i for i in range(x.ndim) if i != channel)
    shape = [-1 if i == channel else 1 for i in range(x.ndim)]
    n = np.prod([x.shape[a] for a in axes])
    mean = x.mean(axes)
    var = ((x - mean.reshape(shape)) ** 2).mean(axes)
    k = scale.astype(np.float64) / np.sqrt(var + eps)
    y = (x - mean.reshape(shape)) * k.reshape(shape) + offset.reshape(shape)
    adj = n / max(n - 1, 1)
    if factor == 1.0:
        out_mean, out_var = mean, var * adj
    else:
        out_mean = (1 - factor) * mean_in + factor * mean
        out_var = (1 - factor) * var_in + factor * adj * var
    return [y, out_mean, out_var, mean, var]


def _bn(fmt, factor, eps=1e-3):
    def f(x, scale, offset, mean, var):
        r = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=scale, offset=offset, mean=mean, variance=var, epsilon=eps,
            exponential_avg_factor=factor, data_format=fmt, is_training=True)
        return [r[0] * 1.0] + [t * 1.0 for t in r[1:5]]
    return f


# NHWC, and tf_keras LayerNormalization's NCHW [1, rows, cols, 1]
_SHAPES = {"NHWC": (4, 6, 6, 16), "NCHW": (1, 24, 40, 1)}


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("factor", [1.0, 0.25])
def test_training_batch_norm_matches_tf_and_float64_in_one_kernel(fmt, dtype, factor):
    rs = np.random.RandomState(7)
    shape = _SHAPES[fmt]
    c = shape[1] if fmt == "NCHW" else shape[-1]
    x = (rs.randn(*shape) * 2 + 1).astype(dtype)
    sc, of = (rs.rand(c) + 0.5).astype("float32"), rs.randn(c).astype("float32")
    mi, vi = rs.randn(c).astype("float32"), (rs.rand(c) + 0.5).astype("float32")
    args = [tf.constant(v) for v in (x, sc, of, mi, vi)]
    fn = _bn(fmt, factor)
    sf = stitching.function(fn)
    got = [t.numpy().astype(np.float64) for t in sf(*args)]
    want = [t.numpy().astype(np.float64) for t in tf.function(fn)(*args)]
    oracle = _oracle(x, sc, of, mi, vi, 1e-3, factor, fmt)
    for i, (g, w, o) in enumerate(zip(got, want, oracle)):
        scale = np.abs(o).max()
        if dtype == "float32":
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6 * scale, err_msg=str(i))
        # never further from float64 than TF, but for float32 rounding of the result
        tol = (1e-3 if dtype == "float16" and i == 0 else 1e-6) * scale
        assert np.abs(g - o).max() <= np.abs(w - o).max() + tol, i
    assert len(sf.report.kernels) == 1 and not sf.report.unfused


def test_statistics_inputs_are_not_read_with_factor_one():
    """tf.compat.v1's fused_batch_norm passes empty mean and variance in training; with
    exponential_avg_factor 1 TF never reads them, nor does the kernel."""
    rs = np.random.RandomState(8)
    x = tf.constant(rs.randn(2, 5, 5, 8).astype("float32"))

    def fn(x):
        y, m, v = tf.compat.v1.nn.fused_batch_norm(x, tf.ones([8]), tf.zeros([8]),
                                                   is_training=True)
        return y, m, v
    sf = stitching.function(fn)
    for g, w in zip(sf(x), tf.function(fn)(x)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert len(sf.report.kernels) == 1 and not sf.report.unfused


def _tf_keras_layer_norm(x, gamma, beta):
    """tf_keras' LayerNormalization with epsilon >= 1.001e-5, as its call() writes it:
    x reshaped to [1, rows, cols, 1], a training-mode NCHW FusedBatchNormV3 with ones
    and zeros, then reshaped back and scaled."""
    shape = tf.shape(x)
    pre, cols = tf.reduce_prod(shape[:-1]), tf.reduce_prod(shape[-1:])
    h = tf.reshape(x, [1, pre, cols, 1])
    y, _, _ = tf.compat.v1.nn.fused_batch_norm(h, tf.ones([pre]), tf.zeros([pre]),
                                               epsilon=1e-3, data_format="NCHW")
    return tf.reshape(y, shape) * gamma + beta


def test_tf_keras_layer_norm_form_fuses_with_one_compiled_kernel_for_any_batch():
    """The FusedBatchNormV3 that tf_keras' LayerNormalization runs (even at inference)
    becomes one row kernel; its scale and shift (after a reshape that merges dims) are
    a second.  With an unknown batch the same compiled kernels serve each batch size."""
    rs = np.random.RandomState(9)
    gamma = tf.constant(rs.rand(32).astype("float32") + 0.5)
    beta = tf.constant(rs.randn(32).astype("float32"))
    fn = lambda x: _tf_keras_layer_norm(x, gamma, beta)      # noqa: E731
    sf = stitching.function(fn, input_signature=[tf.TensorSpec([None, 16, 32])])
    for b in (3, 5):
        x = tf.constant(rs.randn(b, 16, 32).astype("float32") * 3 + 2)
        np.testing.assert_allclose(sf(x), tf.function(fn)(x), rtol=1e-5, atol=2e-6)
    kernels = sf.report.kernels
    assert len(kernels) == 2 and not sf.report.unfused, sf.report.summary()
    assert [op for _, op in kernels[0].ops] == ["FusedBatchNormV3"]
    assert len(sf.reports) == 1


def test_batch_norm_and_relu_is_one_kernel_for_any_batch():
    """Keras 2's BatchNormalization in training (FusedBatchNormV3, NHWC, the moving
    averages by exponential_avg_factor) and a ReLU: one kernel, one compile serving two
    batch sizes (n, and so the Bessel factor, counted at run time)."""
    rs = np.random.RandomState(10)
    sc, of = tf.constant(rs.rand(16).astype("float32") + 0.5), tf.constant(rs.randn(16).astype("float32"))
    mi, vi = tf.constant(rs.randn(16).astype("float32")), tf.constant(rs.rand(16).astype("float32") + 1)

    def fn(x):
        y, m, v = tf.compat.v1.nn.fused_batch_norm(x, sc, of, mean=mi, variance=vi,
                                                   is_training=True,
                                                   exponential_avg_factor=0.01)
        return tf.nn.relu(y), m, v
    sf = stitching.function(fn, input_signature=[tf.TensorSpec([None, 6, 6, 16])])
    for b in (2, 7):
        x = tf.constant(rs.randn(b, 6, 6, 16).astype("float32") * 2 - 1)
        for g, w in zip(sf(x), tf.function(fn)(x)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)
    assert len(sf.report.kernels) == 1 and not sf.report.unfused, sf.report.summary()
    assert len({k.spec_hash for k in sf.report.kernels}) == 1 and len(sf.reports) == 1


def test_nan_and_inf_in_a_channel_reach_its_outputs_as_in_tf():
    rs = np.random.RandomState(11)
    x = rs.randn(2, 4, 4, 8).astype("float32")
    x[0, 1, 2, 3] = np.nan
    x[1, 0, 0, 5] = np.inf
    fn = lambda x: [t * 1.0 for t in tf.compat.v1.nn.fused_batch_norm(   # noqa: E731
        x, tf.ones([8]), tf.zeros([8]), is_training=True)]
    sf = stitching.function(fn)
    got = [t.numpy() for t in sf(tf.constant(x))]
    want = [t.numpy() for t in tf.function(fn)(tf.constant(x))]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.isposinf(g), np.isposinf(w))
        ok = np.isfinite(w)
        np.testing.assert_allclose(g[ok], w[ok], rtol=1e-5, atol=1e-6)
    assert np.isnan(got[0][..., 3]).all() and np.isposinf(got[1][5])
    assert len(sf.report.kernels) == 1 and not sf.report.unfused


def test_training_step_through_batch_norm_and_relu_matches_tf():
    """A tape through Conv, training-mode BatchNorm, ReLU: the forward FusedBatchNormV3
    (with the ReLU) and its FusedBatchNormGradV3 are fused; loss and gradients equal
    TF's."""
    rs = np.random.RandomState(12)
    x = tf.constant(rs.randn(4, 8, 8, 8).astype("float32"))
    w = tf.Variable(rs.randn(3, 3, 8, 8).astype("float32") * 0.2)
    scale = tf.Variable(rs.rand(8).astype("float32") + 0.5)
    offset = tf.Variable(rs.randn(8).astype("float32") * 0.1)

    def step(x):
        with tf.GradientTape() as t:
            h = tf.nn.conv2d(x, w, 1, "SAME")
            y, m, v = tf.compat.v1.nn.fused_batch_norm(h, scale, offset, is_training=True)
            loss = tf.reduce_sum(tf.nn.relu(y) * 0.1)
        return [loss, m, v] + t.gradient(loss, [w, scale, offset])
    sf = stitching.function(step)
    for g, h in zip(sf(x), tf.function(step)(x)):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)
    kernels = [{op for _, op in k.ops} for k in sf.report.kernels]
    assert any({"FusedBatchNormV3", "Relu"} <= k for k in kernels), kernels
    assert any("FusedBatchNormGradV3" in k for k in kernels), kernels


def test_a_gradient_left_to_tf_reads_no_reserve_space_of_the_fused_forward():
    """V3's reserve_space_3 (a scalar 0 from TF's CPU kernel, which its CPU gradient
    ignores) is no output of the fused forward: the gradient reads a constant zero
    (tf/passes/bn_reserve.py), so the forward fuses even where the gradient stays
    TF's."""
    rs = np.random.RandomState(15)
    x = tf.constant(rs.randn(4, 6, 6, 8).astype("float32"))
    scale = tf.Variable(rs.rand(8).astype("float32") + 0.5)
    offset = tf.Variable(np.zeros(8, np.float32))

    def step(x):
        with tf.GradientTape() as t:
            t.watch(x)
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, scale, offset, is_training=True)
            loss = tf.reduce_sum(tf.nn.relu(y) * 0.1)
        return [loss] + t.gradient(loss, [x, scale, offset])
    sf = stitching.function(step, options=stitching.Options(
        exclude=("FusedBatchNormGradV3",)))
    for g, h in zip(sf(x), tf.function(step)(x)):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)
    fused = {op for k in sf.report.kernels for _, op in k.ops}
    assert "FusedBatchNormV3" in fused and "FusedBatchNormGradV3" not in fused


def test_nchw_batch_norm_over_a_batch_stays_tfs_with_the_reason():
    """NCHW with a batch and a spatial size above 1 reduces on both sides of the
    channel axis: left to TF, and the report says which NCHW form does fuse."""
    x = tf.constant(np.random.RandomState(13).randn(2, 8, 3, 3).astype("float32"))
    fn = lambda x: tf.compat.v1.nn.fused_batch_norm(            # noqa: E731
        x, tf.ones([8]), tf.zeros([8]), is_training=True, data_format="NCHW")[0] * 2.0
    sf = stitching.function(fn)
    try:
        want = tf.function(fn)(x)
    except tf.errors.OpError:      # TF's CPU kernel may refuse NCHW itself
        pytest.skip("TF's CPU FusedBatchNormV3 runs no NCHW here")
    np.testing.assert_allclose(sf(x), want, rtol=1e-5, atol=1e-6)
    why = [w for _, op, w in sf.report.unfused if op == "FusedBatchNormV3"]
    assert why and "tf_keras LayerNormalization" in why[0] and "NCHW" in why[0], why


def test_tf_keras_layer_norm_training_step_fuses_forward_and_backward():
    """A tape through tf_keras LayerNormalization's form: the NCHW FusedBatchNormV3 and
    its NCHW FusedBatchNormGradV3 (the same row reductions) are both fused, with an
    unknown batch, and the gradients equal TF's."""
    rs = np.random.RandomState(14)
    gamma = tf.Variable(rs.rand(32).astype("float32") + 0.5)
    beta = tf.Variable(rs.randn(32).astype("float32"))

    def step(x):
        with tf.GradientTape() as t:
            t.watch(x)
            loss = tf.reduce_sum(tf.nn.relu(_tf_keras_layer_norm(x, gamma, beta)) * 0.5)
        return [loss] + t.gradient(loss, [x, gamma, beta])
    sf = stitching.function(step, input_signature=[tf.TensorSpec([None, 16, 32])])
    for b in (2, 3):
        x = tf.constant(rs.randn(b, 16, 32).astype("float32") * 2 + 1)
        for g, h in zip(sf(x), tf.function(step)(x)):
            np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)
    fused = {op for k in sf.report.kernels for _, op in k.ops}
    assert {"FusedBatchNormV3", "FusedBatchNormGradV3"} <= fused, sf.report.summary()
    assert not any(op.startswith("FusedBatchNorm") for _, op, _ in sf.report.unfused)


def test_accuracy_table_rows_within_twice_tf_and_nan_inf_like_tf():
    """stitching/testing/accuracy.py's row for it, over the quick input ranges (tiny,
    ~1, large, subnormal, NaN/Inf among ~1 values): within max(2x TF's, 4) ulps of
    float64 and NaN/Inf where TF's are."""
    from stitching.testing import accuracy as A
    rng = np.random.default_rng(0)
    fns = {"FusedBatchNorm (training)": A.ROWWISE["FusedBatchNorm (training)"]}
    rows = []
    for rname in A.QUICK_RANGES:
        x = rng.permutation(A.RANGES[rname][1](rng, 1024)).reshape(-1, A.ROW)
        rows += A._rows_of(A._run_group(fns, [x]), rname, ulp_bar=rname != "nan/inf", x=x)
    assert [(r.op, r.range) for r in rows if not r.within()] == [], rows
    assert [(r.op, r.range) for r in rows if not r.nonfinite_like_tf] == [], rows


def test_tf_passes_priced_for_a_training_batch_norm_and_its_nchw_transposes():
    """legality.work: TF's CPU kernel reads x for the mean, again for the variance, and
    once more to write y (2 passes); in NCHW it transposes x in and y out (2 more), and
    so does the gradient (4 + 2): the cost model's side of fusing the tf_keras
    LayerNormalization form."""
    from stitching.ir import Node, ValueRef
    from stitching.plan import legality

    def node(op, fmt, **attrs):
        return Node("bn", op, [ValueRef("x")] * 3, dict(attrs, data_format=fmt))
    assert legality.work(node("FusedBatchNormTraining", "NHWC")) == 2
    assert legality.work(node("FusedBatchNormTraining", "NCHW")) == 4
    assert legality.work(node("FusedBatchNormGrad", "NHWC", is_training=True)) == 4
    assert legality.work(node("FusedBatchNormGrad", "NCHW", is_training=True)) == 6


def _bn_grad(dy, x, scale, mean, var):
    r = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=mean, reserve_space_2=var,
        reserve_space_3=var, epsilon=1e-3, data_format="NHWC", is_training=True)
    return [r[0], r[1], r[2]]


def _bn_grad_args(shape, dtype="float32"):
    rs = np.random.RandomState(17)
    c = shape[-1]
    return [tf.constant(rs.randn(*shape).astype(dtype)) for _ in range(2)] + \
        [tf.constant((rs.rand(c) + 0.5).astype("float32")) for _ in range(3)]


def test_lone_batch_norm_gradient_is_left_to_onednn_with_the_reason(machine):
    """Where TF runs oneDNN its FusedBatchNormGradV3 takes about 1.5 passes, not
    Eigen's 4 (plan/legality.py ONEDNN_PASSES, measured on a Zen 5): a lone one is
    left to TF, and the report says why.  Where TF runs Eigen's kernel (amd-avx2) the
    plan is as before: one kernel."""
    args = _bn_grad_args((8, 14, 14, 32))
    sf = stitching.function(_bn_grad)
    for g, h in zip(sf(*args), tf.function(_bn_grad)(*args)):
        np.testing.assert_allclose(g, h, rtol=2e-4, atol=2e-4)
    fused = {op for k in sf.report.kernels for _, op in k.ops}
    why = [w for _, op, w in sf.report.unfused if op == "FusedBatchNormGradV3"]
    if machine.tf_onednn:
        assert "FusedBatchNormGradV3" not in fused, sf.report
        assert why and "oneDNN" in why[0], why
    else:
        assert "FusedBatchNormGradV3" in fused and not why, sf.report


def _relu_grad_bn_grad(g, a, x, scale, mean, var):
    return _bn_grad(tf.raw_ops.ReluGrad(gradients=g, features=a), x, scale, mean, var)


def test_relu_grad_and_bn_gradient_with_unknown_batch_fused_only_where_every_batch_gains(
        machine):
    """ReluGrad + FusedBatchNormGradV3 over [?, 7, 7, 512] is one column kernel whose
    second pass re-reads its three inputs: where TF runs oneDNN (amd-avx512,
    intel-avx512) it is predicted to gain at batch 32 (DEFAULT_DIM) but not at 128
    (on a Zen 5, fused with an unknown batch, it measured 3-40% slower than TF's ops
    at batch 8 and 64), so with the batch unknown both ops are left to TF and the
    report says at which size it would lose (plan/cost.py priced_dims).  With batch 32
    known it fuses as before, and where TF runs Eigen's 4-pass gradient (amd-avx2) it
    fuses at any batch.  Outputs equal TF's either way."""
    args = [tf.constant(np.random.RandomState(i).randn(2, 7, 7, 512).astype("float32"))
            for i in range(3)] + _bn_grad_args((2, 7, 7, 512))[2:]
    sig = [tf.TensorSpec([None, 7, 7, 512])] * 3 + [tf.TensorSpec([512])] * 3
    sf = stitching.function(_relu_grad_bn_grad, input_signature=sig)
    for g, h in zip(sf(*args), tf.function(_relu_grad_bn_grad)(*args)):
        np.testing.assert_allclose(g, h, rtol=2e-4, atol=2e-4)
    fused = {op for k in sf.report.kernels for _, op in k.ops}
    why = {op: w for _, op, w in sf.report.unfused}
    if machine.tf_onednn:
        assert not fused, sf.report.summary()
        for op in ("ReluGrad", "FusedBatchNormGradV3"):
            assert "unknown until run time at 32 but none at 128" in why.get(op, ""), why
    else:
        assert fused == {"ReluGrad", "FusedBatchNormGradV3"} and not why, sf.report
    known = stitching.function(_relu_grad_bn_grad,
                               input_signature=[tf.TensorSpec([32, 7, 7, 512])] * 3
                               + [tf.TensorSpec([512])] * 3)
    big = [tf.concat([a] * 16, 0) for a in args[:3]] + args[3:]
    for g, h in zip(known(*big), tf.function(_relu_grad_bn_grad)(*big)):
        np.testing.assert_allclose(g, h, rtol=2e-4, atol=2e-4)
    assert [sorted(op for _, op in k.ops) for k in known.report.kernels] == \
        [["FusedBatchNormGradV3", "ReluGrad"]], known.report.summary()


def test_onednn_pricing_only_where_tf_runs_onednns_batch_norm_gradient():
    """legality.mark_onednn tags the training-mode channel-last float32 / bfloat16
    gradient (one oneDNN pass: ONEDNN_PASSES), not half (Eigen's kernel) nor NCHW (not
    measured), and the tag is planning only: no KernelSpec carries it."""
    from stitching.ir import Graph, Node, TensorType, ValueRef
    from stitching.plan import legality

    def graph(dtype, fmt="NHWC", training=True):
        g = Graph()
        shape = [4, 6, 6, 8] if fmt == "NHWC" else [4, 8, 6, 6]
        for name in ("dy", "x"):
            g.add(Node(name, "Placeholder", [], {"dtype": dtype},
                       [TensorType(dtype, shape)]))
        for name in ("scale", "mean", "var"):
            g.add(Node(name, "Placeholder", [], {"dtype": "float32"},
                       [TensorType("float32", [8])]))
        g.add(Node("bn", "FusedBatchNormGrad",
                   [ValueRef(n) for n in ("dy", "x", "scale", "mean", "var")],
                   {"data_format": fmt, "is_training": training, "epsilon": 1e-3},
                   [TensorType(dtype, shape), TensorType("float32", [8]),
                    TensorType("float32", [8])]))
        return g
    for dtype, fmt, training, tagged in [("float32", "NHWC", True, True),
                                         ("bfloat16", "NHWC", True, True),
                                         ("float16", "NHWC", True, False),
                                         ("float32", "NCHW", True, False),
                                         ("float32", "NHWC", False, False)]:
        g = graph(dtype, fmt, training)
        assert legality.mark_onednn(g) == int(tagged), (dtype, fmt, training)
        assert legality.work(g["bn"]) == (1 if tagged else 4 + 2 * (fmt == "NCHW"))
    assert legality.ONEDNN_ATTR in legality.PLANNER_ATTRS
