"""Packed kernels (schedule/packed.py): independent element-wise chains of different
sizes -- an optimizer's per-variable updates -- run as one kernel over their
concatenated flat index space.  TF-free tests first (schedule, CPU code against the
float64 NumPy interpreter, refusals, tampered specs), then whole Keras training steps
against stock TF (the CUDA test is in test_codegen_cuda.py)."""
import json

import numpy as np
import pytest

from stitching.codegen.cuda.ref import compare, evaluate
from stitching.compile import compile_kernel
from stitching.ir import SpecError
from stitching.ir.builder import SpecBuilder
from stitching.ir.spec import KernelSpec
from stitching.schedule import KernelKind, build_schedule, check

SHAPES = [(32,), (3, 3, 3, 32), (9216,), (40, 100)]


def sgd_spec(shapes=SHAPES, **sched):
    """SGD with momentum as Keras writes it, per variable: m' = m * mom - g * lr and
    v' = v + m'; lr and momentum are one-element values every chain shares."""
    b = SpecBuilder()
    lr = b.input("float32", ())
    mom = b.Cast(b.input("float64", ()), to="float32")
    nlr = b.Neg(lr)
    outs = []
    for s in shapes:
        v, m, g = (b.input("float32", s) for _ in range(3))
        m2 = b.Add(b.Mul(m, mom), b.Mul(g, nlr))
        outs += [m2, b.Add(v, m2)]
    return b.build(outs, **sched)


def sgd_args(shapes=SHAPES, seed=0):
    rng = np.random.default_rng(seed)
    args = [np.array(0.1, np.float32), np.array(0.9, np.float64)]
    for s in shapes:
        args += [rng.standard_normal(s).astype(np.float32) for _ in range(3)]
    return args


def test_schedule_is_packed_with_a_segment_table_and_says_so():
    s = build_schedule(sgd_spec())
    assert s.kind == KernelKind.PACKED
    sizes = [32, 864, 9216, 4000]
    assert s.segments == tuple(zip(np.cumsum([0] + sizes[:-1]).tolist(), sizes))
    assert [len(p.compute) for p in s.passes] == [4] * 4
    assert s.scalars[0].compute == (0, 1)        # Cast(momentum), Neg(lr): once
    assert "packed 4 chains" in s.describe().splitlines()[0]


@pytest.mark.parametrize("col_block", [None, 7, 1000])
def test_cpu_kernel_matches_float64_across_unit_and_segment_boundaries(col_block):
    """Units of 7 elements straddle every segment boundary; 1000 splits the big ones."""
    spec = sgd_spec(**({"col_block": col_block} if col_block else {}))
    args = sgd_args()
    outs = compile_kernel(spec)(*args)
    for i, (o, r) in enumerate(zip(outs, evaluate(spec, args))):
        assert o.shape == r.shape
        assert compare(o, r, rtol=2e-6, atol=1e-7) <= 1, i


def test_chains_that_are_not_flat_element_wise_are_refused_with_the_usual_reason():
    # a bias broadcast into a matrix (4 elements into 12) is not a flat chain
    b = SpecBuilder()
    x, bias, y = b.input("float32", (3, 4)), b.input("float32", (4,)), b.input("float32", (5,))
    spec = b.build([b.Add(x, bias), b.Mul(y, y)])
    assert check(spec) and "packed" not in str(check(spec))    # the ordinary reason
    from stitching.schedule.packed import segments
    assert "mixes 12 elements with 4" in segments(spec)
    # unknown dims (a batch dimension): packed kernels are static, so unchanged
    b = SpecBuilder()
    x, y = b.input("float32", (-1, 4)), b.input("float32", (5,))
    assert check(b.build([b.Exp(x), b.Exp(y)]))
    assert segments(b.build([b.Exp(x), b.Exp(y)])) == "a packed kernel needs static shapes"
    # a reduction in one chain
    b = SpecBuilder()
    x, y = b.input("float32", (3, 4)), b.input("float32", (5,))
    assert check(b.build([b.Sum(x, axes=[1]), b.Exp(y)]))


def test_tampered_packed_spec_is_rejected():
    """The segment table is derived from the validated spec, never read: a spec edited
    to make a segment larger than its buffers, or to carry a table, fails validation;
    a kernel called with a buffer of the wrong size fails its shape check."""
    d = json.loads(sgd_spec().to_json())
    d["inputs"][2]["shape"] = [64]                   # v of chain 0: 64, nodes say 32
    with pytest.raises(SpecError, match="shape"):
        KernelSpec.from_json(json.dumps(d))
    d = json.loads(sgd_spec().to_json())
    d["nodes"][-1]["shape"] = [40, 1000]             # an output claims 10x its chain
    with pytest.raises(SpecError, match="claims shape"):
        KernelSpec.from_json(json.dumps(d))
    d = json.loads(sgd_spec().to_json())
    d["schedule"]["segments"] = [[0, 1 << 30]]
    with pytest.raises(SpecError, match="unknown schedule parameter"):
        KernelSpec.from_json(json.dumps(d))
    k = compile_kernel(KernelSpec.from_json(sgd_spec().to_json()))
    args = sgd_args()
    args[2] = np.zeros(31, np.float32)
    with pytest.raises(ValueError, match="input 2 dim 0 must be 32"):
        k(*args)


