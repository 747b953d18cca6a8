"""stitching.function end to end: kernel counts, numerics vs TF and float64, behaviour."""
import json
import os

import threading

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import stitching  # noqa: E402
from stitching.testing import patterns  # noqa: E402

ONE_KERNEL = ["layernorm_manual", "layernorm_keras", "add_layernorm", "rmsnorm", "softmax_tf",
              "softmax_manual", "attention_softmax", "log_softmax", "bias_gelu_erf",
              "bias_gelu_tanh", "bn_swish", "leading_axis_reduction",
              "swiglu"]      # tf.nn.silu's custom-gradient IdentityN is bypassed
SYNC = stitching.Options(background_compile=False)


def _pattern(name):
    if name not in patterns.PATTERNS:
        pytest.skip(f"pattern {name} not in the zoo")
    return patterns.PATTERNS[name]


@pytest.mark.parametrize("name", ONE_KERNEL)
def test_pattern_is_exactly_one_kernel_and_matches_tf(name):
    p = _pattern(name)
    sig = p.input_signature("small")
    # The greedy planner deploys every legal region, so this pins what one kernel can
    # hold; the default search planner may leave a lone softmax to TF by its cost model
    # (selective deployment), which tests/test_search.py covers.
    # min_ops=1: a lone op TF runs as one kernel (oneDNN's Softmax) is fused too
    sf = stitching.function(p.fn, input_signature=sig,
                            options=stitching.Options(planner="greedy", min_ops=1))
    ref_fn = tf.function(p.fn, input_signature=sig)
    for batch in (p.shapes["small"][0][0], 3):           # one compile serves both
        args = [a[:batch] if a.shape[0] >= batch else np.concatenate([a] * batch)[:batch]
                for a in p.inputs("small")]
        got, ref = sf(*args), ref_fn(*args)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
    rep = sf.report.to_dict()
    assert rep["kernels"] == p.expected_kernels, sf.report.summary()
    assert not rep["unfused"], sf.report.summary()


@pytest.mark.parametrize("name", ["layernorm_manual", "softmax_manual", "bias_gelu_tanh"])
def test_pattern_float32_error_is_no_worse_than_tf_against_float64(name):
    p = _pattern(name)
    args32 = p.inputs("small")
    args64 = [a.astype(np.float64) if a.dtype == np.float32 else a for a in args32]
    exact = tf.function(p.make_fn(tf.float64))(*args64).numpy()
    tf_err = np.max(np.abs(tf.function(p.fn)(*args32).numpy() - exact))
    st_err = np.max(np.abs(stitching.function(p.fn)(*args32).numpy() - exact))
    assert st_err <= 4 * tf_err + 1e-6


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
@pytest.mark.parametrize("op", [tf.nn.softmax, tf.nn.log_softmax])
def test_lone_softmax_op_with_unknown_batch_is_fused(op, dtype):
    """TF's Eigen Softmax/LogSoftmax walk their data four times
    (legality.COMPOSITE_PASSES); costed as two, a lone one was left to TF, 3.6x slower
    at 8192x1024.  TF's oneDNN Softmax (float32 on Intel CPUs) measured as fast as the
    fused kernel or slower at every size, so a lone Softmax is fused there too."""
    f = stitching.function(op, input_signature=[tf.TensorSpec([None, 1024], dtype)])
    x = tf.constant(np.random.default_rng(1).standard_normal((64, 1024)), dtype)
    tol = {tf.float32: dict(rtol=2e-5, atol=1e-6), tf.float64: dict(rtol=1e-12)}[dtype]
    np.testing.assert_allclose(f(x), op(x), **tol)
    assert f.report.to_dict()["kernels"] == 1, f.report.summary()


def test_rewrite_keeps_repeated_inputs_of_unfused_nodes():
    # regression: the rewriter deduplicated data inputs, turning Add(x, x) into Add(x)
    f = stitching.function(lambda x: tf.transpose(tf.exp(x) * 2.0) + tf.transpose(tf.exp(x) * 2.0))
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(f(x), 2 * np.transpose(np.exp(x) * 2.0), rtol=1e-6)


def test_variables_stay_variables():
    w = tf.Variable(np.ones(16, np.float32))

    @stitching.function
    def f(x):
        return tf.nn.relu(x * w + 1.0)

    x = np.full((2, 16), 2.0, np.float32)
    np.testing.assert_allclose(f(x), 3.0)
    w.assign(np.full(16, -1.0, np.float32))
    np.testing.assert_allclose(f(x), 0.0)        # same trace, new weight value
    assert f.report.to_dict()["kernels"] == 1


def test_ops_after_an_embedding_lookup_of_a_variable_have_known_ranks_and_fuse():
    """tf.gather of a ResourceVariable (tf_keras's Embedding, HF transformers' word and
    position embeddings) is a ResourceGather, whose output shape TF infers from the
    handle's data: the graph stitching imports did not carry it, so every op after
    an embedding lookup was "a tensor of unknown rank" and stayed TF's (an HF
    TFBertModel: 40% of its ops fused, 96% with the lookup typed)."""
    table = tf.Variable(np.random.default_rng(0).standard_normal((50, 16)).astype("float32"))

    @stitching.function
    def f(ids):
        x = tf.gather(table, ids) * 2.0 + 1.0
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-5)

    ids = tf.constant([[1, 4, 9], [0, 49, 3]])
    np.testing.assert_allclose(f(ids), tf.function(f.python_function)(ids),
                               rtol=1e-5, atol=1e-5)
    report = f.report
    assert not [u for u in report.unfused if "unknown rank" in u[2]], report.summary()
    assert report.to_dict()["kernels"] == 1, report.summary()
    assert report.fused_ops == report.memory_intensive_ops, report.summary()


def test_stateful_ops_keep_their_order():
    v = tf.Variable(1.0)

    @stitching.function
    def f(x):
        v.assign_add(1.0)
        y = tf.exp(x * v) + 1.0
        v.assign(10.0)
        return y

    out = f(tf.zeros([3]))
    np.testing.assert_allclose(out, 2.0)
    assert float(v.numpy()) == 10.0


def test_jit_compile_is_refused_clearly():
    with pytest.raises(ValueError, match="jit_compile"):
        stitching.function(tf.function(lambda x: x + 1, jit_compile=True))
    with pytest.raises(ValueError, match="jit_compile"):
        stitching.function(lambda x: x, jit_compile=True)


def test_call_with_wrong_shape_fails_like_tf():
    f = stitching.function(lambda x: tf.nn.softmax(x * 2.0),
                           input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    with pytest.raises((TypeError, ValueError, tf.errors.InvalidArgumentError)):
        f(np.zeros((2, 9), np.float32))


def test_runtime_broadcast_mismatch_is_an_error_not_a_wrong_answer():
    f = stitching.function(lambda x, y: tf.exp(x + y) * 2.0,
                           input_signature=[tf.TensorSpec([None, 4]), tf.TensorSpec([None, 4])])
    np.testing.assert_allclose(f(np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)), 2.0)
    with pytest.raises(tf.errors.InvalidArgumentError):
        f(np.zeros((3, 4), np.float32), np.zeros((5, 4), np.float32))


def test_custom_gradient_identity_n_does_not_split_a_region():
    """tf.nn.silu wraps its value in an IdentityN (custom_gradient); a fetched IdentityN
    stays, one feeding other ops is bypassed, so silu(g) * u is one kernel."""
    from stitching.tf.passes import grappler
    sig = [tf.TensorSpec([None, 64]), tf.TensorSpec([None, 64])]
    g = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    u = np.random.default_rng(4).standard_normal((5, 64)).astype(np.float32)
    f = stitching.function(lambda a, b: tf.nn.silu(a) * b, input_signature=sig)
    np.testing.assert_allclose(f(g, u).numpy(), (tf.nn.silu(g) * u).numpy(), rtol=2e-6,
                               atol=2e-6)
    rep = f.report.to_dict()
    assert rep["kernels"] == 1 and not rep["unfused"], f.report.summary()
    gd = tf.function(lambda a: tf.nn.silu(a), input_signature=sig[:1]) \
        .get_concrete_function().graph.as_graph_def()
    idn = [n.name for n in gd.node if n.op == "IdentityN"]
    assert idn
    kept = grappler.bypass_identity_n(gd, set(idn))
    assert kept is gd
    out = grappler.bypass_identity_n(gd, set())
    assert not [n for n in out.node if n.op == "IdentityN"]
    assert all(not i.startswith(tuple(idn)) for n in out.node for i in n.input)


