"""tf/passes/gemm.py beyond the BatchMatMul -> MatMul rewrite itself (test_function.py has
that): the projection's bias moves into the MatMul as a BiasAdd (which TF's remapper
fuses into the GEMM), and the output shape is a constant when only the batch is
unknown.  Numerics against stock TF and float64."""
import numpy as np
import tensorflow as tf

import stitching
from stitching.tf import pipeline

RNG = np.random.default_rng(31)
W = tf.constant(RNG.standard_normal((16, 12)).astype(np.float32))
BIAS = tf.constant(RNG.standard_normal((3, 4)).astype(np.float32))
ROWBIAS = tf.constant(RNG.standard_normal((5, 1, 1)).astype(np.float32))


def _einsum_dense(x):
    # Keras 3's EinsumDense "abc,cde->abde" as it traces: BatchMatMulV2 against a 2-D
    # weight, a Reshape to the heads, the bias over the trailing dims; the Einsum after
    # it is opaque, so the Add is a lone op the planner leaves to TF
    q = tf.reshape(tf.linalg.matmul(x, W), [-1, 5, 3, 4]) + BIAS
    k = tf.reshape(tf.linalg.matmul(x, W), [-1, 5, 3, 4]) + ROWBIAS   # not per column
    return tf.einsum("btnh,bsnh->bnts", q, k)


def _stitched(fn, sig, **options):
    """The pipeline's result for ``fn`` traced with ``sig``, under ``Options(**options)``."""
    cf = tf.function(fn, input_signature=sig).get_concrete_function()
    return pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs],
                                     options=stitching.Options(**options))


def _stitched_ops(fn, sig):
    # the products as this pass leaves them, whatever the session's machine (where TF's
    # GEMM is Eigen's, tf/passes/blas.py would make them OpenBLAS ops: test_blas.py)
    return [n.op for n in _stitched(fn, sig, blas_gemm=False).graph_def.node]


def test_a_projection_bias_is_added_by_the_matmul():
    sig = [tf.TensorSpec([None, 5, 16], tf.float32)]
    ops = _stitched_ops(_einsum_dense, sig)
    assert ops.count("MatMul") == 2 and ops.count("BatchMatMulV2") == 0, ops
    # the per-column bias became a BiasAdd on the 2-D product; the row bias stayed
    assert ops.count("BiasAdd") == 1 and ops.count("AddV2") == 1, ops
    # only the batch is unknown: the output shapes are constants, no shape ops
    assert "Shape" not in ops and "StridedSlice" not in ops and "ConcatV2" not in ops, ops
    sf = stitching.function(_einsum_dense, input_signature=sig)
    ref = tf.function(_einsum_dense, input_signature=sig)
    sf(RNG.standard_normal((2, 5, 16)).astype(np.float32))
    # the report: the moved Add is fused (into the product), not "a lone op"; the row
    # bias's Add stays TF's with its reason
    rep = sf.report
    assert [(op, where) for _, op, where in rep.folded] == \
        [("AddV2", "added by its product as the MatMul's BiasAdd (tf/passes/gemm.py)")]
    assert [op for _, op, _ in rep.unfused] == ["AddV2"]
    assert rep.memory_intensive_ops == rep.fused_ops + len(rep.unfused) == 2
    assert "(50%): 0 into 0 kernels, 1 into matrix products' ops;" in rep.summary()
    assert "in a matrix product's op (1):" in rep.summary()
    for batch in (1, 3):
        x = RNG.standard_normal((batch, 5, 16)).astype(np.float32)
        got, want = sf(x).numpy(), ref(x).numpy()
        x64 = tf.constant(x.astype(np.float64))
        w64 = tf.cast(W, tf.float64)
        q = tf.reshape(x64 @ w64, [-1, 5, 3, 4]) + tf.cast(BIAS, tf.float64)
        k = tf.reshape(x64 @ w64, [-1, 5, 3, 4]) + tf.cast(ROWBIAS, tf.float64)
        exact = tf.einsum("btnh,bsnh->bnts", q, k).numpy()
        # the products sum in another order than stock TF's BatchMatMulV2 + AddV2 (Eigen's
        # MatMul + BiasAdd where TF runs without oneDNN): an output near 0 out of terms of
        # ~50 differs from TF's by rounding of the terms' scale, not of its own value
        # (1.9e-5 at -0.209 on a Skylake Xeon).  Within float rounding of that scale, and
        # no further from float64 than TF's own result (plus that rounding)
        ulp = np.finfo(np.float32).eps * np.abs(exact).max()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=8 * ulp)
        assert np.abs(got - exact).max() <= np.abs(want - exact).max() + 8 * ulp


