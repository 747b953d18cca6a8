"""Every op in the table, through stitching.function, against stock TF, per dtype.

Each op is wrapped between two cheap ops so the planner forms a region of it
(``Options(min_ops=1)`` keeps even lone ops), inputs include broadcasting and
NaN/±Inf, and results must equal TF's within float rounding (NaN where TF has NaN).
"""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import stitching  # noqa: E402

OPTS = stitching.Options(min_ops=1)
RNG = np.random.default_rng(0)
FLOATS = [tf.float32, tf.float64, tf.float16, tf.bfloat16]
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.5, 1e-30, 80.0, -80.0])

UNARY = {
    "Neg": tf.negative, "Abs": tf.abs, "Square": tf.square, "Sqrt": tf.sqrt,
    "Rsqrt": tf.math.rsqrt, "Reciprocal": tf.math.reciprocal, "Exp": tf.exp,
    "Expm1": tf.math.expm1, "Log": tf.math.log, "Log1p": tf.math.log1p, "Tanh": tf.tanh,
    "Sigmoid": tf.sigmoid, "Relu": tf.nn.relu, "Relu6": tf.nn.relu6,
    "LeakyRelu": lambda x: tf.nn.leaky_relu(x, 0.15), "Elu": tf.nn.elu, "Selu": tf.nn.selu,
    "Softplus": tf.nn.softplus, "Softsign": tf.nn.softsign, "Erf": tf.math.erf,
    "Erfc": tf.math.erfc, "Sign": tf.sign, "Floor": tf.floor, "Ceil": tf.math.ceil,
    "Round": tf.round, "Sin": tf.sin, "Cos": tf.cos,
}
BINARY = {
    "Add": tf.add, "Sub": tf.subtract, "Mul": tf.multiply, "Div": tf.math.truediv,
    "DivNoNan": tf.math.divide_no_nan, "Maximum": tf.maximum, "Minimum": tf.minimum,
    "SquaredDifference": tf.math.squared_difference, "Pow": tf.pow,
}
COMPARE = {"Equal": tf.equal, "NotEqual": tf.not_equal, "Less": tf.less,
           "LessEqual": tf.less_equal, "Greater": tf.greater, "GreaterEqual": tf.greater_equal}


def _floats(shape, dtype):
    x = RNG.standard_normal(shape) * 3
    flat = x.reshape(-1)
    flat[: min(len(SPECIAL), flat.size)] = SPECIAL[: flat.size]
    return tf.constant(x, tf.float64).numpy().astype(dtype.as_numpy_dtype)


def _tol(dtype):
    return {tf.float16: 2e-3, tf.bfloat16: 1.6e-2, tf.float32: 2e-6, tf.float64: 1e-12}[dtype]


def check(fn, *args, sig=None, tol=None, ref64=False):
    """Run fn under tf.function and stitching.function; compare outputs.

    ``ref64``: the reference is fn on float64 copies of the inputs, rounded back.  For
    Softmax: with oneDNN enabled (Intel CPUs), TF's float32 Softmax is oneDNN's, which
    leaves 0 beside a NaN in a row where Eigen (float64), XLA and stitching give a row
    of NaN."""
    sig = sig or [tf.TensorSpec([None] + list(a.shape[1:]), tf.as_dtype(a.dtype)) for a in args]
    if ref64:
        ref = tf.cast(fn(*[tf.constant(a, tf.float64) for a in args]), args[0].dtype)
    else:
        ref = tf.function(fn, input_signature=sig)(*args)
    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    got = sf(*args)
    assert sf.report.kernels, f"nothing was fused: {sf.report.summary()}"
    ref_np, got_np = np.asarray(ref, np.float64) if ref.dtype != tf.bool else ref.numpy(), \
        np.asarray(got, np.float64) if got.dtype != tf.bool else got.numpy()
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if ref.dtype == tf.bool or ref.dtype.is_integer:
        np.testing.assert_array_equal(got_np, ref_np)
    else:
        t = tol if tol is not None else _tol(ref.dtype)
        np.testing.assert_allclose(got_np, ref_np, rtol=t, atol=t, equal_nan=True)
    return sf


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, dtype):
    x = _floats((6, 33), dtype)
    op = UNARY[name]
    # multiplying by one keeps TF's semantics and gives the region a second op
    check(lambda a: op(a * tf.constant(1, dtype)), x, tol=_unary_tol(name, dtype))


