"""Tests for stitching.runtime: the StitchedKernel op, its registry and its build.

Design
------
The codegen is not a dependency: every kernel here is a hand-written pair of Numba
cfuncs that follows the runtime ABI (body + shape function), wrapped in ``HandKernel``,
a duck-typed stand-in for codegen's compiled-kernel object.  Where a kernel is an
honest fused region (y = 2x; x + b with a row sum) its spec is a real, validated
``KernelSpec``; test-only kernels (pointer probes, thread probes) carry an opaque JSON
spec, which is all the runtime ever sees.

Specs are registered process-wide and forever, so tests that need a registry *miss*
make a fresh spec with ``fresh(...)`` (a new schedule value or a new tag).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
numba = pytest.importorskip("numba")

from numba import carray, cfunc, types  # noqa: E402
from numba.core.types import ExternalFunction  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

import stitching.runtime as rt  # noqa: E402
from stitching.ir import KernelSpec  # noqa: E402

# ---- the ABI, in Numba types -------------------------------------------------------

I64P = types.CPointer(types.int64)
BODY = types.void(types.int64, types.int64, types.CPointer(types.voidptr),
                  types.CPointer(types.voidptr), I64P)
SHAPE = types.int64(I64P, I64P, I64P, I64P)
UNIT = 4096  # elements per work unit of the flat kernels

_pthread_self = ExternalFunction("pthread_self", types.uint64())


@intrinsic
def _address(typingctx, ptr):
    """The integer value of a pointer (to report buffer addresses from a kernel)."""
    def codegen(context, builder, sig, args):
        return builder.ptrtoint(args[0], context.get_value_type(types.int64))
    return types.int64(ptr), codegen


# y = 2 * x over a flat float32 tensor, UNIT elements per work unit.
@cfunc(SHAPE, nopython=True, nogil=True)
def double_shape(in_dims, params, out_dims, sched):
    n = in_dims[0]
    params[0] = n
    out_dims[0] = n
    sched[0] = (n + UNIT - 1) // UNIT
    sched[1] = UNIT * 2
    return 0


@cfunc(BODY, nopython=True, nogil=True)
def double_body(begin, end, ins, outs, params):
    n = params[0]
    x = carray(ins[0], (n,), np.float32)
    y = carray(outs[0], (n,), np.float32)
    for i in range(begin * UNIT, min(end * UNIT, n)):
        y[i] = 2.0 * x[i]


# (x [B, C], b [C]) -> (x + b, sum(x, axis=1)); one row per unit; error 1 if C differs.
@cfunc(SHAPE, nopython=True, nogil=True)
def biasrow_shape(in_dims, params, out_dims, sched):
    rows, cols, blen = in_dims[0], in_dims[1], in_dims[2]
    if blen != cols:
        return 1
    params[0] = rows
    params[1] = cols
    out_dims[0] = rows
    out_dims[1] = cols
    out_dims[2] = rows
    sched[0] = rows
    sched[1] = 3 * cols + 10
    return 0


@cfunc(BODY, nopython=True, nogil=True)
def biasrow_body(begin, end, ins, outs, params):
    rows, cols = params[0], params[1]
    x = carray(ins[0], (rows, cols), np.float32)
    b = carray(ins[1], (cols,), np.float32)
    y = carray(outs[0], (rows, cols), np.float32)
    s = carray(outs[1], (rows,), np.float32)
    for r in range(begin, end):
        acc = np.float32(0.0)
        for c in range(cols):
            y[r, c] = x[r, c] + b[c]
            acc += x[r, c]
        s[r] = acc


# x [n] float32 -> (copy of x, [address of input 0, address of output 0]).
@cfunc(SHAPE, nopython=True, nogil=True)
def ptrs_shape(in_dims, params, out_dims, sched):
    params[0] = in_dims[0]
    out_dims[0] = in_dims[0]
    out_dims[1] = 2
    sched[0] = 1
    sched[1] = 1
    return 0


@cfunc(BODY, nopython=True, nogil=True)
def ptrs_body(begin, end, ins, outs, params):
    n = params[0]
    x = carray(ins[0], (n,), np.float32)
    y = carray(outs[0], (n,), np.float32)
    p = carray(outs[1], (2,), np.int64)
    for i in range(n):
        y[i] = x[i]
    p[0] = _address(ins[0])
    p[1] = _address(outs[0])


# spins [n] float64 (iterations per unit) -> (thread id per unit, first unit of the
# call that ran it, the spin's result).  One unit per element, declared expensive.
@cfunc(SHAPE, nopython=True, nogil=True)
def busy_shape(in_dims, params, out_dims, sched):
    n = in_dims[0]
    params[0] = n
    out_dims[0] = n
    out_dims[1] = n
    out_dims[2] = n
    sched[0] = n
    sched[1] = 1 << 24
    return 0


@cfunc(SHAPE, nopython=True, nogil=True)
def light_shape(in_dims, params, out_dims, sched):
    n = busy_shape(in_dims, params, out_dims, sched)
    # 16 units x 20k: the op's inline threshold (400k) keeps it on the calling thread,
    # where the pool would otherwise take some of the 16 units
    sched[1] = 20_000
    return n


@cfunc(BODY, nopython=True, nogil=True)
def busy_body(begin, end, ins, outs, params):
    n = params[0]
    spins = carray(ins[0], (n,), np.float64)
    tid = carray(outs[0], (n,), np.int64)
    first = carray(outs[1], (n,), np.int64)
    res = carray(outs[2], (n,), np.float64)
    me = np.int64(_pthread_self())
    for u in range(begin, end):
        acc = 1.0
        for _ in range(int(spins[u])):
            acc = acc * 0.999999 + 1e-7
        tid[u] = me
        first[u] = begin
        res[u] = acc


# x [n] float64 -> (begin, end) of the call that ran each unit: n cheap units, above
# the op's inline threshold in all, so the calling thread and the pool share them.
@cfunc(SHAPE, nopython=True, nogil=True)
def span_shape(in_dims, params, out_dims, sched):
    n = in_dims[0]
    params[0] = n
    out_dims[0] = n
    out_dims[1] = n
    sched[0] = n
    sched[1] = 2000
    return 0


@cfunc(BODY, nopython=True, nogil=True)
def span_body(begin, end, ins, outs, params):
    n = params[0]
    x = carray(ins[0], (n,), np.float64)
    b = carray(outs[0], (n,), np.int64)
    e = carray(outs[1], (n,), np.int64)
    for u in range(begin, end):
        acc = x[u]
        for _ in range(200):
            acc = acc * 0.999999 + 1e-7
        b[u] = begin if acc > -1.0 else -1
        e[u] = end


# x [n] float32 -> [2] int64: the launch hint the op handed the shape function.
@cfunc(SHAPE, nopython=True, nogil=True)
def hint_shape(in_dims, params, out_dims, sched):
    params[0] = sched[0]
    params[1] = sched[1]
    out_dims[0] = 2
    sched[0] = 1
    sched[1] = 1
    return 0


@cfunc(BODY, nopython=True, nogil=True)
def hint_body(begin, end, ins, outs, params):
    h = carray(outs[0], (2,), np.int64)
    h[0] = params[0]
    h[1] = params[1]


# ---- kernel objects ----------------------------------------------------------------

class OpaqueSpec:
    """A spec the runtime treats as what it is to it: an opaque string."""

    def __init__(self, text):
        self._text = text

    def to_json(self):
        return self._text


class HandKernel:
    """Duck-typed compiled kernel (what codegen will produce)."""

    def __init__(self, spec, body, shape, in_ranks, in_dtypes, out_ranks, out_dtypes,
                 errors=()):
        self.spec = spec
        self.body_address = body.address
        self.shape_address = shape.address
        self.in_ranks, self.in_dtypes = list(in_ranks), list(in_dtypes)
        self.out_ranks, self.out_dtypes = list(out_ranks), list(out_dtypes)
        self.errors = list(errors)


DOUBLE_SPEC = KernelSpec.from_dict({
    "version": 1, "inputs": [{"dtype": "float32", "shape": [-1]}],
    "nodes": [{"op": "Const", "args": [], "dtype": "float32", "shape": [],
               "attrs": {"value": 2.0, "dtype": "float32", "shape": []}},
              {"op": "Mul", "args": [-1, 0], "attrs": {}, "dtype": "float32",
               "shape": [-1]}],
    "outputs": [1]})

BIASROW_SPEC = KernelSpec.from_dict({
    "version": 1, "inputs": [{"dtype": "float32", "shape": [-1, -1]},
                             {"dtype": "float32", "shape": [-1]}],
    "nodes": [{"op": "Add", "args": [-1, -2], "attrs": {}, "dtype": "float32",
               "shape": [-1, -1]},
              {"op": "Sum", "args": [-1], "attrs": {"axes": [1], "keep_dims": False},
               "dtype": "float32", "shape": [-1]}],
    "outputs": [0, 1]})


def double_kernel(spec=DOUBLE_SPEC):
    return HandKernel(spec, double_body, double_shape, [1], ["float32"], [1], ["float32"])


def biasrow_kernel(spec=BIASROW_SPEC):
    return HandKernel(spec, biasrow_body, biasrow_shape, [2, 1], ["float32"] * 2, [2, 1],
                      ["float32"] * 2, errors=["bias length does not match the rows"])


PTRS = HandKernel(OpaqueSpec('{"test":"ptrs"}'), ptrs_body, ptrs_shape, [1], ["float32"],
                  [1, 1], ["float32", "int64"])
BUSY = HandKernel(OpaqueSpec('{"test":"busy"}'), busy_body, busy_shape, [1], ["float64"],
                  [1, 1, 1], ["int64", "int64", "float64"])
LIGHT = HandKernel(OpaqueSpec('{"test":"light"}'), busy_body, light_shape, [1], ["float64"],
                   [1, 1, 1], ["int64", "int64", "float64"])
SPAN = HandKernel(OpaqueSpec('{"test":"span"}'), span_body, span_shape, [1], ["float64"],
                  [1, 1], ["int64", "int64"])


def hand_compiler(text):
    """Plays codegen: validate the spec, then pick the hand kernel of that structure."""
    spec = KernelSpec.from_json(text)
    base = KernelSpec(spec.inputs, spec.nodes, spec.outputs, {}).to_json()
    if base == DOUBLE_SPEC.to_json():
        return double_kernel(spec)
    if base == BIASROW_SPEC.to_json():
        return biasrow_kernel(spec)
    raise NotImplementedError("hand_compiler knows two specs only")


_fresh = itertools.count(1)


def fresh(spec=DOUBLE_SPEC) -> str:
    """A valid spec string no test has registered yet (same kernel structure)."""
    return spec.with_schedule(rows_per_task=next(_fresh)).to_json()


@pytest.fixture
def compiler():
    """Install a recording hand_compiler for one test; remove it afterwards."""
    calls = []

    def compile_(text):
        calls.append((text, threading.current_thread().name))
        return hand_compiler(text)
    rt.set_compiler(compile_)
    yield calls
    rt.set_compiler(None)
    import stitching.tf as stf
    if stf._READY:                 # put stitching's hook back for the tests that follow
        stf._READY = False         # (import stitching installs it: tests/test_serving.py)
        stf.ensure_runtime()


def run_double(x, spec=None):
    return rt.stitched_kernel([x], spec or double_kernel(), label="double")[0]


# ---- correctness -------------------------------------------------------------------

def test_double_eager_and_in_function():
    x = tf.random.uniform([10_000])
    np.testing.assert_array_equal(run_double(x).numpy(), 2 * x.numpy())
    f = tf.function(run_double)
    np.testing.assert_array_equal(f(x).numpy(), 2 * x.numpy())


def test_unknown_batch_one_registration():
    f = tf.function(run_double, input_signature=[tf.TensorSpec([None], tf.float32)])
    run_double(tf.zeros([1]))  # registers
    before = rt.num_registered()
    for n in (1, UNIT - 1, UNIT, UNIT + 1, 3 * UNIT + 7, 50_000):
        x = tf.random.uniform([n])
        y = f(x)
        assert y.shape == (n,)
        np.testing.assert_array_equal(y.numpy(), 2 * x.numpy())
    assert rt.num_registered() == before
    assert f.experimental_get_tracing_count() == 1


def test_graph_shape_inference_sees_static_shapes():
    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32),
                                  tf.TensorSpec([8], tf.float32)])
    def f(x, b):
        y, s = rt.stitched_kernel([x, b], biasrow_kernel(), out_shapes=[[None, 8], [None]])
        assert y.shape.as_list() == [None, 8] and s.shape.as_list() == [None]
        return y, s
    f.get_concrete_function()


def test_zero_size_inputs():
    assert run_double(tf.zeros([0])).shape == (0,)
    y, s = rt.stitched_kernel([tf.zeros([0, 5]), tf.zeros([5])], biasrow_kernel())
    assert y.shape == (0, 5) and s.shape == (0,)
    y, s = rt.stitched_kernel([tf.zeros([3, 0]), tf.zeros([0])], biasrow_kernel())
    assert y.shape == (3, 0)
    np.testing.assert_array_equal(s.numpy(), np.zeros(3, np.float32))


def test_multiple_outputs_and_inputs():
    x = tf.random.uniform([37, 19])
    b = tf.random.uniform([19])
    for fn in (rt.stitched_kernel, tf.function(rt.stitched_kernel)):
        y, s = fn([x, b], biasrow_kernel())
        np.testing.assert_allclose(y.numpy(), x.numpy() + b.numpy(), rtol=1e-6)
        np.testing.assert_allclose(s.numpy(), x.numpy().sum(axis=1), rtol=1e-5)


def test_launch_hint_reaches_the_shape_function():
    """The registered launch hint (rows per unit, column block) is what the op hands the
    shape function in sched[0..1] on every call; without one it hands zeros."""
    hinted = HandKernel(OpaqueSpec('{"test":"hint","n":1}'), hint_body, hint_shape, [1],
                        ["float32"], [1], ["int64"])
    hinted.launch = (5, 96)
    plain = HandKernel(OpaqueSpec('{"test":"hint","n":2}'), hint_body, hint_shape, [1],
                       ["float32"], [1], ["int64"])
    x = tf.zeros([7])
    assert rt.stitched_kernel([x], hinted)[0].numpy().tolist() == [5, 96]
    assert rt.stitched_kernel([x], plain)[0].numpy().tolist() == [0, 0]
    bad = HandKernel(OpaqueSpec('{"test":"hint","n":3}'), hint_body, hint_shape, [1],
                     ["float32"], [1], ["int64"])
    bad.launch = (-1, 0)
    with pytest.raises(rt.RegistrationError, match="launch must be two ints >= 0"):
        rt.register(bad)


def test_default_output_types_from_spec_string():
    rt.register(double_kernel())
    (y,) = rt.stitched_kernel([tf.ones([3])], DOUBLE_SPEC.to_json())
    assert y.dtype == tf.float32
    np.testing.assert_array_equal(y.numpy(), [2, 2, 2])


# ---- errors are TF errors, never crashes -------------------------------------------

def test_shape_fn_error_reports_message_and_shapes():
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"bias length does not match.*input shapes: "
                             r"0: \S+ \[4,3\], 1: \S+ \[2\]"):
        rt.stitched_kernel([tf.zeros([4, 3]), tf.zeros([2])], biasrow_kernel())


@pytest.fixture
def no_compiler():
    """Other tests (stitching.function) install the compile-on-miss hook; remove it here."""
    rt.set_compiler(None)
    yield
    import stitching.tf as stf
    if stf._READY:                 # put stitching's hook back for the tests that follow
        stf._READY = False
        stf.ensure_runtime()


def test_unknown_spec_without_compiler_is_not_found(no_compiler):
    with pytest.raises(tf.errors.NotFoundError, match="no compiled kernel for this spec"):
        rt.stitched_kernel([tf.ones([3])], fresh())
    with pytest.raises(tf.errors.NotFoundError, match="no compiled kernel"):
        tf.function(lambda x: rt.stitched_kernel([x], fresh())[0])(tf.ones([3]))


def test_signature_mismatches_are_invalid_argument():
    rt.register(double_kernel())
    spec = DOUBLE_SPEC.to_json()
    cases = [
        ([tf.ones([3], tf.float64)], ["float32"], [[None]], "input dtypes"),
        ([tf.ones([3])], ["int32"], [[None]], "output dtypes"),
        ([tf.ones([3])], ["float32"], [[None, None]], "has rank 1"),
        ([tf.ones([3, 2])], ["float32"], [[None]], "expects rank 1"),
        ([tf.ones([3])], ["float32"], [[5]], "incompatible with the declared"),
        ([tf.ones([3]), tf.ones([3])], ["float32"], [[None]], "input dtypes"),
    ]
    for inputs, dtypes, shapes, msg in cases:
        with pytest.raises(tf.errors.InvalidArgumentError, match=msg):
            rt.stitched_kernel(inputs, spec, dtypes, shapes)


def test_output_shapes_count_checked_by_raw_op():
    rt.register(double_kernel())
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="output_shapes"):
        rt.load().stitched_kernel(args=[tf.ones([3])], spec=DOUBLE_SPEC.to_json(),
                                  Tout=[tf.float32], output_shapes=[[None], [None]])


def test_bad_kernel_objects_rejected_at_registration():
    bad = double_kernel(OpaqueSpec('{"test":"bad-dtype"}'))
    bad.in_dtypes = ["complex64"]
    with pytest.raises(rt.RegistrationError, match="unsupported dtype"):
        rt.register(bad)
    bad = double_kernel(OpaqueSpec('{"test":"bad-rank"}'))
    bad.out_ranks = [-1]
    with pytest.raises(rt.RegistrationError, match="non-negative"):
        rt.register(bad)
    assert not rt.is_registered('{"test":"bad-dtype"}')


# ---- registry and compile-on-miss --------------------------------------------------

def test_register_is_idempotent_per_spec_string():
    k = double_kernel(OpaqueSpec('{"test":"idem"}'))
    n = rt.num_registered()
    assert rt.register(k) is True
    assert rt.register(k) is False
    assert rt.register(double_kernel(OpaqueSpec('{"test":"idem"}'))) is False
    assert rt.num_registered() == n + 1 and rt.is_registered('{"test":"idem"}')
    assert rt.registered_kernel('{"test":"idem"}') is k


def test_compiler_callback_on_miss_eager_and_function(compiler):
    spec = fresh()
    x = tf.random.uniform([5000])
    np.testing.assert_array_equal(rt.stitched_kernel([x], spec)[0].numpy(), 2 * x.numpy())
    assert [c[0] for c in compiler] == [spec]
    rt.stitched_kernel([x], spec)  # now registered: no second compile
    assert len(compiler) == 1

    spec2 = fresh(BIASROW_SPEC)
    f = tf.function(lambda a, b: rt.stitched_kernel([a, b], spec2))
    y, s = f(tf.ones([4, 3]), tf.ones([3]))
    np.testing.assert_array_equal(s.numpy(), [3, 3, 3, 3])
    assert [c[0] for c in compiler] == [spec, spec2]


def test_compiler_called_from_another_python_thread(compiler):
    spec, out = fresh(), []
    f = tf.function(lambda v: rt.stitched_kernel([v], spec)[0])
    t = threading.Thread(target=lambda: out.append(f(tf.ones([3])).numpy()), name="worker")
    t.start()
    t.join(60)
    assert not t.is_alive(), "compiler callback deadlocked"
    np.testing.assert_array_equal(out[0], [2, 2, 2])
    assert compiler == [(spec, "worker")]


def test_compiler_errors_surface_in_tf_errors(compiler):
    with pytest.raises(tf.errors.InvalidArgumentError, match="SpecError: spec is not valid"):
        rt.stitched_kernel([tf.ones([3])], "not json {", ["float32"], [[None]])
    unknown = json.dumps({"version": 1, "inputs": [{"dtype": "float32", "shape": [-1]}],
                          "nodes": [{"op": "Neg", "args": [-1], "attrs": {},
                                     "dtype": "float32", "shape": [-1]}], "outputs": [0]})
    with pytest.raises(tf.errors.UnimplementedError, match="knows two specs only"):
        rt.stitched_kernel([tf.ones([3])], unknown)

    def broken(text):
        raise RuntimeError("codegen exploded")
    rt.set_compiler(broken)
    with pytest.raises(tf.errors.InternalError, match="RuntimeError: codegen exploded"):
        rt.stitched_kernel([tf.ones([3])], fresh())
    rt.set_compiler(lambda text: object())  # not a kernel
    with pytest.raises(tf.errors.InternalError, match="AttributeError"):
        rt.stitched_kernel([tf.ones([3])], fresh())


# ---- GraphDef round trip -----------------------------------------------------------

def _double_graph_def(spec):
    f = tf.function(lambda x: tf.identity(rt.stitched_kernel([x], spec)[0], name="y"))
    return f.get_concrete_function(tf.TensorSpec([None], tf.float32, name="x")).graph \
        .as_graph_def()


def _import(graph_def):
    def imp(x):
        (y,) = tf.graph_util.import_graph_def(graph_def, input_map={"x:0": x},
                                              return_elements=["y:0"])
        return y
    return tf.compat.v1.wrap_function(imp, [tf.TensorSpec([None], tf.float32)])


def test_graph_def_round_trip():
    rt.register(double_kernel())
    gd = _double_graph_def(DOUBLE_SPEC.to_json())
    node = [n for n in gd.node if n.op == "StitchedKernel"][0]
    assert node.attr["spec"].s.decode() == DOUBLE_SPEC.to_json()
    fn = _import(gd)
    for n in (1, 9000):
        x = tf.random.uniform([n])
        np.testing.assert_array_equal(fn(x).numpy(), 2 * x.numpy())


_FRESH_PROCESS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import tensorflow as tf, numpy as np
    from tensorflow.core.framework import graph_pb2
    import stitching.runtime as rt
    import test_runtime as t
    gd = graph_pb2.GraphDef.FromString(open({path!r}, "rb").read())
    rt.load()  # the op must be registered with TF before the graph is imported
    fn = t._import(gd)
    try:
        fn(tf.ones([2]))
    except tf.errors.NotFoundError as e:
        print("MISS-OK" if "no compiled kernel" in str(e) else "MISS-BAD")
    rt.set_compiler(t.hand_compiler)
    print("RESULT", fn(tf.range(5, dtype=tf.float32)).numpy().tolist())
""")


