"""tf/passes/conv1x1.py and the OpenBLAS ops' pooled outputs: a large 1x1 convolution
runs as one StitchedMatMul whose output comes from op.cc's output pool."""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching import runtime as rt
from stitching.runtime import blas
from stitching.tf.passes import conv1x1, remapper

pytest.importorskip("scipy_openblas32")

EIGEN = "amd-avx2"            # TF runs Eigen's convolution and GEMM (oneDNN off)
ONEDNN = "intel-avx512"       # TF runs oneDNN's
HW = 112                      # conv1x1.decide takes 1x1 expansions over 112x112 pixels


def _rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _err(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max())


# ---- pooled outputs ------------------------------------------------------------------

def test_a_large_product_comes_from_the_output_pool_and_equals_tf():
    """An output of the pool's line (32 MiB) or more comes from op.cc's pool, the one
    StitchedKernel uses (its counters), and a freed one is reused; a small one comes
    from TF's allocator."""
    ops = blas.load()
    assert rt.pool_stats()["min_bytes"] == 32 << 20
    a, b = _rand((1 << 16, 8), seed=1), _rand((8, 128), seed=2)   # out: 32 MiB
    want = tf.linalg.matmul(a, b).numpy()
    before = rt.pool_stats()
    y = ops.stitched_mat_mul(a=a, b=b, bias=[])
    mid = rt.pool_stats()
    assert mid["hits"] + mid["misses"] == before["hits"] + before["misses"] + 1
    assert mid["held_bytes"] >= (1 << 16) * 128 * 4
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    del y                                           # back to the pool: the next one hits
    y = ops.stitched_mat_mul(a=a, b=b, bias=[])
    assert rt.pool_stats()["hits"] == mid["hits"] + 1
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    small = rt.pool_stats()
    ops.stitched_mat_mul(a=a[:1024], b=b, bias=[])  # 0.5 MiB: TF's allocator
    after = rt.pool_stats()
    assert (after["hits"], after["misses"]) == (small["hits"], small["misses"])


# ---- the pass --------------------------------------------------------------------------

def _net(dtype=tf.float32, seed=0, dilated=True, strided=True):
    """(fn, its weights): a 1x1 expansion the rule takes (8 -> 24 channels over
    112x112), its BatchNorm-like scale and ReLU6 (a kernel), then convolutions the pass
    leaves to TF: a 1x1 over more than 16 channels, a strided 1x1 (else a plain one), a
    3x3 and a dilated 1x1."""
    w = {name: tf.Variable(_rand(shape, dtype.as_numpy_dtype, seed + i), name=name)
         for i, (name, shape) in enumerate([("expand", (1, 1, 8, 24)),
                                             ("project", (1, 1, 24, 8)),
                                             ("strided", (1, 1, 8, 8)),
                                             ("k3", (3, 3, 8, 8)),
                                             ("dilated", (1, 1, 8, 8))])}

    def fn(x):
        e = tf.nn.conv2d(x, w["expand"], 1, "SAME")
        h = tf.nn.relu6(e * 0.5 + 0.25)
        y = tf.nn.conv2d(h, w["project"], 1, "VALID")
        y = tf.nn.conv2d(y, w["strided"], 2 if strided else 1, "SAME")
        y = tf.nn.conv2d(y, w["k3"], 1, "SAME")
        if dilated:       # TF's CPU kernels have no gradient of a dilated Conv2D
            y = tf.nn.conv2d(y, w["dilated"], 1, "SAME", dilations=2)
        return tf.reduce_mean(y, axis=[1, 2]) + tf.reduce_sum(e[:, :4, :4, :8], axis=[1, 2])
    return fn, w


def _graph_ops(f, sig):
    return [n.op for n in f.get_concrete_function(*sig).graph.as_graph_def().node]


