"""Loops with a constant trip count are unrolled before planning (tf/passes/unroll.py)."""
import numpy as np
import pytest
import tensorflow as tf

import stitching

keras = pytest.importorskip("keras")

RNG = np.random.default_rng(7)


def _notes(f):
    return [n for n in f.report.notes if n.startswith("loop ")]


def _loops_left(f, *args):
    ops = {op.type for op in f.get_concrete_function(*args).graph.get_operations()}
    return ops & {"While", "StatelessWhile"}


def _rnn(steps=6, features=4, units=8):
    keras.utils.set_random_seed(5)
    inp = keras.Input((steps, features))
    seq = keras.layers.LSTM(units, return_sequences=True)(inp)
    return keras.Model(inp, keras.layers.Dense(2)(keras.layers.GRU(units)(seq)))


def _cell_kernels(f):
    return [k for k in f.report.kernels if "Tanh" in {t for _, t in k.ops}]


def test_a_keras_lstm_and_gru_over_a_fixed_length_become_their_steps():
    """Both layers' loops (6 steps) are unrolled: no loop is left in the stitched
    graph, each step's cell math is one kernel (12 in all), and the outputs equal
    Keras's, also for a second batch size of the traced [None, 6, 4]."""
    model = _rnn()
    f = stitching.function(lambda x: model(x, training=False),
                           input_signature=[tf.TensorSpec([None, 6, 4])])
    for batch in (3, 5):
        x = tf.constant(RNG.standard_normal((batch, 6, 4)).astype(np.float32))
        np.testing.assert_allclose(f(x), model(x, training=False), rtol=1e-5, atol=1e-6)
    notes = _notes(f)
    assert len(notes) == 2 and all("unrolled: 6 iteration(s)" in n for n in notes), notes
    assert not _loops_left(f, tf.TensorSpec([None, 6, 4]))
    assert len(_cell_kernels(f)) == 12, f.report.summary()
    # the loops read the weights once per layer, not once per step: 3 variables each
    graph = f.get_concrete_function(tf.TensorSpec([None, 6, 4])).graph
    reads = [op.name for op in graph.get_operations()
             if op.type == "ReadVariableOp" and "/while/" in op.name]
    assert len(reads) == 3 + 3 and all("/unroll_invariant/" in r for r in reads), reads


def _variable_loop(steps=5):
    """A tf.function of a 5-step loop whose body reads a variable and scales it (loop
    invariants) and multiplies the state by it; its GraphDef, the body's FunctionDef
    and GraphDef, and the body nodes unroll._invariant finds."""
    from tensorflow.python.framework import function_def_to_graph
    from stitching.tf.passes import unroll
    v = tf.Variable(tf.ones([4, 4]))

    @tf.function
    def f(x):
        def body(i, h):
            w = v.read_value() * 2.0                # invariant: a read and its scale
            return i + 1, tf.tanh(tf.matmul(h, w))  # per step
        return tf.while_loop(lambda i, h: i < steps, body, (tf.constant(0), x))[1]
    gd = f.get_concrete_function(tf.TensorSpec([2, 4])).graph.as_graph_def()
    (loop,) = [n for n in gd.node if n.op in unroll.WHILE_OPS]
    (fdef,) = [fn for fn in gd.library.function
               if fn.signature.name == loop.attr["body"].func.name]
    body_gd, flat = function_def_to_graph.function_def_to_graph_def(fdef)
    return f, gd, fdef, body_gd, unroll._invariant(body_gd, fdef, flat)


def test_the_node_budget_counts_hoisted_nodes_once():
    """The budget counts what the copies add: the hoisted nodes once and the rest once
    per step; one node over it keeps the loop, and the note says why."""
    from stitching.tf.passes import unroll
    _, gd, fdef, _, inv = _variable_loop()
    assert inv
    need = len(inv) + 5 * (len(fdef.node_def) - len(inv))
    assert need < 5 * len(fdef.node_def)
    for budget, unrolled in ((need, True), (need - 1, False)):
        g = type(gd)()
        g.CopyFrom(gd)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(unroll, "MAX_NODES", budget)
            (note,) = unroll.unroll_loops(g, 64)
        assert ("unrolled: 5 iteration(s)" in note) == unrolled, (budget, note)
        if not unrolled:
            assert "node budget" in note and f"{len(fdef.node_def) - len(inv)} nodes" \
                in note, note