def test_graph_def_in_fresh_process_compiles_via_callback(tmp_path):
    """A graph file carries the spec, not addresses: a new process compiles on a miss."""
    path = tmp_path / "g.pb"
    path.write_bytes(_double_graph_def(fresh()).SerializeToString())
    script = _FRESH_PROCESS.format(tests=os.path.dirname(__file__), path=str(path))
    # STITCHING_NO_AUTOLOAD: the runtime alone, without the compiler `import stitching`
    # installs (tests/test_serving.py covers that), so the miss is seen
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", STITCHING_NO_AUTOLOAD="1",
               # the directory holding the stitching package (not the package
               # itself: stitching/inspect would shadow the stdlib's inspect)
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(
                   os.path.abspath(rt.__file__))))] + sys.path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MISS-OK" in proc.stdout
    assert "RESULT [0.0, 2.0, 4.0, 6.0, 8.0]" in proc.stdout


# ---- threads, GIL, copies ----------------------------------------------------------

def test_work_is_split_across_calls_and_threads():
    spins = tf.fill([16], 300_000.0)
    for _ in range(5):  # the 2 cores are shared; give the pool a few chances
        tid, first, res = rt.stitched_kernel([tf.cast(spins, tf.float64)], BUSY)
        threads, calls = set(tid.numpy().tolist()), set(first.numpy().tolist())
        if len(threads) > 1:
            break
    assert len(calls) > 1, "the op ran the whole range in one call"
    assert len(threads) > 1, "all work units ran on one thread"
    assert np.all(res.numpy() > 0)