def _sig(dtype=tf.float32):
    return [tf.TensorSpec([None, HW, HW, 8], dtype)]


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_the_expansion_runs_as_one_product_and_equals_tf_and_float64(monkeypatch, dtype):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    fn, weights = _net(dtype)
    f = stitching.function(fn, input_signature=_sig(dtype))
    x = _rand((2, HW, HW, 8), dtype.as_numpy_dtype, 7)
    got, want = f(tf.constant(x)).numpy(), tf.function(fn)(tf.constant(x)).numpy()
    ops = _graph_ops(f, _sig(dtype))
    # the expansion is the one StitchedMatMul; the four others stay TF's Conv2D
    assert ops.count("StitchedMatMul") == 1 and ops.count("Conv2D") == 4, ops
    assert "MatMul" not in ops
    note = [n for n in f.report.notes if "1x1 Conv2D" in n]
    assert note and note[0].startswith("1 1x1 Conv2D(s) run as one matrix product each")
    for why in ("1 over 112x112 pixels with more than 16 input channels", "1 strided",
                "1 not 1x1", "1 dilated"):
        assert why in note[0], note[0]
    # the reference: TF's float64 run of the same weights and input
    fn64, w64 = _net(tf.float64)
    for name, v in weights.items():
        w64[name].assign(v.numpy().astype(np.float64))
    ref = fn64(tf.constant(x.astype(np.float64))).numpy()
    # no less accurate than TF's own convolution, within a few ulps of the largest value
    ulp = np.finfo(dtype.as_numpy_dtype).eps * np.abs(ref).max()
    assert _err(got, ref) <= 1.5 * _err(want, ref) + 8 * ulp


