"""Convolution epilogues left to TF's remapper (plan/epilogue.py, tf/passes/remapper.py).

Planner level on hand-built IR (TF-free), then a small Keras conv block end to end:
its kernel count, its values against TF, float64, and an unknown batch with one trace.
"""
import numpy as np
import pytest

from irbuild import F, G, allow_all
from stitching.ir import Node, TensorType, ValueRef
from stitching.plan import epilogue, profiles, search

CPU = search.SearchConfig(profile=profiles.get("cpu-reference"))


def conv(b, name, x, shape, op="Conv2D", dtype=F):
    b.g.add(Node(name, op, [ValueRef(x)], {}, [TensorType(dtype, tuple(shape))]))
    return b


def se_squeeze(shape=(8, 1, 1, 32), dtype=F, with_identity=True, anchor="Const"):
    """x -> Conv2D -> BiasAdd -> [Identity ->] Sigmoid, Mul(b, s) -> Conv2D: Keras'
    Conv2D(activation="swish") between two convolutions (EfficientNet's SE reduce)."""
    b = G().input("x", shape, dtype).input("bias", shape[-1:], dtype)
    b = conv(b, "conv", "x", shape, dtype=dtype)
    b.composite("ba", "BiasAdd", ["conv", "bias"], data_format="NHWC")
    src = "ba"
    if with_identity:
        b.op("one", "Const", [], value=1.0, dtype=dtype, shape=[])
        b.op("id", "Identity", ["ba"])
        b.g["id"].control_inputs = ["one" if anchor == "Const" else "x"]
        src = "id"
    b.op("sig", "Sigmoid", [src]).op("mul", "Mul", ["ba", "sig"])
    return conv(b, "conv2", "mul", shape, dtype=dtype).build("conv2")


def plan(g, remapper=epilogue.ONEDNN):
    epilogue.mark(g, remapper)
    return search.plan(g, allow_all, 2, CPU)


def test_swish_after_a_conv_is_left_to_tf_with_the_reason():
    g = se_squeeze()
    p = plan(g)
    assert p.regions == []
    why = {n: r for n, _, r in p.unfused}
    assert set(why) == {"ba", "sig", "mul"}
    for r in why.values():
        assert "TF's remapper fuses it into the convolution's epilogue" in r
        assert "Conv2D + BiasAdd + swish" in r
    assert any("1 convolution epilogue(s)" in n for n in p.notes)


def test_same_graph_without_the_remapper_is_one_kernel():
    # what the planner did before (and does where TF would not fuse: float64, GPU plans)
    (r,) = plan(se_squeeze(), epilogue.NONE).regions
    assert sorted(r.nodes) == ["ba", "id", "mul", "sig"]
    (r,) = plan(se_squeeze(dtype="float64")).regions          # oneDNN: float32 only
    assert sorted(r.nodes) == ["ba", "id", "mul", "sig"]


def test_eigen_remapper_fuses_bias_but_not_swish():
    p = plan(se_squeeze(), epilogue.EIGEN)
    why = {n: r for n, _, r in p.unfused}
    assert "TF's remapper" not in why.get("sig", "") and "TF's remapper" not in why.get("mul", "")
    (conv, bias, acts), = epilogue.find(se_squeeze(), epilogue.EIGEN)
    assert (conv, bias, acts) == ("conv", ["ba"], [])


def test_swish_pattern_needs_identity_anchored_to_a_constant_and_one_reader():
    assert epilogue.find(se_squeeze(), epilogue.ONEDNN)[0][2] == ["id", "sig", "mul"]
    assert epilogue.find(se_squeeze(with_identity=False), epilogue.ONEDNN)[0][2] == \
        ["sig", "mul"]
    # a control edge on a real op orders something: the remapper would not fuse
    assert epilogue.find(se_squeeze(anchor="x"), epilogue.ONEDNN)[0][2] == []
    # depthwise: oneDNN fuses BiasAdd (+ Relu...) but runs swish as an op of its own
    g = se_squeeze()
    g["conv"].op = "DepthwiseConv2dNative"
    assert epilogue.find(g, epilogue.ONEDNN) == [("conv", ["ba"], [])]


def relu_then_more_work(second_reader=False):
    """conv -> BiasAdd -> Relu -> x * 2 + 1 -> Tanh (large): more fusible work after."""
    shape = (8, 32, 32, 64)
    b = G().input("x", shape).input("bias", shape[-1:])
    b = conv(b, "conv", "x", shape)
    b.composite("ba", "BiasAdd", ["conv", "bias"], data_format="NHWC")
    b.op("r", "Relu", ["ba"]).op("two", "Const", [], value=2.0, dtype=F, shape=[])
    b.op("m", "Mul", ["r", "two"]).op("a", "Add", ["m", "two"]).op("t", "Tanh", ["a"])
    outs = ["t"]
    if second_reader:
        b.op("n", "Neg", ["ba"])
        outs.append("n")
    return b.build(*outs)


