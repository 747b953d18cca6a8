"""The direct LLVM backend (codegen/cpu/llvm.py, compile/direct.py) against the Numba
backend, float64 and stock TF: element-wise kernels with broadcast inputs, row kernels
of several passes (LayerNorm, softmax), NaN/Inf, unknown batch dims, and the per-kernel
fallback to Numba with its reason.  (The rest of the CPU suite runs on the default
backend, which is this one.)"""
import math

import numpy as np
import pytest

from stitching.codegen.cpu import llvm
from stitching.compile import compile_kernel, direct, kernel
from stitching.ir.builder import SpecBuilder
from stitching.schedule import KernelKind

RNG = np.random.default_rng(39)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Kernels built here, not loaded from the session's cache."""
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    kernel.clear_memory_cache()
    yield
    kernel.clear_memory_cache()


def both(spec, monkeypatch):
    """The spec's kernel built by each backend: {backend: CompiledKernel}."""
    out = {}
    for b in ("numba", "llvm"):
        monkeypatch.setenv("STITCHING_CPU_BACKEND", b)
        kernel.clear_memory_cache()
        out[b] = compile_kernel(spec)
        assert out[b].backend == b and out[b].backend_note is None, out[b].backend_note
    kernel.clear_memory_cache()
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.array_equal(a.view(np.uint8), b.view(np.uint8))


def layernorm_softmax_specs():
    b = SpecBuilder()
    x = b.input("float32", (-1, -1))
    g = b.input("float32", (-1,))
    m = b.Mean(x, axes=[1], keep_dims=True)
    c = b.Sub(x, m)
    v = b.Mean(b.Square(c), axes=[1], keep_dims=True)
    ln = b.build([b.Add(b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-5)))), g)])
    b = SpecBuilder()
    x = b.input("float32", (-1, -1, -1))
    e = b.Exp(b.Sub(x, b.Max(x, axes=[2], keep_dims=True)))
    sm = b.build([b.Div(e, b.Sum(e, axes=[2], keep_dims=True))])
    return ln, sm


def test_backend_is_chosen_by_env_and_checked(monkeypatch):
    monkeypatch.delenv("STITCHING_CPU_BACKEND", raising=False)
    assert direct.backend() == "llvm"
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "numba")
    assert direct.backend() == "numba"
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "gcc")
    with pytest.raises(ValueError, match="STITCHING_CPU_BACKEND must be one of llvm, numba"):
        direct.backend()


def test_elementwise_broadcasts_match_numba_bit_for_bit_and_float64(monkeypatch):
    """bias + GELU(erf) * tanh over [?, 37] (a row vector broadcast), and a scalar
    input: both backends' outputs are the same bits, NaN and Inf included."""
    b = SpecBuilder()
    x = b.input("float32", (-1, 37))
    bias = b.input("float32", (37,))
    s = b.input("float32", ())
    y = b.Add(x, bias)
    out = b.Mul(b.Mul(b.Erf(y), b.Tanh(y)), s)
    ks = both(b.build([out, b.Maximum(y, b.const(0.0))]), monkeypatch)
    assert ks["llvm"].schedule.kind == KernelKind.ELEMENTWISE
    for n in (0, 1, 5, 300):
        X = (RNG.standard_normal((n, 37)) * 3).astype(np.float32)
        if n:
            X[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
        B = RNG.standard_normal(37).astype(np.float32)
        S = np.float32(1.5)
        got, ref = ks["llvm"](X, B, S), ks["numba"](X, B, S)
        assert all(same_bits(g, r) for g, r in zip(got, ref)), n
        y64 = X.astype(np.float64) + B
        e = np.vectorize(math.erf, otypes=[np.float64])(np.nan_to_num(y64)) if n else y64
        e = np.where(np.isfinite(y64), e, np.sign(y64))          # NaN stays NaN
        want = e * np.tanh(y64) * 1.5
        np.testing.assert_allclose(got[0], want, rtol=2e-6, atol=1e-6)
        if n:
            assert np.isnan(got[0][0, 0]) and np.isnan(got[1][0, 0])   # NaN propagates
            assert got[1][0, 1] == np.inf


def test_row_kernels_of_several_passes_match_numba_and_float64(monkeypatch):
    ln, sm = layernorm_softmax_specs()
    kl, ks = both(ln, monkeypatch), both(sm, monkeypatch)
    for n, d in [(3, 7), (4, 1024), (2, 3000), (0, 5)]:
        X = (RNG.standard_normal((n, d)) * 4 + 1).astype(np.float32)
        G = RNG.standard_normal(d).astype(np.float32)
        (y,), (r,) = kl["llvm"](X, G), kl["numba"](X, G)
        assert same_bits(y, r), (n, d)
        x64 = X.astype(np.float64)
        c = x64 - x64.mean(1, keepdims=True)
        want = c / np.sqrt((c * c).mean(1, keepdims=True) + 1e-5) + G
        np.testing.assert_allclose(y, want, rtol=5e-6, atol=3e-6)
    for shape in [(2, 3, 100), (1, 2, 700), (3, 0, 9)]:
        X = (RNG.standard_normal(shape) * 5).astype(np.float32)
        (y,), (r,) = ks["llvm"](X), ks["numba"](X)
        assert same_bits(y, r), shape
        e = np.exp(X - X.max(-1, keepdims=True, initial=-np.inf))
        np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=4e-6, atol=2e-7)
    X = np.zeros((1, 2, 100), np.float32)
    X[0, 0, 7], X[0, 1, 9] = np.nan, np.inf
    (y,) = ks["llvm"](X)
    assert np.isnan(y[0, 0]).all() and np.isnan(y[0, 1, 9])        # as TF