def test_what_a_step_computes_from_loop_invariants_alone_is_copied_once():
    """A body node whose inputs are all arguments the body passes through unchanged
    (or other such nodes) is hoisted: one copy serves every step.  A node that reads
    the step's state, or a stateful op, is copied per step."""
    from stitching.tf.passes import unroll
    f, gd, fdef, body_gd, inv = _variable_loop()
    ops = {n.name: n.op for n in body_gd.node}
    assert {ops[n] for n in inv} >= {"ReadVariableOp", "Mul", "Const"}, inv
    assert not {"MatMul", "Tanh", "AddV2"} & {ops[n] for n in inv}, inv
    notes = unroll.unroll_loops(gd, 64)
    assert "unrolled: 5 iteration(s)" in notes[0], notes
    counts = {}
    for n in gd.node:
        counts[n.op] = counts.get(n.op, 0) + 1
    assert counts["ReadVariableOp"] == 1 and counts["MatMul"] == 5, counts
    x = tf.constant(RNG.standard_normal((2, 4)).astype(np.float32))
    g = stitching.function(f.python_function)
    np.testing.assert_allclose(g(x), f(x), rtol=1e-6, atol=1e-6)


def test_unrolling_matches_the_loop_and_tf_against_float64():
    """The unrolled steps compute what the loop computes: float32 outputs as close to
    a float64 run of the same model as stock TF's loop, and to the stitched loop."""
    keras.utils.set_random_seed(9)
    inp = keras.Input((10, 4))
    out = keras.layers.LSTM(16)(inp)
    model = keras.Model(inp, out)
    x64 = RNG.standard_normal((4, 10, 4))
    x = tf.constant(x64.astype(np.float32))
    want = model(x, training=False).numpy()
    unrolled = stitching.function(lambda t: model(t, training=False))(x).numpy()
    loop = stitching.function(lambda t: model(t, training=False),
                              options=stitching.Options(unroll_loops=0))(x).numpy()
    keras.config.set_floatx("float64")
    try:
        keras.utils.set_random_seed(9)
        inp64 = keras.Input((10, 4))
        m64 = keras.Model(inp64, keras.layers.LSTM(16)(inp64))
        m64.set_weights([w.astype(np.float64) for w in model.get_weights()])
        exact = m64(tf.constant(x64), training=False).numpy()
    finally:
        keras.config.set_floatx("float32")
    err = lambda y: float(np.max(np.abs(y - exact)))  # noqa: E731
    assert err(unrolled) <= max(2 * err(want), 1e-6), (err(unrolled), err(want))
    np.testing.assert_allclose(unrolled, loop, rtol=1e-5, atol=1e-6)


