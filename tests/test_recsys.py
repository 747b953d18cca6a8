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
