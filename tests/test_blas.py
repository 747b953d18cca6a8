"""runtime/gemm.cc and tf/passes/blas.py: matrix products run by OpenBLAS where TF's GEMM
is Eigen's (StitchedMatMul, StitchedBatchMatMul)."""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.runtime import blas
from stitching.tf.passes import blas as blas_pass

pytest.importorskip("scipy_openblas32")

EIGEN = "amd-avx2"            # a machine model whose TF runs Eigen's GEMM (oneDNN off)
ONEDNN = "intel-avx512"       # one whose TF runs oneDNN's
OURS = ("StitchedMatMul", "StitchedBatchMatMul")
TFS = ("MatMul", "BatchMatMulV2", "BatchMatMul", "_FusedMatMul")


@pytest.fixture(scope="module")
def ops():
    return blas.load()


def _rand(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _err(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("mkn", [(64, 96, 200), (1, 256, 64), (300, 17, 5), (40, 1, 33),
                                 # rows or columns by sgemv (runtime/blas_util.h
                                 # kGemvLines), inline and cut over threads
                                 (2, 300, 70), (3, 640, 500), (1, 1280, 1000),
                                 (200, 64, 2), (1500, 700, 1), (1, 1, 1)])
def test_matmul_equals_tf_and_float64(ops, dtype, ta, tb, mkn):
    m, k, n = mkn
    a = _rand((k, m) if ta else (m, k), dtype, 1)
    b = _rand((n, k) if tb else (k, n), dtype, 2)
    bias = _rand((n,), dtype, 3)
    got = ops.stitched_mat_mul(a=a, b=b, bias=[bias], transpose_a=ta, transpose_b=tb)
    want = tf.nn.bias_add(tf.linalg.matmul(a, b, transpose_a=ta, transpose_b=tb), bias)
    assert got.dtype == want.dtype and got.shape == want.shape
    ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64) + bias
    # no less accurate than TF's own product (both sum K terms with FMAs, in their
    # own orders); the floor is a few ulps of the largest value
    ulp = np.finfo(dtype).eps * np.abs(ref).max()
    assert _err(got, ref) <= 1.5 * _err(want, ref) + 8 * ulp


@pytest.mark.parametrize("xs, ys, ax, ay", [
    ((3, 16, 8), (3, 8, 24), False, False),
    ((4, 2, 16, 8), (4, 2, 24, 8), False, True),     # attention's Q K^T
    ((2, 8, 16), (2, 8, 12), True, False),
    ((2, 1, 5, 7), (3, 7, 6), False, False),         # broadcast batch, ranks differ
    ((5, 7), (4, 7, 6), False, False),               # a matrix against a batch
    ((1, 9, 7), (6, 5, 9), True, True),
    ((8, 1, 64), (8, 64, 40), False, False),         # one query per head: sgemv
    ((2, 4, 16, 8), (2, 4, 1, 8), False, True),      # one column per product
])
def test_batch_matmul_equals_tf_with_adjoints_and_broadcast(ops, xs, ys, ax, ay):
    x, y = _rand(xs, seed=4), _rand(ys, seed=5)
    got = ops.stitched_batch_mat_mul(x=x, y=y, adj_x=ax, adj_y=ay)
    want = tf.linalg.matmul(x, y, adjoint_a=ax, adjoint_b=ay)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_empty_dims(ops):
    z = ops.stitched_mat_mul(a=np.zeros((0, 4), np.float32), b=_rand((4, 3)), bias=[])
    assert z.shape == (0, 3)
    # K = 0: the product of nothing is zero (plus the bias)
    bias = np.arange(3, dtype=np.float32)
    z = ops.stitched_mat_mul(a=np.zeros((2, 0), np.float32), b=np.zeros((0, 3), np.float32),
                             bias=[bias])
    np.testing.assert_array_equal(z, np.broadcast_to(bias, (2, 3)))
    z = ops.stitched_batch_mat_mul(x=np.zeros((0, 2, 4), np.float32), y=_rand((4, 3)))
    assert z.shape == (0, 2, 3)


def test_nan_and_inf_propagate_as_in_tf(ops):
    a, b = _rand((40, 64)), _rand((64, 48))
    a[3, 5], a[7, 2], b[9, 11] = np.nan, np.inf, -np.inf
    got = ops.stitched_mat_mul(a=a, b=b, bias=[]).numpy()
    want = tf.linalg.matmul(a, b).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))