def test_the_calls_of_one_run_tile_the_units_exactly_once():
    """The calling thread and pool threads take shares of the units from one queue
    (op.cc, UnitQueue): every unit is run by exactly one call, the calls' ranges tile
    [0, n) without overlap, and the shares shrink towards the end (guided), so there
    are several of them.  A unit run twice would record a range that its neighbours
    in that range do not."""
    for n in (1000, 4097, 30000):
        for _ in range(3):
            b, e = (t.numpy() for t in rt.stitched_kernel([tf.zeros([n], tf.float64)], SPAN))
            assert np.all(b >= 0) and np.all(b <= np.arange(n)) and np.all(np.arange(n) < e)
            starts = np.unique(b)
            ends = np.array([e[s] for s in starts])
            assert starts[0] == 0 and ends[-1] == n
            assert np.array_equal(starts[1:], ends[:-1]), "ranges overlap or leave a gap"
            for s0, e0 in zip(starts, ends):      # each range was run by one call
                assert np.all(b[s0:e0] == s0) and np.all(e[s0:e0] == e0)
            assert len(starts) >= 4
            sizes = ends - starts
            assert sizes[0] >= sizes[-1]


def test_small_work_runs_inline_in_one_call():
    """Below the inline threshold the op does not hand work to the pool (a thread
    wake-up costs more than a small kernel): one call, on one thread."""
    tid, first, _ = rt.stitched_kernel([tf.fill([16], tf.constant(10.0, tf.float64))], LIGHT)
    assert set(first.numpy().tolist()) == {0}
    assert len(set(tid.numpy().tolist())) == 1


