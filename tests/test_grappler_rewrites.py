"""TF's value-changing Grappler rewrites happen before planning (stitching/tf/passes/grappler.py).

Each covered arithmetic-optimizer rewrite: the stitched kernel holds the rewritten
op, and its error against a float64 run of the expression as written is within
max(TF's own, 4 ulp) -- stock tf.function runs the same rewrites.  Plus the two TF
internal ops Grappler may emit (AddN, _UnaryOpsComposition) and a remapper
``_Fused*`` op in a graph file, which must not break the frontend.
"""
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import stitching  # noqa: E402
from stitching.tf.passes import grappler  # noqa: E402

OPTS = stitching.Options(min_ops=1)
RNG = np.random.default_rng(28)
SMALL = RNG.uniform(-1e-3, 1e-3, (8, 256)).astype(np.float32)
WIDE = RNG.uniform(-30.0, 30.0, (8, 256)).astype(np.float32)
POS = RNG.uniform(0.01, 50.0, (8, 256)).astype(np.float32)


def ulps(got, ref64):
    """|got - ref| in units of the float32 spacing at ref (at least the smallest
    subnormal's); equal infinities and NaN where the reference has NaN count as 0."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref64, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        spacing = np.spacing(np.abs(ref.astype(np.float32))).astype(np.float64)
        err = np.abs(got - ref) / np.maximum(spacing, np.float64(2.0 ** -149))
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    return np.where(same, 0.0, np.where(np.isnan(err), np.inf, err))


def _kernel_ops(f):
    return [op for k in f.report.to_dict()["kernel_details"] for op in k["ops"]]


# name -> (fn, float64 oracle of the expression as written, inputs, op the kernel holds)
REWRITES = {
    "ConvertExpm1": (lambda x: tf.exp(x) - 1.0, np.expm1, [SMALL], "Expm1"),
    "ConvertLog1p": (lambda x: tf.math.log(x + 1.0), np.log1p, [SMALL], "Log1p"),
    "ConvertLog1p_const_first": (lambda x: tf.math.log(1.0 + x), np.log1p, [SMALL], "Log1p"),
    "softplus_by_hand": (lambda x: tf.math.log(1.0 + tf.exp(x)),
                         lambda x: np.logaddexp(0.0, x), [WIDE], "Log1p"),
    "ConvertPow_2": (lambda x: tf.pow(x, 2.0), np.square, [WIDE], "Square"),
    "ConvertPow_half": (lambda x: tf.pow(x, 0.5), np.sqrt, [POS], "Sqrt"),
    "ConvertPow_minus_half": (lambda x: tf.pow(x, -0.5), lambda x: 1 / np.sqrt(x), [POS],
                              "Rsqrt"),
    "ConvertPow_minus_1": (lambda x: tf.pow(x, -1.0), lambda x: 1 / x, [POS], "Reciprocal"),
    "ReplaceMulWithSquare": (lambda x: x * x, np.square, [WIDE], "Square"),
    "SqrtDivToRsqrtMul": (lambda x, y: x / tf.sqrt(y), lambda x, y: x / np.sqrt(y),
                          [WIDE, POS], "Rsqrt"),
    "FuseSquaredDiff": (lambda x, y: tf.square(x - y), lambda x, y: (x - y) ** 2,
                        [WIDE, POS], "SquaredDifference"),
    "LogSoftmax": (lambda x: tf.math.log(tf.nn.softmax(x)),
                   lambda x: x - x.max(-1, keepdims=True)
                   - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)),
                   [WIDE], "LogSoftmax"),
    "AddOpsRewrite_AddN": (lambda x, y: x + y + x * y, lambda x, y: x + y + x * y,
                           [WIDE, POS], "AddV2"),
    # ConvertPow's x^3 -> x * Square(x) applies to nodes placed on a CPU only; the
    # graphs we read carry no device, so Pow stays (and is held to the same bar)
    "ConvertPow_3": (lambda x: tf.pow(x, 3.0), lambda x: x ** 3, [POS], "Pow"),
    "RemoveNegation": (lambda x, y: x + (-y), lambda x, y: x - y, [WIDE, POS], "Sub", "Neg"),
    "RemoveInvolution": (lambda x, y: -(-x) * y, lambda x, y: x * y, [WIDE, POS], "Mul",
                         "Neg"),
    "RemoveInvolution_reciprocal": (
        lambda x, y: tf.math.reciprocal(tf.math.reciprocal(x)) * y, lambda x, y: x * y,
        [POS, WIDE], "Mul", "Reciprocal"),
    "HoistCommonFactorOutOfAggregation": (lambda x, y: x * y + x * 2.0,
                                          lambda x, y: x * (y + 2.0), [WIDE, POS], "AddV2"),
    "OptimizeMaxOrMinOfMonotonic": (lambda x: tf.reduce_max(tf.tanh(x), -1) * 2.0,
                                    lambda x: np.tanh(x).max(-1) * 2.0, [WIDE], "Max"),
    "SimplifyAggregation": (lambda x, y: tf.add_n([x, x, x]) * y, lambda x, y: 3 * x * y,
                            [WIDE, POS], "Mul", "AddV2"),
    "RemoveLogicalNot": (lambda x, y: tf.cast(tf.logical_not(x < y), tf.float32),
                         lambda x, y: (x >= y).astype(np.float64), [WIDE, POS],
                         "GreaterEqual", "LogicalNot"),
}


@pytest.mark.parametrize("name", sorted(REWRITES))
def test_rewrite_happens_before_planning(name):
    fn, oracle, args, op, *absent = REWRITES[name]
    sig = [tf.TensorSpec([None, a.shape[1]], tf.float32) for a in args]
    sf = stitching.function(fn, input_signature=sig, options=OPTS)
    got = sf(*args).numpy()
    assert op in _kernel_ops(sf), (name, _kernel_ops(sf))
    assert not set(absent) & set(_kernel_ops(sf)), (name, _kernel_ops(sf))
    stock = tf.function(fn, input_signature=sig)(*args).numpy()
    ref = oracle(*[a.astype(np.float64) for a in args])
    ours, theirs = ulps(got, ref).max(), ulps(stock, ref).max()
    assert ours <= max(theirs, 4.0), (name, ours, theirs)


def test_expm1_and_log1p_near_zero_within_4_ulp():
    """The issue's case: |x| ~ 1e-3 lost 1.6e7 ulp when exp(x) - 1 stayed as written."""
    sf = stitching.function(lambda x: (tf.exp(x) - 1.0, tf.math.log(x + 1.0)))
    a, b = sf(SMALL)
    x = SMALL.astype(np.float64)
    assert ulps(a.numpy(), np.expm1(x)).max() <= 4
    assert ulps(b.numpy(), np.log1p(x)).max() <= 4