def _unary_tol(name, dtype):
    # polynomial forms are a few ulp in float32; TF's own half ops round each step
    base = _tol(dtype)
    if dtype == tf.float32 and name in ("Exp", "Expm1", "Log", "Log1p", "Tanh", "Sigmoid",
                                        "Elu", "Selu", "Softplus", "Erf", "Erfc", "Sin",
                                        "Cos", "Pow"):
        return 2e-6 * 4
    return base


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_with_broadcasting(name, dtype):
    x = _floats((5, 7, 9), dtype)
    y = _floats((7, 1), dtype)
    op = BINARY[name]
    sig = [tf.TensorSpec([None, 7, 9], dtype), tf.TensorSpec([7, 1], dtype)]
    check(lambda a, b: op(a * tf.constant(1, dtype), b), x, y, sig=sig,
          tol=_tol(dtype) * (8 if name == "Pow" else 1))


@pytest.mark.parametrize("dtype", [tf.int32, tf.int64], ids=lambda d: d.name)
@pytest.mark.parametrize("name", ["Add", "Sub", "Mul", "Maximum", "Minimum",
                                  "SquaredDifference"])
def test_integer_binary(name, dtype):
    x = RNG.integers(-1000, 1000, (4, 9)).astype(dtype.as_numpy_dtype)
    y = RNG.integers(-1000, 1000, (1, 9)).astype(dtype.as_numpy_dtype)
    op = BINARY[name]
    check(lambda a, b: op(tf.abs(a), b), x, y,
          sig=[tf.TensorSpec([None, 9], dtype), tf.TensorSpec([1, 9], dtype)])


@pytest.mark.parametrize("name", sorted(COMPARE))
def test_comparisons_and_select(name):
    x = _floats((4, 16), tf.float32)
    y = _floats((4, 16), tf.float32)[::-1].copy()
    cmp = COMPARE[name]
    check(lambda a, b: tf.where(cmp(a, b), a, b * 2.0), x, y)


def test_logical_ops():
    # Finite inputs: stock TF's Grappler rewrites logical_not(a < 5) into a >= 5, which
    # differs for NaN; the stitched kernel keeps the IEEE meaning of the graph as written.
    x = np.nan_to_num(_floats((4, 16), tf.float32), nan=0.25, posinf=7.0, neginf=-7.0)
    check(lambda a: tf.cast(tf.logical_or(tf.logical_and(a > 0, a < 2), tf.logical_not(a < 5)),
                            tf.float32), x)


@pytest.mark.parametrize("src,dst", [
    (tf.float32, tf.int32), (tf.float32, tf.float64), (tf.float64, tf.float16),
    (tf.float32, tf.bfloat16), (tf.int32, tf.float32), (tf.int64, tf.int32),
    (tf.float32, tf.bool), (tf.bool, tf.float32), (tf.float16, tf.float32)],
    ids=lambda d: d.name)
def test_cast(src, dst):
    if src == tf.bool:
        x = RNG.standard_normal((4, 8)) > 0
    elif src.is_integer:
        x = RNG.integers(-2 ** 31, 2 ** 31 - 1, (4, 8)).astype(src.as_numpy_dtype)
    else:
        x = (RNG.standard_normal((4, 8)) * 100).astype(src.as_numpy_dtype)
    check(lambda a: tf.cast(tf.identity(a), dst) if src == tf.bool else
          tf.cast(tf.abs(a) if src.is_integer and dst == tf.int32 and src == tf.int64
                  else a * tf.constant(1, src), dst), x)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("red", ["reduce_sum", "reduce_mean", "reduce_max", "reduce_min",
                                 "reduce_prod"])
@pytest.mark.parametrize("axis,keep", [(-1, True), (-1, False), (0, True), (0, False)])
def test_reductions(red, dtype, axis, keep):
    x = (RNG.standard_normal((6, 40)) * (0.5 if red == "reduce_prod" else 2)) \
        .astype(dtype.as_numpy_dtype)
    x[1, 3] = np.nan
    op = getattr(tf, red)
    tol = _tol(dtype) * (40 if dtype == tf.float16 else 8)
    check(lambda a: op(a * tf.constant(1, dtype), axis=axis, keepdims=keep) + tf.constant(1, dtype),
          x, tol=tol)


def test_softmax_logsoftmax_batchnorm_biasadd():
    x = _floats((5, 32), tf.float32)
    check(lambda a: tf.nn.softmax(a * 2.0), x, tol=1e-5, ref64=True)
    check(lambda a: tf.nn.log_softmax(a * 2.0), x, tol=1e-5)
    b = RNG.standard_normal(32).astype(np.float32)
    check(lambda a: tf.nn.relu(tf.nn.bias_add(a, b)), x)
    img = RNG.standard_normal((2, 4, 4, 8)).astype(np.float32)
    sc, off, mu, var = (RNG.random(8).astype(np.float32) + 0.5 for _ in range(4))
    check(lambda a: tf.nn.relu6(tf.compat.v1.nn.fused_batch_norm(
        a, sc, off, mu, var, epsilon=1e-3, is_training=False)[0]), img, tol=1e-5)