def test_work_after_an_epilogue_still_fuses_and_the_epilogue_stays_in_the_conv():
    p = plan(relu_then_more_work())
    assert [sorted(r.nodes) for r in p.regions] == [["a", "m", "t"]]
    why = {n: r for n, _, r in p.unfused}
    assert set(why) == {"ba", "r"} and "Conv2D + BiasAdd + Relu" in why["r"]


def test_a_bias_read_twice_keeps_no_activation_and_its_readers_fuse():
    g = relu_then_more_work(second_reader=True)
    assert epilogue.find(g, epilogue.ONEDNN) == [("conv", ["ba"], [])]
    p = plan(g)
    fused = {n for r in p.regions for n in r.nodes}
    assert fused >= {"r", "m", "a", "t", "n"}
    # the BiasAdd is free in the conv or in the kernel reading it (a tie the search may
    # break either way); left to TF, the report says why
    assert all("TF's remapper" in why for n, _, why in p.unfused if n == "ba")


def test_a_fused_bias_ends_its_group_in_the_report():
    g = se_squeeze()
    epilogue.mark(g, epilogue.ONEDNN)
    assert epilogue.left_to_tf(g, {"ba", "id", "sig", "mul"}) == {}
    left = epilogue.left_to_tf(g, {"mul"})          # the swish is broken: bias only
    assert set(left) == {"ba"}
    assert "(Conv2D + BiasAdd: one TF op with the convolution" in left["ba"]


# ---- end to end ------------------------------------------------------------------------

tf = pytest.importorskip("tensorflow")
from stitching.tf.passes import remapper  # noqa: E402


def conv_block(dtype="float32"):
    import keras
    keras.utils.set_random_seed(7)
    L = keras.layers
    inp = keras.Input((8, 8, 16), dtype=dtype)
    a = L.Conv2D(16, 3, padding="same", activation="swish", dtype=dtype)(inp)   # epilogue
    b = L.Conv2D(16, 1, activation="relu", dtype=dtype)(a)                      # epilogue
    y = L.Activation("tanh", dtype=dtype)(L.BatchNormalization(dtype=dtype)(b)) + inp
    return keras.Model(inp, y)


def _run(model, dtype, batches=(4,)):
    import stitching
    sig = [tf.TensorSpec([None, 8, 8, 16], dtype)]
    st = stitching.function(lambda x: model(x, training=False), input_signature=sig)
    ref = tf.function(lambda x: model(x, training=False), input_signature=sig)
    rng = np.random.default_rng(1)
    for n in batches:
        x = tf.constant(rng.standard_normal((n, 8, 8, 16)).astype(dtype))
        yield st, st(x).numpy(), ref(x).numpy()


def _fused_in_tf(model):
    """(the StitchedFunction, the fused_ops of every op TF ran, the op types TF ran)."""
    from tensorflow.python.eager import context
    context.enable_run_metadata()          # the graphs TF runs, after its Grappler
    try:
        for st, got, want in _run(model, "float32", batches=(4, 7)):   # unknown batch
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        meta = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    (graph,) = {id(fg): fg for fg in meta.function_graphs for pg in fg.partition_graphs
                for n in pg.node if n.op == "StitchedKernel"}.values()
    nodes = [n for pg in graph.partition_graphs for n in pg.node]
    fused = sorted(tuple(s.decode() for s in n.attr["fused_ops"].list.s)
                   for n in nodes if "fused_ops" in n.attr)
    return st, fused, [n.op for n in nodes]


@pytest.mark.skipif(not remapper.onednn_enabled(),
                    reason="the kernel count and fused ops are oneDNN's remapper's")
def test_keras_conv_block_leaves_bias_swish_to_tf_and_matches_it(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "intel-avx512")   # oneDNN on, as here
    st, fused, ops = _fused_in_tf(conv_block())
    # both epilogues run inside their convolutions, the swish too (no _MklSwish of its own)
    assert fused == [("BiasAdd", "Relu"), ("BiasAdd", "_MklSwish")]
    assert not [op for op in ops if op in ("_MklSwish", "Sigmoid", "BiasAdd", "Relu")]
    assert len(st.reports) == 1                                   # one trace
    rep = st.report.to_dict()
    assert rep["kernels"] == 1                         # BatchNormalization + tanh + add
    (k,) = rep["kernel_details"]
    assert "BiasAdd" not in k["ops"] and "Tanh" in k["ops"]
    reasons = [u for u in rep["unfused_nodes"] if "remapper" in u["reason"]]
    assert sorted(u["op"] for u in reasons) == ["BiasAdd", "BiasAdd", "Mul", "Relu", "Sigmoid"]


