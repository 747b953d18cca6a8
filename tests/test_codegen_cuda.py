"""CUDA backend under the numba-cuda simulator (no GPU, no TensorFlow needed); with
NUMBA_ENABLE_CUDASIM=0 the same tests run on a real GPU.

Every test checks kernel outputs against the float64 NumPy interpreter (cuda_ref.py).
Launch strategies are forced where a test is about one (``k(..., launch=k.plan(...,
threads=, tpr=, variant=, tx=, split=))``); the simulator runs one Python thread per
CUDA thread, so shapes stay small.  The PTX test compiles the same kernels for sm_80
with the real NVVM when libnvvm is installed (no GPU needed), in a subprocess without
the simulator.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
if "numba.cuda" not in sys.modules:       # the flag is read when numba.cuda is imported
    from numba.cuda.core import config as _cfg
    _cfg.ENABLE_CUDASIM = int(os.environ["NUMBA_ENABLE_CUDASIM"])

from stitching.codegen.cuda.rt import SIMULATOR  # noqa: E402

# NUMBA_ENABLE_CUDASIM=0 runs these same tests on a real GPU (tools/gpu_bench.py's machine)
if not SIMULATOR and os.environ["NUMBA_ENABLE_CUDASIM"] != "0":
    # numba.cuda was imported earlier in this process without the simulator
    pytest.skip("numba.cuda already imported without NUMBA_ENABLE_CUDASIM=1",
                allow_module_level=True)

from stitching.codegen.cuda import launch as cuda_launch  # noqa: E402
from stitching.compile.cuda import compile_cuda_kernel  # noqa: E402
from stitching.codegen.cuda.ref import compare, evaluate  # noqa: E402
from stitching.ir.builder import SpecBuilder  # noqa: E402
from stitching.plan import profiles  # noqa: E402

F = "float32"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(spec, arrays, tol=1.0, rtol=2e-5, atol=2e-6, **force):
    """Run the CUDA kernel (optionally with a forced launch); compare with float64."""
    k = compile_cuda_kernel(spec)
    launch = k.plan([np.shape(a) for a in arrays], **force) if force else None
    outs = k(*arrays, launch=launch)
    refs = evaluate(spec, arrays)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape == r.shape, (i, o.shape, r.shape)
        err = compare(o, r, rtol=rtol, atol=atol)
        assert err <= tol, f"output {i}: error {err:.3g} x tolerance\n{o}\n{r}"
    return k, outs


def data(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def softmax_spec(L=-1):
    b = SpecBuilder()
    x = b.input(F, (-1, L))
    m = b.Max(x, axes=[1], keep_dims=True)
    e = b.Exp(b.Sub(x, m))
    y = b.Div(e, b.Sum(e, axes=[1], keep_dims=True))
    return b.build([y, m])          # multi-output: a row vector and a row scalar


def layernorm_spec(L=-1):
    b = SpecBuilder()
    x, g = b.input(F, (-1, L)), b.input(F, (L,))
    m = b.Mean(x, axes=[1], keep_dims=True)
    d = b.Sub(x, m)
    v = b.Mean(b.Square(d), axes=[1], keep_dims=True)
    y = b.Mul(b.Mul(d, b.Rsqrt(b.Add(v, b.const(1e-5)))), g)
    return b.build([y])


# ---- element-wise --------------------------------------------------------------------

def gelu_spec(L=-1):
    b = SpecBuilder()
    x, bias = b.input(F, (-1, L)), b.input(F, (L,))
    h = b.Add(x, bias)
    erf = b.Erf(b.Mul(h, b.const(0.7071067811865476)))
    y = b.Mul(b.Mul(b.const(0.5), h), b.Add(b.const(1.0), erf))
    return b.build([y, b.Relu6(h)])


@pytest.mark.parametrize("rows,L", [(1, 1), (3, 31), (2, 33), (1, 1025), (3, 36)])
def test_elementwise_odd_sizes(rows, L):
    k, _ = check(gelu_spec(), [data(rows, L), data(L, seed=1)])
    wide = k.plan([(rows, L), (L,)]).steps[0][0] == "k_ew_v4"
    assert wide == (L % 4 == 0)        # 16-byte accesses only when every chunk is whole


@pytest.mark.parametrize("rows,L", [(50, 12), (37, 7), (129, 4)])
def test_elementwise_grid_stride_over_rows(rows, L):
    """More chunks than threads in the grid: grid steps that cross one row end or
    several land on the right (row, chunk)."""
    check(gelu_spec(), [data(rows, L), data(L, seed=1)], threads=32)


@pytest.mark.parametrize("rows,L", [(50, 12), (37, 7), (3, 1025)])
def test_elementwise_static_row_length(rows, L):
    """A row length the spec fixes is a constant in the kernel (chunk counts, strides);
    grid steps over many rows still land on the right (row, chunk)."""
    spec = gelu_spec(L)
    assert f"nc = {-(-L // 4)}" in compile_cuda_kernel(spec).text
    for threads in (32, None):
        check(spec, [data(rows, L), data(L, seed=1)], **({"threads": threads} if threads else {}))


@pytest.mark.parametrize("shape", [(50, 12), (50, 7), (3, 1024)])
def test_elementwise_flat_domain_and_gpu_math(shape):
    """No broadcast: the domain is one flat row (no row division in the kernel); swish's
    sigmoid selects its numerator (one division per element), float32 Rsqrt is CUDA's
    rsqrtf: both against float64 at NaN, +-inf, +-0, tiny and huge values."""
    b = SpecBuilder()
    x = b.input(F, (-1, -1))
    spec = b.build([b.Mul(x, b.Sigmoid(x)), b.Rsqrt(b.Abs(x))])
    k = compile_cuda_kernel(spec)
    assert "v // nc" not in k.text
    xs = data(*shape, seed=4) * 30
    special = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 3e38, -3e38]
    xs.flat[:len(special)] = special
    _, (swish, rs) = check(spec, [xs], threads=32)
    assert np.isnan(swish.flat[0]) and np.isnan(rs.flat[0])
    assert swish.flat[1] == np.inf and np.isnan(swish.flat[2]) and rs.flat[3] == np.inf


def test_elementwise_wide_with_narrow_buffers():
    """k_ew_v4 moves the float32 buffers 16 bytes at a time, the bool input 4 bytes at a
    time and the float16 / bool outputs element by element, in the same chunk."""
    b = SpecBuilder()
    x, hx, m = b.input(F, (-1, -1)), b.input("float16", (-1, -1)), b.input("bool", (-1, -1))
    y = b.Select(m, b.Add(x, b.Cast(hx, to=F)), b.const(-1.0))
    spec = b.build([y, b.Cast(y, to="float16"), b.Greater(y, b.const(0.0))])
    k = compile_cuda_kernel(spec)
    assert k.source.wide == ("p_i0", "p_i2", "p_o0")
    rng = np.random.default_rng(5)
    arrays = [data(3, 8), data(3, 8, seed=6).astype(np.float16), rng.random((3, 8)) < 0.7]
    for wide in (True, False):
        check(spec, arrays, rtol=1e-3, atol=1e-3, threads=32, wide=wide)


def test_elementwise_broadcast_inner_and_rank0():
    b = SpecBuilder()
    x, s = b.input(F, (-1, 3, -1)), b.input(F, (3, 1))      # s broadcasts along the last axis
    y = b.Maximum(b.Mul(x, s), b.const(0.0))               # NaN-propagating max
    x_ = data(2, 3, 5)
    x_[0, 1, 2] = np.nan
    _, (o,) = check(b.build([y]), [x_, data(3, 1, seed=2)], threads=32)
    assert np.isnan(o[0, 1, 2])
    b = SpecBuilder()
    p, q = b.input(F, ()), b.input(F, ())
    check(b.build([b.Sub(b.Exp(p), q)]), [np.float32(0.5), np.float32(2.0)])


def test_elementwise_se_gate_per_batch_and_channel():
    """x[N,H,W,C] * sigmoid(z[N,1,1,C] + b): the CPU emitter hoists the gate per group
    of rows (Schedule.hoist_per_group); the CUDA emitter evaluates it per element and
    must agree with float64, NaN in one (batch, channel) included."""
    b = SpecBuilder()
    x, z, c = b.input(F, (-1, 3, 2, 8)), b.input(F, (-1, 1, 1, 8)), b.input(F, (8,))
    spec = b.build([b.Mul(x, b.Sigmoid(b.Add(z, c)))])
    z_ = data(2, 1, 1, 8, seed=3)
    z_[1, 0, 0, 4] = np.nan
    _, (o,) = check(spec, [data(2, 3, 2, 8), z_, data(8, seed=4)], threads=32)
    assert np.isnan(o[1, :, :, 4]).all() and np.isnan(o).sum() == 6


def test_elementwise_dtypes_casts_and_bool():
    b = SpecBuilder()
    x, i = b.input("float16", (-1,)), b.input("int32", (-1,))
    f = b.Cast(x, to="float32")
    y = b.Cast(b.Mul(f, b.Cast(i, to="float32")), to="float16")
    z = b.Cast(b.Round(f), to="int32")                       # half to even, truncation
    c = b.LogicalAnd(b.Greater(f, b.const(0.0)), b.IsFinite(f))
    xs = np.array([0.5, 1.5, 2.5, -0.5, np.inf, np.nan, 3.25, -7.0, 1e4], np.float16)
    check(b.build([y, z, c]), [xs, np.arange(9, dtype=np.int32)], rtol=1e-3, atol=1e-3)


# ---- row -----------------------------------------------------------------------------

@pytest.mark.parametrize("threads,tpr", [(32, 4), (32, 32), (64, 64), (64, 16)])
def test_row_thread_mappings(threads, tpr):
    """several rows per warp (4), one warp per row (32), a row over two warps with the
    shared-memory combine (64), several rows per block (16 x 4)."""
    check(softmax_spec(), [data(5, 37)], threads=threads, tpr=tpr)


@pytest.mark.parametrize("variant", ["regs", "smem", "global"])
def test_row_scratch_placements(variant):
    k, _ = check(softmax_spec(), [data(3, 33)], threads=32, tpr=8, variant=variant)
    assert k.schedule.scratch                       # exp(x - max) is kept across passes


@pytest.mark.parametrize("rows,L", [(1, 1), (2, 31), (3, 33), (1, 1025)])
def test_row_odd_sizes_default_launch(rows, L):
    check(softmax_spec(), [data(rows, L, seed=L)])
    check(layernorm_spec(), [data(rows, L, seed=L + 1), data(L, seed=7)], atol=1e-5)


@pytest.mark.parametrize("variant", [None, "smem", "global"])
@pytest.mark.parametrize("rows,L,tpr", [(3, 4, 1), (5, 36, 4), (2, 132, 8), (2, 1028, 32)])
def test_row_16_byte_passes(variant, rows, L, tpr):
    """k_row*_v4: 4 consecutive elements per thread per step, several 32-element float32
    partials per thread (L=1028 at tpr 4... 32), scratch in shared or global memory."""
    spec = softmax_spec() if variant else layernorm_spec()
    args = [data(rows, L, seed=L)] + ([] if variant else [data(L, seed=1)])
    args[0][0, 1] = np.nan if rows > 1 else args[0][0, 1]
    force = {"tpr": tpr, "threads": max(32, tpr), "chunks": False}
    if variant:
        force["variant"] = variant
    k, _ = check(spec, args, atol=1e-5, **force)
    lau = k.plan([a.shape for a in args], **force)
    assert lau.steps[0][0].endswith("_v4"), lau.steps
    assert "16-byte" in lau.strategy


def masked_softmax_spec():
    """A bool mask along the row (a 1-byte buffer: element-wise loads in the chunked
    kernels) and a row-scalar output."""
    b = SpecBuilder()
    x, keep = b.input(F, (-1, -1)), b.input("bool", (-1, -1))
    z = b.Select(keep, b.Mul(x, b.const(0.125)), b.const(-1e9))
    m = b.Max(z, axes=[1], keep_dims=True)
    e = b.Exp(b.Sub(z, m))
    return b.build([b.Div(e, b.Sum(e, axes=[1], keep_dims=True)), b.Max(x, axes=[1])])


@pytest.mark.parametrize("rows,L,threads,tpr,chunks", [
    (3, 4, 32, 1, 1), (5, 36, 32, 4, 4), (3, 132, 32, 8, 8), (2, 128, 32, 32, 1),
    (2, 1024, 32, 32, 8), (3, 256, 64, 64, 1), (2, 520, 64, 64, 4)])
def test_row_chunks_in_registers(rows, L, threads, tpr, chunks):
    """k_row_r<C>_v4: the row in registers, C chunks of 4 per thread (idle chunks where
    the row is not a multiple of tpr x 4), several rows per block (tpr < threads), a
    row over two warps (tpr 64); scratch (softmax), inputs cached across passes and a
    broadcast weight (layer norm), a bool mask loaded element-wise; NaN in a row."""
    x = data(rows, L, seed=L)
    x[rows - 1, L // 3] = np.nan
    keep = np.random.default_rng(L).random((rows, L)) < 0.8
    force = {"threads": threads, "tpr": tpr, "variant": "chunks"}
    for spec, args in [(softmax_spec(), [x]), (layernorm_spec(), [x, data(L, seed=1)]),
                       (masked_softmax_spec(), [x, keep])]:
        k, _ = check(spec, args, atol=1e-5, **force)
        name = k.plan([a.shape for a in args], **force).steps[0][0]
        assert name == f"k_row_r{chunks}_v4", name


def masked_softmax_static(L):
    b = SpecBuilder()
    x, keep = b.input(F, (-1, L)), b.input("bool", (-1, L))
    z = b.Select(keep, b.Mul(x, b.const(0.125)), b.const(-1e9))
    e = b.Exp(b.Sub(z, b.Max(z, axes=[1], keep_dims=True)))
    return b.build([b.Div(e, b.Sum(e, axes=[1], keep_dims=True)), b.Max(x, axes=[1])])


@pytest.mark.parametrize("rows,L,tpr,chunks", [
    (7, 8, 1, 2), (5, 36, 4, 4), (9, 64, 4, 4), (3, 512, 32, 4), (2, 1024, 64, 4)])
def test_row_static_length_runs_the_twin_with_tpr_in_its_code(rows, L, tpr, chunks):
    """Rows of a length the spec fixes run k_row_r<C>_t<tpr>: threads per row are a
    constant in its code, so lane split, masks and the shuffle / block combine fold.
    Idle chunks (36 = 2.25 chunks of 16), several rows per block, a row over two warps
    (1024); NaN in a row; the misaligned fallback runs the scalar twin."""
    x = data(rows, L, seed=L)
    x[rows - 1, L // 3] = np.nan
    keep = np.random.default_rng(L).random((rows, L)) < 0.8
    keep[rows - 1, L // 3] = True                                 # the NaN is kept
    for spec, args in [(softmax_spec(L), [x]), (layernorm_spec(L), [x, data(L, seed=1)]),
                       (masked_softmax_static(L), [x, keep])]:
        k, outs = check(spec, args, atol=1e-5)
        assert k.plan([a.shape for a in args]).steps[0][0] == f"k_row_r{chunks}_t{tpr}_v4"
        assert np.isnan(outs[0][rows - 1]).all() and not np.isnan(outs[0][0]).any()
    from numba import cuda
    k = compile_cuda_kernel(softmax_spec(L))
    flat = cuda.to_device(data(rows * L + 1, seed=2))             # a view 4 bytes in
    y, m = k(flat[1:].reshape(rows, L))
    ref_y, ref_m = evaluate(softmax_spec(L), [flat.copy_to_host()[1:].reshape(rows, L)])
    assert compare(y.copy_to_host(), ref_y) <= 1 and compare(m.copy_to_host(), ref_m) <= 1


def test_row_chunks_default_and_limits():
    k = compile_cuda_kernel(softmax_spec())
    assert k.plan([(4, 64)]).steps[0][0].startswith("k_row_r")       # the default
    assert "in registers" in k.plan([(4, 64)]).strategy
    assert not k.plan([(4, 66)]).steps[0][0].startswith("k_row_r")   # 66 % 4 != 0
    with pytest.raises(ValueError, match="no k_row_r<C> kernel holds rows of 1028"):
        k.plan([(2, 1028)], threads=32, tpr=32, variant="chunks")
    check(softmax_spec(), [data(2, 1028)], threads=32, tpr=32)        # the looped kernel


def test_row_16_byte_falls_back_for_odd_lengths_and_offsets():
    from numba import cuda
    spec = softmax_spec()
    k = compile_cuda_kernel(spec)
    x = data(3, 30)
    assert not k.plan([x.shape]).steps[0][0].endswith("_v4")     # 30 % 4 != 0
    check(spec, [x])
    flat = cuda.to_device(data(3 * 32 + 1))                      # a view 4 bytes in
    view = flat[1:].reshape(3, 32)
    y, m = k(view)
    ref_y, ref_m = evaluate(spec, [flat.copy_to_host()[1:].reshape(3, 32)])
    assert compare(y.copy_to_host(), ref_y) <= 1 and compare(m.copy_to_host(), ref_m) <= 1


def test_row_nan_propagates():
    x = data(4, 9)
    x[1, 3] = np.nan
    _, (y, m) = check(softmax_spec(), [x], threads=32, tpr=8)
    assert np.isnan(m[1, 0]) and np.isnan(y[1]).all() and not np.isnan(y[[0, 2, 3]]).any()


def test_row_bool_and_int_reductions():
    b = SpecBuilder()
    x, i = b.input(F, (-1, 70)), b.input("int32", (-1, 70))
    xi = b.Mul(x, b.Cast(i, to=F))                          # ties the two inputs' dims
    anyneg = b.Any(b.Less(xi, b.const(0.0)), axes=[1])
    allpos = b.All(b.Greater(i, b.const(0, "int32")), axes=[1])
    s = b.Sum(i, axes=[1], keep_dims=True)
    y = b.Sub(i, b.Max(i, axes=[1], keep_dims=True))
    rng = np.random.default_rng(3)
    ii = rng.integers(-5, 50, size=(6, 70)).astype(np.int32)
    ii[2] = np.abs(ii[2]) + 1
    ii[ii == 0] = 1
    xs = np.sign(ii).astype(np.float32)                      # xi >= 0 ...
    xs[1, 5] *= -1.0                                         # ... but in row 1
    check(b.build([anyneg, allpos, s, y]), [xs, ii], threads=64, tpr=64)


# ---- column --------------------------------------------------------------------------

def center_spec(L=-1):
    b = SpecBuilder()
    x = b.input(F, (-1, L))
    m = b.Mean(x, axes=[0], keep_dims=True)
    d = b.Sub(x, m)
    v = b.Mean(b.Square(d), axes=[0], keep_dims=True)     # a second, dependent reduction
    return b.build([b.Div(d, b.Sqrt(b.Add(v, b.const(1e-3)))), m])


@pytest.mark.parametrize("L", [-1, 9])       # 9: the row length a constant in the code
@pytest.mark.parametrize("split", [1, 3])
def test_column_fused_and_split(split, L):
    k, _ = check(center_spec(L), [data(37, 9)], threads=32, tx=8, split=split, atol=1e-5)
    lau = k.plan([(37, 9)], threads=32, tx=8, split=split)
    assert len(lau.steps) == (1 if split == 1 else 3)      # two passes + the epilogue


def test_column_nhwc_pool_and_odd_sizes():
    b = SpecBuilder()
    x = b.input(F, (-1, -1, -1, -1))
    s = b.Mean(x, axes=[1, 2], keep_dims=True)
    mx = b.Max(x, axes=[1, 2], keep_dims=True)
    spec = b.build([b.Mul(x, b.Sigmoid(s)), mx])
    xs = data(2, 3, 5, 33)
    xs[1, 2, 4, 7] = np.nan
    check(spec, [xs], atol=1e-5)
    check(spec, [data(1, 1, 1, 1)])
    check(spec, [data(2, 4, 5, 3)], threads=64, tx=4, split=2, atol=1e-5)


# ---- packed: chains of different sizes --------------------------------------------------


def test_packed_chains_of_different_sizes():
    """schedule/packed.py: SGD-like updates of four differently shaped variables as one
    k_pk launch over their concatenated flat space (a one-element learning rate shared),
    default launch and a forced 32-thread grid where each thread walks every segment."""
    b = SpecBuilder()
    lr = b.input(F, ())
    shapes = [(5,), (3, 7), (64,), (2, 50)]
    outs = []
    for s in shapes:
        v, g = b.input(F, s), b.input(F, s)
        outs += [b.Sub(v, b.Mul(g, lr)), b.Mul(g, g)]
    spec = b.build(outs)
    arrays = [np.array(0.1, np.float32)] + [data(*s, seed=i) for i, s in
                                            enumerate(s for s in shapes for _ in range(2))]
    k, _ = check(spec, arrays)
    assert k.schedule.kind.value == "packed" and set(k.source.kernels) == {"k_pk"}
    check(spec, arrays, threads=32)


# ---- zero sizes, 16-bit floats --------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_zero_sizes(shape):
    check(gelu_spec(), [data(*shape), data(shape[1], seed=1)])
    check(softmax_spec(), [data(*shape)])            # max of an empty row: -inf
    check(center_spec(), [data(*shape)])             # column mean over no rows: NaN


def test_reshape_unknown_dim_of_size_one():
    """logsumexp at batch 1: Reshape [?,1] -> [?] with the unknown dim 1 at run time."""
    b = SpecBuilder()
    x = b.input(F, (-1, -1))
    m = b.Max(x, axes=[1], keep_dims=True)
    s = b.Sum(b.Exp(b.Sub(x, m)), axes=[1])
    spec = b.build([b.Add(b.Log(s), b.Reshape(m, shape=[-1]))])
    check(spec, [data(1, 6)])
    check(spec, [data(3, 6)])


def test_bfloat16_storage():
    import ml_dtypes
    b = SpecBuilder()
    x = b.input("bfloat16", (-1, -1))
    f = b.Cast(x, to=F)
    m = b.Max(f, axes=[1], keep_dims=True)
    spec = b.build([b.Cast(b.Sub(f, m), to="bfloat16"), m])
    xs = (data(3, 7) * 10).astype(ml_dtypes.bfloat16)
    check(spec, [xs], threads=32, tpr=8)


# ---- API, launch choice, TF-free path ---------------------------------------------

def test_shape_errors_and_one_kernel_for_all_sizes():
    spec = layernorm_spec()
    k = compile_cuda_kernel(spec)
    with pytest.raises(ValueError, match="input 1 dim 0 differs from input 0 dim 1"):
        k(data(2, 5), data(4))
    for shape in [(1, 3), (4, 40)]:
        check(spec, [data(*shape), data(shape[1])], atol=1e-5)
    assert compile_cuda_kernel(spec) is k
    # sizes are arguments, not constants; 16-byte twins for rows of a multiple of 4, and
    # the whole-row-in-registers kernels (C chunks per thread) with theirs
    chunked = {f"k_row_r{c}{v}" for c in cuda_launch.ROW_CHUNKS for v in ("", "_v4")}
    assert set(k.source.kernels) == {"k_row", "k_row_v4"} | chunked
    assert {"D0", "D1", "rows", "tpr"} <= set(k.source.kernels["k_row"])
    for name in chunked | {"k_row_v4"}:
        assert k.source.kernels[name] == k.source.kernels["k_row"]


def test_device_arrays_in_device_arrays_out():
    from numba import cuda
    k = compile_cuda_kernel(softmax_spec())
    x = data(3, 8)
    y, m = k(cuda.to_device(x))
    assert not isinstance(y, np.ndarray)
    ref_y, ref_m = evaluate(k.spec, [x])
    assert compare(y.copy_to_host(), ref_y) <= 1 and compare(m.copy_to_host(), ref_m) <= 1
    outs = [cuda.device_array((3, 8), np.float32), cuda.device_array((3, 1), np.float32)]
    assert k(cuda.to_device(x), out=outs) == outs             # written in place
    assert compare(outs[0].copy_to_host(), ref_y) <= 1
    with pytest.raises(ValueError, match="out\\[1\\] must be C-contiguous of shape"):
        k(x, out=[outs[0], cuda.device_array((3, 2), np.float32)])


def test_launch_from_pinned_profiles():
    """Real-GPU limits (no launch): the evaluator's threads mapped onto the row kernel."""
    k = compile_cuda_kernel(softmax_spec())
    for name in ("v100", "a100", "h100"):
        prof = profiles.get(name)
        for rows, L in [(4096, 8), (4096, 32), (64, 4096)]:
            sizes = cuda_launch.Sizes((rows, L), rows, L)
            lau = cuda_launch.plan(k.source, k.schedule.kind, sizes,
                                   cuda_launch.evaluate(k.spec, [(rows, L)], prof),
                                   prof, cuda_launch.Limits())
            tpr, th = lau.args["tpr"], lau.threads
            assert tpr & (tpr - 1) == 0 and th % tpr == 0 and th % 32 == 0
            assert tpr <= max(L, 1) or tpr == 1
            if L == 8:
                assert tpr <= 8                      # several rows per warp
            assert "latency evaluator" in lau.source
            assert lau.steps[0][2] == th