def test_a_users_custom_gradient_holds_for_a_tape_outside():
    """Regression: a tf.custom_gradient's IdentityN was bypassed like tf.nn.silu's, so a
    tape outside the stitched function differentiated the kernels' original ops
    without it and got the plain derivative (zeros here: a softmax's sum is constant)
    instead of the custom one.  Only TF's own swish gradient is bypassed now."""
    @tf.custom_gradient
    def scaled(x):
        return x * 1.0, lambda dy: dy * 7.0

    def clip_grad(x):
        y = tf.nn.sigmoid(x) * 3.0

        def grad(dy):
            return tf.clip_by_value(dy, -0.1, 0.1) * 2.0
        return y, grad
    clipped = tf.custom_gradient(clip_grad)

    def fn(x):
        return tf.reduce_sum(tf.nn.softmax(scaled(x) * 2.0)) + \
            tf.reduce_sum(clipped(x) * x * 4.0)

    x = tf.constant(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    grads = []
    for f in (stitching.function(fn), tf.function(fn)):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
        grads.append(tape.gradient(y, x).numpy())
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_background_compile_serves_stock_tf_first_then_the_stitched_graph():
    """Options(background_compile=True): the first call with a new signature returns
    stock TF's result at once (no report yet); after wait() the same signature runs the
    stitched graph, with the same numbers; a second signature does the same."""
    def fn(x):
        return tf.nn.softmax(x * 2.0) + 1.0
    f = stitching.function(fn, options=stitching.Options(background_compile=True))
    x = np.random.default_rng(7).standard_normal((6, 40)).astype(np.float32)
    first = f(tf.constant(x)).numpy()
    key = ((tf.float32, (6, 40)),)
    ops = lambda: {op.type for op in f._concrete[key].graph.get_operations()}  # noqa: E731
    assert f.wait(timeout=300)
    second = f(tf.constant(x)).numpy()          # the call that switches
    assert "StitchedKernel" in ops() and f.report.kernels, f.report
    ref = tf.function(fn)(tf.constant(x)).numpy()
    np.testing.assert_allclose(first, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(second, ref, rtol=2e-6, atol=2e-6)
    y = np.random.default_rng(8).standard_normal((3, 40)).astype(np.float32)
    np.testing.assert_allclose(f(tf.constant(y)).numpy(), tf.function(fn)(y).numpy(),
                               rtol=2e-6, atol=2e-6)
    assert f.wait(timeout=300) and len(f.reports) == 2 and not f.background_errors


def test_reports_waits_for_the_background_traces_as_report_does(tiered):
    """``reports`` right after tiered calls lists every trace, as ``report`` waits
    for the latest (the retracing example in docs/differences-from-tf-function.md):
    batches 8 and 9 trace twice (the second relaxed to an unknown batch), 10 and 11
    reuse the relaxed one."""
    f = stitching.function(lambda x: tf.nn.softmax(x * 2.0))
    for batch in (8, 9, 10, 11):
        f(tf.ones([batch, 16]))
    assert len(f.reports) == 2 and not f._pending


def test_a_tiered_inference_graph_runs_once_in_the_background_before_its_switch(tiered):
    """The call that switched to the stitched graph was its first run (TF instantiating
    the function, first allocations): 4-14x a steady call in an audit's serving runs.
    A graph without side effects now runs once in the background on the first call's
    arguments before the switch; one that updates a variable does not (a second update
    would change the model)."""
    from stitching import runtime
    x = tf.constant(np.random.default_rng(5).standard_normal((6, 40)).astype(np.float32))
    v = tf.Variable(tf.zeros([6, 40]))

    def infer(x):
        return tf.nn.softmax(x * 3.0) * 2.0 - 0.5

    def update(x):
        v.assign_add(tf.nn.softmax(x * 3.0) * 2.0 - 0.5)
        return v.read_value()

    runtime.set_profiling(True)
    try:
        for fn, warmed in ((infer, True), (update, False)):
            f = stitching.function(fn)
            runtime.profile_reset()
            f(x)                                        # stock TF; the compile starts
            assert f.wait(timeout=300)
            runs = sum(p["calls"] for p in runtime.profile().values())
            assert (runs > 0) is warmed, (fn.__name__, runtime.profile())
            f(x)                                        # the switch
    finally:
        runtime.set_profiling(False)
    np.testing.assert_allclose(v.numpy(), 2 * (tf.nn.softmax(x * 3.0) * 2.0 - 0.5).numpy(),
                               rtol=1e-5, atol=1e-6)   # two calls: two updates, no third


def test_tiered_by_default_stock_first_then_stitched_with_the_switch_reported(tiered,
                                                                             capsys):
    """Default options: an eager call of a new signature returns stock TF's result
    (nothing stitched yet); after wait() the next call switches to the kernels, with
    TF's numbers; the report and a progress line name the call that switched.
    ``report`` waits for the pending compile (it describes the stitched graph)."""
    def fn(x):
        return tf.nn.softmax(x * 4.0) * 2.0 - 0.5
    f = stitching.function(fn)
    x = tf.constant(np.random.default_rng(3).standard_normal((7, 48)).astype(np.float32))
    ref = tf.function(fn)(x).numpy()
    key = ((tf.float32, (7, 48)),)
    first = f(x).numpy()
    assert type(f._concrete[key]).__name__ == "_StockTier"
    np.testing.assert_array_equal(first, ref)              # stock TF's own graph
    np.testing.assert_array_equal(f(x).numpy(), ref)
    assert f.report.kernels and not f._pending             # report waited
    # ready, not yet called: the report says so (it said nothing)
    assert f.report.tiering == ("stock TF ran calls 1-2; the stitched graph is ready and "
                                "runs from the next call")
    third = f(x).numpy()
    assert "StitchedKernel" in {op.type for op in f._concrete[key].graph.get_operations()}
    np.testing.assert_allclose(third, ref, rtol=2e-6, atol=2e-6)
    assert f.report.tiering.startswith("stock TF ran calls 1-2 while the kernels compiled")
    assert f.report.tiering.endswith("stitched from call 3")
    assert f.report.to_dict()["tiering"] == f.report.tiering       # the same facts as data
    assert "fn (float32[7,48]): stock TF ran calls 1-2" in capsys.readouterr().err
    assert "tiered" in f.report.summary()


def test_synchronous_where_tiering_is_not_safe(tiered, monkeypatch):
    """The first call waits for its kernels (kernels right after it, nothing pending)
    inside another tf.function's trace, under a tf.distribute strategy, through TF's
    call path (a keyword a ``**kwargs`` function binds), and where the user turned
    tiering off: by
    Options or by the environment; a value there that is neither is refused."""
    def fn(x):
        return tf.nn.relu(x * 1.5 - 0.25) + 1.0

    def synchronous(f, call):
        out = call(f)
        assert not f._pending and f.reports and f.reports[-1].kernels
        np.testing.assert_allclose(np.asarray(out), np.asarray(call(tf.function(fn))),
                                   rtol=2e-6, atol=2e-6)
    x = tf.constant(np.linspace(-2, 2, 60, dtype=np.float32).reshape(6, 10))
    synchronous(stitching.function(fn), lambda f: tf.function(lambda t: f(t) * 2.0)(x))
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        synchronous(stitching.function(fn), lambda f: f(x))
    synchronous(stitching.function(lambda **kw: fn(kw["x"])), lambda f: f(x=x))
    synchronous(stitching.function(fn, options=SYNC), lambda f: f(x))
    monkeypatch.setenv("STITCHING_BACKGROUND_COMPILE", "0")
    synchronous(stitching.function(fn), lambda f: f(x))
    asked = stitching.function(fn, options=stitching.Options(background_compile=True))
    asked(x)                                    # an explicit True wins over the variable
    assert [type(v).__name__ for v in asked._concrete.values()] == ["_StockTier"]
    assert asked.wait(timeout=300)
    monkeypatch.setenv("STITCHING_BACKGROUND_COMPILE", "later")
    with pytest.raises(ValueError, match="STITCHING_BACKGROUND_COMPILE"):
        stitching.function(fn)(x)


def test_tiered_stock_calls_are_tf_functions_own(tiered):
    """A tiered signature's stock calls go through tf.function's call: an argument
    its input_signature refuses raises TypeError and leaves nothing behind; a
    variable whose initializer reads the argument is made once (TF runs it under a
    cond) and the stitched graph, after the switch, uses that same variable; the
    tracing count is tf.function's once the background trace is done."""
    f = stitching.function(lambda x: tf.nn.softmax(x) * 2.0,
                           input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    with pytest.raises(TypeError):
        f(tf.zeros([2, 3]))
    assert not f._pending and not f._concrete

    def made_once(state):
        def fn(x):
            if not state:
                state.append(tf.Variable(2.0 * x))
            return tf.exp(state[0] * x) * 0.5 + 1.0
        return fn
    x = [tf.constant(np.full((4, 8), v, np.float32)) for v in (0.5, 0.25, -0.5)]
    stock, st = tf.function(made_once([])), stitching.function(made_once([]))
    want = [stock(v).numpy() for v in x]
    got = [st(x[0]).numpy()]
    assert st.wait(timeout=300)
    got += [st(v).numpy() for v in x[1:]]                  # switched at the second
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert st.report.kernels and "stitched from call 2" in st.report.tiering

    double = stitching.function(lambda a: a + a)
    double(tf.constant(1))
    double(tf.constant(2))
    assert double.experimental_get_tracing_count() == 1


def test_a_tiered_signature_traces_the_python_function_as_often_as_tf_function(tiered):
    """The background compile stitches the trace stock TF made for the first call
    instead of tracing the user's function again, so a trace-time Python side effect
    happens as often as under tf.function (TF's testOnExitCallback): once, or twice
    where the first call made variables (TF's variable-creating trace, then the one
    it runs).  The stitched graph made from that trace gives TF's numbers, its
    variable included."""
    def counted(make_vars):
        traced, state = [], []

        def fn(x):
            traced.append(1)
            y = tf.nn.softmax(x * 2.0) - 0.5
            if make_vars:
                if not state:
                    state.append(tf.Variable(tf.fill([9], 1.5)))
                y = y * state[0]
            return y
        return fn, traced
    x = tf.constant(np.random.default_rng(4).standard_normal((5, 9)).astype(np.float32))
    for make_vars in (False, True):
        fn, stock_traces = counted(make_vars)
        ref = tf.function(fn)(x).numpy()
        fn, traces = counted(make_vars)
        f = stitching.function(fn)
        np.testing.assert_array_equal(f(x).numpy(), ref)        # stock TF
        assert f.wait(timeout=300) and not f.background_errors
        got = f(x).numpy()                                      # the switch
        assert f.report.kernels and "stitched from call 2" in f.report.tiering
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)
        assert len(traces) == len(stock_traces) == 1 + make_vars, make_vars


def test_a_tiered_signature_of_unknown_rank_reuses_stock_tfs_trace_too(tiered):
    """An input_signature of unknown rank: stock TF's trace has inputs of unknown rank,
    which the stitched trace's specs match (their shapes have no dims to compare), so
    it is reused and the function traced once (nothing of unknown rank fuses: the
    report says why; the stitched graph switches in all the same)."""
    traced = []

    def fn(x):
        traced.append(1)
        return tf.nn.softmax(x * 2.0) + 1.0
    f = stitching.function(fn, input_signature=[tf.TensorSpec(None, tf.float32)])
    x = tf.constant(np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32))
    first = f(x).numpy()
    assert f.wait(timeout=300) and not f.background_errors, f.background_errors
    np.testing.assert_allclose(f(x).numpy(), first, rtol=2e-6, atol=2e-6)
    assert "stitched from call 2" in f.report.tiering
    assert all("unknown rank" in why for _, _, why in f.report.unfused), f.report.unfused
    assert len(traced) == 1


def test_seeded_random_numbers_run_on_across_calls_as_in_tf_function(tiered, capsys):
    """Each seeded stateful random op draws from its own generator, which starts at
    its seed: switching a tiered signature to the stitched graph after its stock
    calls made the numbers start again (calls 4-6 repeated calls 1-3; a dropout mask
    repeated).  Such a signature keeps its stock graph, the report and a progress
    line say why, and the function's later signatures wait for their kernels."""
    def fn(x):
        return tf.nn.dropout(x, 0.5, seed=3) + tf.random.uniform([8], seed=7)

    seqs = []
    for make in (tf.function, stitching.function):
        tf.random.set_seed(5)
        f = make(fn)
        seq = [f(tf.ones([8])).numpy()]
        if make is stitching.function:
            assert f.wait(timeout=300)
        seq += [f(tf.ones([8])).numpy() for _ in range(4)]
        seqs.append(np.array(seq))
    np.testing.assert_array_equal(seqs[1], seqs[0])
    assert len({row.tobytes() for row in seqs[1]}) == 5
    assert "holds seeded random ops (RandomUniform)" in f.report.tiering
    assert "seeded random ops" in capsys.readouterr().err
    f(tf.ones([4, 8]))                        # a new signature: stitched at once
    assert not f._pending and f.reports[-1].kernels
    tf.random.set_seed(None)            # no global seed either: TF seeds at random
    unseeded = stitching.function(lambda x: x + tf.random.uniform([8]) * 0.0)
    unseeded(tf.ones([8]))
    assert unseeded.wait(timeout=300)
    assert unseeded._tiers(), "random ops TF seeds at random (no seed) switch as usual"


def test_a_call_that_tf_refuses_leaves_no_lock_behind(tiered):
    """TF's _call takes the function's lock and never releases it when its argument
    check raises (a missing argument, a mistyped keyword).  Stock TF runs in one
    thread, so nothing shows there; here the next background compile waited on that
    lock for ever, and wait() with it."""
    f = stitching.function(lambda x, y=None: tf.nn.softmax(x * 2.0))
    f(tf.ones([4, 8]))
    with pytest.raises(TypeError):
        f()
    with pytest.raises(TypeError):
        f(tf.ones([4, 8]), z=1)
    f(tf.ones([5, 8]))
    done = []
    t = threading.Thread(target=lambda: done.append(f.wait(timeout=300)), daemon=True)
    t.start()
    t.join(300)
    assert done == [True], "wait() hung: the background compile never got TF's lock"
    np.testing.assert_allclose(f(tf.ones([5, 8])), tf.nn.softmax(tf.ones([5, 8]) * 2.0))


def test_saving_right_after_a_tiered_call_saves_the_stitched_graph(tiered, tmp_path):
    """tf.saved_model.save waits for the function's pending background compiles: the
    SavedModel holds the stitched trace (not stock TF's, nor none)."""
    m = tf.Module()
    m.f = stitching.function(lambda x: tf.nn.softmax(x * 2.0) + 1.0)
    x = tf.constant(np.ones((4, 16), np.float32))
    m.f(x)
    tf.saved_model.save(m, str(tmp_path / "m"))
    loaded = tf.saved_model.load(str(tmp_path / "m"))
    np.testing.assert_allclose(loaded.f(x), tf.nn.softmax(x * 2.0) + 1.0, rtol=2e-6)
    gd = loaded.f.get_concrete_function(x).graph.as_graph_def()
    assert "StitchedKernel" in {n.op for f in gd.library.function for n in f.node_def} | \
        {n.op for n in gd.node}


def test_a_training_loop_switching_mid_run_keeps_tf_losses(tiered):
    """A training step (GradientTape and an update inside; its variables made at the
    first call, in the stock trace, as tf.function allows) run tiered: steps 1-3 on
    stock TF, then wait(), then the kernels; and a loop whose tape is outside a
    tiered forward.  Every step's loss equals stock tf.function's within float
    rounding, across the switch."""
    def make():
        class Net(tf.Module):
            w = None

            def loss(self, x, y):
                if self.w is None:              # made once, at the first trace
                    init = np.random.default_rng(0).standard_normal((12, 8))
                    self.w = tf.Variable(init.astype(np.float32) * 0.3)
                    self.g = tf.Variable(tf.ones([8]))
                h = tf.matmul(x, self.w)
                mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
                h = (h - mean) * tf.math.rsqrt(var + 1e-5) * self.g
                return tf.reduce_mean(tf.square(tf.nn.gelu(h) - y))

            def step(self, x, y):
                with tf.GradientTape() as tape:
                    loss = self.loss(x, y)
                grads = tape.gradient(loss, [self.w, self.g])
                for v, g in zip([self.w, self.g], grads):
                    v.assign_sub(0.1 * g)
                return loss
        return Net()

    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_normal((16, 12)).astype(np.float32))
    y = tf.constant(rng.standard_normal((16, 8)).astype(np.float32))

    def losses(step, wait=None):
        out = []
        for i in range(6):
            out.append(float(step(x, y)))
            if i == 2 and wait is not None:
                assert wait(timeout=300)
        return out

    stock_net, net = make(), make()
    want = losses(tf.function(stock_net.step))
    f = stitching.function(net.step)
    got = losses(f, f.wait)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert f.report.kernels and "stitched from call 4" in f.report.tiering

    # the tape outside: a tiered forward, differentiated by its registered gradient
    def outside(loss_fn, net, wait=None):
        out = []
        for i in range(6):
            with tf.GradientTape() as tape:
                loss = loss_fn(x, y)
            grads = tape.gradient(loss, [net.w, net.g])
            for v, g in zip([net.w, net.g], grads):
                v.assign_sub(0.1 * g)
            out.append(float(loss))
            if i == 2 and wait is not None:
                assert wait(timeout=300)
        return out
    stock_net, net = make(), make()
    want = outside(tf.function(stock_net.loss), stock_net)
    fwd = stitching.function(net.loss)
    np.testing.assert_allclose(outside(fwd, net, fwd.wait), want, rtol=1e-5)
    assert fwd.report.kernels and "stitched from call 4" in fwd.report.tiering


