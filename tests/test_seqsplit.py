"""tf/passes/seqsplit.py: token-wise blocks run as two halves of the sequence."""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf import frontend
from stitching.tf.passes import grappler, seqsplit

L2 = 2 << 20          # the tests of ``find`` pass an L2, never read the machine's


def _splits(machine) -> bool:
    """Whether the pipeline splits the 128-token block under a machine model: only where
    TF runs oneDNN (its one-thread rule) and the operands fit that model's L2."""
    return bool(machine.tf_onednn) and machine.caches["l2"] >= L2


def _ffn_block(d=256, ff=1024, seq=128, name="blk"):
    """A post-LN Transformer feed-forward block as Keras writes it."""
    import keras
    keras.utils.set_random_seed(3)
    L = keras.layers
    x = keras.Input((seq, d))
    h = L.Dense(ff, activation="gelu", name=f"{name}_ff1")(x)
    h = L.Dense(d, name=f"{name}_ff2")(h)
    y = L.LayerNormalization(epsilon=1e-6, name=f"{name}_ln")(x + h)
    return keras.Model(x, y)


def _note(report):
    return [n for n in report.notes if "token-wise" in n]


def _graph(model, seq, d, batch=None):
    f = tf.function(lambda t: model(t, training=False),
                    input_signature=[tf.TensorSpec([batch, seq, d], tf.float32)])
    cf = f.get_concrete_function()
    fetches = [t.name for t in cf.outputs]
    gdef = grappler.optimize(cf.graph.as_graph_def(), fetches)
    g = frontend.import_for_shapes(gdef, frontend.resource_shapes(cf.graph))
    return gdef, g, {n.split(":")[0] for n in fetches}


@pytest.mark.parametrize("batch", [1, 3])
def test_a_feed_forward_block_runs_as_two_halves_and_equals_tf(batch, machine):
    model = _ffn_block()
    sig = [tf.TensorSpec([None, 128, 256], tf.float32)]
    # TF's products (not XLA's dots, tf/passes/xladot.py, whose own rounding
    # tests/test_xladot.py bounds): the float64 bar below is the split's
    f = stitching.function(lambda t: model(t, training=False), input_signature=sig,
                           options=stitching.Options(xla_gemm=False))
    x = np.random.default_rng(batch).standard_normal((batch, 128, 256)).astype(np.float32)
    x[0, 5, 7] = np.nan                                 # one token's row goes NaN
    got = f(tf.constant(x)).numpy()
    want = tf.function(lambda t: model(t, training=False))(tf.constant(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.isnan(got[0, 5]).all() and not np.isnan(np.delete(got[0], 5, 0)).any()
    notes = _note(f.report)
    if _splits(machine):
        assert len(notes) == 1 and notes[0].startswith("1 token-wise block(s)"), f.report.notes
    else:
        assert notes == [], (machine.name, f.report.notes)
    # against float64 (numpy, exact GELU): no less accurate than stock TF
    xf = np.nan_to_num(x).astype(np.float64)
    ref = _reference64(model, xf)
    st = f(tf.constant(xf, tf.float32)).numpy()
    tf32 = tf.function(lambda t: model(t, training=False))(tf.constant(xf, tf.float32)).numpy()
    assert np.abs(st - ref).max() <= 2 * np.abs(tf32 - ref).max() + 1e-6


def _reference64(model, x):
    import math
    w1, b1, w2, b2, gamma, beta = [v.numpy().astype(np.float64) for v in model.weights]
    a = x @ w1 + b1
    h = 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))
    z = x + h @ w2 + b2
    mu = z.mean(-1, keepdims=True)
    var = ((z - mu) ** 2).mean(-1, keepdims=True)
    return (z - mu) / np.sqrt(var + 1e-6) * gamma + beta


def test_the_split_is_an_option_and_gradients_match_tf(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "intel-avx512")   # a machine it splits on
    model = _ffn_block(name="g")
    sig = [tf.TensorSpec([None, 128, 256], tf.float32)]
    whole = stitching.function(lambda t: model(t, training=False), input_signature=sig,
                               options=stitching.Options(seq_split=False))
    split = stitching.function(lambda t: model(t, training=False), input_signature=sig)
    x = tf.constant(np.random.default_rng(7).standard_normal((2, 128, 256)), tf.float32)
    np.testing.assert_allclose(whole(x).numpy(), split(x).numpy(), rtol=2e-5, atol=2e-5)
    assert not _note(whole.report) and _note(split.report)
    grads = []
    for f in (split, tf.function(lambda t: model(t, training=False))):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(f(x) * tf.range(256, dtype=tf.float32))
        grads.append(tape.gradient(loss, [x] + model.trainable_variables))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-3, atol=1e-3)