def test_a_kernel_the_backend_cannot_translate_is_built_by_numba_with_the_reason(
        monkeypatch):
    def refuse(*a, **k):
        raise llvm.Unsupported("call of math.frobnicate")
    monkeypatch.setattr(llvm, "translate", refuse)
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "llvm")
    kernel.clear_memory_cache()
    ln, _ = layernorm_softmax_specs()
    k = compile_kernel(ln)
    kernel.clear_memory_cache()
    assert k.backend == "numba"
    assert k.backend_note == ("built by Numba: the direct backend does not handle call of "
                              "math.frobnicate")
    X = RNG.standard_normal((2, 8)).astype(np.float32)
    assert np.isfinite(k(X, np.ones(8, np.float32))[0]).all()


def test_a_direct_backend_bug_costs_a_warning_not_the_kernel(monkeypatch):
    def broken(*a, **k):
        raise KeyError("oops")
    monkeypatch.setattr(llvm, "translate", broken)
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "llvm")
    _, sm = layernorm_softmax_specs()
    with pytest.warns(RuntimeWarning, match="direct backend failed .KeyError: 'oops'.; "
                                            "please report it"):
        k = compile_kernel(sm)
    assert k.backend == "numba" and "KeyError" in k.backend_note
    X = RNG.standard_normal((1, 2, 5)).astype(np.float32)
    np.testing.assert_allclose(k(X)[0].sum(-1), 1.0, rtol=1e-6)


# A loop whose addressing LSR rewrites (a strided and a unit-stride access).
_STRIDED_LOOP = """
define void @f(ptr %a, ptr %c, i64 %n, i64 %s) {
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%i1, %loop]
  %k = mul i64 %i, %s
  %pa = getelementptr float, ptr %a, i64 %k
  %pc = getelementptr float, ptr %c, i64 %i
  %x = load float, ptr %pa
  %z = fadd float %x, %x
  store float %z, ptr %pc
  %i1 = add i64 %i, 1
  %cc = icmp slt i64 %i1, %n
  br i1 %cc, label %loop, label %exit
exit:
  ret void
}
"""


def test_code_without_loop_strength_reduction_leaves_the_option_as_it_was(monkeypatch):
    """native.py switches LSR off for one emission (an LLVM option, global to the
    process): the loop's code differs without it and is the same again after it; a
    direct kernel's kept IR says so, and its assembly is regenerated that way."""
    import llvmlite.binding as ll

    from stitching.compile import native
    ll.initialize_native_target()
    ll.initialize_native_asmprinter()
    target = (ll.get_process_triple(), *native._host_cpu())

    def asm(lsr):
        return native._emit(ll.parse_assembly(_STRIDED_LOOP), target, lsr, "assembly")
    before = asm(True)
    assert asm(False) != before
    assert asm(True) == before
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "llvm")
    b = SpecBuilder()
    x = b.input("float32", (-1, 16))
    k = compile_kernel(b.build([b.Mul(x, x)]))
    assert k.backend == "llvm"
    assert k.inspect_llvm().startswith(native._LSR_MARK)
    assert "ymm" in k.inspect_asm() and asm(True) == before


def test_translator_names_what_it_does_not_handle():
    class NoCalls:
        def type_call(self, name, argtypes):
            raise llvm.Unsupported(f"h.{name}")
    from numba.core import registry
    ctx = registry.cpu_target.target_context
    head = "import numpy as np\n\ndef body(begin, end, ins, outs, dims):\n"
    cases = {"    x = [1]\n": "expression List",
             "    x = dims[0]\n    y = x ** 2\n": "operator Pow",
             "    for i in range(0, 9, dims[0]):\n        pass\n": "range step",
             "    x = np.float32(1.0) // np.float32(2.0)\n": "// or % of floats",
             "    h.exp_f32(1.0)\n": "h.exp_f32",
             "    x = dims[0] > 0 and dims[dims[0]] > 0\n": "a load inside and/or"}
    for src, what in cases.items():
        with pytest.raises(llvm.Unsupported, match=what):
            llvm.translate(head + src, NoCalls(), "f", ctx)
    with pytest.raises(llvm.Unsupported, match="module constant"):
        llvm.translate("_K0 = float(1)\n" + head + "    pass\n", NoCalls(), "f", ctx)


def test_stitched_function_matches_tf_with_unknown_batch(monkeypatch):
    """Through the TF op: LayerNorm + GELU with an unknown batch dim, direct backend."""
    tf = pytest.importorskip("tensorflow")
    import stitching
    monkeypatch.setenv("STITCHING_CPU_BACKEND", "llvm")
    kernel.clear_memory_cache()
    g = tf.constant(RNG.standard_normal(48).astype(np.float32))

    def f(x):
        m = tf.reduce_mean(x, -1, keepdims=True)
        v = tf.reduce_mean(tf.square(x - m), -1, keepdims=True)
        return tf.nn.gelu((x - m) * tf.math.rsqrt(v + 1e-5) * g, approximate=False)
    sig = [tf.TensorSpec([None, 48], tf.float32)]
    ref, st = tf.function(f, input_signature=sig), stitching.function(f, input_signature=sig)
    for n in (1, 7, 33):
        x = tf.constant((RNG.standard_normal((n, 48)) * 2).astype(np.float32))
        np.testing.assert_allclose(st(x).numpy(), ref(x).numpy(), rtol=1e-5, atol=2e-6)
    built = list(kernel._kernels.values())
    assert built and all(k.backend in ("llvm", None) for k in built)   # None: from disk
