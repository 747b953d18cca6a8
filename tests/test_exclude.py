"""Options(exclude=...): the ops a user keeps TF's, by op type or node-name pattern
(tf/passes/exclude.py).  An excluded node stays the TF op the graph has: in no kernel,
not folded, removed nor rewritten by any pass (``verify=True`` checks that after every
pass: tf/passmanager.py), listed as not fused with the entry that matched; an entry
that matches nothing is a note.  Numerics against stock tf.function."""
import numpy as np
import pytest
import tensorflow as tf

import stitching
from stitching.tf import pipeline, results
from stitching.tf.passes import original, xladot

RNG = np.random.default_rng(5)
X = tf.constant(RNG.standard_normal((8, 64)).astype(np.float32))
SOFTMAX_WHY = "excluded by Options(exclude): op type Softmax"


def _softmax_block(x):
    return tf.tanh(tf.nn.softmax(x * 2.0 + 1.0) * 3.0)


def _function(fn, **kw):
    return stitching.function(fn, options=stitching.Options(background_compile=False, **kw))


def _stitch(fn, sig, **kw):
    """The pipeline's result for ``fn`` traced at ``sig``; every pass verified."""
    cf = tf.function(fn, input_signature=sig).get_concrete_function()
    return pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs],
                                     options=stitching.Options(verify=True, **kw))


def _excluded(report) -> list:
    return [(n, op, why) for n, op, why in report.unfused if why.startswith("excluded")]


def test_an_excluded_op_type_stays_tf_and_the_rest_fuses_around_it():
    plain, ex = _function(_softmax_block), _function(_softmax_block, exclude=("Softmax",))
    want = tf.function(_softmax_block)(X).numpy()
    for f in (plain, ex):
        np.testing.assert_allclose(f(X).numpy(), want, rtol=2e-6)
    # without: one kernel computes all five ops; with: the two either side of the
    # Softmax, which TF runs between them
    assert len(plain.report.kernels) == 1 and not plain.report.unfused
    assert len(ex.report.kernels) == 2
    assert ex.report.unfused == [("Softmax", "Softmax", SOFTMAX_WHY)]
    assert f"Softmax (Softmax): {SOFTMAX_WHY}" in ex.report.summary()
    assert not any(op == "Softmax" for k in ex.report.kernels for _, op in k.ops)
    ops = [n.op for n in ex.get_concrete_function(X).graph.as_graph_def().node]
    assert ops.count("Softmax") == 1 and ops.count("StitchedKernel") == 2, ops
    assert "Softmax" not in [n.op for n in
                             plain.get_concrete_function(X).graph.as_graph_def().node]


def _two_chains(x):
    # the same ops in two scopes (other constants, so Grappler does not merge them)
    with tf.name_scope("left"):
        a = tf.nn.softmax(x * 2.0 + 1.0) * 3.0
    with tf.name_scope("right"):
        b = tf.nn.softmax(x * 0.5 + 2.0) * 4.0
    return a, b


def test_a_name_pattern_excludes_one_of_two_equal_chains():
    plain, ex = _function(_two_chains), _function(_two_chains, exclude="right/*")
    assert ex.options.exclude == ("right/*",)
    want = tf.function(_two_chains)(X)
    for f in (plain, ex):
        for got, ref in zip(f(X), want):
            np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=2e-6)
    # without: the two chains side by side in one kernel (same domain); with: the
    # left one's alone
    assert len(plain.report.kernels) == 1 and not plain.report.unfused
    why = "excluded by Options(exclude): name matches 'right/*'"
    assert ex.report.unfused == [("right/mul", "Mul", why), ("right/add", "AddV2", why),
                                 ("right/Softmax", "Softmax", why),
                                 ("right/mul_1", "Mul", why)]
    assert len(ex.report.kernels) == 1
    assert {n for k in ex.report.kernels for n, _ in k.ops} >= {
        "left/mul", "left/add", "left/Softmax", "left/mul_1"}
    # (the stitched graph runs as a function called "stitched")
    nodes = {n.name: n.op for n in ex.get_concrete_function(X).graph.as_graph_def().node}
    assert nodes["stitched/right/Softmax"] == "Softmax", nodes
    assert "Softmax" not in [op for n, op in nodes.items() if "left/" in n], nodes