@pytest.mark.parametrize("m, n", [(1, 300), (2, 7), (300, 1), (9, 3)])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, True)])
def test_nan_and_inf_propagate_through_the_gemv_path(ops, m, n, ta, tb):
    # a matrix-vector product must not skip the zeros of the vector (0 x inf = nan)
    a, b = _rand((m, 64)), _rand((64, n))
    a[:, 5], b[5, :] = 0.0, np.inf       # 0 x inf in every output
    a[0, 9] = np.nan
    got = ops.stitched_mat_mul(a=a.T if ta else a, b=b.T if tb else b, bias=[],
                               transpose_a=ta, transpose_b=tb).numpy()
    want = tf.linalg.matmul(a, b).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got).all()


def test_unknown_batch_in_a_function(ops):
    w = _rand((32, 16))

    @tf.function(input_signature=[tf.TensorSpec([None, None, 32], tf.float32)])
    def f(x):
        return ops.stitched_batch_mat_mul(x=x, y=w), ops.stitched_mat_mul(
            a=tf.reshape(x, [-1, 32]), b=w, bias=[])
    for shape in [(1, 3, 32), (5, 7, 32)]:
        x = _rand(shape, seed=6)
        y3, y2 = f(x)
        np.testing.assert_allclose(y3, x @ w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y2, x.reshape(-1, 32) @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda o: o.stitched_mat_mul(a=_rand((3, 4)), b=_rand((5, 6)), bias=[]),
     "inner dimensions differ"),
    (lambda o: o.stitched_mat_mul(a=_rand((3, 4)), b=_rand((4, 6)), bias=[_rand((5,))]),
     "bias must have shape"),
    (lambda o: o.stitched_batch_mat_mul(x=_rand((2, 3, 4)), y=_rand((3, 4, 5))),
     "do not broadcast"),
])
def test_bad_operands_are_refused_with_the_reason(ops, call, message):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
        call(ops)


@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False), (True, True)])
def test_matmul_gradient_equals_tf(ops, ta, tb):
    a, b, c = (tf.constant(_rand(s, seed=i)) for i, s in
               enumerate([(7, 5) if ta else (5, 7), (3, 7) if tb else (7, 3), (3,)]))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([a, b, c])
        ours = tf.reduce_sum(tf.sin(ops.stitched_mat_mul(a=a, b=b, bias=[c], transpose_a=ta,
                                                         transpose_b=tb)))
        theirs = tf.reduce_sum(tf.sin(tf.nn.bias_add(
            tf.linalg.matmul(a, b, transpose_a=ta, transpose_b=tb), c)))
    for g, w in zip(tape.gradient(ours, [a, b, c]), tape.gradient(theirs, [a, b, c])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_batch_matmul_gradient_sums_over_broadcast_dims(ops):
    x, y = tf.constant(_rand((2, 1, 4, 5), seed=7)), tf.constant(_rand((3, 6, 5), seed=8))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, y])
        ours = tf.reduce_sum(tf.sin(ops.stitched_batch_mat_mul(x=x, y=y, adj_y=True)))
        theirs = tf.reduce_sum(tf.sin(tf.linalg.matmul(x, y, adjoint_b=True)))
    for g, w in zip(tape.gradient(ours, [x, y]), tape.gradient(theirs, [x, y])):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def _swap(t):
    """[.., H, M, N] <-> [.., M, H, N]: the head transpose of transpose_x/_y/_out."""
    r = len(t.shape)
    return np.transpose(t, list(range(r - 3)) + [r - 2, r - 3, r - 1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("xs, ys, ax, ay", [
    ((2, 3, 40, 33), (2, 3, 33, 50), False, False),   # pieces of rows of wider rows
    ((2, 3, 5, 40), (1, 3, 70, 40), False, True),     # broadcast batch; pieces of columns
    ((3, 4, 5), (3, 4, 6), True, False),              # rank 3
    ((2, 4, 6, 0), (2, 4, 0, 7), False, False),       # the product of nothing is zero
    ((2, 3, 2, 40), (2, 3, 50, 40), False, True),     # sgemv per row (M = 2)
    ((2, 3, 40, 2), (2, 3, 40, 50), True, False),     # ... of an adjoint x
    ((2, 3, 40, 33), (2, 3, 33, 3), False, False),    # sgemv per column (N = 3)
])
@pytest.mark.parametrize("tx, ty, to", [(False, False, True), (True, False, False),
                                        (False, True, False), (True, True, True)])
def test_batch_matmul_head_layouts_equal_tf_transposes(ops, dtype, xs, ys, ax, ay, tx, ty, to):
    x, y = _rand(xs, dtype, seed=12), _rand(ys, dtype, seed=13)
    if x.size:
        x[0, ..., 1, :] = np.nan                       # NaN rows land where TF puts them
    want = tf.linalg.matmul(x, y, adjoint_a=ax, adjoint_b=ay).numpy()
    got = ops.stitched_batch_mat_mul(x=_swap(x).copy() if tx else x,
                                     y=_swap(y).copy() if ty else y, adj_x=ax, adj_y=ay,
                                     transpose_x=tx, transpose_y=ty, transpose_out=to)
    want = _swap(want) if to else want
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", ["transpose_x", "transpose_out"])
def test_batch_matmul_head_layouts_need_a_batch_dim(ops, key):
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError),
                       match="need.* a batch dimension|rank >= 2 \\(3 with"):
        ops.stitched_batch_mat_mul(x=_rand((3, 4)), y=_rand((4, 5)), **{key: True})


