"""tf/passes/einsum.py: a two-operand Einsum runs as one BatchMatMulV2 with its transposes as
row gathers.  Which equations qualify (plan_for), the exact nodes the rewrite leaves,
numerics against stock TF and a float64 run with an unknown batch, and gradients."""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf.passes import einsum as es
from stitching.tf import pipeline

RNG = np.random.default_rng(531)
T, N, H = 8, 3, 16          # H: rows of 16 floats, the shortest a gather moves


def test_attention_equations_plan_one_gather_per_transpose():
    scores = es.plan_for("BTNH,BSNH->BNTS", (-1, T, N, H), (-1, T, N, H))
    assert (scores.a_order, scores.b_order, scores.adj_x, scores.adj_y) == \
        ("BNTH", "BNSH", False, True)
    assert [m is not None for m in scores.moves()] == [True, True, False]
    context = es.plan_for("BNTS,BSNH->BTNH", (-1, N, T, T), (-1, T, N, H))
    assert (context.a_order, context.b_order, context.adj_x, context.adj_y) == \
        ("BNTS", "BNSH", False, False)
    assert [m is not None for m in context.moves()] == [False, True, True]
    # the gather index: row r of [N, T] reads row index[r] of [T, N]
    idx = es._gather_index(scores.moves()[0], scores.dims)
    assert idx.tolist() == np.arange(T * N).reshape(T, N).T.reshape(-1).tolist()


def test_value_gradient_equation_swaps_its_operands():
    # as they come the result would be [B, N, H, S], rows of S to reorder element by
    # element; swapped it is [B, N, S, H], one gather of rows of H from BSNH
    p = es.plan_for("BTNH,BNTS->BSNH", (-1, T, N, H), (-1, N, T, 20))
    assert p.swap and (p.lhs, p.rhs, p.a_order, p.b_order, p.adj_x, p.adj_y) == \
        ("BNTS", "BTNH", "BNTS", "BNTH", True, False)
    assert [m is not None for m in p.moves()] == [False, True, True]


def test_a_swapped_einsum_equals_numpy_in_float64():
    def fn(a, b):
        return tf.einsum("btnh,bnts->bsnh", a, b)
    sig = [tf.TensorSpec([None, T, N, H], tf.float64), tf.TensorSpec([None, N, T, 20], tf.float64)]
    ops, report = _stitched_ops(fn, sig)
    assert "Einsum" not in ops and ops.count("GatherV2") == 2, ops
    a = RNG.standard_normal((2, T, N, H))
    b = RNG.standard_normal((2, N, T, 20))
    b[1, 2, 3, 4] = np.nan
    got = stitching.function(fn, input_signature=sig)(a, b).numpy()
    want = np.einsum("btnh,bnts->bsnh", a, b)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("equation, lhs, rhs", [
    ("bij,bjk->bik", (-1, 4, 16), (-1, 16, 32)),          # no transpose: Einsum is a BMM
    ("...ij,...jk->...ik", (2, 4, 16), (2, 16, 32)),       # ellipsis
    ("btnh,bsnh->bnts", (-1, T, N, 4), (-1, T, N, 4)),     # rows of 4: element gathers
    ("btnh,bsnh->bnts", (-1, -1, N, H), (-1, -1, N, H)),   # two unknown dims
    ("btnh,bsnh->bnts", (2, -1, N, H), (2, -1, N, H)),     # unknown dim not a batch label
    ("bii,bij->bj", (2, 16, 16), (2, 16, 16)),            # a repeated label (a diagonal)
    ("btnh,bsnk->bnts", (2, T, N, H), (2, T, N, H)),       # h, k summed in one operand only
    ("btnh,bsnh->bnts", (2, T, N, H), (2, T, N, 32)),      # the operands disagree on h
    ("btnh,bsnh->bnts", (-1, 0, N, H), (-1, 0, N, H)),     # empty beside an unknown
])
def test_equations_left_to_tf(equation, lhs, rhs):
    assert es.plan_for(equation, lhs, rhs) is None


def _attention(q, k, v):
    # Keras MultiHeadAttention's two einsums with a softmax between them
    p = tf.nn.softmax(tf.einsum("BTNH,BSNH->BNTS", q, k) * 0.25)
    return tf.einsum("BNTS,BSNH->BTNH", p, v)


