"""Eigen's filter gradients one after another (tf/passes/convgrad.py): a training step's
second filter gradient gets a control input on the first where the machine model says
TF's convolutions are Eigen's (each holds an im2col buffer of up to ~30 MiB), none
where they are oneDNN's; the gradients equal TF's either way."""
import numpy as np
import tensorflow as tf

import stitching
from stitching.tf import pipeline
from stitching.tf.passes import convgrad


def _step(x, w1, w2):
    with tf.GradientTape() as t:
        t.watch([w1, w2])
        h = tf.nn.relu(tf.nn.conv2d(x, w1, 1, "SAME") * 1.5 + 0.5)
        y = tf.nn.conv2d(h, w2, 1, "SAME")
        loss = tf.reduce_sum(y * y)
    return t.gradient(loss, [w1, w2])


def _args():
    rs = np.random.RandomState(7)
    return (tf.constant(rs.randn(2, 8, 8, 3).astype(np.float32)),
            tf.constant(rs.randn(3, 3, 3, 8).astype(np.float32) * 0.3),
            tf.constant(rs.randn(3, 3, 8, 8).astype(np.float32) * 0.3))


def test_filter_gradients_are_chained_only_where_tfs_convolutions_are_eigens(machine):
    args = _args()
    cf = tf.function(_step).get_concrete_function(*args)
    res = pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs])
    grads = [n for n in res.graph_def.node if n.op in convgrad.OPS]
    assert len(grads) == 2
    x_name = cf.inputs[0].op.name
    (first,) = [n for n in grads if n.input[0].split(":")[0] != x_name]   # w2's: ready first
    (second,) = [n for n in grads if n is not first]
    chained = "^" + first.name in second.input
    assert chained == (not machine.tf_onednn), (machine.name, list(second.input))
    assert not any(i.startswith("^") and i[1:] == second.name for i in first.input)
    notes = " ".join(str(n) for n in res.report.notes)
    assert ("convgrad.py" in notes) == (not machine.tf_onednn)
    got = stitching.function(_step)(*args)
    for g, w in zip(got, tf.function(_step)(*args)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


def test_chain_follows_readiness_and_closes_no_cycle():
    """Three independent filter gradients ready at depths 3, 1 and 2 are chained in
    that order (1 -> 2 -> 3), whatever their order in the GraphDef."""
    from tensorflow.core.framework import graph_pb2
    gd = graph_pb2.GraphDef()

    def node(name, op, *inputs):
        n = gd.node.add(name=name, op=op)
        n.input.extend(inputs)
        return n
    node("a", "Placeholder")
    node("b", "Relu", "a")
    node("c", "Relu", "b")
    node("f3", "Conv2DBackpropFilter", "c", "s", "a")
    node("f1", "Conv2DBackpropFilter", "a", "s", "a")
    node("s", "Const")
    node("f2", "Conv2DBackpropFilter", "b", "s", "a")
    assert convgrad.chain(gd) == 2
    ins = {n.name: list(n.input) for n in gd.node}
    assert "^f1" in ins["f2"] and "^f2" in ins["f3"] and not any(
        i.startswith("^") for i in ins["f1"])
    assert convgrad.chain(gd) == 0            # already chained: nothing added
