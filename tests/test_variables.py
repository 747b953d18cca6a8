"""Variable updates computed as new values (tf/passes/variables.py, opt-in with
Options(variable_updates=True)): an optimizer's update of one variable is one kernel,
its values equal TF's, reads see every write before them, and what the pass must not
touch it leaves alone.  And, with the default options, what no kernel may write over
(a variable's value, a constant) takes no in-place pair."""
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

import stitching
from stitching.tf.passes import variables as V

ON = stitching.Options(variable_updates=True)


def _ops(sf, *args) -> list:
    """The op types of the graph a stitching.function runs for ``args``."""
    return [n.op for n in sf.get_concrete_function(*args).graph.as_graph_def().node]


def _adam_like(n=64, seed=0):
    rs = np.random.RandomState(seed)
    w = tf.Variable(rs.randn(n, n).astype("float32"))
    m = tf.Variable(tf.zeros([n, n]))
    v = tf.Variable(tf.zeros([n, n]))
    t = tf.Variable(0, dtype=tf.int64)

    def step(g):
        t.assign_add(1)
        tf32 = tf.cast(t, tf.float32)
        lr = 0.01 * tf.sqrt(1.0 - tf.pow(0.999, tf32)) / (1.0 - tf.pow(0.9, tf32))
        m.assign_add((g - m) * 0.1)
        v.assign_add((tf.square(g) - v) * 0.001)
        w.assign_sub(lr * m / (tf.sqrt(v) + 1e-7))
        return w.read_value() * 1.0
    return step, (w, m, v, t)


@pytest.mark.parametrize("on", [True, False])
def test_an_adam_update_is_one_kernel_and_equals_tf(on):
    """g, m, v and w in; m, v and w out: one kernel (two without the pass: the moments'
    deltas, then w's after TF's AssignAdds), no AssignAdd/Sub of them left; after five steps
    every variable equals stock TF's, NaN where TF has NaN."""
    g = tf.constant(np.random.RandomState(1).randn(64, 64).astype("float32"))
    ref_step, ref_vars = _adam_like()
    ref = tf.function(ref_step)
    step, got_vars = _adam_like()
    sf = stitching.function(step, options=stitching.Options(variable_updates=on))
    for i in range(5):
        gi = g * (i + 1)
        if i == 3:
            gi = tf.tensor_scatter_nd_update(gi, [[2, 3]], [np.nan])
        np.testing.assert_array_equal(sf(gi).numpy(), ref(gi).numpy())
    for a, b in zip(got_vars, ref_vars):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.isnan(got_vars[0].numpy()[2, 3])
    ops = _ops(sf, g)
    kernels = [n for n in sf.report.kernels]
    if on:   # the step counter's += 1 (a constant: no kernel computes it) stays TF's
        assert ops.count("AssignAddVariableOp") == 1 and "AssignSubVariableOp" not in ops
        assert len(kernels) == 1, sf.report.summary()
        assert any("variable(s)" in n for n in sf.report.notes)
    else:
        assert ops.count("AssignAddVariableOp") == 3 and "AssignSubVariableOp" in ops
        assert len(kernels) == 2, sf.report.summary()