def test_an_entry_that_matches_nothing_is_a_note_and_changes_nothing():
    f = _function(_softmax_block, exclude=["Sofmax", "Softmax", "nowhere/*"])
    f(X)
    notes = [n for n in f.report.notes if n.startswith("Options(exclude)")]
    assert notes == [
        "Options(exclude): 'Sofmax' matches no op type or node name of this graph",
        "Options(exclude): 'nowhere/*' matches no op type or node name of this graph"]
    assert f.report.unfused == [("Softmax", "Softmax", SOFTMAX_WHY)]
    g = _function(_softmax_block, exclude="Sofmax")
    np.testing.assert_allclose(g(X).numpy(), tf.function(_softmax_block)(X).numpy(),
                               rtol=2e-6)
    assert len(g.report.kernels) == 1 and not g.report.unfused
    assert "note: Options(exclude): 'Sofmax' matches no op type or node name of this " \
           "graph" in g.report.summary()


def _pad_then_depthwise(x):
    w = tf.constant(np.linspace(-1, 1, 3 * 3 * 4, dtype=np.float32).reshape(3, 3, 4, 1))
    h = tf.pad(tf.nn.relu(x), [[0, 0], [0, 1], [0, 1], [0, 0]])
    return tf.nn.depthwise_conv2d(h, w, [1, 2, 2, 1], "VALID") * 2.0


def test_padfold_leaves_an_excluded_pad():
    # (depthwise=False: the convolution stays a TF node, its padding in sight)
    sig = [tf.TensorSpec([None, 12, 12, 4], tf.float32)]
    folded = _stitch(_pad_then_depthwise, sig, depthwise=False)
    kept = _stitch(_pad_then_depthwise, sig, depthwise=False, exclude="Pad")
    # without: the Pad is the convolution's explicit padding
    assert "Pad" not in [n.op for n in folded.graph_def.node]
    assert any("zero Pad" in n for n in folded.report.notes)
    # with: the Pad is TF's, the convolution pads nothing itself
    nodes = {n.name: n for n in kept.graph_def.node}
    assert nodes["Pad"].op == "Pad"
    conv = next(n for n in kept.graph_def.node if n.op == "DepthwiseConv2dNative")
    assert conv.attr["padding"].s == b"VALID" and list(conv.input)[0] == "Pad"
    assert not any("zero Pad" in n for n in kept.report.notes)
    assert _excluded(kept.report) == [("Pad", "Pad",
                                       "excluded by Options(exclude): op type Pad")]
    # a convolution a kernel computes reads the Pad TF runs
    nodes = {n.name: n for n in _stitch(_pad_then_depthwise, sig, exclude="Pad").graph_def.node}
    assert nodes["Pad"].op == "Pad" and "DepthwiseConv2dNative" not in \
        [n.op for n in nodes.values()]
    assert [n for n in nodes.values() if n.op == "StitchedKernel"][0].input[0] == "Pad"
    f = _function(_pad_then_depthwise, exclude="Pad")
    x = RNG.standard_normal((2, 12, 12, 4)).astype(np.float32)
    np.testing.assert_allclose(f(x).numpy(), tf.function(_pad_then_depthwise)(x).numpy(),
                               rtol=2e-6, atol=1e-6)


W = tf.constant(RNG.standard_normal((16, 12)).astype(np.float32))
BIAS = tf.constant(RNG.standard_normal((3, 4)).astype(np.float32))


def _projection(x):
    # an EinsumDense as Keras 3 traces it: its bias Add is what gemm folds into the MatMul
    q = tf.reshape(tf.linalg.matmul(x, W), [-1, 5, 3, 4])
    with tf.name_scope("proj"):
        q = q + BIAS
    return tf.einsum("btnh,bsnh->bnts", q, q)


def test_gemm_leaves_an_excluded_bias_add():
    sig = [tf.TensorSpec([None, 5, 16], tf.float32)]
    folded = _stitch(_projection, sig, blas_gemm=False)
    kept = _stitch(_projection, sig, blas_gemm=False, exclude="proj/*")
    ops = [n.op for n in folded.graph_def.node]
    assert ops.count("BiasAdd") == 1 and ops.count("MatMul") == 1, ops
    assert [n for n, _, _ in folded.report.folded] == ["proj/add"]
    # the product is still one MatMul; the Add is TF's Add of the bias
    nodes = {n.name: n for n in kept.graph_def.node}
    ops = [n.op for n in kept.graph_def.node]
    assert ops.count("BiasAdd") == 0 and ops.count("MatMul") == 1, ops
    assert nodes["proj/add"].op == "AddV2" and len(nodes["proj/add"].input) == 2
    assert not kept.report.folded
    assert _excluded(kept.report) == [
        ("proj/add", "AddV2", "excluded by Options(exclude): name matches 'proj/*'")]
    f = _function(_projection, exclude="proj/*", blas_gemm=False)
    x = RNG.standard_normal((3, 5, 16)).astype(np.float32)
    np.testing.assert_allclose(f(x).numpy(), tf.function(_projection)(x).numpy(),
                               rtol=1e-5, atol=1e-5)