def test_a_cached_result_serves_tiered_signatures_without_compiling():
    """Where the result cache holds a signature's stitched graph (plan and kernels
    built before: by another process, here by another function of the same code):
    a tiered function's first call runs stock TF (it may make the function's
    variables), and the background trace finds that graph in the cache, compiling
    nothing; a later new signature of a function that ran is probed at its first
    call and runs stitched at once: no stock call, nothing pending.  Stock TF's
    numbers throughout."""
    def fn(x):
        return tf.nn.softmax(x * 3.0) - 1.0
    opts = stitching.Options(background_compile=True)
    rng = np.random.default_rng(9)
    x = tf.constant(rng.standard_normal((5, 24)).astype(np.float32))
    y = tf.constant(rng.standard_normal((3, 24)).astype(np.float32))
    first = stitching.function(fn, options=opts)
    for v in (x, y):
        first(v)
        assert first.wait(timeout=300) and first.report.kernels
    f = stitching.function(fn, options=opts)
    got = [f(x).numpy()]
    assert type(f._concrete[((tf.float32, (5, 24)),)]).__name__ == "_StockTier"
    assert f.wait(timeout=300) and f.cache_hits == 1 and f.cache_misses == 0
    f(x)                                       # the switch: nothing was compiled
    assert "while the stitched graph was traced and loaded from the cache" in \
        f.reports[0].tiering, f.reports[0].tiering
    got.append(f(y).numpy())                   # relaxed [None, 24]: first's key too
    cf = f._concrete[((tf.float32, (3, 24)),)]
    assert "StitchedKernel" in {op.type for op in cf.graph.get_operations()}
    assert not f._pending and f._probe.cache_hits == 1
    assert f.report.tiering.startswith("stitched from call 1")
    for v, out in zip((x, y), got):
        np.testing.assert_allclose(out, tf.function(fn)(v).numpy(), rtol=2e-6, atol=2e-6)