def test_two_unknown_dims_take_the_shape_from_the_input():
    def fn(x):
        y = tf.reshape(tf.linalg.matmul(x, W), [tf.shape(x)[0], -1, 3, 4]) + BIAS
        return tf.einsum("btnh,nh->bnt", y, tf.ones([3, 4]))
    sig = [tf.TensorSpec([None, None, 16], tf.float32)]
    ops = _stitched_ops(fn, sig)
    assert ops.count("MatMul") == 1 and "Shape" in ops and "ConcatV2" in ops, ops
    sf = stitching.function(fn, input_signature=sig)
    x = RNG.standard_normal((2, 7, 16)).astype(np.float32)
    np.testing.assert_allclose(sf(x).numpy(), tf.function(fn, input_signature=sig)(x).numpy(),
                               rtol=1e-5, atol=1e-5)


def _reshape_targets(fn, sig):
    """op of each Reshape's shape input in the stitched graph."""
    res = _stitched(fn, sig)
    nodes = {n.name: n for n in res.graph_def.node}
    return [nodes[n.input[1].split(":")[0]].op for n in res.graph_def.node
            if n.op == "Reshape"], res.report


def _dense(x):
    # Keras's Dense on a 3-D input: tf.tensordot, whose Reshape targets are computed
    # at run time from Shape(x) (GatherV2, Prod, Pack, ConcatV2); the matmul's
    # consumer is opaque (an Einsum) so they stay TF ops
    y = tf.tensordot(x, W, axes=[[2], [0]])
    return tf.einsum("bti,ij->btj", y, tf.ones([12, 3]))


def test_run_time_reshape_targets_known_but_for_the_batch_become_constants():
    sig = [tf.TensorSpec([None, 5, 16], tf.float32)]
    targets, report = _reshape_targets(_dense, sig)
    assert targets and set(targets) == {"Const"}, targets
    assert any("Reshape target(s) computed at run time" in n for n in report.notes)
    _matches_tf(_dense, sig, batches=(1, 4))