def test_gil_released_while_kernel_runs():
    """Python threads keep running during the op: TF released the GIL (no deadlock for
    a callback arriving from another thread, and no serialization of Python work)."""
    spins = tf.fill([4], 4e7)
    spins = tf.cast(spins, tf.float64)
    f = tf.function(lambda s: rt.stitched_kernel([s], BUSY)[2])
    f(tf.cast(tf.fill([4], 1.0), tf.float64))
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        for call in (lambda: rt.stitched_kernel([spins], BUSY), lambda: f(spins)):
            before = ticks[0]
            call()
            assert ticks[0] - before > 1000
    finally:
        stop.set()
        t.join()


def test_inputs_are_not_copied():
    """The body sees the producing op's own output buffer as its input pointer."""
    x = tf.random.uniform([1000])
    y1, p1 = rt.stitched_kernel([x], PTRS)
    y2, p2 = rt.stitched_kernel([y1], PTRS)
    np.testing.assert_array_equal(y2.numpy(), x.numpy())
    assert p2.numpy()[0] == p1.numpy()[1]
    assert p1.numpy()[0] % 64 == 0  # TF's aligned allocation, not some staging copy

    @tf.function
    def chain(v):
        a, pa = rt.stitched_kernel([v], PTRS)
        _, pb = rt.stitched_kernel([a], PTRS)
        return pa, pb
    pa, pb = chain(x)
    assert pb.numpy()[0] == pa.numpy()[1]