def test_a_warm_cache_under_an_input_signature_traces_as_often_as_tf_function():
    """Under an input_signature every shape shares one trace.  A warm process's second
    shape must not probe the result cache with a twin trace (TF traces nothing there,
    and experimental_get_tracing_count counted the probe: 2 where TF reads 1)."""
    def fn(x):
        return tf.nn.softmax(x * 2.0 + 1.0)
    sig = [tf.TensorSpec([None, 24], tf.float32)]
    opts = stitching.Options(background_compile=True)
    xs = [tf.constant(np.random.default_rng(n).standard_normal((n, 24)), tf.float32)
          for n in (5, 3)]
    first = stitching.function(fn, input_signature=sig, options=opts)
    for x in xs:
        first(x)
        assert first.wait(timeout=300)
    f = stitching.function(fn, input_signature=sig, options=opts)   # a warm process
    stock = tf.function(fn, input_signature=sig)
    for x in xs + xs:
        np.testing.assert_allclose(f(x).numpy(), stock(x).numpy(), rtol=2e-6, atol=2e-6)
    assert f.wait(timeout=300) and f._probe is None
    assert f.experimental_get_tracing_count() == stock.experimental_get_tracing_count() == 1


def test_background_compile_failure_keeps_stock_tf(monkeypatch):
    from stitching.tf import pipeline

    def broken(*a, **k):
        raise RuntimeError("simulated planner failure")
    monkeypatch.setattr(pipeline, "stitch_graph_def", broken)
    f = stitching.function(lambda x: tf.exp(x) * 2.0,
                           options=stitching.Options(background_compile=True))
    x = tf.constant(np.ones((2, 3), np.float32))
    np.testing.assert_allclose(f(x).numpy(), np.exp(1.0) * 2, rtol=1e-6)
    assert not f.wait(timeout=300)
    assert "simulated planner failure" in str(f.background_errors[0])
    np.testing.assert_allclose(f(x).numpy(), np.exp(1.0) * 2, rtol=1e-6)


def test_nan_inf_and_zero_size():
    f = stitching.function(lambda x: tf.nn.softmax(x * 1.0),
                           input_signature=[tf.TensorSpec([None, 4])])
    x = np.array([[np.nan, 1, 2, 3], [np.inf, 0, 0, 0], [-np.inf, 0, 0, 0]], np.float32)
    # TF's float64 Softmax (Eigen; XLA agrees): a NaN or +Inf poisons its whole row.  The
    # float32 one is oneDNN's on Intel CPUs, which leaves 0 beside the NaN.
    ref = tf.nn.softmax(x.astype(np.float64)).numpy().astype(np.float32)
    np.testing.assert_array_equal(np.isnan(f(x).numpy()), np.isnan(ref))
    np.testing.assert_allclose(f(x).numpy(), ref, equal_nan=True, rtol=1e-6)
    assert f(np.zeros((0, 4), np.float32)).shape == (0, 4)


def test_kernel_that_fails_to_compile_leaves_region_to_tf(monkeypatch):
    from stitching.compile import kernel

    def broken(spec, tier=2):
        raise RuntimeError("simulated codegen failure")

    monkeypatch.setattr(kernel, "compile_kernel", broken)
    f = stitching.function(lambda x: tf.tanh(x) * 2.0 + 1.0)
    np.testing.assert_allclose(f(tf.zeros([4])), 1.0)
    rep = f.report.to_dict()
    assert rep["kernels"] == 0
    assert any("simulated codegen failure" in why for _, why in rep["unfused"])


def test_retraces_per_signature_and_reports_each_trace():
    f = stitching.function(lambda x: tf.nn.relu(x) + 1.0)
    f(tf.zeros([2, 3]))
    f(tf.zeros([2, 3], tf.float64))
    assert len(f.reports) == 2
    assert f(tf.zeros([2, 3], tf.float64)).dtype == tf.float64


def test_eager_tensor_calls_take_the_concrete_function_and_match_tf_function():
    """The fast call (eager tensors straight to the exact-signature ConcreteFunction)
    gives what tf.function gives: structured outputs, variables read at call time,
    stateful ops run, gradients, one trace per signature, and tf.function's errors."""
    w = tf.Variable(2.0)
    calls = tf.Variable(0)

    def fn(x, y):
        calls.assign_add(1)
        return {"a": tf.nn.softmax(x * w), "b": (tf.reduce_sum(x, axis=0) + y,)}

    st, ref = stitching.function(fn), tf.function(fn)
    x = tf.constant(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    y = tf.constant(1.5)
    for _ in range(2):
        got, want = st(x, y), ref(x, y)
        assert set(got) == {"a", "b"} and isinstance(got["b"], tuple)
        np.testing.assert_allclose(got["a"], want["a"], rtol=1e-6)
        np.testing.assert_allclose(got["b"][0], want["b"][0], rtol=1e-6)
    assert len(st._concrete) == 1 and len(st.reports) == 1
    w.assign(-1.0)
    np.testing.assert_allclose(st(x, y)["a"], ref(x, y)["a"], rtol=1e-6)
    assert int(calls.numpy()) == 6                     # 3 stitched + 3 stock calls ran
    st(tf.zeros([2, 8]), y)                            # a new shape: a new trace
    assert len(st._concrete) == 2 and len(st.reports) == 2
    with tf.GradientTape() as tape:
        tape.watch(x)
        want_grad = tape.gradient(ref(x, y)["a"], x)
    for call in (lambda: st(x, y), lambda: st(x=x, y=y)):   # fast path, tf.function path
        # the same gradient either way (StitchedKernel's gradient: tf/passes/original.py)
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = call()["a"]
        np.testing.assert_allclose(tape.gradient(out, x), want_grad, rtol=1e-5, atol=1e-6)
    f = stitching.function(lambda x: x + 1.0,
                           input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    with pytest.raises((TypeError, ValueError)):
        f(tf.zeros([2, 9]))                            # tf.function's error, fast path too
    assert not f._concrete


def test_decorates_methods_and_keras_models():
    import keras
    layer = keras.layers.LayerNormalization()
    f = stitching.function(layer, input_signature=[tf.TensorSpec([None, 32])])
    x = np.random.default_rng(1).standard_normal((5, 32)).astype(np.float32)
    np.testing.assert_allclose(f(x), layer(x), rtol=1e-5, atol=1e-5)
    assert f.report.to_dict()["kernels"] == 1

    class M(tf.Module):
        @stitching.function
        def __call__(self, x):
            return tf.sigmoid(x) * x

    np.testing.assert_allclose(M()(tf.ones([3])), tf.sigmoid(1.0) * 1.0, rtol=1e-6)


def test_report_names_what_was_not_fused():
    f = stitching.function(lambda x: tf.math.cumsum(tf.exp(x) + 1.0, axis=1) * 2.0)
    f(tf.ones([3, 4]))
    rep = f.report.to_dict()
    # a scan is not in the op table: left to TF with that reason
    (why,) = [r for op, r in rep["unfused"] if op == "Cumsum"]
    assert "Cumsum is not supported by the fuser yet" in why, why
    assert "not fused" in f.report.summary()


def test_identity_transpose_is_removed_before_planning():
    """Keras' Tensordot leaves Transposes with the identity permutation; TF's Grappler
    (RemoveIdentityTranspose, run before planning: tf/passes/grappler.py) removes them, so
    they no longer cut a region."""
    f = stitching.function(lambda x: tf.transpose(tf.exp(x), [0, 1, 2]) * 2.0)
    x = tf.ones([2, 3, 4])
    np.testing.assert_allclose(f(x), np.exp(np.ones([2, 3, 4])) * 2.0, rtol=1e-6)
    rep = f.report.to_dict()
    assert rep["unfused"] == [] and rep["kernels"] == 1


def test_graph_def_rewrite_tool_round_trip(tmp_path):
    from stitching import cli
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        tf.nn.softmax(x * 3.0, name="y")
    src, dst = tmp_path / "g.pb", tmp_path / "out.pb"
    src.write_bytes(g.as_graph_def().SerializeToString())
    assert cli.main([str(src), str(dst), "--outputs", "y"]) == 0
    gd = tf.compat.v1.GraphDef.FromString(dst.read_bytes())
    assert sum(n.op == "StitchedKernel" for n in gd.node) == 1
    run = tf.compat.v1.wrap_function(
        lambda a: tf.graph_util.import_graph_def(gd, {"x:0": a}, ["y:0"], name=""),
        [tf.TensorSpec([None, 16], tf.float32)])
    xv = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(run(xv)[0], tf.nn.softmax(xv * 3.0), rtol=1e-5, atol=1e-6)
    assert cli.main([str(tmp_path / "missing.pb"), str(dst)]) == 1


def test_saved_model_rewrite_and_load(tmp_path):
    from stitching.saved_model import load_saved_model, rewrite_saved_model

    class M(tf.Module):
        def __init__(self):
            self.g = tf.Variable(np.linspace(0.5, 1.5, 8).astype(np.float32))

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
        def serve(self, x):
            m = tf.reduce_mean(x, -1, keepdims=True)
            return {"y": (x - m) * self.g}

    m = M()
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"serving_default": m.serve})
    reports = rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert reports["serving_default"].to_dict()["kernels"] == 1
    loaded = load_saved_model(str(tmp_path / "dst"))
    xv = np.arange(16, dtype=np.float32).reshape(2, 8)
    np.testing.assert_allclose(loaded.signatures["serving_default"](x=xv)["y"],
                               m.serve(xv)["y"], rtol=1e-6)


def _coverage_and_check(model, shape, batch=2, tol=1e-4):
    sig = [tf.TensorSpec((None,) + shape, tf.float32)]
    f = stitching.function(lambda x: model(x, training=False), input_signature=sig)
    x = np.random.default_rng(0).standard_normal((batch,) + shape).astype(np.float32)
    ref = tf.function(lambda x: model(x, training=False), input_signature=sig)(x)
    np.testing.assert_allclose(f(x), ref, rtol=tol, atol=tol)
    return f.report