def test_unknown_batch_nan_and_inf_propagate(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    fn, _ = _net()
    f = stitching.function(fn, input_signature=_sig())
    ref = tf.function(fn, input_signature=_sig())
    for batch in (1, 3):
        x = _rand((batch, HW, HW, 8), seed=batch)
        x[0, 2, 2, 2] = np.nan                  # pixels the outputs read
        x[-1, 1, 3, 1] = np.inf
        got, want = f(tf.constant(x)).numpy(), ref(tf.constant(x)).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(got[0]).any() and not np.isfinite(got[-1]).any()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert _graph_ops(f, _sig()).count("StitchedMatMul") == 1


def test_left_to_tf_where_tf_runs_onednn_or_the_option_is_off(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", ONEDNN)
    fn, _ = _net()
    f = stitching.function(fn, input_signature=_sig())
    x = _rand((1, HW, HW, 8), seed=3)
    np.testing.assert_allclose(f(x).numpy(), fn(tf.constant(x)).numpy(), rtol=2e-5, atol=2e-5)
    ops = _graph_ops(f, _sig())
    assert ops.count("Conv2D") == 5 and "StitchedMatMul" not in ops
    assert not [n for n in f.report.notes if "1x1 Conv2D" in n]
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    off = stitching.function(fn, input_signature=_sig(),
                             options=stitching.Options(conv1x1_gemm=False))
    off(x)
    assert _graph_ops(off, _sig()).count("Conv2D") == 5


def test_unknown_shapes_stay_tf_with_their_reason(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    sig = [tf.TensorSpec([None, None, None, 8], tf.float32),      # spatial size unknown
           tf.TensorSpec([None, HW, HW, None], tf.float32),       # channels unknown
           tf.TensorSpec([1, 1, None, None], tf.float32)]         # filter unknown

    def fn(a, b, w):
        return (tf.reduce_sum(tf.nn.conv2d(a, tf.ones([1, 1, 8, 24]), 1, "SAME")) +
                tf.reduce_sum(tf.nn.conv2d(b, w, 1, "SAME")))
    f = stitching.function(fn, input_signature=sig)
    a, b, w = _rand((1, HW, HW, 8), seed=4), _rand((1, HW, HW, 4), seed=5), \
        _rand((1, 1, 4, 6), seed=6)
    np.testing.assert_allclose(f(a, b, w).numpy(), fn(a, b, w).numpy(), rtol=1e-4)
    assert _graph_ops(f, sig).count("Conv2D") == 2
    note = [n for n in f.report.notes if "1x1 Conv2D" in n][0]
    assert note.startswith("0 1x1 Conv2D(s)")
    assert "1 spatial size or channels unknown" in note and "1 filter shape unknown" in note


def test_nchw_is_left_alone():
    """Decided on the GraphDef: TF's CPU Conv2D runs no NCHW, so no function is run."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, HW, HW], name="x")
        tf.raw_ops.Conv2D(input=x, filter=tf.ones([1, 1, 8, 24]), strides=[1, 1, 1, 1],
                          padding="SAME", data_format="NCHW", name="nchw")
    nchw = [n for n in g.as_graph_def().node if n.op == "Conv2D"][0]
    assert conv1x1._form(nchw) == "not NHWC"


def test_a_bias_add_after_the_convolution_keeps_tf_fused_conv(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    w, c = tf.Variable(_rand((1, 1, 8, 24), seed=8)), tf.Variable(_rand((24,), seed=9))

    def fn(x):
        return tf.reduce_sum(tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, w, 1, "SAME"), c)),
                             axis=[1, 2])
    f = stitching.function(fn, input_signature=_sig())
    x = _rand((1, HW, HW, 8), seed=10)
    np.testing.assert_allclose(f(x).numpy(), fn(tf.constant(x)).numpy(), rtol=1e-4)
    note = [n for n in f.report.notes if "1x1 Conv2D" in n]
    assert "Conv2D" in _graph_ops(f, _sig()) and note
    assert "1 a BiasAdd follows (TF's _FusedConv2D)" in note[0]


@pytest.mark.parametrize("h, w, cin, taken", [
    (112, 112, 16, True), (112, 112, 8, True), (224, 224, 3, True),
    (112, 112, 32, False),       # MobileNetV2's expanded_conv_project: Eigen's as fast
    (56, 56, 16, False), (56, 56, 144, False), (14, 14, 384, False),
    (7, 7, 160, True), (7, 7, 1152, True), (7, 7, 64, False), (1, 1, 960, True)])
def test_the_rule(h, w, cin, taken):
    assert (conv1x1.decide(h, w, cin, 96) is None) == taken


def test_a_tape_outside_differentiates_through_the_product(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    # Stock TF 2.21 with oneDNN on kills the process in the gradient of the strided 1x1
    # (its _MklNativeConv2DBackprop* at [2,112,112,8], stride 2, SAME; checked without
    # stitching on an AMD EPYC Zen 4): there the net keeps that convolution unstrided.
    fn, weights = _net(dilated=False, strided=not remapper.onednn_enabled())
    f = stitching.function(fn, input_signature=_sig())
    x = tf.constant(_rand((2, HW, HW, 8), seed=11))
    assert "StitchedMatMul" in _graph_ops(f, _sig())
    grads = []
    for g in (f, fn):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(tf.sin(g(x)))
        grads.append(tape.gradient(y, [x, weights["expand"], weights["project"]]))
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_keras_fit_with_the_expansion_on_openblas_matches_keras(monkeypatch):
    """A training step's forward convolution becomes the product too (its gradient
    ops read the convolution's operands, not its output) and the losses are Keras's."""
    keras = pytest.importorskip("keras")
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((HW, HW, 8)),
                              keras.layers.Conv2D(16, 1, use_bias=False),
                              keras.layers.BatchNormalization(), keras.layers.ReLU(6.0),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)])
        m.compile(optimizer=keras.optimizers.SGD(1e-2), loss="mse")
        return m
    x, y = _rand((12, HW, HW, 8), seed=12), _rand((12, 3), seed=13)
    stock = model().fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    m = stitching.keras.stitch(model(), stitching.Options(background_compile=False))
    got = m.fit(x, y, batch_size=4, epochs=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(got.history["loss"], stock.history["loss"], rtol=1e-4)
    note = [n for n in m.stitching_report.train.notes if "1x1 Conv2D" in n]
    assert note and note[0].startswith("1 1x1 Conv2D(s) run as one matrix product")