def test_batch_matmul_head_layouts_gradient_equals_tf(ops):
    # every layout at once, and a broadcast batch dim to sum the gradient over
    x, y = tf.constant(_rand((2, 4, 3, 5), seed=14)), tf.constant(_rand((1, 6, 3, 5), seed=15))
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, y])
        ours = tf.reduce_sum(tf.sin(ops.stitched_batch_mat_mul(
            x=x, y=y, adj_y=True, transpose_x=True, transpose_y=True, transpose_out=True))
            * tf.range(6.0))
        theirs = tf.linalg.matmul(tf.transpose(x, [0, 2, 1, 3]), tf.transpose(y, [0, 2, 1, 3]),
                                  adjoint_b=True)
        theirs = tf.reduce_sum(tf.sin(tf.transpose(theirs, [0, 2, 1, 3])) * tf.range(6.0))
    for g, w in zip(tape.gradient(ours, [x, y]), tape.gradient(theirs, [x, y])):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


# ---- the pass -------------------------------------------------------------------------

def _encoder():
    from stitching.testing.models import transformer_encoder
    import keras
    keras.utils.set_random_seed(3)
    return transformer_encoder(num_layers=1, d_model=32, heads=2, ff=64, seq_len=8)


def _ops_of(f, sig):
    return [n.op for n in f.get_concrete_function(*sig).graph.as_graph_def().node]


# Exact kernel counts of the one-layer encoder, with the products ours or TF's: the
# pass moves products only, never a kernel.
KERNELS = {EIGEN: 4, ONEDNN: 4}