def test_rewrites_leave_no_dead_node_behind():
    """exp(x) - 1 -> Expm1(x) leaves the Exp without consumers: it is dropped, not
    fused into a kernel that writes an output nobody reads."""
    sf = stitching.function(lambda x: (tf.exp(x) - 1.0) * 2.0)
    sf(SMALL)
    (k,) = sf.report.to_dict()["kernel_details"]
    assert "Exp" not in k["ops"] and "Expm1" in k["ops"]
    assert k["outputs"] == 1


def _graph(nodes):
    gd = tf.compat.v1.GraphDef()
    gd.node.extend(nodes)
    return gd


def _run(gd, feeds, fetch):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    # Grappler off: the session must run the graph as written (its arithmetic
    # optimizer would turn an Add chain back into an AddN)
    cfg = tf.compat.v1.ConfigProto()
    cfg.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=g, config=cfg) as s:
        return s.run(fetch, feeds)


def test_unary_ops_composition_on_cpu_is_expanded_with_the_same_values():
    """A GraphDef with CPU devices gets _UnaryOpsComposition from the arithmetic
    optimizer (frozen graphs may already hold it): it becomes its chain of ops."""
    g = tf.Graph()
    with g.as_default(), tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        tf.identity(tf.sigmoid(tf.tanh(tf.exp(x * 0.1))) * 3.0, name="y")
    gd = g.as_graph_def()
    fused = grappler.optimize(gd, ["y"])
    assert not any(n.op == "_UnaryOpsComposition" for n in fused.node)
    assert {"Exp", "Tanh", "Sigmoid"} <= {n.op for n in fused.node}
    feed = {"x:0": RNG.standard_normal((4, 16)).astype(np.float32)}
    np.testing.assert_array_equal(_run(gd, feed, "y:0"), _run(fused, feed, "y:0"))
    # and its expansion is what TF's own kernel computes, bit for bit
    raw = tf.compat.v1.NodeDef(name="c", op="_UnaryOpsComposition", input=["x"])
    raw.attr["T"].type = tf.float32.as_datatype_enum
    raw.attr["op_names"].list.s.extend([b"Exp", b"Tanh", b"Sigmoid"])
    comp = _graph([n for n in gd.node if n.name == "x"] + [raw])
    np.testing.assert_array_equal(
        _run(comp, feed, "c:0"), _run(grappler.expand_tf_internal_ops(comp), feed, "c:0"))