def test_reads_see_the_writes_before_them():
    """A read between updates returns the value the last write left, whichever way the
    write was made; a read before the first write returns the value at entry."""
    v = tf.Variable(tf.range(8, dtype=tf.float32))
    u = tf.Variable(tf.ones([8]))

    def f(x):
        before = v.read_value() * 1.0
        v.assign_add(x * 2.0)
        mid = v.read_value() + 0.5
        v.assign_sub(tf.exp(x))
        v.assign(v * 3.0)
        u.assign_add(v.read_value() * x)
        return before, mid, v.read_value() - 1.0, u.read_value() * 1.0

    x = tf.constant(np.linspace(-1, 1, 8).astype("float32"))
    sf = stitching.function(f, options=ON)
    ref = tf.function(f)
    got = [t.numpy() for t in sf(x)]
    v.assign(tf.range(8, dtype=tf.float32))
    u.assign(tf.ones([8]))
    want = [t.numpy() for t in ref(x)]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_tape_outside_sees_tfs_gradients():
    """An output read after an update: an outer tape's gradient goes to the variable
    (TF's ReadVariableOp gradient), none to what computed the update."""
    def run(make):
        v = tf.Variable(tf.ones([8]))

        def f(x):
            v.assign_add(x * 2.0)
            return v.read_value() * 3.0
        fn = make(f)
        x = tf.constant(np.arange(8, dtype="float32"))
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            y = tf.reduce_sum(fn(x))
        gx, gv = tape.gradient(y, x), tape.gradient(y, v)
        return y.numpy(), None if gx is None else gx.numpy(), gv.numpy(), v.numpy()
    got, want = run(lambda f: stitching.function(f, options=ON)), run(tf.function)
    assert want[1] is None and got[1] is None
    for a, b in zip(got[:1] + got[2:], want[:1] + want[2:]):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_an_update_of_another_shape_fails_as_tf_does():
    """AssignAdd refuses a delta of another shape; an element-wise add would broadcast
    it, so the pass leaves such an update to TF, and the call fails as TF's does."""
    v = tf.Variable(tf.zeros([4]))

    def f(x):
        v.assign_add(x * 2.0)
        return v.read_value() + 1.0

    sf = stitching.function(f, options=ON)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        sf(tf.constant(3.0))
    np.testing.assert_array_equal(v.numpy(), np.zeros(4, np.float32))


def test_a_variable_read_another_way_is_left_alone():
    """A gathered (sparse) read: the handle escapes the plain reads and writes, so its
    updates stay TF's ops, and the values are TF's."""
    def run(make):
        v = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), [4, 3]))

        def f(x):
            v.assign_add(x * 0.5)
            return tf.gather(v, [1, 3]) * 2.0
        fn = make(f)
        return fn, fn(tf.ones([4, 3])).numpy(), v.numpy()
    sf, got, gv = run(lambda f: stitching.function(f, options=ON))
    _, want, wv = run(tf.function)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(gv, wv)
    assert "AssignAddVariableOp" in _ops(sf, tf.ones([4, 3]))


def test_the_pass_is_off_by_default():
    step, _ = _adam_like(8)
    sf = stitching.function(step)
    g = tf.ones([8, 8])
    sf(g)
    assert _ops(sf, g).count("AssignAddVariableOp") == 3
    assert not any("variable(s)" in n for n in sf.report.notes)


def test_inputs_tf_never_forwards_take_no_in_place_pair():
    """A kernel may write an output over a dead input (tf/passes/forward.py); never over
    a variable's value, which TF does not grant: with such a pair among its others,
    the granted ones made the kernel's loop alias partly, and LLVM ran it scalar.  So
    every pair of every kernel of an Adam step (default options) is on an input some
    op computed, and the moments' kernel writes over the gradient."""
    from stitching.tf.passes.forward import ATTR
    step, _ = _adam_like(64)
    w = tf.Variable(tf.ones([64, 64]) * 0.5)

    def f(x):
        return step(tf.matmul(x, w))          # the "gradient": a dead TF product
    sf = stitching.function(f)
    x = tf.ones([64, 64])
    sf(x)
    gd = sf.get_concrete_function(x).graph.as_graph_def()
    nodes = {n.name: n for n in gd.node}
    pairs = 0
    for n in gd.node:
        if n.op != "StitchedKernel" or ATTR not in n.attr:
            continue
        data = [i for i in n.input if not i.startswith("^")]
        ps = list(n.attr[ATTR].list.i)
        for i in ps[0::2]:
            src = nodes[data[i].split(":")[0]]
            assert src.op not in ("ReadVariableOp", "Const"), (n.name, src.op)
            pairs += 1
    assert pairs >= 1


