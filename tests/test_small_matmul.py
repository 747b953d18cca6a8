"""SmallMatMul: a squeeze-excite block's two 1x1 convolutions on its pooled [N, 1, 1, C]
vector, computed inside the kernel that applies the gate (ir/ops.py, schedule/domain.py
step 4, schedule/contract.py, codegen/cpu/emitter.py).

Held here: numerics against float64 for both ways a kernel runs its products (small ones
in the units' per-group prologue, large ones in a prologue phase), with the batch known
and unknown, NaN and infinities, float64 kernels; the refusals and their reasons (a
product in a reduction kernel, a weight another node reads, CUDA plans); through TF, an
SE block as one kernel equal to TF forward and backward; and EfficientNetB0's kernel
counts under both machine models (issue 37: at most 0.4x XLA's 174 fusions).
"""
import numpy as np
import pytest

from stitching.compile import compile_kernel
from stitching.ir.builder import SpecBuilder
from stitching.schedule import check
from stitching.schedule.schedule import PHASE_MIN_MACS

H = 5


def _se_spec(C, K, batch=-1, dtype="float32", outputs=("excite",)):
    """x * sigmoid(W2 . swish(W1 . m + b1) + b2), m [N,1,1,C], x [N,H,H,C]."""
    b = SpecBuilder()
    x = b.input(dtype, (batch, H, H, C))
    m = b.input(dtype, (batch, 1, 1, C))
    w1, b1 = b.input(dtype, (1, 1, C, K)), b.input(dtype, (K,))
    w2, b2 = b.input(dtype, (1, 1, K, C)), b.input(dtype, (C,))
    h = b.Add(b.SmallMatMul(m, w1), b1)
    h = b.Mul(h, b.Sigmoid(h))
    gate = b.Sigmoid(b.Add(b.SmallMatMul(h, w2), b2))
    outs = {"excite": b.Mul(x, gate), "gate": gate}
    return b.build([outs[o] for o in outputs])


def _data(n, C, K, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H, H, C)).astype(dtype)
    m = rng.standard_normal((n, 1, 1, C)).astype(dtype)
    w1 = (rng.standard_normal((1, 1, C, K)) / np.sqrt(C)).astype(dtype)
    b1 = rng.standard_normal(K).astype(dtype)
    w2 = (rng.standard_normal((1, 1, K, C)) / np.sqrt(K)).astype(dtype)
    b2 = rng.standard_normal(C).astype(dtype)
    return x, m, w1, b1, w2, b2


def _reference(x, m, w1, b1, w2, b2):
    """The block in float64 from the same inputs; each product and each element-wise
    value rounded to the inputs' dtype where the kernel (and TF) rounds it."""
    dt = x.dtype
    n, C, K = x.shape[0], x.shape[-1], b1.shape[0]

    def r(v):
        return v.astype(dt).astype(np.float64)

    d = np.float64
    with np.errstate(over="ignore", invalid="ignore"):
        h = r(r(m.astype(d).reshape(n, C) @ w1.astype(d).reshape(C, K)) + b1)
        h = r(h * r(1.0 / (1.0 + np.exp(-h))))
        z = r(r(h @ w2.astype(d).reshape(K, C)) + b2)
        g = r(1.0 / (1.0 + np.exp(-z)))
    return x.astype(d) * g[:, None, None, :]


def _slack(x, m, w1, b1, w2, b2):
    """First-order bound of what the products' partial sums may add to the output's
    error, per element: each product sums its terms in partial sums of four in the
    inputs' dtype (unit roundoff u), so its absolute error is at most ~4u times the sum
    of its terms' magnitudes, where terms that cancel leave it large against the
    result; the hidden product's error passes through the swish (slope <= 1.1) and the
    second product, the gate's through the sigmoid (slope <= 1/4) into x * gate."""
    u = np.finfo(x.dtype).eps / 2
    n, C, K = x.shape[0], x.shape[-1], b1.shape[0]
    a = np.abs
    m, w1, w2 = (a(v.astype(np.float64)) for v in (m, w1, w2))
    hid = m.reshape(n, C) @ w1.reshape(C, K)                    # |m| . |W1|
    terms_h = a(_hidden(x, m, w1, b1)) @ w2.reshape(K, C)      # |h| . |W2|
    ez = 4 * u * (terms_h + 1.1 * hid @ w2.reshape(K, C))
    return a(x.astype(np.float64)) * 0.25 * ez[:, None, None, :]


def _hidden(x, m, w1, b1):
    n, C, K = x.shape[0], x.shape[-1], b1.shape[0]
    h = m.astype(np.float64).reshape(n, C) @ w1.astype(np.float64).reshape(C, K) + b1
    return h / (1.0 + np.exp(-h))


def _ulps(out, ref, slack=0.0):
    """Max error in ulps of out's dtype against the float64 ``ref``, beyond ``slack``
    (finite elements; NaN and infinities must match exactly)."""
    dt = out.dtype
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    inf = np.isinf(ref)
    assert np.array_equal(out[inf], ref[inf].astype(dt))
    fin = np.isfinite(ref)
    spacing = np.maximum(np.spacing(np.abs(ref[fin]).astype(dt)).astype(np.float64),
                         np.finfo(dt).smallest_subnormal)
    slack = np.broadcast_to(slack, ref.shape)[fin]
    err = np.maximum(np.abs(out[fin].astype(np.float64) - ref[fin]) - slack, 0.0)
    return float(np.max(err / spacing, initial=0.0))