def test_transformer_encoder_coverage(intel_plan):
    from stitching.testing.models import transformer_encoder
    m = transformer_encoder(num_layers=2, d_model=64, heads=4, ff=128, seq_len=16)
    rep = _coverage_and_check(m, (16, 64))
    assert rep.coverage >= 0.85, rep.summary()
    # 2 layers x (add + LayerNorm after attention and after the FF, masked softmax,
    # bias + GELU): 8 kernels.  The last FF add + LayerNorm ends in the model's output
    # Identity, which adds no node: it has layer 0's FF spec (4 specs), and the two
    # add + LayerNorm specs compile to one native code (3)
    assert (len(rep.kernels), rep.unique_kernels, rep.code_objects) == (8, 4, 3), \
        rep.summary()


@pytest.mark.slow
@pytest.mark.parametrize("app", ["MobileNetV2", "EfficientNetB0"])
def test_keras_application_coverage(app):
    import keras
    m = getattr(keras.applications, app)(weights=None, input_shape=(96, 96, 3))
    rep = _coverage_and_check(m, (96, 96, 3), tol=2e-3)
    assert rep.coverage >= 0.85, rep.summary()


def test_small_keras_cnn_coverage():
    import keras
    m = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), alpha=0.35)
    rep = _coverage_and_check(m, (32, 32, 3), tol=2e-3)
    assert rep.coverage >= 0.85, rep.summary()


@pytest.mark.parametrize("which", ["layernorm", "log_softmax"])
def test_a_single_long_row_is_split_across_threads_in_phases(which, monkeypatch):
    """One row of 256K: the cost model splits it across units (split_rows=1) and the op
    runs the kernel in phases (partial reductions, then their consumers); the result
    equals TF's and NaN in a row still poisons that row only.  Planned with the pinned
    2-core profile: on a machine whose L2 holds the 1 MB row, one task is the better
    plan."""
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", "cpu-reference")
    def ln(x):
        m = tf.reduce_mean(x, -1, keepdims=True)
        v = tf.reduce_mean(tf.square(x - m), -1, keepdims=True)
        return (x - m) * tf.math.rsqrt(v + 1e-5)
    fn = ln if which == "layernorm" else tf.nn.log_softmax
    x = np.random.default_rng(5).standard_normal((1, 1 << 18)).astype(np.float32) * 2 + 1
    f = stitching.function(fn)
    got = f(tf.constant(x)).numpy()
    rep = f.report.to_dict()
    assert rep["kernels"] == 1 and "split_rows=1" in f.report.explain(), f.report.explain()
    want = fn(tf.constant(x.astype(np.float64))).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, tf.function(fn)(tf.constant(x)).numpy(), rtol=2e-5,
                               atol=2e-5)
    x[0, 12345] = np.nan
    assert np.isnan(f(tf.constant(x)).numpy()).all()


def test_compile_workers_start_early_only_for_large_graphs_not_seen_before(
        monkeypatch, tmp_path, compile_workers):
    """pipeline: a graph of >= 300 nodes not compiled before prestarts the compile
    workers while it is planned; the same graph again (a new process would see the
    marker in the kernel cache too) and small graphs do not.  A cache directory of its
    own: in a cache that has compiled this graph before, it is seen from the start."""
    from stitching.compile import kernel, parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    kernel.clear_memory_cache()
    calls = []
    real = parallel.prestart
    monkeypatch.setattr(parallel, "prestart",
                        lambda *a, **k: calls.append(1) or real(*a, **k))

    def chain(x):
        for i in range(160):            # ~2 nodes a step: over the 300-node threshold
            x = x * (1.0 + i * 1e-4) + 0.5
        return tf.nn.relu(x)
    x = tf.constant(np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8))
    want = tf.function(chain)(x).numpy()
    np.testing.assert_allclose(stitching.function(chain)(x).numpy(), want, rtol=1e-5)
    assert len(calls) == 1
    np.testing.assert_allclose(stitching.function(chain)(x).numpy(), want, rtol=1e-5)
    assert len(calls) == 1                          # seen: no workers started
    stitching.function(lambda x: tf.nn.relu(x * 2.0))(x)
    assert len(calls) == 1                          # small graph


@pytest.fixture
def workers_started(monkeypatch, tmp_path):
    """An empty kernel cache, two compile jobs, and the list of every ``Workers``
    started from now on."""
    from stitching.compile import kernel, parallel
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    started = []

    class Spy(parallel.Workers):
        def __init__(self, jobs):
            super().__init__(jobs)
            started.append(self)
    monkeypatch.setattr(parallel, "Workers", Spy)
    monkeypatch.setattr(parallel, "default_jobs", lambda: 2)
    kernel.clear_memory_cache()
    return started


def test_an_empty_kernel_cache_starts_one_worker_while_tf_traces(workers_started,
                                                                  monkeypatch, tmp_path):
    """With no kernel in the disk cache, one compile worker starts before the function
    is traced; the graph's kernel is compiled there (its shared object lands in the
    cache) and the worker is closed.  Once the cache holds a kernel, a new function
    starts none early."""
    from stitching.compile import kernel
    started = workers_started
    x = tf.constant(np.linspace(-3, 3, 96, dtype=np.float32).reshape(8, 12))

    def fn(x):
        return tf.nn.relu(x * 1.7 - 0.3) + 0.123
    assert kernel.cache_is_empty()
    got = stitching.function(fn)(x).numpy()
    np.testing.assert_allclose(got, tf.function(fn)(x).numpy(), rtol=1e-6)
    assert len(started) == 1 and started[0].procs == []     # one, used and closed
    assert not kernel.cache_is_empty()                       # the worker built it
    stitching.function(lambda x: tf.nn.relu(x * 2.5) - 1.0)(x)
    assert len(started) == 1
    # behind a background compile stock TF's first call has the cores: no early worker
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path / "bg"))
    assert kernel.cache_is_empty()
    g = stitching.function(lambda x: tf.nn.relu(x * 3.5) - 2.0,
                           options=stitching.Options(background_compile=True))
    g(x)
    assert g.wait(timeout=300)
    assert len(started) == 1


def test_a_trace_that_raises_starts_no_early_worker_again(workers_started, monkeypatch):
    """An early worker starts while TF traces; where the trace raises (TF's own
    tf.function tests call such a function in a loop, a notebook re-runs the cell) it
    is closed unused, and later traces in the process start none: one worker process,
    not one per attempt.  The error is TF's, as stock."""
    from stitching.compile import kernel
    from stitching.tf import pipeline
    monkeypatch.setattr(pipeline, "_early_unused", False)
    started = workers_started
    assert kernel.cache_is_empty()

    def failing():
        a = tf.constant(1.0)
        with tf.init_scope():      # a graph tensor used eagerly: TF raises
            _ = a + a
    for _ in range(3):
        with pytest.raises(TypeError, match="out of scope"):
            stitching.function(failing)()
    assert len(started) == 1 and started[0].procs == []      # one, closed unused
    x = tf.constant(np.linspace(-3, 3, 96, dtype=np.float32).reshape(8, 12))
    got = stitching.function(lambda x: tf.nn.relu(x * 1.3) - 0.2)(x).numpy()
    np.testing.assert_allclose(got, np.maximum(x.numpy() * np.float32(1.3), 0) - 0.2,
                               rtol=1e-6)
    assert len(started) == 1


def test_stitching_pauses_the_garbage_collector_and_restores_it():
    """The collector is off while a graph is stitched and as it was afterwards, on
    or off, also when stitching fails."""
    import gc

    from stitching.tf import pipeline
    seen = []
    real = pipeline._stitch

    def spy(*a, **k):
        seen.append(gc.isenabled())
        return real(*a, **k)
    x = tf.constant(np.ones((4, 4), np.float32))
    try:
        pipeline._stitch = spy
        stitching.function(lambda x: tf.nn.relu(x * 3.0) + 2.0)(x)
        assert seen == [False] and gc.isenabled()
        gc.disable()
        stitching.function(lambda x: tf.nn.relu(x * 4.0) + 2.0)(x)
        assert seen == [False, False] and not gc.isenabled()
        gc.enable()
        pipeline._stitch = lambda *a, **k: 1 / 0
        with pytest.raises(ZeroDivisionError):
            stitching.function(lambda x: tf.nn.relu(x * 5.0))(x)
        assert gc.isenabled()
    finally:
        pipeline._stitch = real
        gc.enable()


def test_large_graph_plan_is_stored_and_reused_after_checking_it(monkeypatch, tmp_path):
    """A large graph's plan is stored under its key; the same graph stitched again
    (as a new process would) rebuilds the regions from the stored node lists without
    running the planner, with the same kernels, report and numerics.  A stored plan
    that does not fit the graph is ignored, not trusted."""
    from stitching.plan import cache as plan_cache
    from stitching.tf import pipeline, results
    monkeypatch.setattr(plan_cache, "_path", lambda key: tmp_path / f"{key}.json")
    # the whole stitched result would be taken from its own cache before a plan is
    # looked for (test_results.py): here the pipeline runs every time
    monkeypatch.setattr(results, "probe", lambda key, traced: None)

    def chain(x):
        for i in range(160):            # over the 300-node threshold
            x = x * (1.0 + i * 3e-4) + 0.25
        return tf.nn.relu(x) + tf.nn.softmax(x)
    x = tf.constant(np.linspace(-2, 2, 96, dtype=np.float32).reshape(6, 16))
    want = tf.function(chain)(x).numpy()
    f1 = stitching.function(chain)
    np.testing.assert_allclose(f1(x).numpy(), want, rtol=1e-5, atol=1e-6)
    stored = list(tmp_path.glob("*.json"))
    assert len(stored) == 1

    real_planner = pipeline.get_planner

    def refuse(name):
        raise AssertionError("planned again")
    monkeypatch.setattr(pipeline, "get_planner", refuse)
    f2 = stitching.function(chain)
    np.testing.assert_allclose(f2(x).numpy(), want, rtol=1e-5, atol=1e-6)
    r1, r2 = f1.report.to_dict(), f2.report.to_dict()
    for k in ("kernels", "kernel_details", "unfused_nodes", "boundaries", "notes",
              "explanation", "fused_ops"):
        assert r1[k] == r2[k], k

    # a plan naming a node the graph does not have: planned afresh
    doc = json.loads(stored[0].read_text())
    doc["regions"][0]["nodes"][0] = "no_such_node"
    stored[0].write_text(json.dumps(doc))
    monkeypatch.setattr(pipeline, "get_planner", real_planner)
    f3 = stitching.function(chain)
    np.testing.assert_allclose(f3(x).numpy(), want, rtol=1e-5, atol=1e-6)
    assert f3.report.to_dict()["kernel_details"] == r1["kernel_details"]