def _matches_tf(fn, sig, batches):
    """stitching.function(fn) with ``sig`` equals TF at each batch size, shape [B, 5, 3]."""
    sf = stitching.function(fn, input_signature=sig)
    for batch in batches:
        x = RNG.standard_normal((batch, 5, 16)).astype(np.float32)
        got = sf(x)
        assert got.shape == (batch, 5, 3)
        np.testing.assert_allclose(got.numpy(), tf.function(fn)(x).numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_two_unknown_dims_keep_the_run_time_target():
    sig = [tf.TensorSpec([None, None, 16], tf.float32)]
    targets, _ = _reshape_targets(_dense, sig)
    # [B*T, 16] folds (one product of unknowns), [B, T, 12] cannot
    assert "Const" in targets and "ConcatV2" in targets, targets
    sf = stitching.function(_dense, input_signature=sig)
    x = RNG.standard_normal((2, 7, 16)).astype(np.float32)
    np.testing.assert_allclose(sf(x).numpy(), tf.function(_dense)(x).numpy(),
                               rtol=1e-5, atol=1e-5)


W2 = tf.constant(RNG.standard_normal((12, 7)).astype(np.float32))


def _dense_gelu_dense(x):
    # TF's shape inference gives the first Tensordot's output [?, ?, 12] (its target
    # is a GatherV2 of a Shape), and the GELU after it inherits that: the second
    # Dense's output target needs the first's folded target to see T again
    h = tf.nn.gelu(tf.tensordot(x, W, axes=[[2], [0]]), approximate=False)
    y = tf.tensordot(h, W2, axes=[[2], [0]])
    return tf.einsum("bti,ij->btj", y, tf.ones([7, 3]))


def test_a_dense_after_an_element_wise_op_on_a_dense_folds_too():
    sig = [tf.TensorSpec([None, 5, 16], tf.float32)]
    targets, report = _reshape_targets(_dense_gelu_dense, sig)
    assert len(targets) >= 4 and set(targets) == {"Const"}, targets
    _matches_tf(_dense_gelu_dense, sig, batches=(1, 3))


# ---- products against a transposed weight (MatMul transpose_b -> BatchMatMulV2 adj_y) --

WT = tf.constant((RNG.standard_normal((512, 512)) * 0.05).astype(np.float32))   # [N, K]
WT_SMALL = tf.constant((RNG.standard_normal((512, 256)) * 0.05).astype(np.float32))
BT = tf.constant(RNG.standard_normal(512).astype(np.float32))


def _input_grad(x):
    # a Dense layer's input gradient, dY W^T, with an element-wise op on each side
    return tf.nn.relu(tf.linalg.matmul(tf.tanh(x), WT, transpose_b=True)) * 2.0


def _small_k(x):
    return tf.nn.relu(tf.linalg.matmul(tf.tanh(x), WT_SMALL, transpose_b=True))


def _biased(x):
    return tf.nn.bias_add(tf.linalg.matmul(tf.tanh(x), WT, transpose_b=True), BT)


def _projection_adj_y(x):
    # [B, T, K] x [N, K]^T as Keras traces a projection against a transposed weight
    return tf.nn.relu(tf.linalg.matmul(tf.tanh(x), WT, adjoint_b=True))


TRANSPOSED = stitching.Options(transposed_gemm=True)


def _products(fn, sig, ops=("MatMul", "BatchMatMulV2"), exclude=(), transposed_gemm=True):
    res = _stitched(fn, sig, blas_gemm=False, xla_gemm=False, exclude=exclude,
                    transposed_gemm=transposed_gemm)
    return {n.name: n for n in res.graph_def.node if n.op in ops}


def test_a_transposed_weight_runs_as_batch_matmul_where_measured(machine):
    sig = [tf.TensorSpec([None, 512], tf.float32)]
    prods = list(_products(_input_grad, sig).values())
    assert len(prods) == 1, prods
    if machine.name == "amd-avx512":      # TRANSPOSED_B_CLASSES, TF on oneDNN
        assert prods[0].op == "BatchMatMulV2" and prods[0].attr["adj_y"].b, prods[0]
        assert not prods[0].attr["adj_x"].b
    else:                                 # not measured there: the MatMul stays
        assert prods[0].op == "MatMul" and prods[0].attr["transpose_b"].b, prods[0]
    sf = stitching.function(_input_grad, input_signature=sig, options=TRANSPOSED)
    ref = tf.function(_input_grad, input_signature=sig)
    for batch in (1, 33):
        x = RNG.standard_normal((batch, 512)).astype(np.float32)
        got = sf(x).numpy()
        np.testing.assert_allclose(got, ref(x).numpy(), rtol=1e-5, atol=1e-5)
        x64 = tf.constant(x.astype(np.float64))
        want = tf.nn.relu(tf.tanh(x64) @ tf.transpose(tf.cast(WT, tf.float64))) * 2.0
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
    assert ("transposed weight run as BatchMatMulV2" in sf.report.summary()) == \
        (machine.name == "amd-avx512")


def test_transposed_products_that_do_not_pay_stay_matmuls(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "amd-avx512")
    # K = 256 (BatchMatMulV2's fixed cost loses), and a BiasAdd TF's remapper fuses
    # into the MatMul
    prods = list(_products(_small_k, [tf.TensorSpec([None, 256], tf.float32)]).values())
    assert [p.op for p in prods] == ["MatMul"], prods
    # a BiasAdd left to TF after the product: TF's remapper fuses it into the MatMul
    # (here left to TF by Options(exclude); the planner would take it into a kernel)
    sig = [tf.TensorSpec([None, 512], tf.float32)]
    got = _products(_biased, sig, ("MatMul", "BatchMatMulV2", "BiasAdd"), ("BiasAdd",))
    assert sorted(p.op for p in got.values()) == ["BiasAdd", "MatMul"], got
    # without the BiasAdd as TF's, the same product runs as BatchMatMulV2
    assert [p.op for p in _products(_biased, sig).values()] == ["BatchMatMulV2"]
    # float64: not measured
    f64 = tf.cast(WT, tf.float64)
    prods = list(_products(lambda x: tf.linalg.matmul(tf.tanh(x), f64, transpose_b=True),
                           [tf.TensorSpec([None, 512], tf.float64)]).values())
    assert [p.op for p in prods] == ["MatMul"], prods


def test_a_projection_against_a_transposed_weight_is_one_batch_matmul(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "amd-avx512")
    sig = [tf.TensorSpec([None, 6, 512], tf.float32)]
    prods = list(_products(_projection_adj_y, sig).values())
    # the batch dims folded into rows (the gemm rewrite), the product a rank-2
    # BatchMatMulV2 with adj_y rather than a MatMul with transpose_b
    assert [p.op for p in prods] == ["BatchMatMulV2"], prods
    assert prods[0].attr["adj_y"].b and prods[0].name.endswith("/gemm/matmul")
    sf = stitching.function(_projection_adj_y, input_signature=sig, options=TRANSPOSED)
    for batch in (1, 2):
        x = RNG.standard_normal((batch, 6, 512)).astype(np.float32)
        np.testing.assert_allclose(sf(x).numpy(), tf.function(_projection_adj_y)(x).numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_a_training_step_with_transposed_products_matches_tf(monkeypatch):
    # the train suite's MLP (Dense 256-512-512-10, Adam): the second layer's input
    # gradient, dY [128, 512] x W [512, 512]^T, runs as BatchMatMulV2 on amd-avx512
    from stitching.testing import train
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "amd-avx512")
    ref, st = train.make_step("mlp"), train.make_step("mlp")
    f_ref = tf.function(ref.fn)
    f_st = stitching.function(st.fn, options=stitching.Options(background_compile=False,
                                                                transposed_gemm=True))
    for _ in range(3):
        want, got = float(f_ref(ref.x, ref.y)), float(f_st(st.x, st.y))
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert "1 product(s) against a transposed weight run as BatchMatMulV2" in \
        f_st.report.summary()
    for a, b in zip(ref.model.trainable_variables, st.model.trainable_variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-4, atol=1e-6)


def test_by_default_the_report_says_where_a_transposed_product_would_pay(monkeypatch):
    # opt-in (BatchMatMulV2 holds one more output-sized buffer while it runs): by
    # default the MatMul stays and the report names the option
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "amd-avx512")
    sig = [tf.TensorSpec([None, 512], tf.float32)]
    prods = list(_products(_input_grad, sig, transposed_gemm=False).values())
    assert [p.op for p in prods] == ["MatMul"], prods
    sf = stitching.function(_input_grad, input_signature=sig)
    x = RNG.standard_normal((4, 512)).astype(np.float32)
    np.testing.assert_allclose(sf(x).numpy(), tf.function(_input_grad)(x).numpy(),
                               rtol=1e-5, atol=1e-5)
    assert "1 product(s) against a transposed weight would run 1.2-3.4x faster as " \
        "BatchMatMulV2 (adj_y) on this CPU class" in sf.report.summary()
    assert "Options(transposed_gemm=True)" in sf.report.summary()