def _real_plan(k, shapes, prof="h100"):
    sizes, _ = k.sizes(shapes)
    prof = profiles.get(prof)
    return cuda_launch.plan(k.source, k.schedule.kind, sizes,
                            cuda_launch.evaluate(k.spec, shapes, prof), prof,
                            cuda_launch.Limits())


@pytest.mark.parametrize("L,tpr,kernel", [
    (8, 1, "k_row_r2_v4"), (128, 8, "k_row_r4_v4"), (256, 16, "k_row_r4_v4"),
    (1024, 64, "k_row_r4_v4"), (4096, 256, "k_row_r4_v4"), (32768, 1024, "k_row_r8_v4"),
    (1030, 64, "k_row_smem"), (65536, 1024, "k_row_global_v4")])
def test_row_launch_rule_at_gpu_limits(L, tpr, kernel):
    """The rules measured on an H100 (cuda_launch docstring): rows of a multiple of 4 in
    registers, 16 elements per thread, in 128-thread blocks (up to 32 per thread at
    the block limit); other rows at most 32 elements per thread, blocks of 128+,
    scratch kept on chip where it fits."""
    lau = _real_plan(compile_cuda_kernel(softmax_spec()), [(4096, L)])
    assert lau.args["tpr"] == tpr and lau.steps[0][0] == kernel, lau.strategy
    assert lau.threads >= 128 and lau.threads % tpr == 0
    assert "global" not in lau.strategy or L == 65536   # 256 KB rows outgrow 48 KB