def test_fill_likes_and_clip():
    x = _floats((3, 10), tf.float32)
    check(lambda a: tf.clip_by_value(a + tf.ones_like(a), -1.0, 2.0) + tf.zeros_like(a), x)


TRAINING_BINARY = {   # (first, second) as TF's raw op takes them
    "ReluGrad": lambda a, b: tf.raw_ops.ReluGrad(gradients=a, features=b),
    "Relu6Grad": lambda a, b: tf.raw_ops.Relu6Grad(gradients=a, features=b * 4.0),
    "EluGrad": lambda a, b: tf.raw_ops.EluGrad(gradients=a, outputs=b),
    "SeluGrad": lambda a, b: tf.raw_ops.SeluGrad(gradients=a, outputs=b),
    "SoftplusGrad": lambda a, b: tf.raw_ops.SoftplusGrad(gradients=a, features=b),
    "SigmoidGrad": lambda a, b: tf.raw_ops.SigmoidGrad(y=a, dy=b),
    "TanhGrad": lambda a, b: tf.raw_ops.TanhGrad(y=a, dy=b),
    "AddN": lambda a, b: tf.raw_ops.AddN(inputs=[a, b, a * b]),
}


@pytest.mark.parametrize("dtype", [tf.float32, tf.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(TRAINING_BINARY))
def test_training_ops_match_tf(name, dtype):
    a, b = _floats((6, 16), dtype), _floats((6, 16), dtype)[::-1].copy()
    # float16: kernels compute in float32 where TF rounds each op to half, so the
    # oracle is float64 (rounded back), as for the other half-precision tests
    sf = check(TRAINING_BINARY[name], a, b, ref64=dtype == tf.float16)
    fused = {t for k in sf.report.kernels for _, t in k.ops}
    # AddN reaches the IR as TF's own order of Adds (tf/passes/grappler.py expands it)
    assert name in fused if name != "AddN" else "AddV2" in fused, fused


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_bias_add_grad_and_l2_loss_reduce_like_tf(fmt):
    g = RNG.standard_normal((4, 3, 5, 8)).astype(np.float32)
    sf = check(lambda x: tf.raw_ops.BiasAddGrad(out_backprop=x * 2.0, data_format=fmt), g,
               tol=1e-5)
    fused = [t for k in sf.report.kernels for _, t in k.ops if t != "Identity"]
    if fmt == "NHWC":       # a column reduction over [N*H*W, C]
        assert fused == ["Mul", "BiasAddGrad"]
    else:                   # axes (0, 2, 3): left to TF, with the schedule's reason
        assert fused == ["Mul"] and "neither a row reduction" in sf.report.summary()
    check(lambda x: tf.raw_ops.L2Loss(t=x - 1.0), g, tol=1e-5)


def test_tile_of_size_one_axes_is_a_fused_broadcast():
    x = _floats((4, 1, 1, 8), tf.float32)
    sf = check(lambda a: tf.tile(a * 2.0, [1, 3, 5, 1]) - 1.0, x,
               sig=[tf.TensorSpec([4, 1, 1, 8], tf.float32)])
    assert "Tile" in {t for k in sf.report.kernels for _, t in k.ops}
    sf = check(lambda a: tf.broadcast_to(a[:, :, :, :1] + 1.0, [3, 4, 5, 2, 8]) * 2.0, x,
               sig=[tf.TensorSpec([4, 1, 1, 8], tf.float32)])
    assert "BroadcastTo" in {t for k in sf.report.kernels for _, t in k.ops}
    # a Tile that repeats a real axis is not a broadcast: left to TF, with the reason
    y = _floats((4, 2), tf.float32)
    sf = stitching.function(lambda a: tf.tile(a * 2.0, [1, 3]) - 1.0, options=OPTS)
    np.testing.assert_array_equal(sf(y).numpy(), (tf.tile(y * 2.0, [1, 3]) - 1.0).numpy())
    assert "not a broadcast" in sf.report.summary()


def _one_kernel_of(sf, *ops):
    kernels = [{t for _, t in k.ops} for k in sf.report.kernels]
    assert len(kernels) == 1 and set(ops) <= kernels[0], sf.report.summary()


@pytest.mark.parametrize("batch", [1, 3])
def test_broadcast_to_a_run_time_batch_reads_the_batch_from_its_source(batch):
    """A class token broadcast to ``[shape(x)[0], 1, d]``: one kernel with its
    consumers, which takes the batch from x's shape (one compile for every batch)."""
    token = tf.Variable(_floats((1, 1, 8), tf.float32))
    sig = [tf.TensorSpec([None, 5, 8], tf.float32)]

    def fn(x):
        t = tf.broadcast_to(token, tf.stack([tf.shape(x)[0], 1, 8]))
        return t * 3.0 + tf.reduce_sum(x, 1, keepdims=True)

    x = _floats((batch, 5, 8), tf.float32)
    sf = check(fn, x, sig=sig)
    _one_kernel_of(sf, "BroadcastTo", "Mul")
    # keras.ops.repeat / tf.tile with a run-time multiple on a size-1 axis: the same
    sf = check(lambda x: tf.tile(token, tf.stack([tf.shape(x)[0], 1, 1])) - x[:, :1, :],
               x, sig=sig)
    _one_kernel_of(sf, "Tile")


def test_broadcast_to_the_shape_of_another_tensor_is_fused():
    """TF's gradient of a reduction over a run-time batch broadcasts to Shape(x)."""
    x = _floats((6, 4, 8), tf.float32)
    sf = check(lambda a: tf.broadcast_to(tf.reduce_sum(a, 0, keepdims=True) * 0.5,
                                         tf.shape(a)) + a, x, tol=1e-5)
    assert "BroadcastTo" in {t for k in sf.report.kernels for _, t in k.ops}


def test_broadcast_to_run_time_sizes_it_cannot_prove_stays_tf_with_the_reason():
    x = _floats((3, 4), tf.float32)
    sig = [tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None, 1], tf.float32)]

    def fn(a, b):     # b's unknown dim may be 1 at run time (TF broadcasts it then)
        return tf.broadcast_to(b * 2.0, tf.shape(a)) + 1.0

    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    b = x[:, :1]
    np.testing.assert_array_equal(sf(x, b).numpy(), fn(x, b).numpy())
    np.testing.assert_array_equal(sf(x, b[:1]).numpy(), fn(x, b[:1]).numpy())
    assert "may be 1 and broadcast when the op runs" in sf.report.summary()