# ---- the rewrite on hand-made graphs: what it must refuse ------------------------------

def _graph(control: bool, device: str = "") -> graph_pb2.GraphDef:
    """h: a float [4] variable; r0 = read; d = r0 * 2; AssignAdd(h, d); r1 = read;
    out = r1 + 1.  ``control``: the edges tf.function's automatic control dependencies
    add (the update after r0, r1 after the update)."""
    with tf.Graph().as_default() as g:
        h = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[4], shared_name="v")
        r0 = tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32)
        d = r0 * 2.0
        if control:
            with tf.control_dependencies([r0]):
                up = tf.raw_ops.AssignAddVariableOp(resource=h, value=d)
            with tf.control_dependencies([up]):
                r1 = tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32)
        else:
            tf.raw_ops.AssignAddVariableOp(resource=h, value=d)
            r1 = tf.raw_ops.ReadVariableOp(resource=h, dtype=tf.float32)
        tf.identity(r1 + 1.0, name="out")
    gd = g.as_graph_def()
    for n in gd.node:
        n.device = device
    return gd, g


def test_rewrite_on_an_ordered_graph():
    gd, g = _graph(control=True)
    # "out" an output: r1 is not forwarded (an outer tape's gradient of out goes to the
    # variable through r1, not to what computed the update)
    _, updates, forwarded, _ = V.rewrite(gd, g, pinned={"out"}, fetches=["out:0"])
    assert (updates, forwarded) == (1, 0)
    out, updates, forwarded, variables = V.rewrite(gd, g, pinned={"out"})
    ops = {n.name: n.op for n in out.node}
    assert (updates, forwarded, variables) == (1, 1, 1)
    assert "AssignAddVariableOp" not in ops.values()
    assert ops["AssignAddVariableOp"] == "AssignVariableOp"
    add = next(n for n in out.node if n.name.endswith("stitching_value"))
    assert add.op == "AddV2" and add.input[0] == "ReadVariableOp"   # r0, no new read
    # r1 is gone: out's operand reads the new value
    assert not any(n.op == "ReadVariableOp" and n.name == "ReadVariableOp_1" for n in out.node)
    assert next(n for n in out.node if n.name == "add").input[0] == add.name


@pytest.mark.parametrize("control,device", [(False, ""), (True, "/job:ps/replica:0/task:0/device:CPU:0")])
def test_rewrite_leaves_unordered_or_remote_variables_alone(control, device):
    """Without the control edges a read may run before or after the update (a TF1
    graph); on a parameter server, AssignAdd's atomic add is what concurrent workers
    rely on."""
    gd, g = _graph(control, device)
    assert V.rewrite(gd, g, pinned={"out"}) is None


def test_elementwise_kernel_computes_one_element_values_once():
    """The one-element values of an element-wise kernel (here an Adam step's bias
    correction from the step count) are computed before the element loop, not per
    element: the generated source has no pow call inside the loop."""
    from stitching.compile import compile_kernel
    from stitching.ir.builder import SpecBuilder
    b = SpecBuilder()
    x = b.input("float32", (-1,))
    t = b.input("float32", ())
    corr = b.Sqrt(b.Sub(b.const(1.0), b.Pow(b.const(0.999), t)))
    k = compile_kernel(b.build([b.Mul(x, corr)]))
    src = k.source
    loop = src.index("for j in range(")
    assert "pow" in src[:loop] and "pow" not in src[loop:].split("\n    else:")[0]
    xs = np.linspace(-3, 3, 1000).astype("float32")
    got = k(xs, np.float32(7.0))[0]
    base = float(np.float32(0.999))          # the constant the kernel holds, exactly
    want = xs.astype(np.float64) * np.sqrt(1.0 - base ** 7)
    np.testing.assert_allclose(got, want, rtol=2e-6)