def _graph(*nodes):
    from tensorflow.core.framework import graph_pb2
    gd = graph_pb2.GraphDef()
    for name, op, inputs in nodes:
        nd = gd.node.add(name=name, op=op, input=inputs)
        nd.attr["T" if op != "Placeholder" else "dtype"].type = tf.float32.as_datatype_enum
    return gd


def test_the_product_passes_leave_an_excluded_product_or_bias_add():
    """xladot.candidates is the blas pass's too: an excluded BiasAdd stays out of its
    product's op, an excluded product is not replaced."""
    gd = _graph(("a", "Placeholder", []), ("w", "Placeholder", []), ("b", "Placeholder", []),
                ("mm1", "MatMul", ["a", "w"]), ("ba1", "BiasAdd", ["mm1", "b"]),
                ("mm2", "MatMul", ["a", "w"]), ("ba2", "BiasAdd", ["mm2", "b"]))
    pairs = xladot.candidates(gd, set())
    assert [(p.name, b.name) for p, b in pairs] == [("mm1", "ba1"), ("mm2", "ba2")]
    pairs = xladot.candidates(gd, set(), excluded={"ba1", "mm2"})
    assert [(p.name, b) for p, b in pairs] == [("mm1", None)]


def test_with_verify_a_pass_that_drops_an_excluded_node_is_named(monkeypatch):
    """The guard the tests above rely on: padfold without its exclude check."""
    from stitching.tf.passes import padfold
    real = padfold.candidates
    monkeypatch.setattr(padfold, "candidates",
                        lambda g, keep, bias, excluded=(): real(g, keep, bias))
    sig = [tf.TensorSpec([None, 12, 12, 4], tf.float32)]
    with pytest.raises(ValueError, match="after the 'padfold' pass.*Pad, excluded by "
                                         r"Options\(exclude\), is gone"):
        _stitch(_pad_then_depthwise, sig, exclude="Pad")


def test_a_stored_result_or_plan_is_not_used_with_other_exclusions(monkeypatch):
    context = [results.context(["y:0"], [], stitching.Options(exclude=e), None)
               for e in ((), "Softmax", ("Softmax", "Tanh"))]
    assert len(set(context)) == 3
    # a plan stored without exclude, found under the same key: its kernel holds the
    # Softmax, which the stored plan's check refuses (plan/cache.py), so it is planned
    # again
    monkeypatch.setattr(pipeline, "_graph_key", lambda *a, **k: "exclude-shared-key")
    sig = [tf.TensorSpec([8, 64], tf.float32)]
    assert len(_stitch(_softmax_block, sig).report.kernels) == 1
    res = _stitch(_softmax_block, sig, exclude="Softmax")
    assert len(res.report.kernels) == 2
    assert res.report.unfused == [("Softmax", "Softmax", SOFTMAX_WHY)]


def test_the_stitched_backward_inherits_the_exclusions():
    attr = original.options_attr(stitching.Options(exclude="Softmax"))

    class Op:
        name = "k"

        def get_attr(self, name):
            return attr
    assert original.backward_options(Op()).exclude == ("Softmax",)
    # left out at its default: a graph stitched without it is the bytes it was
    assert b"exclude" not in original.options_attr(stitching.Options())


