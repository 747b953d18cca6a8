"""tf/passes/xladot.py: matrix products run by XLA's dot where TF's GEMM is Eigen's."""
import numpy as np
import tensorflow as tf

import stitching
from stitching.tf.passes import xladot

EIGEN = "amd-avx2"          # a machine model whose TF runs Eigen's GEMM (oneDNN off)
ON = stitching.Options(xla_gemm=True)      # opt-in (stitching/options.py says why)


class _Block:
    """Dense + exact GELU, Dense (no bias), residual, LayerNorm, then attention-like
    products (two BatchMatMulV2): Keras layers called inside a function."""

    def __init__(self, name="blk", d=64, ff=256):
        import keras
        keras.utils.set_random_seed(5)
        L = keras.layers
        self.ff1 = L.Dense(ff, activation="gelu", name=f"{name}_ff1")
        self.ff2 = L.Dense(d, use_bias=False, name=f"{name}_ff2")
        self.ln = L.LayerNormalization(epsilon=1e-6, name=f"{name}_ln")
        self.__call__(tf.zeros([1, 16, d]))
        self.weights = self.ff1.weights + self.ff2.weights + self.ln.weights

    def __call__(self, x):
        y = self.ln(x + self.ff2(self.ff1(x)))
        s = tf.nn.softmax(tf.matmul(y, y, transpose_b=True) * 0.125)
        return tf.matmul(s, y)


def _calls(f, x):
    """(XLA calls, plain products) in the stitched graph ``f`` runs on ``x``."""
    gd = f.get_concrete_function(tf.TensorSpec([None] + list(x.shape[1:]), x.dtype)) \
        .graph.as_graph_def()
    ops = [n for n in gd.node if n.op == "PartitionedCall" and
           n.attr["f"].func.name.startswith(xladot.PREFIX)]
    plain = [n for n in gd.node if n.op in xladot.PRODUCTS]
    return ops, plain, gd