def _stitched_and_checked(monkeypatch, machine_name, model, x):
    """(stitched function, signature) of ``model`` under ``machine_name``, its outputs
    checked against the model's at ``x`` (NaN where TF's are) and at batch 1."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", machine_name)
    sig = [tf.TensorSpec([None] + list(x.shape[1:]), tf.float32)]
    # the attentions' products as products (tests/test_attention.py: fused)
    f = stitching.function(lambda t: model(t), input_signature=sig,
                           options=stitching.Options(fused_attention=False))
    want = model(x).numpy()
    got = f(tf.constant(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(f(x[:1]).numpy(), model(x[:1]).numpy(), rtol=2e-5, atol=2e-5)
    return f, sig


@pytest.mark.parametrize("machine_name", [EIGEN, ONEDNN])
def test_encoder_products_and_kernels_under_each_machine(monkeypatch, machine_name):
    model = _encoder()
    x = _rand((3, 8, 32), seed=9)
    x[1, 2, 5] = np.nan                              # one token's row goes NaN
    on, sig = _stitched_and_checked(monkeypatch, machine_name, model, x)
    off = stitching.function(lambda t: model(t), input_signature=sig,
                             options=stitching.Options(blas_gemm=False))
    off(tf.constant(x))
    assert len(on.report.kernels) == len(off.report.kernels) == KERNELS[machine_name]
    names = _ops_of(on, sig)
    notes = [n for n in on.report.notes if "OpenBLAS" in n]
    if machine_name == EIGEN:
        # 4 projections and 2 Dense (3 BiasAdds taken in: the others are in kernels),
        # 2 attention products
        assert names.count("StitchedMatMul") == 6 and names.count("StitchedBatchMatMul") == 2
        assert not set(TFS) & set(names) and "BiasAdd" not in names, names
        # the einsums' head transposes (query, key, value, the context's result) are
        # read or written by the products: no gather, no Transpose is left
        assert "Transpose" not in names and "GatherV2" not in names, names
        assert notes and notes[0].startswith("8 matrix product(s) run by OpenBLAS "
                                             "(2 BatchMatMulV2, 6 MatMul; 3 with their BiasAdd; "
                                             "4 head transpose(s) read or written in place)")
    else:      # oneDNN's GEMM was not measured against OpenBLAS: left to TF
        assert not set(OURS) & set(names) and not notes
        assert "Transpose" not in names and names.count("GatherV2") == 4, names
    assert not set(OURS) & set(_ops_of(off, sig))


def _llama():
    from stitching.testing.models import llama_decoder
    import keras
    keras.utils.set_random_seed(4)
    return llama_decoder(num_layers=1, d_model=32, heads=4, kv_heads=2, ff=48, seq_len=8)


# Exact kernel counts of the one-layer Llama decoder (norms, rotary embeddings with the
# K/V repeats and head transposes, softmax, SwiGLU), with the products ours or TF's.
LLAMA_KERNELS = {EIGEN: 7, ONEDNN: 7}


@pytest.mark.parametrize("machine_name", [EIGEN, ONEDNN])
def test_the_attention_head_transpose_is_written_by_its_product(monkeypatch, machine_name):
    model = _llama()
    x = _rand((3, 8, 32), seed=16)
    x[2, 3, 7] = np.inf                              # one token's row goes NaN
    f, sig = _stitched_and_checked(monkeypatch, machine_name, model, x)
    assert len(f.report.kernels) == LLAMA_KERNELS[machine_name]
    graph = f.get_concrete_function(*sig).graph.as_graph_def()
    names = [n.op for n in graph.node]
    if machine_name == EIGEN:
        heads = [n for n in graph.node if n.op == "StitchedBatchMatMul" and
                 n.attr["transpose_out"].b]
        assert len(heads) == 1 and heads[0].name.endswith("transpose_4"), names
        assert "Transpose" not in names and names.count("StitchedBatchMatMul") == 2, names
        notes = [n for n in f.report.notes if "OpenBLAS" in n]
        assert notes and "1 head transpose(s) read or written in place" in notes[0]
        x1 = tf.constant(x[:2])                       # a tape outside: the op's gradient
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x1)
            ours, theirs = (tf.reduce_sum(tf.sin(g(x1))) for g in (f, model))
        np.testing.assert_allclose(tape.gradient(ours, x1), tape.gradient(theirs, x1),
                                   rtol=1e-4, atol=1e-4)
    else:      # TF's products, and TF's transpose between them
        assert not set(OURS) & set(names) and names.count("Transpose") == 1, names


def test_without_the_library_products_stay_tf_and_the_report_says_why(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    monkeypatch.setattr(blas, "unavailable",
                        lambda: "the scipy-openblas32 package is not installed")
    model = _encoder()
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    f = stitching.function(lambda t: model(t), input_signature=sig)
    x = _rand((2, 8, 32), seed=10)
    np.testing.assert_allclose(f(x).numpy(), model(x).numpy(), rtol=2e-5, atol=2e-5)
    assert not set(OURS) & set(_ops_of(f, sig))
    note = [n for n in f.report.notes if "left to TF's Eigen GEMM" in n]
    assert note and "scipy-openblas32 package is not installed" in note[0]


def test_a_tape_outside_the_stitched_function_uses_the_registered_gradients(monkeypatch):
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    w1, b1, w2 = (tf.Variable(_rand(s, seed=i)) for i, s in
                  enumerate([(16, 24), (24,), (24, 16)]))

    def fn(x):
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1), b1))
        return tf.reduce_sum(tf.linalg.matmul(h[None], h[None], adjoint_b=True)) + \
            tf.reduce_sum(tf.matmul(h, w2) ** 2)
    sig = [tf.TensorSpec([None, 16], tf.float32)]
    f = stitching.function(fn, input_signature=sig)
    x = tf.constant(_rand((6, 16), seed=11))
    assert {"StitchedMatMul", "StitchedBatchMatMul"} <= set(_ops_of(f, sig))
    with tf.GradientTape() as tape:
        y = f(x)
    got = tape.gradient(y, [w1, b1, w2])
    with tf.GradientTape() as tape:
        y = fn(x)
    want = tape.gradient(y, [w1, b1, w2])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_rewrite_drops_tf_hints_and_keeps_the_bias_node_name():
    g = tf.Graph()
    with g.as_default():
        a = tf.compat.v1.placeholder(tf.float32, [None, 4], name="a")
        w = tf.constant(_rand((4, 3)), name="w")
        c = tf.constant(_rand((3,)), name="c")
        tf.nn.bias_add(tf.raw_ops.MatMul(a=a, b=w, grad_a=True, name="mm"), c, name="out")
    gd = g.as_graph_def()
    pairs = [(p, blas_pass._nhwc(b)) for p, b in
             blas_pass.xladot.candidates(gd, {"out"})]
    assert blas_pass.rewrite(gd, pairs) == 1
    out = {n.name: n for n in gd.node}
    assert "mm" not in out and out["out"].op == "StitchedMatMul"
    assert list(out["out"].input) == ["a", "w", "c"] and out["out"].attr["n_bias"].i == 1
    assert "grad_a" not in out["out"].attr


def test_the_missing_wheel_is_the_reason_given(monkeypatch):
    def no_wheel(force=False):
        raise ImportError("No module named 'scipy_openblas32'")
    monkeypatch.setattr(blas, "_module", None)
    monkeypatch.setattr(blas, "_problem", None)
    monkeypatch.setattr(blas._build, "build_blas", no_wheel)
    assert blas.unavailable() == ("the scipy-openblas32 package is not installed "
                                  "(pip install scipy-openblas32)")
    with pytest.raises(RuntimeError, match="scipy-openblas32 package is not installed"):
        blas.load()


_LOAD = """
    import json, numpy as np
    import stitching, tensorflow as tf
    m = tf.saved_model.load({path!r})
    sig = m.signatures["serving_default"]
    x, want = np.load({d!r} + "/x.npy"), np.load({d!r} + "/y.npy")
    (got,) = sig(**{{list(sig.structured_input_signature[1])[0]: tf.constant(x)}}).values()
    ops = {{n.op for f in sig.graph.as_graph_def().library.function for n in f.node_def}}
    ops |= {{n.op for n in sig.graph.as_graph_def().node}}
    print("RESULT", json.dumps({{"err": float(np.abs(got.numpy() - want).max()),
                                "ours": sorted(ops & {{"StitchedMatMul", "StitchedBatchMatMul",
                                                "StitchedAttention"}})}}))