def test_large_outputs_reuse_pooled_buffers():
    """Outputs of min_bytes (32 MiB) or more come from the op's pool: a freed output's
    buffer is handed to the next output of its size (no fresh, page-faulting
    allocation), and a buffer still referenced is never handed out again; smaller
    outputs come from TF's allocator."""
    assert rt.pool_stats()["min_bytes"] == 32 << 20
    n = 1 << 23                                   # 32 MiB of float32: pooled
    x = tf.random.uniform([n])
    y1, p1 = rt.stitched_kernel([x], PTRS)
    before = rt.pool_stats()
    y2, p2 = rt.stitched_kernel([x], PTRS)        # y1 alive: must get another buffer
    out1, out2 = int(p1.numpy()[1]), int(p2.numpy()[1])
    assert out1 != out2 and out1 % 64 == 0 and out2 % 64 == 0
    np.testing.assert_array_equal(y1.numpy(), x.numpy())
    np.testing.assert_array_equal(y2.numpy(), x.numpy())
    del y1                                        # back to the pool
    y3, p3 = rt.stitched_kernel([x], PTRS)
    assert int(p3.numpy()[1]) == out1
    np.testing.assert_array_equal(y3.numpy(), x.numpy())
    after = rt.pool_stats()
    assert after["hits"] >= before["hits"] + 1
    assert after["held_bytes"] >= 2 * n * 4

    small_before = rt.pool_stats()
    rt.stitched_kernel([tf.random.uniform([1 << 19])], PTRS)  # 2 MiB: TF's allocator
    small_after = rt.pool_stats()
    assert (small_after["hits"], small_after["misses"]) == (small_before["hits"],
                                                            small_before["misses"])


