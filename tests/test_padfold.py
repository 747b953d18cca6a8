"""tf/passes/padfold.py: a zero Pad before a convolution becomes its explicit padding."""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf import pipeline
from stitching.tf.passes import padfold


def _rewritten(fn, sig, options=stitching.Options()):
    cf = tf.function(fn, input_signature=sig).get_concrete_function()
    res = pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs],
                                    options=options)
    return res.graph_def, res.report


def _notes(report):
    return [n for n in report.notes if "zero Pad" in n]


def _kept_pads(gdef, report) -> list:
    """The Pads the rewrite kept: TF's own, or inside a stitched kernel (a Pad of H and
    W fuses with its producer: schedule/domain.py, Domain.clamped)."""
    pads = ("Pad", "PadV2", "MirrorPad")
    return [n.op for n in gdef.node if n.op in pads] + \
        [op for k in report.kernels for _, op in k.ops if op in pads]


def _mobilenet_downsample(dtype="float32", bias=False):
    """MobileNetV2's strided depthwise stage as Keras writes it: BN + ReLU6 (stitched),
    ZeroPadding2D(correct_pad), DepthwiseConv2D(stride 2, valid)."""
    import keras
    keras.utils.set_random_seed(11)
    L = keras.layers
    x = keras.Input((24, 24, 16), dtype=dtype)
    h = L.BatchNormalization(epsilon=1e-3, dtype=dtype)(x)
    h = L.ReLU(6.0, dtype=dtype)(h)
    h = L.ZeroPadding2D(((0, 1), (0, 1)), dtype=dtype)(h)
    h = L.DepthwiseConv2D(3, strides=2, padding="valid", use_bias=bias, dtype=dtype)(h)
    if bias:
        h = L.ReLU(dtype=dtype)(h)
    model = keras.Model(x, h)
    for w in model.weights:      # moving statistics away from 0/1, so BN does work
        if "moving" in w.path or "gamma" in w.path or "beta" in w.path:
            w.assign(np.random.default_rng(len(w.path)).uniform(0.5, 1.5, w.shape))
    return model