# ---- whole training steps against stock TF -----------------------------------------

def _keras_case(opt_name, layers=(16, 12, 4)):
    """A Dense stack with a LayerNorm: kernels [8,16] [16] [16,12] [12] [12,4] [4] and
    gamma/beta [12]: seven variables of five shapes."""
    import keras
    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    h = keras.layers.Dense(layers[0], activation="relu")(inp)
    h = keras.layers.LayerNormalization()(keras.layers.Dense(layers[1])(h))
    out = keras.layers.Dense(layers[2])(h)
    model = keras.Model(inp, out)
    opt = {"adam": lambda: keras.optimizers.Adam(1e-2),
           "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.05),
           "sgd": lambda: keras.optimizers.SGD(0.05, momentum=0.9)}[opt_name]()
    opt.build(model.trainable_variables)
    return model, opt


def _train(opt_name, stitched, steps=20, batch=None):
    import keras
    import tensorflow as tf

    import stitching
    from stitching.testing.train import keras_step
    model, opt = _keras_case(opt_name)
    loss_fn = keras.losses.MeanSquaredError()
    step = keras_step(model, opt, loss_fn)

    sig = [tf.TensorSpec([batch, 8]), tf.TensorSpec([batch, 4])]
    f = (stitching.function(step, input_signature=sig) if stitched
         else tf.function(step, input_signature=sig))
    rng = np.random.default_rng(7)
    losses = []
    for i in range(steps):
        n = 16 + (i % 3 if batch is None else 0)     # unknown batch: sizes vary
        x = tf.constant(rng.standard_normal((n, 8)).astype(np.float32))
        y = tf.constant(rng.standard_normal((n, 4)).astype(np.float32))
        losses.append(float(f(x, y)))
    return np.array(losses), [v.numpy() for v in model.trainable_variables], f, opt


def _optimizer_kernels(report, opt):
    """Kernels holding optimizer ops, and whether any holds only optimizer ops."""
    scope = opt.name + "/"
    return [k for k in report.kernels if any(n.startswith(scope) for n, _ in k.ops)]


# Adam: 2 packs at least (the assigns of m and v split them); the calibrated cost model
# may pack one variable's m/v chain with the other side, 3 packs, which measured the
# same step time as 2 (170-180 µs either way, 2026-11-25).  With
# Options(variable_updates=True) one (tests/test_variables.py)
@pytest.mark.parametrize("opt_name,kernels", [("sgd", {1}), ("adam", {2, 3}),
                                              ("adamw", {2, 3})])
def test_training_matches_tf_and_the_update_is_a_few_packed_kernels(opt_name, kernels):
    """20 steps with an unknown batch dim (sizes 16-18): losses and final weights equal
    stock TF; the optimizer's element-wise updates of the seven variables are exactly
    one of ``kernels`` packed kernels (SGD: the momenta; Adam: m and v, then the variables
    from m and v read back after their assigns; AdamW: its decay packs with the
    second), besides the updates fused vertically into the gradient reductions that
    feed them (bias and LayerNorm gradients: column kernels)."""
    want, w_want, _, _ = _train(opt_name, stitched=False)
    got, w_got, f, opt = _train(opt_name, stitched=True)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for a, b in zip(w_got, w_want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    upd = _optimizer_kernels(f.report, opt)
    packed = [k for k in upd if k.schedule.startswith("packed")]
    assert len(packed) in kernels, f.report.summary()


@pytest.mark.parametrize("depth", [2, 6])
def test_sgd_momentum_update_is_one_packed_kernel_whatever_the_depth(depth, intel_plan):
    """An MLP of ``depth`` hidden Dense layers (6 or 14 variables): every weight's
    momentum update is in one packed kernel, the biases' in their gradient reductions
    (column kernels); no optimizer op is left to TF or in a kernel of its own."""
    import keras
    import tensorflow as tf

    import stitching
    from stitching.testing.train import keras_step
    keras.utils.set_random_seed(1)
    inp = keras.Input((8,))
    h = inp
    for i in range(depth):
        h = keras.layers.Dense(16 + i, activation="relu")(h)
    model = keras.Model(inp, keras.layers.Dense(4)(h))
    opt = keras.optimizers.SGD(0.05, momentum=0.9)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()
    step = keras_step(model, opt, loss_fn)

    f = stitching.function(step)
    f(tf.zeros([16, 8]), tf.zeros([16, 4]))
    upd = _optimizer_kernels(f.report, opt)
    kinds = sorted(k.schedule.split(" kernel")[0] for k in upd)
    assert kinds == ["column"] * (depth + 1) + ["packed"], f.report.summary()
    assert not any(n.startswith(opt.name + "/") for n, _, _ in f.report.unfused)