def test_batch_matmul_against_a_2d_weight_runs_as_one_matmul():
    """tf/passes/gemm.py: BatchMatMulV2(x[B, T, D], W[D, E]) (Keras 3's EinsumDense) becomes
    Reshape-MatMul-Reshape, for every batch size and with adj_y; an adj_x product or
    a batched right operand stays a BatchMatMul.  Numerics match TF and float64."""
    from stitching.tf import pipeline
    rng = np.random.default_rng(7)
    w = tf.constant(rng.standard_normal((16, 12)).astype(np.float32))
    wt = tf.constant(rng.standard_normal((12, 16)).astype(np.float32))
    wb = tf.constant(rng.standard_normal((1, 16, 4)).astype(np.float32))

    def fn(x):
        a = tf.linalg.matmul(x, w)                        # rewritten
        b = tf.linalg.matmul(x, wt, adjoint_b=True)       # rewritten, transpose_b
        c = tf.linalg.matmul(x, x, adjoint_a=True)        # adj_x: kept
        d = tf.linalg.matmul(x, wb)                       # batched weight: kept
        return tf.nn.relu(a) + b, c, d
    sig = [tf.TensorSpec([None, 5, 16], tf.float32)]
    cf = tf.function(fn, input_signature=sig).get_concrete_function()
    # the products as tf/passes/gemm.py leaves them (an Eigen machine would make them OpenBLAS
    # ops, tf/passes/blas.py)
    res = pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs],
                                    options=stitching.Options(blas_gemm=False))
    ops = [n.op for n in res.graph_def.node]
    assert ops.count("BatchMatMulV2") == 2 and ops.count("MatMul") == 2, ops
    assert any("2 BatchMatMul node(s)" in n for n in res.report.notes)
    sf = stitching.function(fn, input_signature=sig)
    for batch in (1, 3):
        x = rng.standard_normal((batch, 5, 16)).astype(np.float32)
        got, want = sf(x), tf.function(fn, input_signature=sig)(x)
        x64 = tf.constant(x.astype(np.float64))
        ref64 = tf.nn.relu(x64 @ tf.cast(w, tf.float64)) + \
            tf.linalg.matmul(x64, tf.cast(wt, tf.float64), adjoint_b=True)
        for g, r in zip(got, want):
            assert g.shape == r.shape
            np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[0].numpy(), ref64.numpy(), rtol=1e-4, atol=1e-4)
    off = pipeline.stitch_graph_def(cf.graph.as_graph_def(), [t.name for t in cf.outputs],
                                    options=stitching.Options(gemm=False, blas_gemm=False))
    assert [n.op for n in off.graph_def.node].count("BatchMatMulV2") == 4
    # a GraphDef with default-valued attrs stripped (as SavedModels may store it):
    # adj_x/adj_y absent mean False, and the kept nodes do not gain empty attrs
    gdef = cf.graph.as_graph_def()
    for nd in gdef.node:
        if nd.op == "BatchMatMulV2" and not nd.attr["adj_x"].b and not nd.attr["adj_y"].b:
            del nd.attr["adj_x"], nd.attr["adj_y"]
    res = pipeline.stitch_graph_def(gdef, [t.name for t in cf.outputs],
                                    options=stitching.Options(blas_gemm=False))
    kept = [n for n in res.graph_def.node if n.op == "BatchMatMulV2"]
    assert len(kept) == 2 and [n.op for n in res.graph_def.node].count("MatMul") == 2
    assert not any(len(n.attr[a].ListFields()) == 0 for n in res.graph_def.node
                   for a in n.attr)