def test_op_enforces_static_dims_of_a_generic_kernel():
    """A kernel compiled for a spec's shape-generic twin accepts any size itself; the
    op still holds each input to the spec's static dims."""
    from stitching.compile import compile_kernel
    from stitching.ir.builder import SpecBuilder
    b = SpecBuilder()
    x = b.input("float32", (-1, 24))
    y = b.Div(x, b.Exp(x))          # element-wise: rows are not kept concrete
    k = compile_kernel(b.build([y]))
    assert k.generic is not None and k.in_static_dims == [-1, 24]
    v = tf.random.uniform([3, 24]) + 1.0
    np.testing.assert_allclose(rt.stitched_kernel([v], k)[0].numpy(),
                               (v / tf.exp(v)).numpy(), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="input 0 dim 1 must be 24"):
        rt.stitched_kernel([tf.ones([3, 25])], k)


def test_pool_trim_releases_idle_buffers():
    y, _ = rt.stitched_kernel([tf.random.uniform([1 << 23])], PTRS)
    del y, _
    assert rt.pool_stats()["idle_bytes"] > 0
    rt.pool_trim()
    stats = rt.pool_stats()
    assert stats["idle_bytes"] == 0 and stats["held_bytes"] >= 0


# ---- build and loading -------------------------------------------------------------

