"""tf/passes/prune.py: what the rewrite leaves unread goes, equal constants merge, inlining's
Identity nodes are forwarded -- and the graph computes the same."""
import numpy as np
import tensorflow as tf

from stitching.tf.passes import prune


def _graph():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        ctl = tf.raw_ops.NoOp(name="ctl")
        a = tf.identity(x, name="outer/Func/f/input/_0")
        with tf.control_dependencies([ctl]):
            b = tf.identity(a, name="outer/Func/f/input/_1")   # a chain, with a control
        c1 = tf.constant(2.0, name="c1")
        c2 = tf.constant(2.0, name="c2")                         # same value as c1
        tf.constant(7.0, name="unread")
        tf.reduce_sum(x, name="unread_sum")
        y = tf.multiply(tf.add(b, c1, name="add"), c2, name="y")
        tf.identity(y, name="Func/g/output/_5")                  # a root: kept
    return g.as_graph_def()


def _run(gd, x):
    with tf.Graph().as_default() as g:
        tf.compat.v1.import_graph_def(gd, name="")
        with tf.compat.v1.Session(graph=g) as s:
            return s.run("y:0", {"x:0": x})


def test_prune_keeps_the_answer_and_drops_what_nothing_reads():
    gd = _graph()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    want = _run(gd, x)
    roots = ["y:0", "Func/g/output/_5"]
    assert prune.bypass_inlined_identities(gd, roots) == 2
    assert prune.merge_constants(gd, roots) == 1
    removed = prune.dead_nodes(gd, roots)
    names = {n.name for n in gd.node}
    # the two Identities, c2 (merged), unread, unread_sum and its axis constant
    assert removed == 6
    assert "unread" not in names and "c2" not in names
    assert not any("/input/_" in n for n in names) and "Func/g/output/_5" in names
    add = next(n for n in gd.node if n.name == "add")
    assert list(add.input) == ["x", "c1", "^ctl"]    # the control edge is inherited
    np.testing.assert_array_equal(_run(gd, x), want)


def test_a_control_edge_on_an_argument_is_dropped_not_left_dangling():
    """An inlined Identity that is itself a control input of another forwards to a
    Placeholder: import_graph_def's input_map does not remap control edges, so the
    edge is dropped (an argument orders nothing) rather than left on the placeholder."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2], name="x")
        a = tf.identity(x, name="f/Func/c/input/_0")
        with tf.control_dependencies([a]):
            b = tf.identity(x, name="f/Func/c/input/_1")
        tf.add(b, 1.0, name="y")
    gd = g.as_graph_def()
    prune.bypass_inlined_identities(gd, ["y:0"])
    prune.dead_nodes(gd, ["y:0"])
    y = next(n for n in gd.node if n.name == "y")
    assert [i for i in y.input if i.startswith("^")] == []
    np.testing.assert_array_equal(_run(gd, np.ones(2, np.float32)), [2.0, 2.0])
