"""Layout ops as index maps (schedule/layout.py): Transpose, Slice, ConcatV2, Pack and
Split folded into the loads of one kernel.  Layout ops do no arithmetic, so where a
kernel only moves data its output equals NumPy's bit for bit; NaN moves with the data;
one compiled kernel serves every batch size; what stays out says why."""
import json

import numpy as np
import pytest

from stitching.compile import compile_kernel
from stitching.ir.builder import SpecBuilder
from stitching.ir.spec import KernelSpec, SpecError
from stitching.schedule import KernelKind, ScheduleError, build_schedule, check

RNG = np.random.default_rng(43)
T, H, D = 8, 4, 16


def rope_spec(dtype="float32", batch=-1):
    """Rotary embedding of q [B,T,H,D] (rotate-half), then the head transpose."""
    b = SpecBuilder()
    x = b.input(dtype, [batch, T, H, D])
    c = b.input(dtype, [T, 1, D])
    s = b.input(dtype, [T, 1, D])
    x1 = b.Slice(x, begin=[0, 0, 0, 0], size=[-1, -1, -1, D // 2], strides=[1] * 4,
                 shape=[batch, T, H, D // 2])
    x2 = b.Slice(x, begin=[0, 0, 0, D // 2], size=[-1, -1, -1, D // 2], strides=[1] * 4,
                 shape=[batch, T, H, D // 2])
    r = b.ConcatV2(b.Neg(x2), x1, axis=3)
    y = b.Add(b.Mul(x, c), b.Mul(r, s))
    return b.build([b.Transpose(y, perm=[0, 2, 1, 3])])


def rope_ref(x, c, s):
    h = x.shape[-1] // 2
    r = np.concatenate([-x[..., h:], x[..., :h]], -1)
    return np.transpose(x * c + r * s, (0, 2, 1, 3))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rotary_embedding_and_head_transpose_are_one_kernel(dtype):
    spec = rope_spec(dtype)
    sched = build_schedule(spec)
    assert sched.kind == KernelKind.ELEMENTWISE
    k = compile_kernel(spec)
    for batch in (1, 3):          # one compiled kernel, every batch size
        x = RNG.standard_normal((batch, T, H, D)).astype(dtype)
        x[0, 0, 0, 0], x[0, 1, 2, D - 1] = np.nan, np.inf
        c = RNG.standard_normal((T, 1, D)).astype(dtype)
        s = RNG.standard_normal((T, 1, D)).astype(dtype)
        (y,) = k(x, c, s)
        # the same operations in the same order as NumPy: equal bits, NaN included
        np.testing.assert_array_equal(y, rope_ref(x, c, s))


def test_pure_layout_changes_no_bits():
    """Slice + transpose + concat + pack only: every output element is an input element."""
    b = SpecBuilder()
    x = b.input("float32", [-1, 6, 10])
    y = b.input("float32", [-1, 6, 10])
    t = b.Transpose(x, perm=[1, 0, 2])                                  # [6,?,10]
    sl = b.Slice(y, begin=[0, 5, 1], size=[-1, 3, 4], strides=[1, -2, 1],
                 shape=[-1, 3, 4])                                      # rows 5,3,1
    p = b.Pack(x, y, axis=1)                                            # [?,2,6,10]
    cat = b.ConcatV2(x, x, axis=2)                                      # pieces of one x
    spec = b.build([t, sl, p, cat])
    k = compile_kernel(spec) if check(spec).ok else None
    outs = []
    for ref in (t, sl, p, cat):   # each alone where they do not share one domain
        one = SpecBuilder()
        one.inputs, one.nodes = list(spec.inputs), list(spec.nodes)
        outs.append(compile_kernel(one.build([ref])))
    X = RNG.standard_normal((3, 6, 10)).astype(np.float32)
    Y = RNG.standard_normal((3, 6, 10)).astype(np.float32)
    X[1, 2, 3] = np.nan
    want = [np.transpose(X, (1, 0, 2)), Y[:, 5::-2, 1:5], np.stack([X, Y], 1),
            np.concatenate([X, X], 2)]
    for kk, w in zip(outs, want):
        (got,) = kk(X, Y)
        np.testing.assert_array_equal(got, w)
    if k is not None:
        for got, w in zip(k(X, Y), want):
            np.testing.assert_array_equal(got, w)


def test_split_and_softmax_over_transposed_rows():
    """A row kernel (softmax) reading its input through a transpose and a slice."""
    b = SpecBuilder()
    x = b.input("float32", [-1, T, H, D])
    xt = b.Transpose(x, perm=[0, 2, 1, 3])
    half = b.Slice(xt, begin=[0, 0, 0, 0], size=[-1, -1, -1, D // 2], strides=[1] * 4,
                   shape=[-1, H, T, D // 2])
    m = b.Max(half, axes=[3], keep_dims=True)
    e = b.Exp(b.Sub(half, m))
    y = b.Div(e, b.Sum(e, axes=[3], keep_dims=True))
    spec = b.build([y])
    assert build_schedule(spec).kind == KernelKind.ROW
    X = RNG.standard_normal((2, T, H, D)).astype(np.float32)
    (got,) = compile_kernel(spec)(X)
    h = np.transpose(X, (0, 2, 1, 3))[..., :D // 2].astype(np.float64)
    e = np.exp(h - h.max(-1, keepdims=True))
    np.testing.assert_allclose(got, e / e.sum(-1, keepdims=True), rtol=2e-6)


def test_what_stays_out_says_why():
    b = SpecBuilder()
    x = b.input("float32", [-1, 8, 16])
    moved = b.Transpose(x, perm=[0, 2, 1])              # moves the innermost axis
    assert "only element-wise kernels load along a stride" in check(
        b.build([b.Sum(b.Exp(moved), axes=[2], keep_dims=True)])).reason
    b = SpecBuilder()
    x = b.input("float32", [8192, 32])
    moved = b.Exp(b.Transpose(x, perm=[1, 0]))           # 8192 lines per row
    assert "a strided load runs over at most 4096" in check(b.build([moved])).reason
    b = SpecBuilder()
    x = b.input("float32", [-1, 8, 16])
    s = b.Sum(x, axes=[2], keep_dims=True)
    t = b.Transpose(b.Add(s, x), perm=[1, 0, 2])
    assert "Sum result is read through a layout op" in check(b.build([t])).reason
    b = SpecBuilder()
    x = b.input("float32", [-1, 8, 16])
    y = b.input("float32", [-1, 8, 16])
    cat = b.ConcatV2(b.Exp(x), y, axis=2)                # innermost, under a column sum
    assert "on the innermost axis read in a column reduction" in check(
        b.build([b.Sum(cat, axes=[1])])).reason


def test_spec_with_layout_ops_round_trips_and_bad_ones_are_rejected():
    spec = rope_spec()
    assert KernelSpec.from_json(spec.to_json()).hash == spec.hash
    d = json.loads(spec.to_json())
    node = next(n for n in d["nodes"] if n["op"] == "Transpose")
    node["attrs"]["perm"] = [0, 1, 1, 3]
    with pytest.raises(SpecError, match="not a permutation"):
        KernelSpec.from_json(json.dumps(d))
    d = json.loads(spec.to_json())
    node = next(n for n in d["nodes"] if n["op"] == "Slice")
    node["attrs"]["begin"][3] = 12              # 8 elements from 12 of 16
    with pytest.raises(SpecError, match="out of range"):
        KernelSpec.from_json(json.dumps(d))
    d = json.loads(spec.to_json())
    node = next(n for n in d["nodes"] if n["op"] == "ConcatV2")
    node["args"] = node["args"] * 40            # more pieces than MAX_VARIADIC
    with pytest.raises(SpecError, match="takes 1 to 64"):
        KernelSpec.from_json(json.dumps(d))


def test_cuda_backend_refuses_views_clearly():
    from stitching.codegen.cuda import emitter as cuda
    with pytest.raises(NotImplementedError, match="CPU backend only"):
        cuda.emit(build_schedule(rope_spec()))


def test_invalid_layout_spec_is_a_schedule_error():
    b = SpecBuilder()
    x = b.input("float32", [-1, 8, -1])
    # the innermost axis would be loaded along a stride that depends on the unknown
    # dim (an outer axis's run-time stride is a kernel parameter: test_slice_runtime.py)
    t = b.Exp(b.Transpose(x, perm=[0, 2, 1]))
    with pytest.raises(ScheduleError, match="known only at run time"):
        build_schedule(b.build([t]))


# ---- through TF ------------------------------------------------------------------------

def _tf_rope_case():
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(7)
    w = tf.constant(rng.standard_normal((H * D, H * D)).astype(np.float32) * 0.1)
    c = tf.constant(rng.standard_normal((T, 1, D)).astype(np.float32))
    s = tf.constant(rng.standard_normal((T, 1, D)).astype(np.float32))

    def rope(x):
        # the projection's output is an intermediate TF may let a kernel write over:
        # the rotary kernel reads it at other positions, so it must not
        q = tf.reshape(tf.matmul(tf.reshape(x, [-1, H * D]), w), [-1, T, H, D])
        q1, q2 = tf.split(q, 2, axis=-1)
        return tf.transpose(q * c + tf.concat([-q2, q1], axis=-1) * s, [0, 2, 1, 3])
    return tf, rope


def test_tf_rotary_block_is_one_kernel_equal_to_tf():
    import stitching
    tf, rope = _tf_rope_case()
    sig = [tf.TensorSpec([None, T, H, D], tf.float32)]
    f = stitching.function(rope, input_signature=sig)
    for batch in (1, 4):
        x = tf.constant(RNG.standard_normal((batch, T, H, D)).astype(np.float32))
        np.testing.assert_array_equal(f(x).numpy(), tf.function(rope)(x).numpy())
    assert len(f.report.kernels) == 1
    assert f.report.coverage == 1.0


@pytest.mark.slow
def test_tf_gradient_through_folded_layout_ops():
    """A tape inside the stitched function: the backward of split/concat/transpose
    (more layout ops) is planned with the rest; gradients equal TF's."""
    import stitching
    tf, rope = _tf_rope_case()

    def grad(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = rope(x)
            loss = tf.reduce_sum(y * g)
        return tape.gradient(loss, x)
    sig = [tf.TensorSpec([None, T, H, D], tf.float32), tf.TensorSpec([None, H, T, D])]
    f = stitching.function(grad, input_signature=sig)
    x = tf.constant(RNG.standard_normal((2, T, H, D)).astype(np.float32))
    g = tf.constant(RNG.standard_normal((2, H, T, D)).astype(np.float32))
    np.testing.assert_allclose(f(x, g).numpy(), tf.function(grad)(x, g).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_tf_tile_of_unknown_batch_is_a_broadcast():
    """keras.ops.repeat's Tile (grouped-query attention's K/V heads): a size-1 axis
    tiled, the batch (multiple 1) known only at run time."""
    import stitching
    tf = pytest.importorskip("tensorflow")

    def rep(x):
        return tf.tile(-x[:, :, None, :], [1, 1, 3, 1]) * 2.0   # exact: equal bits
    f = stitching.function(rep, input_signature=[tf.TensorSpec([None, 4, 8], tf.float32)])
    for batch in (1, 3):
        x = tf.constant(RNG.standard_normal((batch, 4, 8)).astype(np.float32))
        np.testing.assert_array_equal(f(x).numpy(), tf.function(rep)(x).numpy())
    assert len(f.report.kernels) == 1 and f.report.coverage == 1.0


def test_tf_broadcast_constant_keeps_its_extent_through_a_transpose():
    """A broadcasting Tile (x * ones[..]) read through a transpose: the ones' non-1 dims
    keep their extent in the transposed index space (a stride-0 view of x)."""
    b = SpecBuilder()
    x = b.input("float32", [-1, T, 2, D])
    ones = b.Const(value=1.0, dtype="float32", shape=[1, T, 2, 3, D])
    tiled = b.Mul(b.Reshape(x, shape=[-1, T, 2, 1, D]), ones)
    spec = b.build([b.Transpose(tiled, perm=[0, 2, 3, 1, 4])])
    assert check(spec).ok
    X = RNG.standard_normal((2, T, 2, D)).astype(np.float32)
    (got,) = compile_kernel(spec)(X)
    want = np.transpose(np.repeat(X[:, :, :, None, :], 3, axis=3), (0, 2, 3, 1, 4))
    np.testing.assert_array_equal(got, want)


# ---- grouped-query attention: the K/V repeat and the gradients --------------------------

KV, R = 2, 2


def _gqa_case():
    tf = pytest.importorskip("tensorflow")
    rng = np.random.default_rng(11)
    c = tf.constant(rng.standard_normal((T, 1, D)).astype(np.float32))
    s = tf.constant(rng.standard_normal((T, 1, D)).astype(np.float32))

    def rope_repeat(k):
        """keras_hub Llama's K path: rotate-half rotary, repeat_kv, head transpose."""
        k1, k2 = tf.split(k, 2, axis=-1)
        k = k * c + tf.concat([-k2, k1], axis=-1) * s
        return tf.transpose(tf.repeat(k, R, axis=2), [0, 2, 1, 3])
    return tf, rope_repeat


def test_reshape_sink_groups_only_adjacent_dims():
    from stitching.tf.passes.reshape_sink import groups
    assert groups([None, 8, 2, 4, 32], [None, 8, 8, 32]) == [[0], [1], [2, 3], [4]]
    assert groups([2, 3, 1], [6]) == [[0, 1, 2]]
    assert groups([6, 4], [4, 6]) is None            # regroups across dims
    assert groups([None, None], [None]) is None      # an unknown dim merged


def test_tf_gqa_repeat_is_one_kernel_with_the_rotary_embedding():
    """The Transpose of repeat_kv's regrouping Reshape is sunk below it
    (tf/passes/reshape_sink.py), and the Shape that keras.ops.repeat's target reads
    is folded away before planning (tf/passes/shapes.py): rotary + repeat + head
    transpose are one kernel, equal to TF bit for bit at two batch sizes."""
    import stitching
    tf, rope_repeat = _gqa_case()
    f = stitching.function(rope_repeat,
                           input_signature=[tf.TensorSpec([None, T, KV, D], tf.float32)])
    for batch in (1, 3):
        x = tf.constant(RNG.standard_normal((batch, T, KV, D)).astype(np.float32))
        x = tf.tensor_scatter_nd_update(x, [[0, 1, 1, 3]], [np.nan])
        np.testing.assert_array_equal(f(x).numpy(), tf.function(rope_repeat)(x).numpy())
    rep = f.report
    assert len(rep.kernels) == 1 and rep.coverage == 1.0, rep.summary()


def test_tf_gqa_backward_is_fused_and_equal_to_tf_bitwise():
    """The tape's backward of split/concat/repeat/transpose: the ConcatV2 gradient's
    Slices get constant bounds (tf/passes/concat_grad.py) and fuse with the rest; the
    math is the same operations in TF's order, so the gradient has TF's bits."""
    import stitching
    tf, rope_repeat = _gqa_case()

    def grad(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(rope_repeat(x) * g)
        return tape.gradient(loss, x)
    sig = [tf.TensorSpec([None, T, KV, D], tf.float32),
           tf.TensorSpec([None, KV * R, T, D], tf.float32)]
    f = stitching.function(grad, input_signature=sig)
    for batch in (2, 1):
        x = tf.constant(RNG.standard_normal((batch, T, KV, D)).astype(np.float32))
        g = tf.constant(RNG.standard_normal((batch, KV * R, T, D)).astype(np.float32))
        np.testing.assert_array_equal(f(x, g).numpy(), tf.function(grad)(x, g).numpy())
    rep = f.report
    left = {op for _, op, _ in rep.unfused}
    assert not left & {"Slice", "Split", "ConcatV2", "Tile", "Transpose"}, rep.summary()
    assert len(rep.kernels) == 3, rep.summary()


def test_tf_transpose_folded_into_a_matmul_is_not_counted():
    """Grappler's FoldTransposeIntoMatMul makes a BatchMatMulV2 with adj_y and leaves
    the old matmul and its Transpose behind, read by nothing: they are dropped
    (tf/passes/grappler.py), not reported as a Transpose left to TF."""
    import stitching
    tf = pytest.importorskip("tensorflow")

    def scores(q, k):
        return tf.nn.softmax(tf.matmul(q, tf.transpose(k, [0, 1, 3, 2])) * 0.25)
    sig = [tf.TensorSpec([None, H, T, D], tf.float32)] * 2
    f = stitching.function(scores, input_signature=sig)
    q, k = (tf.constant(RNG.standard_normal((2, H, T, D)).astype(np.float32))
            for _ in range(2))
    np.testing.assert_allclose(f(q, k).numpy(), tf.function(scores)(q, k).numpy(),
                               rtol=1e-6, atol=1e-7)
    assert "Transpose" not in {op for _, op, _ in f.report.unfused}, f.report.summary()
    assert f.report.coverage == 1.0


@pytest.mark.slow
def test_llama_decoder_block_coverage():
    """A Llama-style block from Keras layers (RMSNorm, rotary, GQA, SwiGLU): every
    memory-intensive op fused but the attention output's head transpose, which sits
    alone between two matmuls (fusing it alone saves nothing)."""
    import stitching
    from stitching.testing.models import llama_decoder
    tf = pytest.importorskip("tensorflow")
    import keras
    keras.utils.set_random_seed(3)
    model = llama_decoder(num_layers=1, d_model=64, heads=4, kv_heads=2, ff=96, seq_len=16)
    sig = [tf.TensorSpec([None, 16, 64], tf.float32)]
    f = stitching.function(lambda x: model(x, training=False), input_signature=sig)
    x = tf.constant(RNG.standard_normal((2, 16, 64)).astype(np.float32))
    want = tf.function(lambda x: model(x, training=False))(x).numpy()
    np.testing.assert_allclose(f(x).numpy(), want, rtol=2e-5, atol=2e-5)
    rep = f.report
    assert rep.coverage >= 0.9, rep.summary()
    assert [op for _, op, _ in rep.unfused] == ["Transpose"], rep.summary()
    assert "lone op" in rep.unfused[0][2]


def test_cuda_plans_keep_layout_ops_out_of_kernels():
    """The CUDA emitter reads no views: a plan for a CUDA profile leaves the transpose
    to TF with that reason, where a CPU plan fuses it."""
    import sys
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from irbuild import G
    from stitching.plan import profiles, search
    from stitching.schedule import check as legal_check

    def legal(spec):
        d = legal_check(spec)
        return None if d.ok else d.reason
    g = (G().input("x", [-1, T, H, D]).op("e", "Exp", ["x"]).op("n", "Neg", ["e"])
         .op("t", "Transpose", ["n"], perm=[0, 2, 1, 3]).op("y", "Sigmoid", ["t"])
         .build("y"))
    cpu = search.plan(g, legal, config=search.SearchConfig(profile=profiles.get("cpu-reference")))
    assert "t" in {m for r in cpu.regions for m in r.nodes}
    gpu = search.plan(g, legal, config=search.SearchConfig(profile=profiles.get("v100")))
    assert "t" not in {m for r in gpu.regions for m in r.nodes}
    why = dict((n, r) for n, _, r in gpu.unfused)["t"]
    assert "the CUDA emitter reads no views" in why


def test_pad_and_reverse_change_no_bits():
    """Pad (zeros or a value) on the innermost axis: a select over a constant table,
    the input's loads guarded; Reverse: a negative stride (on the innermost axis too)."""
    b = SpecBuilder()
    x = b.input("float32", [-1, 6, 10])
    outs = [b.Pad(b.Neg(x), paddings=[0, 0, 0, 0, 3, 2], value=0.0),
            b.Reverse(x, axes=[1, 2]),
            b.Pad(x, paddings=[0, 0, 0, 0, 1, 0], value=-1.5)]
    X = RNG.standard_normal((2, 6, 10)).astype(np.float32)
    X[1, 2, 3] = np.nan
    want = [np.pad(-X, [(0, 0), (0, 0), (3, 2)]), X[:, ::-1, ::-1],
            np.pad(X, [(0, 0), (0, 0), (1, 0)], constant_values=-1.5)]
    for out, w in zip(outs, want):
        one = SpecBuilder()
        one.inputs, one.nodes = list(b.inputs), list(b.nodes)
        (got,) = compile_kernel(one.build([out]))(X)
        np.testing.assert_array_equal(got, w)


def test_pad_and_reverse_that_stay_out_say_why():
    b = SpecBuilder()
    x = b.input("float32", [-1, 6, 10])
    assert "only element-wise kernels load along a stride" in check(b.build([b.Sum(
        b.Reverse(b.Exp(x), axes=[2]), axes=[2], keep_dims=True)])).reason
    with pytest.raises(SpecError, match="known only at run time"):
        b = SpecBuilder()
        b.Pad(b.input("float32", [-1, 6]), paddings=[1, 0, 0, 0], value=0.0)


def test_tf_pad_reverse_and_strided_slice_gradient_fuse_bitwise():
    """tf.pad / tf.reverse in a kernel, and the tape's StridedSliceGrad of x[..., 2:9]
    (a Pad of dy: the SliceGrad composite) fused with its neighbours, equal to TF."""
    import stitching
    tf = pytest.importorskip("tensorflow")

    def fwd(x):
        return tf.pad(-x, [[0, 0], [0, 0], [3, 1]]) * 2.0 + tf.pad(
            tf.reverse(x, [1]), [[0, 0], [0, 0], [0, 4]], constant_values=0.5)

    def grad(x, g):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.reverse(x[:, :, 2:9], [1]) * g * 3.0)
        return tape.gradient(loss, x)
    f = stitching.function(fwd, input_signature=[tf.TensorSpec([None, 6, 10], tf.float32)])
    f2 = stitching.function(grad, input_signature=[tf.TensorSpec([None, 6, 10], tf.float32),
                                                   tf.TensorSpec([None, 6, 7], tf.float32)])
    for batch in (1, 3):
        x = tf.constant(RNG.standard_normal((batch, 6, 10)).astype(np.float32))
        g = tf.constant(RNG.standard_normal((batch, 6, 7)).astype(np.float32))
        np.testing.assert_array_equal(f(x).numpy(), tf.function(fwd)(x).numpy())
        np.testing.assert_array_equal(f2(x, g).numpy(), tf.function(grad)(x, g).numpy())
    for rep in (f.report, f2.report):
        assert rep.coverage == 1.0, rep.summary()
    assert len(f.report.kernels) == 1
    assert any("StridedSliceGrad" in [op for _, op in k.ops] for k in f2.report.kernels)


def test_the_op_table_names_every_layout_converter():
    pytest.importorskip("tensorflow")
    from stitching.tf import frontend, opnames
    assert set(frontend._LAYOUT) == opnames.LAYOUT_MAPS


def test_transposes_of_the_last_dim_are_strided_loads():
    """A transpose that moves the innermost axis (attention's k^T, a 2-D transpose) or
    a strided slice of it: element-wise kernels load along the stride; bit-exact."""
    cases = []
    b = SpecBuilder()
    x = b.input("float32", [-1, H, T, D])
    cases.append((b, b.Neg(b.Transpose(x, perm=[0, 1, 3, 2])),
                  lambda X: -np.transpose(X, (0, 1, 3, 2)), (2, H, T, D)))
    b = SpecBuilder()
    x = b.input("float32", [48, 64])
    cases.append((b, b.Mul(b.Transpose(x, perm=[1, 0]), b.Transpose(x, perm=[1, 0])),
                  lambda X: X.T * X.T, (48, 64)))
    b = SpecBuilder()
    x = b.input("float32", [-1, T, D])
    cases.append((b, b.Neg(b.Slice(x, begin=[0, 0, 1], size=[-1, T, D // 2],
                                   strides=[1, 1, 2], shape=[-1, T, D // 2])),
                  lambda X: -X[:, :, 1::2], (3, T, D)))
    for b, out, ref, shape in cases:
        spec = b.build([out])
        assert build_schedule(spec).kind == KernelKind.ELEMENTWISE
        X = RNG.standard_normal(shape).astype(np.float32)
        X.flat[5] = np.nan
        (got,) = compile_kernel(spec)(X)
        np.testing.assert_array_equal(got, ref(X))


def test_tf_gather_by_run_time_indices_stays_out_and_by_constant_ones_fuses():
    """A GatherV2 by run-time indices is not folded into kernels (a data-dependent
    load, and TF's CPU kernel fails on an out-of-range index): the report says so; one
    by constant indices is (tests/test_concat_outer.py); the math around both fuses,
    equal to TF, and an out-of-range index fails as in TF."""
    import stitching
    tf = pytest.importorskip("tensorflow")
    emb = tf.constant(RNG.standard_normal((50, D)).astype(np.float32))

    def lookup(ids, x):
        return tf.nn.relu(tf.gather(emb, ids) * 2.0 + x) + tf.gather(x, [2, 0, 1], axis=1)
    sig = [tf.TensorSpec([None, 3], tf.int32), tf.TensorSpec([None, 3, D], tf.float32)]
    f = stitching.function(lookup, input_signature=sig)
    ids = tf.constant([[1, 49, 0], [7, 7, 3]], tf.int32)
    x = tf.constant(RNG.standard_normal((2, 3, D)).astype(np.float32))
    np.testing.assert_array_equal(f(ids, x).numpy(), tf.function(lookup)(ids, x).numpy())
    why = {n.rsplit("/", 1)[-1]: r for n, op, r in f.report.unfused if op == "GatherV2"}
    assert "by run-time indices" in why["GatherV2"], f.report.summary()
    assert "GatherV2_1" not in why and "GatherV2" in {
        op for k in f.report.kernels for _, op in k.ops}, f.report.summary()
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
        f(tf.constant([[1, 50, 0]], tf.int32), x[:1])


@pytest.mark.slow
def test_vit_block_equals_tf_and_names_what_stays_out():
    """A ViT-style classifier from Keras layers (models.vit_encoder: patch conv, class
    token broadcast to the run-time batch, position embeddings, a pre-LN block): equal
    to TF's at two batches with one trace for the unknown batch; what stays TF's is
    named with its reason.  The class token's BroadcastTo to the run-time batch (its
    batch read from the patches' shape, tf/dim_sources.py) and its concatenation along
    the tokens (an outer axis, tests/test_concat_outer.py) are fused."""
    import stitching
    from stitching.testing.models import vit_encoder
    tf = pytest.importorskip("tensorflow")
    import keras
    keras.utils.set_random_seed(5)
    model = vit_encoder(num_layers=1, d_model=32, heads=2, ff=48, image=32, patch=8,
                        classes=10)
    sig = [tf.TensorSpec([None, 32, 32, 3], tf.float32)]
    f = stitching.function(lambda x: model(x, training=False), input_signature=sig)
    ref = tf.function(lambda x: model(x, training=False), input_signature=sig)
    for batch in (1, 3):
        x = tf.constant(RNG.uniform(0, 255, (batch, 32, 32, 3)).astype(np.float32))
        np.testing.assert_allclose(f(x).numpy(), ref(x).numpy(), rtol=2e-5, atol=2e-5)
    rep = f.report
    assert len(f.reports) == 1, "one trace for the unknown batch"
    why = {op: reason for _, op, reason in rep.unfused}
    fused = {op for k in rep.kernels for _, op in k.ops}
    assert {"BroadcastTo", "ConcatV2"} <= fused, rep.summary()
    # the rest: the patch conv's BiasAdd where TF's remapper takes it, or a slice the
    # cost model leaves (the session's machine model decides)
    assert set(why) <= {"BiasAdd", "StridedSlice"}, rep.summary()
    assert rep.coverage >= 0.9, rep.summary()