def test_a_tape_outside_differentiates_the_unrolled_steps():
    model = _rnn()
    f = stitching.function(lambda x: model(x, training=False))
    x = tf.constant(RNG.standard_normal((2, 6, 4)).astype(np.float32))
    grads = []
    for g in (f, lambda t: model(t, training=False)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(g(x) ** 2)
        grads.append(tape.gradient(y, [x] + model.trainable_variables))
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert all("unrolled" in n for n in _notes(f))


def test_a_loop_whose_length_is_unknown_stays_a_loop_and_says_why():
    """An unknown sequence length ([None, None, 4]): the trip count is a value of the
    input's shape, not a constant; both loops are kept, stitched as bodies."""
    model = _rnn()
    f = stitching.function(lambda x: model(x, training=False),
                           input_signature=[tf.TensorSpec([None, None, 4])])
    x = tf.constant(RNG.standard_normal((2, 6, 4)).astype(np.float32))
    np.testing.assert_allclose(f(x), model(x, training=False), rtol=1e-5, atol=1e-6)
    notes = _notes(f)
    assert len(notes) == 2, notes
    assert all("kept as a loop: its trip count is not a constant here" in n for n in notes)
    assert _loops_left(f, tf.TensorSpec([None, None, 4]))


def test_a_data_dependent_loop_stays_a_loop():
    def fn(x):
        return tf.while_loop(lambda v: tf.reduce_sum(v) < 100.0, lambda v: [v * 2.0 + 1.0],
                             [x])[0]
    f = stitching.function(fn)
    x = tf.constant(np.ones((4, 4), np.float32))
    np.testing.assert_array_equal(f(x), tf.function(fn)(x))
    (note,) = _notes(f)
    assert "kept as a loop: its trip count is not a constant here" in note, note
    assert "Sum" in note or "not integer arithmetic" in note, note


def test_the_trip_count_limit_and_unroll_loops_0():
    """A loop longer than ``Options.unroll_loops`` is kept, and the note says so;
    ``unroll_loops=0`` unrolls nothing and adds no note."""
    def fn(x):
        return tf.while_loop(lambda i, v: i < 6, lambda i, v: (i + 1, tf.tanh(v) * 1.5),
                             (0, x))[1]
    x = tf.constant(RNG.standard_normal((4, 8)).astype(np.float32))
    want = tf.function(fn)(x)
    short = stitching.function(fn, options=stitching.Options(unroll_loops=4))
    np.testing.assert_allclose(short(x), want, rtol=1e-6, atol=1e-6)
    (note,) = _notes(short)
    assert "it runs more than 4 times (Options.unroll_loops)" in note, note
    off = stitching.function(fn, options=stitching.Options(unroll_loops=0))
    np.testing.assert_allclose(off(x), want, rtol=1e-6, atol=1e-6)
    assert _notes(off) == []
    assert _loops_left(off, x)
    on = stitching.function(fn)
    np.testing.assert_allclose(on(x), want, rtol=1e-6, atol=1e-6)
    assert _notes(on) == ["loop while unrolled: 6 iteration(s) of its "
                          f"{_notes(on)[0].split('its ')[1]}"]
    # six tanh steps in a row: one kernel
    assert len(on.report.kernels) == 1, on.report.summary()


def test_a_loop_with_a_stateful_op_or_no_iterations():
    """A random op in the body keeps the loop (each step draws anew; copies would
    change nothing here, but a stateful op is never duplicated); a loop whose
    condition is false at once is unrolled to nothing: its results are its inputs."""
    def noisy(x):
        return tf.while_loop(lambda i, v: i < 3,
                             lambda i, v: (i + 1, v + tf.random.uniform(tf.shape(v))),
                             (0, x))[1]
    f = stitching.function(noisy)
    x = tf.zeros((2, 3))
    assert f(x).shape == (2, 3)
    (note,) = _notes(f)
    assert "kept as a loop: its body has a stateful op (RandomUniform" in note, note

    def never(x):
        return tf.while_loop(lambda i, v: i < 0, lambda i, v: (i + 1, v * 2.0), (0, x))[1]
    g = stitching.function(never)
    x = tf.constant(RNG.standard_normal((2, 3)).astype(np.float32))
    np.testing.assert_array_equal(g(x), x)
    assert _notes(g) == ["loop while unrolled: 0 iteration(s) of its "
                         f"{_notes(g)[0].split('its ')[1]}"]


def test_an_unrolled_rnn_reads_and_writes_no_tensorlist():
    """After unrolling, each step's read of the sequence is a slice of it and the
    outputs' stack a Pack (tf/passes/tensorlist.py): no TensorList read, write or
    stack is left for TF to run step by step."""
    model = _rnn()
    f = stitching.function(lambda x: model(x, training=False))
    x = tf.constant(RNG.standard_normal((3, 6, 4)).astype(np.float32))
    np.testing.assert_allclose(f(x), model(x, training=False), rtol=1e-5, atol=1e-6)
    ops = {op.type for op in f.get_concrete_function(x).graph.get_operations()}
    assert not [op for op in ops if op.startswith("TensorList")], ops   # none is built
    assert any("12 read(s) became slices" in n and "2 stack(s) a Pack" in n
               for n in f.report.notes), f.report.notes


def test_an_identityn_loses_the_list_slots_nothing_reads():
    """An IdentityN's TensorList slot that no node reads and no fetch names is taken
    out, the readers of later slots renumbered; a fetched list slot stays."""
    from stitching.tf.passes import tensorlist
    g = tf.Graph()
    with g.as_default():
        x = tf.constant([1.0, 2.0])
        lst = tf.raw_ops.TensorListFromTensor(tensor=x, element_shape=tf.constant(
            [], tf.int32))
        ids = tf.raw_ops.IdentityN(input=[lst, x * 2.0], name="ids")
        tf.identity(ids[1] + 1.0, name="out")
    gd = g.as_graph_def()
    kept = type(gd)()
    kept.CopyFrom(gd)
    assert tensorlist._drop_unread_lists(kept, {("ids", 0)}, set()) == 0
    assert tensorlist._drop_unread_lists(gd, set(), set()) == 1
    nodes = {n.name: n for n in gd.node}
    assert len(nodes["ids"].input) == 1 and len(nodes["ids"].attr["T"].list.type) == 1
    (add,) = [n for n in gd.node if n.op == "AddV2"]
    assert "ids:0" in list(add.input), add.input
    run = tf.Graph()
    with run.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    with tf.compat.v1.Session(graph=run) as sess:
        np.testing.assert_allclose(sess.run("out:0"), [3.0, 5.0])


def _stack(writes, n=3):
    """A TensorList of ``n`` [2] elements written at ``writes`` ((index, value)), in
    order, then stacked; the GraphDef and the stack's tensor name."""
    g = tf.Graph()
    with g.as_default():
        h = tf.raw_ops.TensorListReserve(element_shape=tf.constant([2]), num_elements=n,
                                          element_dtype=tf.float32)
        for i, v in writes:
            h = tf.raw_ops.TensorListSetItem(input_handle=h, index=tf.constant(i),
                                             item=tf.constant([v, -v]))
        out = tf.raw_ops.TensorListStack(input_handle=h, element_shape=tf.constant([2]),
                                         element_dtype=tf.float32, num_elements=n)
    return g, out.name


def _run(graph_def, fetch):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=g) as s:
            return s.run(fetch)