def test_the_cli_flag_reaches_options_and_the_output(tmp_path, capsys):
    from stitching.testing.models import frozen_softmax_graph_def
    from stitching.tf import cli
    ap = cli._parser()
    o = cli._options(ap, ap.parse_args(["a.pb", "b.pb", "--exclude", "Softmax",
                                        "--exclude", "y*"]))
    assert o.exclude == ("Softmax", "y*") and o.fallback
    assert cli._options(ap, ap.parse_args(["a.pb", "b.pb"])).exclude == ()
    src = tmp_path / "g.pb"
    src.write_bytes(frozen_softmax_graph_def().SerializeToString())
    assert cli.main([str(src), str(tmp_path / "o.pb"), "--outputs", "y", "--no-kernels",
                     "--exclude", "Softmax"]) == 0
    assert f"Softmax (y): {SOFTMAX_WHY}" in capsys.readouterr().out
    gd = tf.compat.v1.GraphDef.FromString((tmp_path / "o.pb").read_bytes())
    assert {n.name: n.op for n in gd.node}["y"] == "Softmax"
    with pytest.raises(SystemExit):
        cli.main([str(src), str(tmp_path / "p.pb"), "--exclude", ""])
    assert "--exclude: an empty entry" in capsys.readouterr().err


def _strided_slice_grad(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(tf.sin(x[:, ::2]))
    return tape.gradient(y, x) * 2.0


def test_an_op_a_pass_made_is_excluded_too_and_its_entry_gets_no_note():
    """The Pad of a strided slice's gradient (tf/passes/strided_grad.py) is made after
    the exclude pass; lifting matches the entries again."""
    sig = [tf.TensorSpec([None, 16], tf.float32)]
    plain, res = _stitch(_strided_slice_grad, sig), _stitch(_strided_slice_grad, sig,
                                                            exclude="Pad")
    assert "Pad" not in [n.op for n in plain.graph_def.node]
    pads = [n.name for n in res.graph_def.node if n.op == "Pad"]
    assert len(pads) == 1 and pads[0].endswith("/stitching_strided_grad_pad"), pads
    assert _excluded(res.report) == [(pads[0], "Pad",
                                      "excluded by Options(exclude): op type Pad")]
    assert not [n for n in res.report.notes if "exclude" in n]
    f = _function(_strided_slice_grad, exclude="Pad")
    x = RNG.standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(f(x).numpy(), tf.function(_strided_slice_grad)(x).numpy(),
                               rtol=2e-6)


def test_the_environment_adds_entries_to_every_options(monkeypatch):
    """$STITCHING_EXCLUDE (comma-separated, as TF-TRT's TF_TRT_OP_DENYLIST) adds its
    entries to every Options made: a bisect of a Keras model or a server needs no code
    change.  Each entry once, the user's first."""
    from stitching.options import Options
    monkeypatch.setenv("STITCHING_EXCLUDE", " Softmax, mlp/* ,,")
    assert Options().exclude == ("Softmax", "mlp/*")
    assert Options(exclude=["Erf", "Softmax"]).exclude == ("Erf", "Softmax", "mlp/*")
    import dataclasses
    assert dataclasses.replace(Options(), min_ops=3).exclude == ("Softmax", "mlp/*")
    monkeypatch.delenv("STITCHING_EXCLUDE")
    assert Options().exclude == ()


def test_seqsplit_leaves_a_block_holding_an_excluded_op_whole(monkeypatch):
    """On a machine model seqsplit splits a token-wise block on (oneDNN's one-thread
    rule, a 2 MiB L2), a block that holds an excluded node is not split: the node stays
    one TF op over the whole sequence, and every pass is verified to leave it."""
    import keras
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "intel-avx512")
    keras.utils.set_random_seed(3)
    L = keras.layers
    x = keras.Input((128, 256))
    h = L.Dense(1024, activation="gelu", name="ex_ff1")(x)
    h = L.Dense(256, name="ex_ff2")(h)
    model = keras.Model(x, L.LayerNormalization(epsilon=1e-6, name="ex_ln")(x + h))
    fn = lambda t: model(t, training=False)  # noqa: E731
    t = tf.constant(RNG.standard_normal((2, 128, 256)).astype(np.float32))
    want = tf.function(fn)(t).numpy()
    sig = [tf.TensorSpec([None, 128, 256], tf.float32)]      # decides by the batch of 1
    split, kept = (stitching.function(fn, input_signature=sig, options=stitching.Options(
        background_compile=False, xla_gemm=False, verify=True, exclude=ex))
        for ex in ((), ("*ex_ln*",)))
    for f in (split, kept):
        np.testing.assert_allclose(f(t).numpy(), want, rtol=2e-5, atol=2e-5)
    assert [n for n in split.report.notes if "token-wise" in n], split.report.notes
    assert not [n for n in kept.report.notes if "token-wise" in n], kept.report.notes
    assert _excluded(kept.report)