def test_blocks_are_found_only_where_tf_would_run_the_product_on_one_thread():
    """The feed-forward block of a sequence of 128 (33M multiply-adds, 1.7 MB of
    operands) is split under a 2 MiB L2, not under 1 MiB (TF runs it on both threads
    already); a narrow block (d 64, ff 256: 2M multiply-adds) is never worth it."""
    gdef, g, fetched = _graph(_ffn_block(), 128, 256)
    blocks = seqsplit.find(g, fetched, L2)
    assert len(blocks) == 1
    b, outs = blocks[0]
    assert [t.op.type for t in b.inputs] != [] and len(outs) == 1
    assert {op.type for op in b.ops} >= {"MatMul", "Erfc", "Mean", "Rsqrt"}
    assert seqsplit.find(g, fetched, 1 << 20) == []
    gdef2, g2, fetched2 = _graph(_ffn_block(d=64, ff=256, name="n"), 128, 64)
    assert seqsplit.find(g2, fetched2, L2) == []


def test_a_known_batch_decides_by_its_rows(machine):
    """Traced at one batch size, the product's rows are B T: at batch 1 TF runs it on one
    thread (split: the Tensordot's constant targets [128, 256] and [1, 128, 1024] get
    their halves' own), at batch 4 (512 rows, 3.7 MB of operands) on both (left whole,
    the split would only add its copies); an unknown batch is planned for batch 1."""
    model = _ffn_block(name="kb")
    for batch, want in ((None, 1), (1, 1), (4, 0)):
        gdef, g, fetched = _graph(model, 128, 256, batch)
        assert len(seqsplit.find(g, fetched, L2)) == want, batch
    ref = tf.function(lambda t: model(t, training=False))
    for batch, split in ((1, True), (4, False)):
        # the first call traces the exact shape (the batch is known)
        st = stitching.function(lambda t: model(t, training=False))
        x = np.random.default_rng(batch).standard_normal((batch, 128, 256)).astype(np.float32)
        x[0, 3, 1] = np.inf
        got, want = st(tf.constant(x)).numpy(), ref(tf.constant(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        assert np.isnan(got[0, 3]).all() and np.isnan(want[0, 3]).all()
        assert bool(_note(st.report)) == (split and _splits(machine)), \
            (machine.name, batch, st.report.notes)


def test_a_reshape_whose_constant_target_holds_the_sequence_ends_the_block():
    """[?, 128, 1024] -> [-1, 128, 4, 256] by a constant target is wrong for a half of
    64 positions: the block stops before it, and what it still covers is split."""
    w = tf.Variable(np.random.default_rng(0).standard_normal((256, 1024)), dtype=tf.float32)

    def fn(x):
        h = tf.nn.relu(tf.tensordot(x, w, 1))
        return tf.reshape(h, [-1, 128, 4, 256]) * 2.0

    f = tf.function(fn, input_signature=[tf.TensorSpec([None, 128, 256], tf.float32)])
    cf = f.get_concrete_function()
    fetches = [t.name for t in cf.outputs]
    gdef = grappler.optimize(cf.graph.as_graph_def(), fetches)
    g = frontend.import_for_shapes(gdef, frontend.resource_shapes(cf.graph))
    blocks = seqsplit.find(g, {n.split(":")[0] for n in fetches}, L2)
    members = {op.type for b, _ in blocks for op in b.ops}
    assert "Reshape" not in members or all(
        op.outputs[0].shape.rank != 4 for b, _ in blocks for op in b.ops)
    st = stitching.function(fn, input_signature=[tf.TensorSpec([None, 128, 256], tf.float32)])
    x = tf.constant(np.random.default_rng(1).standard_normal((1, 128, 256)), tf.float32)
    np.testing.assert_allclose(st(x).numpy(), f(x).numpy(), rtol=2e-5, atol=2e-5)