def test_products_run_as_xla_dots_under_an_eigen_machine_and_equal_tf(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    model = _Block()
    sig = [tf.TensorSpec([None, 16, 64], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig, options=ON)
    # (without the fused attention, which would take the softmax kernel between the
    # products into one op where they are OpenBLAS's)
    off = stitching.function(lambda t: model(t), input_signature=sig,
                             options=stitching.Options(xla_gemm=False,
                                                       fused_attention=False))
    x = np.random.default_rng(1).standard_normal((3, 16, 64)).astype(np.float32)
    x[1, 4, 9] = np.nan                              # one token's row goes NaN
    got = f(tf.constant(x)).numpy()
    want = tf.function(lambda t: model(t))(tf.constant(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    calls, plain, gd = _calls(f, x)
    # ff1 (with its BiasAdd), ff2 and the two attention products; shared by signature
    assert len(calls) == 4 and not plain, [n.op for n in gd.node]
    assert sum(n.op == "BiasAdd" for n in gd.node) == 0
    assert all(n.attr["_XlaMustCompile"].b for n in calls)
    lib = {fd.signature.name: fd for fd in gd.library.function}
    assert all(lib[n.attr["f"].func.name].attr["_XlaMustCompile"].b for n in calls)
    assert [n for n in f.report.notes if "XLA's dot" in n][0].startswith(
        "4 matrix product(s) run by XLA's dot")
    # the kernels are the same with and without (only the products moved)
    off(tf.constant(x))
    assert len(f.report.kernels) == len(off.report.kernels) >= 1
    assert not _calls(off, x)[0]
    # against float64: no less accurate than the products left to TF
    xf = np.nan_to_num(x)
    # against float64: the products carry XLA's rounding (its dot sums in another
    # order than Eigen's; on a [128, 1024] x [1024, 256] product ~3x TF's largest
    # error, 3e-6 on values ~2): no worse than twice TF's or XLA's own
    tf32 = tf.function(lambda t: model(t))(tf.constant(xf)).numpy()
    xla = tf.function(lambda t: model(t), jit_compile=True)(tf.constant(xf)).numpy()
    st = f(tf.constant(xf)).numpy()
    ref = _reference64(model, xf.astype(np.float64))
    assert np.abs(st - ref).max() <= 2 * max(np.abs(tf32 - ref).max(),
                                             np.abs(xla - ref).max()) + 1e-6


def _reference64(model, x):
    import math
    w1, b1, w2, gamma, beta = [v.numpy().astype(np.float64) for v in model.weights]
    a = x @ w1 + b1
    h = 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))
    z = x + h @ w2
    mu = z.mean(-1, keepdims=True)
    var = ((z - mu) ** 2).mean(-1, keepdims=True)
    y = (z - mu) / np.sqrt(var + 1e-6) * gamma + beta
    s = y @ np.swapaxes(y, 1, 2) * 0.125
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ y


def test_only_where_tf_runs_eigen(machine):
    model = _Block(name="m")
    sig = [tf.TensorSpec([None, 16, 64], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig, options=ON)
    x = tf.constant(np.random.default_rng(2).standard_normal((2, 16, 64)), tf.float32)
    f(x)
    calls, plain, _ = _calls(f, x)
    if machine.tf_onednn:
        assert not calls and len(plain) == 4, machine.name
    else:
        assert len(calls) == 4 and not plain, machine.name


def test_gradients_through_the_dots_match_tf(monkeypatch):
    """A tape outside: each call differentiated through _dot_grad; attention's y y^T reads
    one tensor twice, and each operand gets its own partial (regression: both got the
    sum, 3.6% off on the LayerNorm scale)."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    model = _Block(name="g")
    sig = [tf.TensorSpec([None, 16, 64], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig, options=ON)
    x = tf.constant(np.random.default_rng(3).standard_normal((2, 16, 64)), tf.float32)
    grads = []
    for g in (f, tf.function(lambda t: model(t))):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(g(x) * tf.range(64, dtype=tf.float32))
        grads.append(tape.gradient(loss, [x] + model.weights))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-3, atol=1e-3)
    assert _calls(f, x)[0]


def _graph(*nodes):
    from tensorflow.core.framework import graph_pb2
    gd = graph_pb2.GraphDef()
    for name, op, inputs in nodes:
        nd = gd.node.add(name=name, op=op, input=inputs)
        if op in ("MatMul", "BiasAdd", "Placeholder", "AddV2"):
            nd.attr["T" if op != "Placeholder" else "dtype"].type = tf.float32.as_datatype_enum
    return gd


def test_a_bias_is_taken_in_only_from_a_matmul_it_alone_reads():
    gd = _graph(("a", "Placeholder", []), ("w", "Placeholder", []), ("b", "Placeholder", []),
                ("mm1", "MatMul", ["a", "w"]), ("ba1", "BiasAdd", ["mm1", "b"]),
                ("mm2", "MatMul", ["a", "w"]), ("ba2", "BiasAdd", ["mm2:0", "b"]),
                ("use", "AddV2", ["mm2", "ba2"]),                 # mm2 read twice
                ("mm3", "MatMul", ["a", "w"]), ("ba3", "BiasAdd", ["mm3", "b"]))
    pairs = xladot.candidates(gd, fetched={"mm3"})              # mm3 is fetched
    assert [(p.name, b.name if b is not None else None) for p, b in pairs] == [
        ("mm1", "ba1"), ("mm2", None), ("mm3", None)]
    fdefs = xladot.rewrite(gd, pairs)
    by = {n.name: n for n in gd.node}
    assert "mm1" not in by and by["ba1"].op == "PartitionedCall"
    assert list(by["ba1"].input) == ["a", "w", "b"]
    assert by["mm2"].op == by["mm3"].op == "PartitionedCall" and by["ba2"].op == "BiasAdd"
    # two signatures (with and without the bias): two functions, each defined once
    assert len(fdefs) == 2 and len(gd.library.function) == 2
    assert by["mm2"].attr["f"].func.name == by["mm3"].attr["f"].func.name


def test_a_saved_model_keeps_the_dots_and_their_gradient(monkeypatch, tmp_path):
    """tf.saved_model.save traces every custom gradient (ours with no op): saving works,
    and the loaded function runs and differentiates (this process's registration)."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    model = _Block(name="sv")
    m = tf.Module()
    m.weights = model.weights
    m.f = stitching.function(lambda t: model(t),
                             input_signature=[tf.TensorSpec([None, 16, 64], tf.float32)],
                             options=ON)
    x = tf.constant(np.random.default_rng(4).standard_normal((2, 16, 64)), tf.float32)
    want = m.f(x).numpy()
    assert _calls(m.f, x)[0]
    tf.saved_model.save(m, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    np.testing.assert_array_equal(loaded.f(x).numpy(), want)
    grads = []
    for f in (loaded.f, m.f):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(f(x))
        grads.append(tape.gradient(loss, x).numpy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5)
