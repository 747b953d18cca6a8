"""Recommender-style models: string and integer ids through lookup tables and hashing
into embeddings, dict inputs, embedding gradients (tools/recsys_check.py runs the
full-size audit: a two-tower retrieval model, a DCN-v2 ranking model, a DLRM)."""
import numpy as np
import pytest
import tensorflow as tf

import stitching


def test_ops_after_a_table_lookup_have_known_ranks_and_fuse():
    """A table lookup (tf.lookup's StaticHashTable, Keras's StringLookup and
    IntegerLookup) has the shape of its keys only because TF's Python code sets it on
    the live graph: the op's shape function needs the table handle's data, which no
    table handle carries.  The graph stitching imports lost it, so the embedding's index
    arithmetic and everything after the lookup was "a tensor of unknown rank (an
    input_signature, or inputs, with known ranks let it fuse)", with inputs of known
    rank, and stayed TF's."""
    keys = tf.constant(["a", "b", "c"])
    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(keys, tf.constant([0, 1, 2], tf.int64)), -1)
    emb = tf.Variable(np.random.default_rng(0).standard_normal((4, 8)).astype("float32"))

    @stitching.function(input_signature=[tf.TensorSpec([None], tf.string)])
    def f(ids):
        idx = table.lookup(ids)
        idx = tf.where(idx < 0, idx + 4, idx)           # Keras's take: negative ids wrap
        x = tf.gather(emb, idx)
        return tf.nn.relu(x * 2.0 + 1.0)

    ids = tf.constant(["b", "zz", "a", "c", "a"])
    np.testing.assert_array_equal(f(ids), tf.function(f.python_function)(ids))
    report = f.report
    assert not [u for u in report.unfused if "unknown rank" in u[2]], report.summary()
    assert report.to_dict()["kernels"] == 2, report.summary()     # the index, the rows


def _string_id_module():
    keys = tf.constant(["a", "b", "c"])

    class Tower(tf.Module):
        def __init__(self):
            self.table = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(keys, tf.constant([0, 1, 2], tf.int64)),
                -1)
            self.emb = tf.Variable(
                np.random.default_rng(0).standard_normal((4, 8)).astype("float32"))

        @tf.function(input_signature=[{
            "user_id": tf.TensorSpec([None], tf.string, name="user_id"),
            "age": tf.TensorSpec([None, 1], tf.float32, name="age")}])
        def serve(self, features):
            idx = self.table.lookup(features["user_id"])
            idx = tf.where(idx < 0, idx + 4, idx)
            x = tf.gather(self.emb, idx) * features["age"]
            return {"score": tf.nn.relu(x * 2.0 + 1.0)}

    return Tower()


def test_a_rewritten_saved_model_with_string_ids_fuses_after_its_lookups(tmp_path):
    """A SavedModel's signature calls its function (StatefulPartitionedCall), whose
    lookups stitching sees through Grappler's inlining: they had unknown rank too (a
    FunctionDef carries no shapes), though the loaded function's graph knows them."""
    m = _string_id_module()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tf.saved_model.save(m, src, signatures={"serving_default": m.serve})
    reports = stitching.rewrite_saved_model(src, dst)
    report = reports["serving_default"]
    assert not [u for u in report.unfused if "unknown rank" in u[2]], report.summary()
    assert report.to_dict()["kernels"] == 2, report.summary()
    x = {"user_id": tf.constant(["b", "zz", "a"]), "age": tf.constant([[1.0], [2.0], [3.0]])}
    got = tf.saved_model.load(dst).signatures["serving_default"](**x)["score"]
    want = tf.saved_model.load(src).signatures["serving_default"](**x)["score"]
    np.testing.assert_array_equal(got, want)