@pytest.mark.parametrize("writes,packed", [
    ([(0, 1.0), (1, 2.0), (2, 3.0)], True),
    ([(2, 3.0), (0, 1.0), (1, 2.0), (1, 5.0)], True),     # index 1 twice: the last wins
    ([(0, 1.0), (2, 3.0)], False),                        # index 1 never written
])
def test_a_stack_becomes_a_pack_only_where_every_element_is_written(writes, packed):
    from stitching.tf.passes import tensorlist
    g, fetch = _stack(writes)
    new, reads, stacks = tensorlist.rewrite(g.as_graph_def(), g, fetches=[fetch])
    assert (new is not None, stacks) == ((True, 1) if packed else (False, 0))
    if packed:
        assert {n.op for n in new.node if n.name == fetch.split(":")[0]} == {"Pack"}
        np.testing.assert_array_equal(_run(new, fetch), _run(g.as_graph_def(), fetch))


def test_a_kernel_has_at_most_32_outputs():
    """40 results of one input would be one kernel with 40 outputs: a spec over the
    limits a spec read back from JSON is checked against (ir/spec.py), which its
    compile worker refused, so it ran its quick tier-1 code for good.  The planner
    keeps every kernel within them, and every kernel's spec reads back."""
    from stitching.compile import kernel as compiled
    from stitching.ir.spec import MAX_OUTPUTS, KernelSpec

    def fn(x):
        return [tf.tanh(x) * float(i) + 1.0 for i in range(40)]
    f = stitching.function(fn)
    x = tf.constant(RNG.standard_normal((4, 8)).astype(np.float32))
    for got, want in zip(f(x), tf.function(fn)(x)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert f.report.kernels
    specs = {k.spec.hash: k.spec for k in list(compiled._kernels.values())}
    for k in f.report.kernels:
        spec = specs[k.spec_hash]
        assert len(spec.outputs) <= MAX_OUTPUTS, k.schedule
        assert KernelSpec.from_json(spec.to_json()).hash == spec.hash


@pytest.mark.parametrize("axes,trips", [([0], 5), ([], 2)])
def test_the_trip_count_interpreter_reduces_as_tf(axes, trips):
    """The loop's bound a reduction of a constant: over axis 0, max([2, 5, 3]) = 5;
    over no axis TF's Max is the vector itself, and the condition all(i < [2, 5, 3])
    stops after 2 steps (a reduction over all axes would have made it 5)."""
    def fn(x):
        n = tf.reduce_max(tf.constant([2, 5, 3]), axis=axes)
        return tf.while_loop(lambda i, v: tf.reduce_all(i < n),
                             lambda i, v: (i + 1, v * 1.5 + 1.0), (0, x))[1]
    x = tf.constant(RNG.standard_normal((2, 3)).astype(np.float32))
    f = stitching.function(fn)
    np.testing.assert_allclose(f(x), tf.function(fn)(x), rtol=1e-6)
    assert _notes(f) == [f"loop while unrolled: {trips} iteration(s) of its "
                         f"{_notes(f)[0].split('its ')[1]}"], _notes(f)