def test_column_launch_rule_at_gpu_limits():
    b = SpecBuilder()
    x = b.input(F, (-1, 1024))
    spec = b.build([b.Sub(x, b.Mean(x, axes=[0], keep_dims=True))])
    lau = _real_plan(compile_cuda_kernel(spec), [(8192, 1024)])
    # 256-thread blocks (32 columns x 8 row slices); 32 column tiles split until 4 blocks
    # per SM of the H100 profile's 132
    assert lau.threads == 256 and lau.args["tx_n"] == 32
    assert lau.args["nsplit"] == 4 * profiles.get("h100").units // 32   # within one wave
    assert lau.steps[0][1] <= 4 * profiles.get("h100").units
    assert all(step[2] == 256 for step in lau.steps)


def test_block_too_large_for_the_compiled_kernel_is_replanned(monkeypatch):
    """On a GPU a kernel's register count can forbid the planned block (seen on an H100:
    1024 threads, 68 registers): the kernel is re-planned under its limit, not failed."""
    from stitching.compile import cuda as cuda_mod
    k = compile_cuda_kernel(softmax_spec(L=40))
    x = data(6, 40, seed=3)
    k.plan([x.shape])
    limited = {}

    class Limited:         # the compiled kernel, launching at most 32 threads per block
        def __init__(self, fn):
            self.fn = fn

        def get_max_threads_per_block(self):
            return 32

        def __getitem__(self, cfg):
            limited.setdefault("blocks", []).append(cfg[1])
            assert cfg[1] <= 32, cfg
            return self.fn[cfg]

    real = cuda_mod.CudaKernel._kernel
    monkeypatch.setattr(cuda_mod, "simulated", lambda: False)
    monkeypatch.setattr(cuda_mod.CudaKernel, "_kernel",
                        lambda self, name, args: Limited(real(self, name, args)))
    monkeypatch.setattr(k, "limits", cuda_launch.Limits(max_threads=64, max_blocks=4))
    monkeypatch.setattr(k, "_max_threads", {})
    k._plans.clear()
    big = k.plan([x.shape], threads=64, tpr=32)     # made before the limit is known
    outs = k(x)
    assert limited["blocks"] and max(limited["blocks"]) <= 32
    assert k.limits.max_threads == 32           # later plans keep the kernel's limit
    for out, ref in zip(outs, evaluate(k.spec, [x])):
        assert compare(out, ref) <= 1.0
    with pytest.raises(ValueError, match="does not fit the compiled kernel"):
        k(x, launch=big)                       # a caller's launch is not re-planned