def test_a_sum_over_no_axes_is_no_data_work_and_not_counted():
    """The gradient of an Add whose operands have one shape (DCN-v2's cross layer,
    ``x0 * (x W + b) + x``, at an unknown batch) is a Sum over the axes
    BroadcastGradientArgs computes: none, once the shapes pass folds them.  The IR
    lifts it as a view and TF's kernel forwards its input, but the report counted it
    as memory-intensive: as fused work inside a kernel, and outside one with no reason
    to give ("left to TF by the planner", a DCN-v2 train step's cross layers)."""
    w = tf.Variable(np.random.default_rng(0).standard_normal((6, 6)).astype("float32") * 0.3)

    @stitching.function(input_signature=[tf.TensorSpec([None, 4]), tf.TensorSpec([None, 2])])
    def step(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            x0 = tf.concat([a, b], 1)
            loss = tf.reduce_sum(tf.tanh(x0 * (x0 @ w) + x0))
        return tape.gradient(loss, [a, b, w])

    rng = np.random.default_rng(1)
    a, b = (tf.constant(rng.standard_normal((3, n)).astype("float32")) for n in (4, 2))
    for got, want in zip(step(a, b), tf.function(step.python_function)(a, b)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    rep = step.report
    counted = [op for k in rep.kernels for _, op in k.split_ops()[0]]
    assert "Sum" not in counted, rep.summary()
    assert not [u for u in rep.unfused if u[1] == "Sum" or "by the planner" in u[2]], \
        rep.summary()
    assert rep.memory_intensive_ops == rep.fused_ops + len(rep.unfused), rep.summary()


def test_an_unknown_rank_from_an_op_names_that_op():
    """Where a tensor's unknown rank comes from an op of the graph (a
    tf.numpy_function, a custom op: TF's shape inference gives its output none), the
    reason names that op; it said "an input_signature, or inputs, with known ranks let
    it fuse", of inputs that had known ranks."""
    @stitching.function(input_signature=[tf.TensorSpec([None, 4])])
    def f(x):
        y = tf.numpy_function(lambda v: v * 3.0, [x], tf.float32, stateful=False)
        return tf.nn.relu(y * 2.0 + 1.0)

    x = tf.constant(np.arange(8, dtype="float32").reshape(2, 4) - 4.0)
    np.testing.assert_array_equal(f(x), tf.function(f.python_function)(x))
    whys = {why for _, _, why in f.report.unfused}
    assert whys and all("from PyFunc" in w and "ensure_shape" in w for w in whys), whys


def test_a_multi_hot_encoding_keeps_its_width_and_its_concatenation_fuses():
    """Keras's multi-hot and count encodings are a DenseBincount of a run-time size,
    whose width Keras sets on the live graph (``set_shape``): the graph stitching
    imports lost it, and the features' concatenation was "axis 1 of a piece is known
    only at run time", left to TF."""
    import keras
    lookup = keras.layers.StringLookup(vocabulary=["a", "b", "c", "d"], output_mode="multi_hot")

    @stitching.function(input_signature=[tf.TensorSpec([None, 3], tf.string),
                                         tf.TensorSpec([None, 2], tf.float32)])
    def f(tags, dense):
        x = tf.concat([tf.cast(lookup(tags), tf.float32) * 0.5, tf.math.log1p(dense)], 1)
        return tf.nn.relu(x * 2.0 - 0.25)

    tags = tf.constant([["a", "zz", "c"], ["d", "d", ""]])
    dense = tf.constant([[1.0, 2.0], [3.0, 0.5]])
    np.testing.assert_allclose(f(tags, dense), tf.function(f.python_function)(tags, dense),
                               rtol=1e-6)
    report = f.report
    assert not [u for u in report.unfused if u[1] == "ConcatV2"], report.summary()
    assert report.fused_ops == report.memory_intensive_ops, report.summary()


def test_a_scratch_import_drops_shape_annotations_a_pass_made_inconsistent():
    """The ``_output_shapes`` stitching carries over (tfgraph.annotate_live_shapes)
    are the live graph's; should a later rewrite make one disagree with TF's own
    inference, the scratch import for shapes falls back to that inference instead of
    failing the whole stitch."""
    from stitching.tf import tfgraph
    with tf.Graph().as_default() as g:
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        tf.math.exp(x, name="y")
    gd = g.as_graph_def()
    for nd in gd.node:
        if nd.name == "y":
            nd.attr["_output_shapes"].list.shape.add().CopyFrom(
                tf.TensorShape([None, 5]).as_proto())
    scratch = tfgraph.import_for_shapes(gd)
    assert scratch.get_tensor_by_name("y:0").shape.as_list() == [None, 4]