def test_softmax_cross_entropy_two_outputs_match_tf():
    """A two-output composite: loss [N] and backprop [N, C] from one row kernel."""
    logits = _floats((6, 10), tf.float32)[::-1].copy()
    logits[0, :] = RNG.standard_normal(10)          # a row without NaN/Inf too
    labels = tf.nn.softmax(RNG.standard_normal((6, 10))).numpy().astype(np.float32)

    def fn(a, b):
        loss, backprop = tf.raw_ops.SoftmaxCrossEntropyWithLogits(features=a * 1.5, labels=b)
        return loss * 2.0, backprop - 1.0

    sig = [tf.TensorSpec([None, 10], tf.float32)] * 2
    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    got, want = sf(logits, labels), tf.function(fn, input_signature=sig)(logits, labels)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-5, equal_nan=True)
    ops = [t for k in sf.report.kernels for _, t in k.ops]
    assert "SoftmaxCrossEntropyWithLogits" in ops and len(sf.report.kernels) == 1


def test_dropout_mask_is_tf_s_and_the_report_says_why():
    keras = pytest.importorskip("keras")
    layer = keras.layers.Dropout(0.5, seed=7)
    x = _floats((8, 32), tf.float32)
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)

    def fn(a):
        return layer(a * 2.0, training=True) + 1.0

    want = tf.function(fn)(x)                  # the seed generator advanced once
    layer.seed_generator.state.assign(layer.seed_generator.state - [0, 1])
    sf = stitching.function(fn)
    got = sf(x)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    assert "Philox" in sf.report.summary()


def test_random_numbers_and_their_math_are_counted_and_fused_not_shape_arithmetic():
    """Regression: random numbers take only constants or shapes as inputs, and were
    taken for shape arithmetic with all the math on them: tf.nn.dropout's mask was
    left to TF and out of the report's counts.  Random numbers are data, new at each
    call (the ops stay TF's, for TF's Philox stream); the math on them fuses."""
    def fn(x):
        noise = tf.random.stateless_uniform([256, 256], seed=[3, 1]) * 0.1 + 1.0
        keep = tf.random.stateless_uniform([256, 256], seed=[4, 1]) >= 0.5
        return tf.where(keep, x * noise, 0.0) + 1.0

    x = tf.constant(_floats((256, 256), tf.float32))
    sf = stitching.function(fn, options=stitching.Options(background_compile=False))
    np.testing.assert_allclose(sf(x).numpy(), tf.function(fn)(x).numpy(), rtol=1e-6,
                               equal_nan=True)
    rep = sf.report
    fused = [t for k in rep.kernels for _, t in k.split_ops()[0]]
    assert sorted(fused) == sorted(["Mul", "AddV2", "GreaterEqual", "Mul", "SelectV2",
                                    "AddV2"]), rep.summary()
    assert rep.unfused and all("Random" in op for _, op, _ in rep.unfused), rep.summary()
    assert rep.memory_intensive_ops == 6 + len(rep.unfused)