@pytest.mark.skipif(remapper.onednn_enabled(),
                    reason="checks Eigen's remapper, which runs where oneDNN is off")
def test_keras_conv_block_under_eigen_leaves_bias_relu_to_tf_and_stitches_the_swish(
        monkeypatch):
    """The Eigen table (plan/epilogue.py) against the TF running here: Conv2D's BiasAdd
    and ReLU run inside _FusedConv2D, its swish does not, so the swish is stitched."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "amd-avx2")    # oneDNN off, as here
    st, fused, ops = _fused_in_tf(conv_block())
    assert ("BiasAdd", "Relu") in fused, fused
    assert "Relu" not in ops and "Sigmoid" not in ops and "_MklSwish" not in ops, ops
    kernels = st.report.to_dict()["kernel_details"]
    assert any({"Sigmoid", "Mul"} <= set(k["ops"]) for k in kernels), kernels


def test_keras_conv_block_float32_error_against_float64_is_tf_s():
    m32, m64 = conv_block(), conv_block("float64")
    m64.set_weights([w.astype(np.float64) for w in m32.get_weights()])
    ((st, got, want),) = list(_run(m32, "float32"))
    x = np.random.default_rng(1).standard_normal((4, 8, 8, 16)).astype(np.float32)  # _run's
    exact = m64(tf.constant(x.astype(np.float64)), training=False).numpy()
    err_st, err_tf = np.abs(got - exact).max(), np.abs(want - exact).max()
    assert err_st <= 2 * err_tf + 1e-7, (err_st, err_tf)


def test_keras_conv_block_in_float64_fuses_its_epilogues_and_stays_exact():
    model = conv_block("float64")
    ((st, got, want),) = list(_run(model, "float64"))
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    rep = st.report.to_dict()
    assert not any("remapper" in u["reason"] for u in rep["unfused_nodes"])
    assert rep["kernels"] == 2                         # bias+swish; bias+relu+BN+tanh+add


def _dense_bias(dtype):
    """x -> MatMul -> BiasAdd, the product opaque: a Keras Dense layer's forward."""
    b = G().input("x", (8, 16), dtype).input("bias", (16,), dtype)
    b = conv(b, "mm", "x", (8, 16), op="MatMul", dtype=dtype)
    b.composite("ba", "BiasAdd", ["mm", "bias"], data_format="NHWC")
    return b.op("t", "Tanh", ["ba"]).build("t")


def test_a_bfloat16_products_bias_stays_tfs_where_onednn_adds_it_before_rounding():
    """oneDNN's fused product adds a bfloat16 bias to its float32 accumulator and
    rounds once; a kernel taking the BiasAdd read the product rounded to bfloat16
    first (a Keras Dense layer under mixed_bfloat16: 251 ulps against stock's 0.5).
    The BiasAdd stays TF's there, with the reason; float32 products (rounded to float32
    either way) and TF without oneDNN plan as before."""
    g = _dense_bias("bfloat16")
    assert epilogue.pin_rounding(g, epilogue.ONEDNN) == 1
    p = search.plan(g, allow_all, 2, CPU)
    assert not any("ba" in r.nodes for r in p.regions)
    why = g["ba"].attrs["unfusible"]          # the reason the report shows
    assert "adds the bias inside the product" in why and "bfloat16" in why
    for dtype, table in (("float32", epilogue.ONEDNN), ("bfloat16", epilogue.EIGEN)):
        g = _dense_bias(dtype)
        assert epilogue.pin_rounding(g, table) == 0
        (r,) = search.plan(g, allow_all, 2, CPU).regions
        assert sorted(r.nodes) == ["ba", "t"]


def _dense_gelu(dtype, half=0.5, fetch_erfc=False):
    """x -> MatMul -> BiasAdd -> tf.nn.gelu (exact) as Grappler leaves it:
    0.5 * ba * erfc(-ba * 1/sqrt(2)), then a Tanh reading it."""
    b = G().input("x", (8, 16), dtype).input("bias", (16,), dtype)
    b = conv(b, "mm", "x", (8, 16), op="MatMul", dtype=dtype)
    b.composite("ba", "BiasAdd", ["mm", "bias"], data_format="NHWC")
    b.op("c_half", "Const", [], value=half, dtype=dtype, shape=[])
    b.op("c_sqrt_half", "Const", [], value=0.70703125, dtype=dtype, shape=[])
    b.op("g_half", "Mul", ["c_half", "ba"])
    b.op("g_neg", "Neg", ["ba"])
    b.op("g_scaled", "Mul", ["g_neg", "c_sqrt_half"])
    b.op("g_erfc", "Erfc", ["g_scaled"])
    b.op("g_out", "Mul", ["g_half", "g_erfc"])
    b.op("t", "Tanh", ["g_out"])
    return b.build(*(["t", "g_erfc"] if fetch_erfc else ["t"]))