"""


def test_saved_model_round_trip_in_a_fresh_process(monkeypatch, tmp_path):
    """A SavedModel rewritten under an Eigen machine holds our product ops; a fresh
    process that imports stitching loads and runs it (the ops' library is loaded with
    the StitchedKernel one)."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from stitching.saved_model import rewrite_saved_model
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    model = _encoder()
    model.export(str(tmp_path / "src"), verbose=False)
    rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"))
    x = _rand((2, 8, 32), seed=12)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", model(x, training=False).numpy())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(_LOAD.format(path=str(tmp_path / "dst"), d=str(tmp_path)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, PYTHONPATH=root,
                                             TF_CPP_MIN_LOG_LEVEL="3"))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    # (the attention's two products run as one StitchedAttention, of the same library)
    assert out["ours"] == ["StitchedAttention", "StitchedMatMul"] and out["err"] < 2e-5, out


def test_products_run_inline_in_a_forward_and_handed_off_in_a_training_step(monkeypatch):
    """tf/passes/inline.py: in a graph without a backward the OpenBLAS ops run on the
    thread that made their inputs ready (``inline``); a training step's independent
    products (weight and input gradients) keep TF's inter-op scheduling."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", EIGEN)
    model = _encoder()
    x = _rand((3, 8, 32), seed=9)
    sig = [tf.TensorSpec([None, 8, 32], tf.float32)]
    fwd = stitching.function(lambda t: model(t), input_signature=sig)
    fwd(tf.constant(x))
    marks = {n.attr["inline"].b for n in fwd.get_concrete_function(*sig).graph
             .as_graph_def().node if n.op in OURS + ("StitchedAttention",)}
    assert marks == {True}, marks
    assert any("tf/passes/inline.py" in n for n in fwd.report.notes), fwd.report.notes

    def step(t):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(t) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    train = stitching.function(step, input_signature=sig)
    for got, want in zip(train(tf.constant(x)), step(tf.constant(x))):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    graph = train.get_concrete_function(*sig).graph.as_graph_def()
    nodes = list(graph.node) + [n for fd in graph.library.function for n in fd.node_def]
    marks = {n.attr["inline"].b for n in nodes if n.op in OURS}
    assert marks == {False}, marks