@pytest.mark.parametrize("n", [2, 3, 8, 9, 10, 11, 17, 25])
def test_add_n_expands_to_tf_s_summation_order(n):
    """TF's CPU AddN sums n % 8 inputs, then adds groups of 8 summed apart: the
    expansion must give its bits (inputs spread over 12 decades, so any other order
    rounds differently)."""
    g = tf.Graph()
    with g.as_default():
        xs = [tf.compat.v1.placeholder(tf.float32, [256], name=f"x{i}") for i in range(n)]
        tf.identity(tf.add_n(xs), name="y")
    out = grappler.expand_tf_internal_ops(g.as_graph_def())
    assert not any(nd.op == "AddN" for nd in out.node)
    vals = [(RNG.standard_normal(256) * 10.0 ** RNG.integers(-6, 6, 256)).astype(np.float32)
            for _ in range(n)]
    want = tf.add_n([tf.constant(v) for v in vals]).numpy()       # TF's kernel, eager
    got = _run(out, {f"x{i}:0": v for i, v in enumerate(vals)}, "y:0")
    np.testing.assert_array_equal(got, want)


def test_an_add_n_of_variants_stays_add_n():
    """AddV2 takes no variants: a gradient loop body's AddN of TensorLists stays."""
    g = tf.Graph()
    with g.as_default():
        ls = [tf.raw_ops.EmptyTensorList(element_shape=[2], max_num_elements=-1,
                                         element_dtype=tf.float32) for _ in range(2)]
        tf.identity(tf.raw_ops.AddN(inputs=ls), name="y")
    out = grappler.expand_tf_internal_ops(g.as_graph_def())
    assert [nd.op for nd in out.node if nd.name == "y" or "AddN" in nd.name] == \
        ["AddN", "Identity"]


def test_inputs_named_with_output_zero_survive_constant_folding():
    """A body made from a FunctionDef names inputs ``node:0``; folding ``Fill(s:0,
    c:0)`` wrote the control input ``^s:0``, which Grappler's next optimizer rejected
    ("Non-existent input"), failing the whole optimize (a Keras GRU's gradient loop
    body).  They are written ``node`` first, as TF writes a graph."""
    g = tf.Graph()
    with g.as_default():
        x = tf.raw_ops.Placeholder(dtype=tf.float32, shape=[4], name="x")
        z = tf.raw_ops.Fill(dims=tf.constant([4], name="s"),
                            value=tf.constant(1.5, name="c"), name="z")
        tf.math.add(x, z, name="y")
    gd = g.as_graph_def()
    for nd in gd.node:
        named = [i if ":" in i or i.startswith("^") else i + ":0" for i in nd.input]
        del nd.input[:]
        nd.input.extend(named)
    out = grappler.optimize(gd, ["y:0"])
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(_run(out, {"x:0": x}, "y:0"), x + 1.5)


def test_remapper_fused_op_in_a_graph_file_stays_a_tf_op():
    """_FusedMatMul (Grappler's remapper; frozen graphs hold it) is not ours to fuse:
    it stays a TF op and the element-wise ops after it still stitch."""
    from stitching.tf.pipeline import stitch_graph_def
    x = tf.compat.v1.NodeDef(name="x", op="Placeholder")
    x.attr["dtype"].type = tf.float32.as_datatype_enum
    x.attr["shape"].shape.CopyFrom(tf.TensorShape([None, 8]).as_proto())
    w = tf.compat.v1.NodeDef(name="w", op="Const")
    w.attr["dtype"].type = tf.float32.as_datatype_enum
    w.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(
        RNG.standard_normal((8, 8)).astype(np.float32)))
    b = tf.compat.v1.NodeDef(name="b", op="Const")
    b.attr["dtype"].type = tf.float32.as_datatype_enum
    b.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(RNG.standard_normal(8).astype(np.float32)))
    mm = tf.compat.v1.NodeDef(name="mm", op="_FusedMatMul", input=["x", "w", "b"])
    mm.attr["T"].type = tf.float32.as_datatype_enum
    mm.attr["num_args"].i = 1
    mm.attr["fused_ops"].list.s.extend([b"BiasAdd", b"Relu"])
    for k in ("transpose_a", "transpose_b"):
        mm.attr[k].b = False
    gd = _graph([x, w, b, mm])
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
        t = g.get_tensor_by_name("mm:0")
        tf.identity(tf.tanh(t) * 2.0 + 1.0, name="y")
    gd = g.as_graph_def()
    res = stitch_graph_def(gd, ["y:0"], options=OPTS)
    assert "_FusedMatMul" in {n.op for n in res.graph_def.node}
    assert res.report.to_dict()["kernels"] == 1
    feed = {"x:0": RNG.standard_normal((4, 8)).astype(np.float32)}
    np.testing.assert_allclose(_run(res.graph_def, feed, "y:0"), _run(gd, feed, "y:0"),
                               rtol=1e-6, atol=1e-6)


def test_constant_grappler_anchors_to_an_argument_does_not_need_feeding():
    """x + x becomes Mul(Const(2) ^x, x): the control edge on the argument is dropped
    (it kept the original Placeholder in the rewritten graph, which TF then asked to
    be fed; found by tests/test_differential.py)."""
    sig = [tf.TensorSpec([None, 4])]
    sf = stitching.function(lambda x: (x + x) * 3.0, input_signature=sig)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(sf(x).numpy(), (x + x) * np.float32(3.0))