def test_library_is_one_image_and_cached():
    path = rt.build_library()
    assert path.name.startswith("stitching_ops-tf" + tf.__version__)
    mtime = path.stat().st_mtime_ns
    assert rt.build_library() == path and path.stat().st_mtime_ns == mtime  # reused
    import ctypes
    ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_NOW)  # same image TF loaded
    assert rt.library().stitching_abi_version() == rt.registry.ABI_VERSION == 10


def test_a_cache_that_cannot_be_written_builds_the_op_library_for_this_process(
        tmp_path, monkeypatch, capfd):
    """An upgraded image whose read-only cache holds only the old release's op
    library: the new one is built into a directory of the process's own (once per
    process), saying why and how to avoid it, rather than failing the op's
    registration (and every model load after it: "Op type not registered")."""
    import stitching.runtime.build as b
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(blocker / "cache"))  # mkdir fails
    monkeypatch.setattr(b, "_prebuilt", lambda path: None)
    monkeypatch.setattr(b, "_PRIVATE", {}, raising=False)
    runs = tmp_path / "runs"
    cxx = tmp_path / "fake-cxx"
    cxx.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                   f'echo run >> {runs}\nprintf library > "$out"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    first = b.build()
    assert first.read_bytes() == b"library" and first.parent.name.startswith(
        f"stitching-ops-{os.getpid()}-"), first
    err = capfd.readouterr().err
    assert str(blocker / "cache" / "ops") in err and "stitching-build" in err, err
    assert b.build() == first and runs.read_text().count("run") == 1   # once per process


def test_build_errors_are_clear(tmp_path, monkeypatch, capfd):
    import stitching.runtime.build as b
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(b, "_prebuilt", lambda path: None)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(rt.BuildError, match="was not found"):
        b.build()
    # a build says so before the compiler's minute, naming what and where
    err = capfd.readouterr().err
    assert "stitching: building stitching_ops-" in err and str(tmp_path) in err, err
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    with pytest.raises(rt.BuildError, match="failed"):
        b.build()
    assert not list((tmp_path / "ops").glob("*.so"))  # nothing half-written left