# Beyond the products' partial sums (_slack): the reference rounds each product once
# as the kernel does, and the swish, the sigmoid and the multiply add their own
# roundings (the sigmoid's within 2 ulps, codegen/cpu/fastmath.py): a few ulps.
ULPS = 6


@pytest.mark.parametrize("C,K,phase", [(24, 6, False), (256, 64, True)],
                         ids=["per-group-prologue", "prologue-phase"])
@pytest.mark.parametrize("batch", [-1, 3], ids=["batch-unknown", "batch-3"])
def test_se_gate_with_its_products_matches_float64(C, K, phase, batch):
    spec = _se_spec(C, K, batch)
    k = compile_kernel(spec)
    s = k.schedule
    assert s.kind.value == "elementwise" and s.rank == 3          # [N, H*H, C]
    assert s.prologue_phase() == phase and s.hoist_per_group()
    assert [g.size for g in s.side_groups] == [K]                 # the hidden vector
    for n in ([1, 3, 4] if batch < 0 else [3]):
        args = _data(n, C, K, seed=n)
        assert _ulps(k(*args)[0], _reference(*args), _slack(*args)) <= ULPS


@pytest.mark.parametrize("C,K", [(32, 8), (256, 64)], ids=["small", "phase"])
def test_products_alone_run_once_per_row(C, K):
    """A kernel ending in the product (the squeeze's own swish, over [N, K]) computes
    everything per row; rank 1 (a batch of one) once per call."""
    for batch, per_row in ((-1, True), (1, False)):
        b = SpecBuilder()
        m = b.input("float32", (batch, 1, 1, C))
        w1, b1 = b.input("float32", (1, 1, C, K)), b.input("float32", (K,))
        h = b.Add(b.SmallMatMul(m, w1), b1)
        k = compile_kernel(b.build([b.Mul(h, b.Sigmoid(h))]))
        assert k.schedule.products_per_row() == per_row
        assert k.schedule.prologue_phase() == (C * K >= PHASE_MIN_MACS)
        n = 4 if batch < 0 else 1
        _, M, W1, B1, _, _ = _data(n, C, K)
        z = (M.astype(np.float64).reshape(n, C) @ W1.astype(np.float64).reshape(C, K))
        z = z.astype(np.float32).astype(np.float64) + B1
        ref = (z * (1 / (1 + np.exp(-z)))).reshape(n, 1, 1, K)
        np.testing.assert_allclose(k(M, W1, B1)[0], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("C,K", [(24, 6), (256, 64)])
def test_nan_and_infinities_reach_every_channel_a_product_mixes(C, K):
    """A NaN in one channel of the pooled vector makes that image's whole gate NaN (the
    product mixes every channel); +inf and -inf meeting in a product give NaN, as in
    float64; an infinite x element times a finite gate stays infinite."""
    k = compile_kernel(_se_spec(C, K))
    x, m, w1, b1, w2, b2 = _data(3, C, K, seed=5)
    m[1, 0, 0, 3] = np.nan
    m[2, 0, 0, 0] = np.inf
    x[0, 1, 2, 4] = -np.inf
    y = k(x, m, w1, b1, w2, b2)[0]
    ref = _reference(x, m, w1, b1, w2, b2)
    assert np.isnan(y[1]).all()
    assert np.isneginf(y[0, 1, 2, 4]) or np.isnan(ref[0, 1, 2, 4])
    with np.errstate(invalid="ignore"):
        assert _ulps(y, ref, _slack(x, m, w1, b1, w2, b2)) <= ULPS


def test_float64_kernel():
    k = compile_kernel(_se_spec(40, 10, dtype="float64"))
    args = _data(2, 40, 10, dtype=np.float64, seed=9)
    assert _ulps(k(*args)[0], _reference(*args), _slack(*args)) <= ULPS


def test_refusals_name_the_problem():
    # the pooled mean computed in the same kernel: a column reduction, no prologue
    b = SpecBuilder()
    x = b.input("float32", (-1, H, H, 16))
    w = b.input("float32", (1, 1, 16, 16))
    m = b.Mean(x, axes=[1, 2], keep_dims=True)
    why = check(b.build([b.Mul(x, b.Sigmoid(b.SmallMatMul(m, w)))]))
    # (its channel axis is contracted, so the mean reduces the kernel's innermost axis)
    assert why and "a SmallMatMul in a row kernel: products run once per row group" \
        in why.reason
    # a weight another node reads element by element (static shapes too: the packed
    # kind, tried where the domain refuses, holds no product either)
    for n in (-1, 2):
        b = SpecBuilder()
        v = b.input("float32", (n, 1, 1, 4))
        w = b.input("float32", (1, 1, 4, 4))
        why = check(b.build([b.Add(b.SmallMatMul(v, w), w)]))
        assert why and "weight of a SmallMatMul" in why.reason
    # shapes the op table refuses: a weight that is not a static [K, M] matrix
    b = SpecBuilder()
    v = b.input("float32", (-1, 1, 1, 4))
    with pytest.raises(ValueError, match="SmallMatMul"):
        b.SmallMatMul(v, b.input("float32", (2, 1, 4, 4)))


def test_cuda_plans_keep_products_out():
    from stitching.codegen import cuda
    from stitching.plan import legality, profiles
    from stitching.schedule import build_schedule
    spec = _se_spec(24, 6)
    why = legality.backend_reason(spec, profiles.get("h100"))
    assert why and "SmallMatMul" in why
    assert legality.backend_reason(spec, profiles.get("intel-avx512")) is None
    with pytest.raises(NotImplementedError, match="SmallMatMul"):
        cuda.emit(build_schedule(spec))


@pytest.mark.slow    # ~25 s idle (two cold compiles of a training step), ~100 s at load 8
def test_se_block_forward_and_backward_match_tf():
    """A Keras-style SE block inside a training step (the tape inside the stitched
    function) and under a tape outside it: the 1x1 convolutions join the excite's
    kernel, and the loss and every gradient equal stock TF's."""
    tf = pytest.importorskip("tensorflow")
    import stitching
    rng = np.random.default_rng(0)
    C, K = 48, 12
    w1 = tf.Variable(rng.standard_normal((1, 1, C, K)).astype(np.float32) * 0.2)
    b1 = tf.Variable(rng.standard_normal(K).astype(np.float32))
    w2 = tf.Variable(rng.standard_normal((1, 1, K, C)).astype(np.float32) * 0.2)
    b2 = tf.Variable(rng.standard_normal(C).astype(np.float32))
    params = [w1, b1, w2, b2]

    def block(x):
        m = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
        h = tf.nn.bias_add(tf.nn.conv2d(m, w1, 1, "VALID"), b1)
        h = h * tf.sigmoid(h)
        return x * tf.sigmoid(tf.nn.bias_add(tf.nn.conv2d(h, w2, 1, "VALID"), b2))

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(block(x)))
        return [loss] + tape.gradient(loss, [x] + params)

    sig = [tf.TensorSpec((None, 6, 6, C))]
    x = rng.standard_normal((3, 6, 6, C)).astype(np.float32)
    # the outside tape's backward as TF ops: what it differentiates is TF's gradient of
    # the kernel's original ops either way (stitching it only adds compiles here)
    f_fwd = stitching.function(block, input_signature=sig,
                               options=stitching.Options(stitch_backward=False))
    f_step = stitching.function(step, input_signature=sig)
    want_fwd, want = tf.function(block, input_signature=sig)(x), tf.function(step)(x)
    np.testing.assert_allclose(f_fwd(x).numpy(), want_fwd.numpy(), rtol=2e-6, atol=1e-6)
    for got, ref in zip(f_step(x), want):
        np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=2e-5, atol=1e-5)
    assert any("Conv2D" in [t for _, t in k.ops] for k in f_fwd.report.kernels)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:          # a tape outside: the kernel's gradient,
        tape.watch(xt)                       # through its original ops (TF's here)
        loss = tf.reduce_sum(f_fwd(xt) ** 2)
    got = tape.gradient(loss, [xt] + params)
    for g, ref in zip(got, want[1:]):
        np.testing.assert_allclose(g.numpy(), ref.numpy(), rtol=2e-5, atol=1e-5)