SIG = [tf.TensorSpec([None, T, N, H], tf.float32)] * 3


# the products as the einsum pass leaves them, whatever the session's machine (where
# TF's GEMM is Eigen's, tf/passes/blas.py would make them OpenBLAS ops: test_blas.py)
TF_GEMM = stitching.Options(blas_gemm=False)


def _stitched_ops(fn, sig, options=TF_GEMM):
    cf = tf.function(fn, input_signature=sig).get_concrete_function()
    res = pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs],
                                    options=options)
    return [n.op for n in res.graph_def.node], res.report


def test_attention_becomes_two_batch_matmuls_and_four_gathers():
    ops, report = _stitched_ops(_attention, SIG)
    assert "Einsum" not in ops and "Transpose" not in ops, ops
    assert ops.count("BatchMatMulV2") == 2 and ops.count("GatherV2") == 4, ops
    assert any("2 Einsum node(s) run as one BatchMatMulV2" in n for n in report.notes)
    ops, _ = _stitched_ops(_attention, SIG, stitching.Options(einsum=False, blas_gemm=False))
    assert ops.count("Einsum") == 2 and "GatherV2" not in ops, ops


def _inputs(batch, dtype=np.float32):
    return [RNG.standard_normal((batch, T, N, H)).astype(dtype) for _ in range(3)]


def test_attention_equals_tf_and_float64_with_unknown_batch():
    sf = stitching.function(_attention, input_signature=SIG)
    ref = tf.function(_attention, input_signature=SIG)
    for batch in (1, 3):
        args = _inputs(batch)
        got = sf(*args).numpy()
        assert got.shape == (batch, T, N, H)
        np.testing.assert_allclose(got, ref(*args).numpy(), rtol=1e-5, atol=1e-6)
        exact = _attention(*[tf.constant(a.astype(np.float64)) for a in args]).numpy()
        np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-5)


def test_gradients_through_the_rewrite_equal_tf():
    sf = stitching.function(_attention, input_signature=SIG)
    args = [tf.constant(a) for a in _inputs(2)]
    grads = []
    for f in (sf, _attention):
        with tf.GradientTape() as tape:
            tape.watch(args)
            y = tf.reduce_sum(f(*args) * tf.range(H, dtype=tf.float32))
        grads.append([g.numpy() for g in tape.gradient(y, args)])
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_general_equation_with_a_result_transpose_equals_numpy():
    # lhs and result both reordered, rhs taken through adj_y; float64 end to end
    def fn(a, b):
        return tf.einsum("btnh,bnsh->btns", a, b)
    sig = [tf.TensorSpec([None, T, N, H], tf.float64), tf.TensorSpec([None, N, 20, H], tf.float64)]
    ops, _ = _stitched_ops(fn, sig)
    assert "Einsum" not in ops and ops.count("GatherV2") == 2, ops
    a = RNG.standard_normal((2, T, N, H))
    b = RNG.standard_normal((2, N, 20, H))
    got = stitching.function(fn, input_signature=sig)(a, b).numpy()
    np.testing.assert_allclose(got, np.einsum("btnh,bnsh->btns", a, b), rtol=1e-12, atol=1e-12)


def test_keras_attention_gradients_inside_the_function_equal_tf():
    # a tape inside the stitched function: the backward einsums are rewritten too
    import keras
    from stitching.testing.models import transformer_encoder
    keras.utils.set_random_seed(5)
    model = transformer_encoder(num_layers=1, d_model=32, heads=2, ff=64, seq_len=8)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(x, training=False)))
        return [loss] + tape.gradient(loss, model.trainable_variables)

    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    sf = stitching.function(step, input_signature=sig)
    x = RNG.standard_normal((2, 8, 32)).astype(np.float32)
    got, want = sf(x), tf.function(step, input_signature=sig)(x)
    # the forward's 2 and the 4 in TF's gradient (the value's, swapped)
    assert any(n.startswith("6 Einsum node(s) run as one BatchMatMulV2")
               for n in sf.report.notes), sf.report.notes
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=2e-3, atol=2e-4)