def test_new_batch_sizes_reuse_one_relaxed_trace():
    """A server's varying batch sizes: the second size traces once with the batch dim
    unknown, and every later size runs that trace (no re-plan, no kernel lookup)."""
    traces = []

    @stitching.function
    def f(x):
        traces.append(x.shape.as_list())
        return tf.nn.softmax(x * 2.0) + 1.0

    for b in (8, 9, 10, 11, 40):
        x = tf.random.normal([b, 16])
        np.testing.assert_allclose(f(x).numpy(), (tf.nn.softmax(x * 2.0) + 1.0).numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert traces == [[8, 16], [None, 16]]
    assert len(f.reports) == 2 and len(f.reports[1].kernels) >= 1
    f(tf.zeros([3, 32]))           # another dim differs: relaxed again, once
    f(tf.zeros([5, 7]))
    assert traces[2:] == [[None, None]]


def _dict_step(d):
    """HF transformers' calling convention: a dict of tensors, used asymmetrically (a
    mix-up of its keys changes the result)."""
    mask = tf.cast(d["attention_mask"], tf.float32)
    return tf.nn.softmax(d["input"] * 2.0 + (1.0 - mask) * -1e4) - d["bias"][0]


def _dict_inputs(seq, seed=0, order=("input", "attention_mask", "bias")):
    rng = np.random.default_rng(seed)
    values = {"input": tf.constant(rng.standard_normal((2, seq)).astype(np.float32)),
              "attention_mask": tf.constant(rng.integers(0, 2, (2, seq)).astype(np.int32)),
              "bias": [tf.constant(rng.standard_normal(seq).astype(np.float32))]}
    return {k: values[k] for k in order}


def test_dict_arguments_relax_shapes_as_tensors_do():
    """A dict (and lists in it) of tensors takes the fast path: new sequence lengths
    share one relaxed trace, whatever order the dict's keys come in, with stock TF's
    numbers (the flat inputs follow tf.nest's sorted keys, as TF's trace)."""
    traces = []

    def step(d):
        traces.append(d["input"].shape.as_list())
        return _dict_step(d)
    f = stitching.function(step)
    stock = tf.function(_dict_step)
    for seq, order in [(8, ("input", "attention_mask", "bias")),
                       (9, ("bias", "input", "attention_mask")),
                       (10, ("attention_mask", "bias", "input")), (33, ("input", "bias",
                                                                        "attention_mask"))]:
        d = _dict_inputs(seq, seed=seq, order=order)
        np.testing.assert_allclose(f(d).numpy(), stock(d).numpy(), rtol=2e-6, atol=2e-6)
    assert traces == [[2, 8], [2, None]]
    assert len(f.reports) == 2 and f.reports[1].kernels
    f(_dict_inputs(12))                               # the relaxed trace again
    assert len(traces) == 2


def test_dict_arguments_are_tiered_stock_first_then_stitched(tiered):
    """A dict's first call runs stock TF while its kernels compile behind it, and the
    call after the compile switches, with stock TF's numbers (not the first call
    waiting for the compile: 3-7 s for HF models in an audit)."""
    f = stitching.function(_dict_step)
    d = _dict_inputs(16, seed=4)
    ref = tf.function(_dict_step)(d).numpy()
    np.testing.assert_array_equal(f(d).numpy(), ref)           # stock TF's own graph
    f.wait()
    assert f.report.kernels
    d2 = _dict_inputs(16, seed=4, order=("bias", "attention_mask", "input"))
    np.testing.assert_allclose(f(d2).numpy(), ref, rtol=2e-6, atol=2e-6)
    assert "stock TF ran call 1" in f.report.tiering
    assert f.report.tiering.endswith("stitched from call 2"), f.report.tiering


def test_keyword_arguments_take_the_fast_path_as_positional_ones(tiered):
    """``f(input_ids=..., attention_mask=...)`` of a function with plain parameters is
    its positional call: new sequence lengths share a relaxed trace, the first call
    runs stock TF while the kernels compile, with stock TF's numbers; TF's call path
    keeps what it alone binds (a missing argument: TF's TypeError)."""
    traces = []

    def step(input_ids, attention_mask):
        traces.append(input_ids.shape.as_list())
        return _dict_step({"input": input_ids, "attention_mask": attention_mask,
                           "bias": [input_ids[0] * 0.0]})
    f = stitching.function(step)
    stock = tf.function(step)
    for seq in (8, 9, 10):
        d = _dict_inputs(seq, seed=seq)
        got = f(attention_mask=d["attention_mask"], input_ids=d["input"]).numpy()
        np.testing.assert_allclose(got, stock(d["input"], d["attention_mask"]).numpy(),
                                   rtol=2e-6, atol=2e-6)
        f.wait()
    d = _dict_inputs(11, seed=11)
    np.testing.assert_allclose(f(d["input"], attention_mask=d["attention_mask"]).numpy(),
                               stock(d["input"], d["attention_mask"]).numpy(),
                               rtol=2e-6, atol=2e-6)
    assert [t for t in traces if t[1] is None] == [[2, None]], traces
    assert "stock TF ran call 1" in f.reports[0].tiering
    with pytest.raises(TypeError):
        f(input_ids=d["input"])


def test_keywords_of_a_function_with_kwargs_go_through_tf():
    """A function taking ``**kwargs`` (or ``*args``) binds through TF's call path."""
    f = stitching.function(lambda x, **kw: x * kw["scale"])
    x = tf.constant([1.0, 2.0])
    np.testing.assert_array_equal(f(x, scale=tf.constant(3.0)).numpy(), [3.0, 6.0])
    assert f._keywords_as_positional((x,), {"scale": 1}) is None


def test_arguments_the_fast_path_does_not_take_go_through_tf():
    """A nesting with a non-tensor leaf (None, a Python number), a namedtuple or an
    empty dict is TF's call path (its own tracing rules), with TF's numbers."""
    import collections
    from stitching.tf.function import _eager_key
    x = tf.constant([[1.0, 2.0]])
    Pair = collections.namedtuple("Pair", "a b")
    for args in [({"x": x, "s": None},), ({"x": x, "s": 2.0},), (Pair(x, x),), ({},),
                 ([x, [x, 1]],)]:
        assert _eager_key(args) is None, args
    f = stitching.function(lambda d: d["x"] * 2.0 + (d["s"] if d["s"] is not None else 0))
    np.testing.assert_array_equal(f({"x": x, "s": None}).numpy(), [[2.0, 4.0]])
    np.testing.assert_array_equal(f({"x": x, "s": 1.0}).numpy(), [[3.0, 5.0]])
    assert _eager_key(({"x": x, "y": [x, x]},)) is not None


def test_reduce_retracing_false_traces_every_shape():
    traces = []

    @stitching.function(reduce_retracing=False)
    def f(x):
        traces.append(x.shape.as_list())
        return tf.tanh(x) * 2.0 + 1.0

    for b in (2, 3, 4):
        f(tf.zeros([b, 4]))
    assert traces == [[2, 4], [3, 4], [4, 4]]


def test_a_slow_synchronous_first_call_names_tiering_once(monkeypatch, capsys, tiered):
    """An eager call that waited for its kernels though tiering is on (a keyword that
    TF binds: its call path) says which calls are tiered, once per process; not
    where tiering was turned off, nor with STITCHING_NO_HINTS."""
    from stitching.tf import function as fn_module
    monkeypatch.setattr(fn_module, "HINT_SECONDS", 0.0)
    monkeypatch.setattr(fn_module, "_hinted", False)
    monkeypatch.delenv("STITCHING_NO_HINTS", raising=False)
    stitching.function(lambda **k: tf.tanh(k["x"]) * 2.0 + 1.0)(x=tf.zeros([2, 3]))
    stitching.function(lambda **k: tf.sigmoid(k["x"]) * 3.0 + 1.0)(x=tf.zeros([2, 3]))
    err = capsys.readouterr().err
    assert err.count("run stock TF while they compile") == 1
    monkeypatch.setattr(fn_module, "_hinted", False)
    stitching.function(lambda **k: tf.exp(k["x"]) * 3.0 + 1.0, options=SYNC)(
        x=tf.zeros([2, 3]))
    monkeypatch.setenv("STITCHING_NO_HINTS", "1")
    stitching.function(lambda **k: tf.exp(k["x"]) * 4.0 + 1.0)(x=tf.zeros([2, 3]))
    assert "stock TF while" not in capsys.readouterr().err


def test_a_new_rank_is_traced_exactly_not_relaxed_to_unknown_rank():
    # regression: relaxing through tf.function(reduce_retracing=True) turned a rank
    # change into an unknown-rank trace, which fuses nothing
    traces = []

    @stitching.function
    def f(x):
        traces.append(x.shape.rank)
        return tf.tanh(x) * 2.0 + 1.0

    f(tf.zeros([2, 8]))
    f(tf.zeros([3, 8, 4]))
    assert traces == [2, 3] and len(f.report.kernels) == 1
    g = stitching.function(lambda x: tf.tanh(x) * 2.0 + 1.0)
    g(x=tf.zeros([2, 8]))              # keyword calls take tf.function's path
    g(x=tf.zeros([3, 8, 4]))
    assert len(g.report.kernels) == 1


def test_the_report_names_the_device_profile_it_planned_with(tmp_path, monkeypatch):
    from stitching.plan import profiles
    f = stitching.function(lambda x: tf.tanh(x) * 2.0 + 1.0)
    f(tf.zeros([2, 3]))
    # the session's pinned machine model (tests/conftest.py), by name
    assert os.environ["STITCHING_DEVICE_PROFILE"] in f.report.profile
    assert f.report.profile in f.report.summary()
    path = str(tmp_path / "mine.json")
    profiles.save_file(profiles.with_overrides(profiles.get("cpu-reference"), name="mine"),
                       path)
    monkeypatch.delenv("STITCHING_PROFILE", raising=False)
    monkeypatch.setenv("STITCHING_DEVICE_PROFILE", path)
    g = stitching.function(lambda x: tf.tanh(x) * 3.0 + 1.0)
    g(tf.zeros([2, 3]))
    assert g.report.profile == f"mine from {path}"


def test_independent_same_shape_chains_are_packed_into_one_kernel():
    """Horizontal packing: independent element-wise chains whose outputs share one
    static shape -- an optimizer's update of same-shaped variables -- share one
    iteration domain (schedule/domain.py: _pack_components), and chains of different
    shapes become one packed kernel over their concatenated flat space
    (schedule/packed.py): exactly one kernel either way."""
    def f(a, b, c):
        return [tf.sqrt(tf.abs(t * 0.9 + 0.1)) * 2.0 - t for t in (a, b, c)]

    rng = np.random.default_rng(3)
    for shapes, kernels in ((((64, 64),) * 3, 1), (((64, 64), (32,), (300, 8)), 1)):
        args = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        sf = stitching.function(f)
        for g, w in zip(sf(*args), f(*args)):
            np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)
        assert len(sf.report.kernels) == kernels, sf.report.summary()
        if len(set(shapes)) > 1:
            assert "packed 3 chains" in sf.report.kernels[0].schedule


def test_captured_constants_that_grappler_folds_need_no_feed():
    """Regression (EfficientNetB0 failed to stitch): a captured constant only feeding
    foldable arithmetic (Keras Normalization's Sqrt(variance)) is folded away by
    Grappler; mapping it at import gave 'Attempted to map inputs that were not found
    in graph_def'."""
    import keras
    inp = keras.Input((4, 4, 3))
    h = keras.layers.Normalization(mean=[0.4, 0.5, 0.6], variance=[0.2, 0.3, 0.4])(inp)
    m = keras.Model(inp, keras.layers.Activation("swish")(h * 2.0 + 1.0))
    x = tf.constant(np.random.default_rng(5).random((2, 4, 4, 3)).astype(np.float32))
    f = stitching.function(lambda x: m(x, training=False))
    np.testing.assert_allclose(f(x).numpy(), m(x, training=False).numpy(),
                               rtol=1e-5, atol=1e-6)
    assert len(f.report.kernels) == 1


def test_a_cond_stays_functional_so_the_stitched_graph_imports_into_a_tf_function():
    """Regression (Keras mixed_float16 fit failed: 'NoneType' object has no attribute
    'outer_context'): Grappler's function optimizer lowered tf.cond to Switch/Merge,
    which a TF2 function's automatic control dependencies cannot take."""
    def fn(x, p):
        return tf.cond(p > 0, lambda: tf.tanh(x) * 2.0 + 1.0, lambda: x - 1.0) * 3.0 + x

    sf = stitching.function(fn)
    outer = tf.function(lambda x, p: sf(x, p) * 1.0)
    x = tf.constant(np.random.default_rng(6).standard_normal((4, 8)).astype(np.float32))
    for p in (1.0, -1.0):
        np.testing.assert_allclose(outer(x, tf.constant(p)).numpy(),
                                   fn(x, tf.constant(p)).numpy(), rtol=1e-6, atol=1e-6)
    assert sf.report is not None and len(sf.report.kernels) >= 1
    assert any("functional control flow" in n for n in sf.report.notes)


def test_a_first_trace_that_creates_variables_is_not_stitched():
    """TF calls the trace that made the function's variables never (it lifts their
    initializers and traces again without variable creation): only the second trace
    is stitched, and the function gives tf.function's numbers."""
    class Scale(tf.Module):
        def __init__(self):
            self.v = None

        def __call__(self, x):
            if self.v is None:
                self.v = tf.Variable(tf.fill([x.shape[-1]], 1.5))
            return tf.nn.softmax(x * self.v) + 1.0
    x = tf.constant(np.random.default_rng(3).standard_normal((4, 24)), tf.float32)
    f = stitching.function(Scale())
    got = f(x)
    assert len(f.reports) == 1 and f.report.kernels
    np.testing.assert_allclose(got, tf.nn.softmax(x * 1.5) + 1.0, rtol=2e-6, atol=2e-6)


def test_an_unliftable_initializer_runs_the_throwaway_trace_as_tf_does():
    """A variable whose initial value is computed from the argument cannot be lifted
    out: TF then runs the first (variable-creating) trace once, under a cond, to
    initialize it.  That trace is a call of the inner trace (not stitched, not
    imported): the first call initializes as tf.function's does, later calls run the
    stitched trace and read the variable, their numbers tf.function's."""
    def module():
        class Init(tf.Module):
            def __init__(self):
                self.v = None

            def __call__(self, x):
                if self.v is None:
                    self.v = tf.Variable(tf.nn.softmax(x[0]) * 3.0)
                return tf.nn.softmax(x * self.v) * 2.0 + x
        return Init()
    rng = np.random.default_rng(8)
    x1, x2 = (tf.constant(rng.standard_normal((4, 24)), tf.float32) for _ in range(2))
    ref, f = tf.function(module()), stitching.function(module())
    for x in (x1, x2):
        np.testing.assert_allclose(f(x), ref(x), rtol=2e-6, atol=2e-6)
    assert f.report is not None and f.report.kernels