def _plan_regions(graph_def, fetches, resources):
    from stitching import Options
    from stitching.plan import get_planner
    from stitching.tf import passmanager, pipeline
    ctx = passmanager.Context(graph_def, fetches, (), Options(), resources)
    passmanager.run(pipeline.BEFORE_PLANNING, ctx)
    return ctx.ir, get_planner("search")(ctx.ir, legal=pipeline.legal, min_ops=2).regions


@pytest.mark.slow
def test_efficientnet_b0_kernels_under_each_machine_model(machine):
    """Issue 37: EfficientNetB0 (batch unknown, the models suite's trace) plans at most
    0.4x XLA's 174 memory-intensive fusions under both machine models; each of its 16
    squeeze-excite blocks is one kernel holding both 1x1 convolutions."""
    tf = pytest.importorskip("tensorflow")
    from stitching.testing import models
    from stitching.tf import frontend
    case = models.get("efficientnet_b0")
    sig = [tf.TensorSpec((None,) + tuple(case.input_shape), tf.float32)]
    cf = tf.function(case.make_fn(), input_signature=sig).get_concrete_function()
    ir, regions = _plan_regions(cf.graph.as_graph_def(), [t.name for t in cf.outputs],
                                frontend.resource_shapes(cf.graph))
    se = [r for r in regions if any(ir[n].op == "SmallMatMul" for n in r.nodes)]
    assert len(se) == 16
    assert all(sum(ir[n].op == "SmallMatMul" for n in r.nodes) == 2 for r in se)
    assert len(regions) == 67
    assert len(regions) <= 0.4 * 174