def test_tensorflow_free_path():
    code = textwrap.dedent("""
        import os, sys
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        import numpy as np
        from stitching.ir.builder import SpecBuilder
        from stitching.compile.cuda import compile_cuda_kernel
        b = SpecBuilder()
        x = b.input("float32", (-1, -1))
        y = b.Div(x, b.Sum(b.Exp(x), axes=[1], keep_dims=True))
        (out,) = compile_cuda_kernel(b.build([y]))(np.ones((2, 3), np.float32))
        assert abs(out[0, 0] - 1 / (3 * np.e)) < 1e-6, out
        assert "tensorflow" not in sys.modules, "tensorflow was imported"
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def _have_nvvm() -> bool:
    return any(os.path.exists(os.path.join(d, "libnvvm.so"))
               for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/nvvm/lib64"))


@pytest.mark.slow    # ~20 s of NVVM compiles
@pytest.mark.skipif(not _have_nvvm(), reason="libnvvm not installed")
def test_kernels_compile_to_ptx():
    """The kernels the simulator ran also type-check and compile for a real GPU."""
    # of the register-resident row kernels, the two the default launch uses most (the
    # others differ only in their count of unrolled chunks; tools/gpu_bench.py --ptx
    # compiles them all)
    r = subprocess.run([sys.executable, "tools/gpu_bench.py", "--ptx", "--only",
                        "softmax_tf,center_axis0,bias_gelu_erf,dien_masked_softmax",
                        "--kernels", r"^k_(?!row_r\d)|^k_row_r(4_v4|1|4_t\d+_v4)$"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items()
                            if k != "NUMBA_ENABLE_CUDASIM"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "shfl.sync" in r.stdout and "FAIL" not in r.stdout