def test_a_small_graphs_plan_is_stored_too_and_a_broken_entry_is_planned_afresh(
        monkeypatch, tmp_path):
    """Every graph's plan is stored (not only large ones): a new function of the same
    graph (as a warm process) does not plan; an entry that is not a plan (cut short,
    wrong types, empty) is ignored and the graph planned again, with the same
    numbers."""
    from stitching.plan import cache as plan_cache
    from stitching.tf import pipeline, results
    monkeypatch.setattr(plan_cache, "_path", lambda key: tmp_path / f"{key}.json")
    monkeypatch.setattr(results, "probe", lambda key, traced: None)   # as above
    planned, real = [], pipeline.get_planner
    monkeypatch.setattr(pipeline, "get_planner",
                        lambda name: planned.append(name) or real(name))

    def fn(x):
        return tf.nn.softmax(x * 2.0) + 1.0
    x = tf.constant(np.random.default_rng(5).standard_normal((4, 24)), tf.float32)
    want = tf.function(fn)(x).numpy()
    np.testing.assert_allclose(stitching.function(fn)(x), want, rtol=2e-6, atol=2e-6)
    stored = list(tmp_path.glob("*.json"))
    assert len(planned) == 1 and len(stored) == 1
    np.testing.assert_allclose(stitching.function(fn)(x), want, rtol=2e-6, atol=2e-6)
    assert len(planned) == 1                       # the stored plan: no planning
    for broken in ('{"format": 1, "regi', json.dumps({"format": 1, "regions": 7}), ""):
        stored[0].write_text(broken)
        np.testing.assert_allclose(stitching.function(fn)(x), want, rtol=2e-6, atol=2e-6)
    assert len(planned) == 4


def test_cancel_at_exit_stops_background_compiles_only(monkeypatch):
    """parallel.cancel() (what interpreter exit calls) stops a background compile at
    its next step, never the caller's own; a stopped background compile leaves stock
    TF serving, with the reason."""
    import threading

    from stitching.compile import parallel
    monkeypatch.setattr(parallel, "_cancelled", threading.Event())
    parallel.cancel()
    parallel.check_cancelled()                 # a synchronous compile goes on
    with parallel.background():
        with pytest.raises(parallel.Cancelled, match="exiting"):
            parallel.check_cancelled()
    f = stitching.function(lambda x: tf.exp(x) * 2.0,
                           options=stitching.Options(background_compile=True))
    x = tf.constant(np.ones((2, 3), np.float32))
    np.testing.assert_allclose(f(x).numpy(), np.exp(1.0) * 2, rtol=1e-6)
    assert not f.wait(timeout=300) and f.report is None
    assert isinstance(f.background_errors[0], parallel.Cancelled)
    np.testing.assert_allclose(f(x).numpy(), np.exp(1.0) * 2, rtol=1e-6)


def test_a_background_compile_stops_inside_planning_at_exit(monkeypatch):
    """A cancel while the planner runs stops it at its next legality check: the
    interpreter's exit waited out a large model's seconds of planning (5.2 s from
    Ctrl-C to exit on EfficientNetB3), the passes checking only between them."""
    import threading

    from stitching.compile import parallel
    from stitching.tf import pipeline
    monkeypatch.setattr(parallel, "_cancelled", threading.Event())
    checked, check = [], pipeline.schedule.check

    def cancel_at_first(spec):
        checked.append(spec)
        parallel.cancel()                       # the process starts exiting
        return check(spec)
    monkeypatch.setattr(pipeline.schedule, "check", cancel_at_first)

    def fn(x, w):
        h = tf.matmul(tf.exp(x) * 2.0 + 1.0, w)
        return tf.nn.softmax(h * 0.5) - tf.reduce_mean(h, axis=-1, keepdims=True)
    f = stitching.function(fn, options=stitching.Options(background_compile=True))
    rng = np.random.default_rng(4)
    x, w = (tf.constant(rng.standard_normal(s).astype(np.float32)) for s in ((4, 8), (8, 8)))
    np.testing.assert_allclose(f(x, w).numpy(), tf.function(fn)(x, w).numpy(), rtol=1e-6)
    assert not f.wait(timeout=300) and f.report is None
    assert isinstance(f.background_errors[0], parallel.Cancelled)
    assert len(checked) == 1, len(checked)      # planning stopped at the next check


def test_numpy_batches_of_many_sizes_share_a_relaxed_trace_as_tensors_do():
    """NumPy arrays are traced as tensors (tf.function's rule), so they take the
    relaxed shapes too: a step fed NumPy batches of several sizes traces as it would
    for tensors, not once per size (each a full plan and compile), with TF's numbers."""
    def step(x, w):
        return tf.nn.softmax(tf.matmul(x, w) * 0.5) + x[:, :1]
    f = stitching.function(step, options=stitching.Options(background_compile=False))
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    for n in (4, 7, 9, 12, 3):
        x = rng.standard_normal((n, 8)).astype(np.float32)
        np.testing.assert_allclose(f(x, w), tf.function(step)(x, w), rtol=1e-5, atol=1e-6)
    assert f.experimental_get_tracing_count() == 2, f.experimental_get_tracing_count()


def test_stitching_disable_turns_every_function_into_tf_functions(monkeypatch):
    """$STITCHING_DISABLE=1: a switch for operations.  A stitching.function traces and
    runs as tf.function (no kernel, no background compile, TF's numbers bit for bit)
    and its report says so; keras.stitch leaves the model as it is; a bad value is an
    error naming the variable."""
    monkeypatch.setenv("STITCHING_DISABLE", "1")
    monkeypatch.delenv("STITCHING_BACKGROUND_COMPILE", raising=False)    # tiered default

    def fn(x):
        return tf.nn.softmax(x * 4.0) * 2.0 - 0.5
    x = tf.constant(np.random.default_rng(9).standard_normal((5, 32)).astype(np.float32))
    f = stitching.function(fn)
    for _ in range(2):
        np.testing.assert_array_equal(f(x).numpy(), tf.function(fn)(x).numpy())
    assert not f._pending and not f.report.kernels
    assert "stitching is off ($STITCHING_DISABLE)" in f.report.summary()
    ops = {op.type for op in f.get_concrete_function(x).graph.get_operations()}
    assert "Softmax" in ops and "StitchedKernel" not in ops
    keras = pytest.importorskip("keras")
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    m.compile(optimizer="sgd", loss="mse")
    train_step = m.train_step
    assert stitching.keras.stitch(m) is m and m.train_step == train_step
    assert m.stitching_report.train is None and "stitching is off" in \
        m.stitching_report.summary()
    assert stitching.keras.wait(m)
    monkeypatch.setenv("STITCHING_DISABLE", "maybe")
    with pytest.raises(ValueError, match="STITCHING_DISABLE"):
        stitching.function(fn)(x)


def test_compile_progress_names_the_function_and_says_when_it_plans(capsys):
    """Progress lines said 'stitching: kernel 13/52' with no function named, and a large
    model's seconds of planning printed nothing: with progress on, a plan made (not
    read from the plan cache) says so first, and each count names the function."""
    def progress_fn(x):
        return tf.nn.softmax(x * 7.25) * tf.sigmoid(x) - 0.125
    f = stitching.function(progress_fn, options=stitching.Options(progress=True))
    f(tf.ones([6, 24]))
    err = capsys.readouterr().err
    assert "progress_fn (float32[6,24]): planning " in err, err
    assert "progress_fn (float32[6,24]): kernel 1/1" in err, err


def test_progress_lines_name_the_signature_they_compile(capsys):
    """Several signatures compiling at once (a server's batch sizes, each in its
    background thread) printed lines that only named the function: each line now
    carries the signature it plans and compiles, a relaxed dimension as ``?``."""
    def sig_fn(x, n):
        return tf.nn.softmax(x * 3.5) * tf.cast(tf.reduce_sum(n), tf.float32)
    f = stitching.function(sig_fn, options=stitching.Options(progress=True),
                           reduce_retracing=True)
    f(tf.ones([6, 24]), tf.constant([1, 2], tf.int32))
    f(tf.ones([5, 24]), tf.constant([1, 2, 3], tf.int32))
    err = capsys.readouterr().err
    assert "sig_fn (float32[6,24], int32[2]): planning 10 nodes" in err, err
    assert "sig_fn (float32[?,24], int32[?]): kernel 1/" in err, err


def test_names_start_after_the_enclosing_functions_locals():
    """A function defined inside another was named by its whole qualified name in
    reports, progress lines and dump directories: Keras's replicated step read
    ``_ReplicatedStep.__init__.<locals>.one_step_on_data``.  The name starts after
    the innermost ``<locals>``; a class's method keeps its class."""
    from stitching.tf.function import display_name

    def outer():
        def one_step_on_data(x):
            return x

        class Model:
            def call(self, x):
                return x
        return one_step_on_data, Model().call
    step, call = outer()
    assert display_name(step) == "one_step_on_data"
    assert display_name(call) == "Model.call"
    assert display_name(tf.function(step)) == "one_step_on_data"
    f = stitching.function(step, options=stitching.Options(background_compile=False))
    f(tf.constant([1.0, 2.0]) * 2.0)
    assert f.report.function == "one_step_on_data"