GELU = ["g_half", "g_neg", "g_scaled", "g_erfc", "g_out"]


def test_a_bfloat16_dense_gelu_stays_tfs_with_its_bias_where_onednn_fuses_them():
    """oneDNN's fused product takes tf.nn.gelu after the bias too (fused_ops BiasAdd,
    GeluExact) and rounds once: a kernel computing the GELU from the rounded BiasAdd
    was at 0.51 ulp mean against stock's 0.27.  Where the bias stays TF's, so does
    that GELU; not in float32, nor without oneDNN, nor where the pattern is not TF's
    (another constant, an intermediate fetched)."""
    g = _dense_gelu("bfloat16")
    assert epilogue.pin_rounding(g, epilogue.ONEDNN) == 1
    for n in GELU:
        assert "fuses this GELU with the product" in g[n].attrs["unfusible"], n
    assert not any(set(GELU) & set(r.nodes) for r in search.plan(g, allow_all, 2, CPU).regions)
    for dtype, table in (("float32", epilogue.ONEDNN), ("bfloat16", epilogue.EIGEN)):
        g = _dense_gelu(dtype)
        epilogue.pin_rounding(g, table)
        assert not any("unfusible" in g[n].attrs for n in GELU), (dtype, table.name)
        (r,) = search.plan(g, allow_all, 2, CPU).regions
        assert set(GELU) < set(r.nodes)
    for g in (_dense_gelu("bfloat16", half=0.25), _dense_gelu("bfloat16", fetch_erfc=True)):
        assert epilogue.pin_rounding(g, epilogue.ONEDNN) == 1     # the bias still is
        assert not any("unfusible" in g[n].attrs for n in GELU)


@pytest.mark.skipif(not remapper.onednn_enabled(),
                    reason="the single rounding is oneDNN's fused product's")
def test_a_bfloat16_dense_gelu_is_tfs_bit_for_bit():
    """End to end: the GELU and the bias left to TF's remapper, which fuses them with
    the product as in stock TF (it needs Grappler's arithmetic optimizer to pass over
    the GELU again: tf/passes/grappler.py drops the marks its own run left).  Without
    that, the same graph ran the GELU as five bfloat16 ops (0.70 ulp mean)."""
    import stitching
    from stitching.testing.counting import profiled_ops
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((64, 128)), tf.bfloat16)
    w = tf.constant(rng.standard_normal((128, 128)) / 11, tf.bfloat16)
    bias = tf.constant(rng.standard_normal(128), tf.bfloat16)

    def dense(x, w, bias):
        return tf.nn.gelu(tf.nn.bias_add(tf.matmul(x, w), bias))
    st = stitching.function(dense)
    got, want = st(x, w, bias), tf.function(dense)(x, w, bias)
    np.testing.assert_array_equal(got.numpy().astype(np.float32),
                                  want.numpy().astype(np.float32))
    ran = profiled_ops(lambda: st(x, w, bias))
    assert ran["_MklNativeFusedMatMul"] == 1 and not ran["Erfc"] and not ran["Mul"], ran
    reasons = {u["op"]: u["reason"] for u in st.report.to_dict()["unfused_nodes"]}
    assert "fuses this GELU with the product" in reasons["Erfc"]


@pytest.mark.skipif(not remapper.onednn_enabled(),
                    reason="the single rounding is oneDNN's fused product's")
def test_a_bfloat16_dense_layer_is_as_accurate_as_tfs():
    import ml_dtypes

    import stitching
    x = tf.constant(np.random.default_rng(0).standard_normal((64, 128)), tf.bfloat16)
    w = tf.constant(np.random.default_rng(1).standard_normal((128, 128)) / 11, tf.bfloat16)
    bias = tf.constant(np.random.default_rng(2).standard_normal(128), tf.bfloat16)

    def dense(x, w, bias):
        return tf.nn.bias_add(tf.matmul(x, w), bias)
    st = stitching.function(dense)
    got, want = st(x, w, bias), tf.function(dense)(x, w, bias)
    exact = (x.numpy().astype(np.float64) @ w.numpy().astype(np.float64)
             + bias.numpy().astype(np.float64))
    spacing = np.spacing(np.abs(exact).astype(ml_dtypes.bfloat16)).astype(np.float64)
    err_st = np.abs(got.numpy().astype(np.float64) - exact) / spacing
    err_tf = np.abs(want.numpy().astype(np.float64) - exact) / spacing
    assert err_st.max() <= err_tf.max() + 1e-9, (err_st.max(), err_tf.max())
    assert "BiasAdd" in {u["op"] for u in st.report.to_dict()["unfused_nodes"]}