def test_a_keras_downsample_loses_its_pad_and_equals_tf():
    """The Pad is gone from the rewritten graph, the convolution pads explicitly, the
    outputs equal stock TF's at two batch sizes (the batch unknown), and NaN/Inf reach
    the same outputs."""
    model = _mobilenet_downsample()
    sig = [tf.TensorSpec([None, 24, 24, 16], tf.float32)]
    gdef, report = _rewritten(lambda t: model(t, training=False), sig)
    ops = [n.op for n in gdef.node]
    assert "Pad" not in ops and "PadV2" not in ops, ops
    convs = [n for n in gdef.node if n.op == "DepthwiseConv2dNative"]
    assert len(convs) == 1 and convs[0].attr["padding"].s == b"EXPLICIT"
    assert list(convs[0].attr["explicit_paddings"].list.i) == [0, 0, 0, 1, 0, 1, 0, 0]
    assert len(_notes(report)) == 1 and _notes(report)[0].startswith("1 zero Pad")
    # folded before planning: the report does not list the Pad as TF's to run
    assert not [op for _, op, _ in report.unfused if op in ("Pad", "PadV2")], \
        report.unfused

    f = stitching.function(lambda t: model(t, training=False), input_signature=sig)
    ref = tf.function(lambda t: model(t, training=False), input_signature=sig)
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 24, 24, 16)) * 4
        x = x.astype(np.float32)
        x[0, 23, 23, 2] = np.nan            # a bottom-right cell: its window is padded
        x[0, 0, 0, 5] = np.inf
        got, want = f(tf.constant(x)).numpy(), ref(tf.constant(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert (np.isnan(got) == np.isnan(want)).all()


def test_a_convolution_with_a_bias_keeps_its_pad_where_tf_fuses_the_bias(machine):
    """oneDNN's remapper fuses a bias (+ ReLU) after a depthwise convolution into one
    kernel, which aborts on explicit padding: the planner leaves the bias to TF there and
    the Pad stays.  Eigen's remapper does not fuse it: the Pad is folded, and the bias and
    ReLU are stitched.  Either way the result is TF's."""
    model = _mobilenet_downsample(bias=True)
    sig = [tf.TensorSpec([None, 24, 24, 16], tf.float32)]
    gdef, report = _rewritten(lambda t: model(t, training=False), sig)
    ops = [n.op for n in gdef.node]
    if machine.tf_onednn:
        assert "Pad" in ops and not _notes(report) and "BiasAdd" in ops
    else:
        assert "Pad" not in ops and len(_notes(report)) == 1 and "BiasAdd" not in ops
    x = tf.constant(np.random.default_rng(9).standard_normal((2, 24, 24, 16)), tf.float32)
    got = stitching.function(lambda t: model(t, training=False), input_signature=sig)(x)
    want = tf.function(lambda t: model(t, training=False))(x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_float64_pads_explicitly_on_eigens_kernel():
    """float64 (no oneDNN: Eigen's depthwise kernel) takes the explicit padding too,
    and equals stock TF exactly (the same arithmetic on the same cells)."""
    model = _mobilenet_downsample("float64")
    sig = [tf.TensorSpec([None, 24, 24, 16], tf.float64)]
    gdef, _ = _rewritten(lambda t: model(t, training=False), sig)
    assert "Pad" not in [n.op for n in gdef.node]
    x = tf.constant(np.random.default_rng(2).standard_normal((2, 24, 24, 16)))
    got = stitching.function(lambda t: model(t, training=False), input_signature=sig)(x)
    want = tf.function(lambda t: model(t, training=False))(x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


def _normalized_stem(bias=False):
    """EfficientNet's stem as Keras writes it: Rescaling and a per-channel
    Normalization of the image, ZeroPadding2D(correct_pad), a strided Conv2D (valid);
    ResNet's 7x7 stem has a bias (then the remapper fuses it, and a ReLU, into the
    convolution)."""
    import keras
    keras.utils.set_random_seed(12)
    L = keras.layers
    x = keras.Input((20, 20, 3))
    h = L.Rescaling(1.0 / 255.0)(x)
    h = L.Normalization(mean=[0.485, 0.456, 0.406], variance=[0.052, 0.050, 0.051])(h)
    h = L.ZeroPadding2D(((0, 1), (0, 1)))(h)
    h = L.Conv2D(8, 3, strides=2, padding="valid", use_bias=bias)(h)
    if bias:
        h = L.ReLU()(h)
    return keras.Model(x, h)


@pytest.mark.parametrize("bias", [False, True])
def test_a_pad_before_a_convolution_is_its_explicit_padding(bias):
    """The image's Pad goes into the Conv2D's explicit padding (with or without a bias
    the remapper fuses: Conv2D's fused kernels take explicit padding, oneDNN's and
    Eigen's), the normalization before it is one flat kernel over the image's 3
    channels, and the outputs equal stock TF's at two batch sizes (the batch unknown),
    NaN and Inf included."""
    model = _normalized_stem(bias)
    sig = [tf.TensorSpec([None, 20, 20, 3], tf.float32)]
    gdef, report = _rewritten(lambda t: model(t, training=False), sig)
    assert "Pad" not in [n.op for n in gdef.node]
    convs = [n for n in gdef.node if n.op == "Conv2D"]
    assert len(convs) == 1 and convs[0].attr["padding"].s == b"EXPLICIT"
    assert list(convs[0].attr["explicit_paddings"].list.i) == [0, 0, 0, 1, 0, 1, 0, 0]
    assert _notes(report) == ["1 zero Pad(s) before a convolution folded into its "
                              "explicit padding (tf/passes/padfold.py; "
                              "Options(pad_fold=False) keeps them)"]
    assert len(report.kernels) == 1 and report.kernels[0].schedule.startswith(
        "elementwise kernel over [?x3]"), [k.schedule for k in report.kernels]

    f = stitching.function(lambda t: model(t, training=False), input_signature=sig)
    ref = tf.function(lambda t: model(t, training=False), input_signature=sig)
    for batch in (1, 3):
        x = (np.random.default_rng(batch).random((batch, 20, 20, 3)) * 255).astype(np.float32)
        x[0, 19, 19, 1] = np.nan            # a bottom-right cell: its window is padded
        x[0, 0, 0, 2] = np.inf
        got, want = f(tf.constant(x)).numpy(), ref(tf.constant(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert (np.isnan(got) == np.isnan(want)).all()


def test_gradients_through_a_convolutions_explicit_padding_equal_tf():
    """A tape outside the function differentiates the Conv2D with its explicit padding:
    input and filter gradients equal stock TF's."""
    w = tf.Variable(np.random.default_rng(4).standard_normal((3, 3, 8, 4)).astype(np.float32))

    def fn(x):
        return tf.nn.conv2d(tf.pad(tf.nn.relu(x) * 3.0, [[0, 0], [0, 1], [0, 1], [0, 0]]),
                            w, 2, "VALID")
    gdef, _ = _rewritten(fn, SIG)
    assert "Pad" not in [n.op for n in gdef.node]
    _assert_gradients_equal_tf(fn, w, 4)


def _assert_gradients_equal_tf(fn, w, channels):
    """Input and filter gradients of ``fn`` stitched, through a tape outside the
    function, equal stock TF's."""
    x = tf.constant(np.random.default_rng(5).standard_normal((2, 16, 16, 8)), tf.float32)
    grads = []
    for f in (stitching.function(fn, input_signature=SIG), tf.function(fn)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(f(x) * tf.range(channels, dtype=tf.float32))
        grads.append(tape.gradient(loss, [x, w]))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)


W = np.random.default_rng(0).standard_normal((3, 3, 8, 1)).astype(np.float32)
SIG = [tf.TensorSpec([None, 16, 16, 8], tf.float32)]


def _dw(h):
    return tf.nn.depthwise_conv2d(h, W, [1, 2, 2, 1], "VALID")


@pytest.mark.parametrize("name, fn", [
    ("read twice", lambda x: (lambda p: _dw(p) * 2.0 + tf.reduce_sum(p))(
        tf.pad(tf.nn.relu(x) * 3.0, [[0, 0], [1, 1], [1, 1], [0, 0]]))),
    ("nonzero constant", lambda x: _dw(tf.pad(tf.nn.relu(x) * 3.0,
                                             [[0, 0], [1, 1], [1, 1], [0, 0]],
                                             constant_values=1.0))),
    ("channels padded", lambda x: tf.nn.depthwise_conv2d(
        tf.pad(tf.nn.relu(x) * 3.0, [[0, 0], [1, 1], [1, 1], [0, 1]]),
        np.ones((3, 3, 9, 1), np.float32), [1, 2, 2, 1], "VALID")),
    ("reflect", lambda x: _dw(tf.pad(tf.nn.relu(x) * 3.0, [[0, 0], [1, 1], [1, 1], [0, 0]],
                                     mode="REFLECT"))),
])
def test_pads_that_are_not_only_the_convolutions_zeros_are_kept(name, fn):
    gdef, report = _rewritten(fn, SIG)
    assert _kept_pads(gdef, report), name
    assert not _notes(report)
    x = tf.constant(np.random.default_rng(3).standard_normal((2, 16, 16, 8)), tf.float32)
    np.testing.assert_allclose(stitching.function(fn, input_signature=SIG)(x).numpy(),
                               tf.function(fn)(x).numpy(), rtol=1e-5, atol=1e-5)


def test_a_fetched_pad_is_kept():
    def fn(x):
        p = tf.pad(tf.nn.relu(x) * 3.0, [[0, 0], [0, 1], [0, 1], [0, 0]])
        return _dw(p), p
    gdef, report = _rewritten(fn, SIG)
    assert _kept_pads(gdef, report) == ["Pad"]


def test_gradients_through_the_explicit_padding_equal_tf():
    """A tape outside the function differentiates the convolution with its explicit
    padding (TF's gradient passes explicit_paddings on): input and filter gradients
    equal stock TF's."""
    w = tf.Variable(W)

    def fn(x):
        return tf.nn.depthwise_conv2d(
            tf.pad(tf.nn.relu(x) * 3.0, [[0, 0], [0, 1], [0, 1], [0, 0]]), w,
            [1, 2, 2, 1], "VALID")
    _assert_gradients_equal_tf(fn, w, 8)


def test_candidates_read_only_constant_paddings():
    """Paddings from a placeholder (not a constant) are never folded."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 4])
        p = tf.compat.v1.placeholder(tf.int32, [4, 2])
        y = tf.nn.depthwise_conv2d(tf.pad(x, p), np.ones((3, 3, 4, 1), np.float32),
                                   [1, 1, 1, 1], "VALID")
    assert padfold.candidates(g.as_graph_def(), {y.op.name}) == {}


def test_candidates_do_not_add_attributes_to_the_graph():
    """A convolution whose NodeDef leaves data_format to its default is folded, and no
    node gains an attribute it did not have (an empty one would fail the import)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 4])
        y = tf.nn.depthwise_conv2d(tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]]),
                                   np.ones((3, 3, 4, 1), np.float32), [1, 1, 1, 1], "VALID")
    gdef = g.as_graph_def()
    conv = next(n for n in gdef.node if n.op == "DepthwiseConv2dNative")
    del conv.attr["data_format"]
    before = {n.name: sorted(n.attr) for n in gdef.node}
    found = padfold.candidates(gdef, {y.op.name})
    assert list(found) == [conv.name]
    assert {n.name: sorted(n.attr) for n in gdef.node} == before
