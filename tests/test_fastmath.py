"""Fast float32 math (stitching/codegen/cpu/fastmath.py): error bounds over dense sweeps
against float64, special values, and that a loop calling each helper vectorizes."""
import math
import re

import numba
import numpy as np
import pytest

from stitching.codegen.cpu import fastmath as F
from stitching.codegen.cpu import intrinsics as I

try:
    from scipy import special as _sp
except ImportError:   # the GPU machines may lack scipy: math.* is exact enough
    _sp = None


def _vec(fn):
    return np.vectorize(fn, otypes=[np.float64])


REF = {
    "exp": np.exp, "expm1": np.expm1, "log": np.log, "log1p": np.log1p, "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "erf": _sp.erf if _sp else _vec(math.erf),
    "erfc": _sp.erfc if _sp else _vec(math.erfc),
    "sin": np.sin, "cos": np.cos,       # glibc's: correctly reduced up to FLT_MAX
}

SINCOS_ULP = 0.5 + 2 ** -8   # sin_f32/cos_f32: float64 reduction and polynomials, one rounding

# (function, [(lo, hi) ranges of |x| or x], max ulp) -- the bounds the docstrings state
BOUNDS = {
    "exp": ([(-87.33, 88.72)], 1.1),
    "expm1": ([(-88.0, 88.7)], 2.0),
    "log": ([(1e-45, 3.4e38)], 1.0),
    "log1p": ([(-0.99999994, 3.0e38)], 3.0),
    "tanh": ([(-20.0, 20.0)], 2.5),      # 2.43 over every float32
    "sigmoid": ([(-87.0, 87.0)], 3.0),
    "erf": ([(-6.0, 6.0)], 5.5),
    "erfc": ([(-6.0, 9.2)], 4.4),       # 4.32 near 5
    "sin": ([(-3.4e38, 3.4e38)], SINCOS_ULP),   # whole range, huge |x| included
    "cos": ([(-3.4e38, 3.4e38)], SINCOS_ULP),
}

_runners = {}


def run(name, x):
    """Evaluate fastmath.<name>_f32 over x in one compiled loop."""
    if name not in _runners:
        f = getattr(F, f"{name}_f32")

        @numba.njit(fastmath={"contract"}, error_model="numpy", nogil=True)
        def loop(x, out):
            for i in range(x.size):
                out[i] = f(x[i])
        _runners[name] = loop
    out = np.empty_like(x)
    _runners[name](x, out)
    return out


def sweep(lo, hi, n=600_000):
    """Float32 values spread evenly in *bit pattern* between lo and hi (every binade
    sampled alike), both signs handled by splitting at 0."""
    def pos(a, b):
        ia = np.float32(a).view(np.int32)
        ib = np.float32(b).view(np.int32)
        return np.unique(np.linspace(ia, ib, n).astype(np.int64)).astype(np.int32) \
            .view(np.float32)
    parts = []
    if lo < 0:
        parts.append(-pos(1e-30, -lo) if hi > 0 else -pos(-hi, -lo))
    if hi > 0:
        parts.append(pos(max(lo, 1e-30), hi))
    return np.concatenate(parts)


def ulp_error(y, ref):
    r32 = ref.astype(np.float32)
    spacing = np.maximum(np.spacing(np.abs(r32)).astype(np.float64), 2.0 ** -149)
    return np.abs(y.astype(np.float64) - ref) / spacing


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_error_bound_dense_sweep(name):
    ranges, bound = BOUNDS[name]
    for lo, hi in ranges:
        x = sweep(lo, hi)
        y = run(name, x)
        ref = REF[name](x.astype(np.float64))
        err = ulp_error(y, ref)
        worst = int(np.argmax(err))
        assert err[worst] <= bound, (
            f"{name}({x[worst]!r}) = {y[worst]!r}, float64 {ref[worst]!r}: "
            f"{err[worst]:.2f} ulp > {bound}")


def test_erf_absolute_error():
    x = sweep(-8.0, 8.0)
    assert np.abs(run("erf", x) - REF["erf"](x.astype(np.float64))).max() <= 3.2e-7


SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1e-30, -1e-30],
                    np.float32)


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_special_values(name):
    y = run(name, SPECIALS)
    with np.errstate(all="ignore"):
        ref = REF[name](SPECIALS.astype(np.float64)).astype(np.float32)
    assert np.array_equal(np.isnan(y), np.isnan(ref)), (name, y, ref)
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(y[ok], ref[ok], rtol=3e-7, atol=1e-44, err_msg=name)


def test_exp_overflow_and_underflow_thresholds():
    big = np.array([88.72283, 88.7229, 89.0, 1e30], np.float32)
    y = run("exp", big)
    assert np.isfinite(y[0]) and np.all(np.isinf(y[1:]))
    small = np.array([-87.33, -87.3365, -87.34, -100.0, -104.0, -1e30], np.float32)
    y = run("exp", small)
    ref = np.exp(small[:2].astype(np.float64))
    assert np.all(np.abs(y[:2] - ref) <= 2 * np.spacing(ref.astype(np.float32)))
    assert y[1] > 0                      # just above FLT_MIN: still normal
    assert np.all(y[2:] == 0.0)          # below FLT_MIN: flushed to 0, as TF does
    assert run("expm1", np.array([-20.0, -100.0], np.float32)).tolist() == [-1.0, -1.0]


def test_exp_of_a_nonpositive_argument():
    """exp_nonpos_f32 (softmax's exp(x - max x)) drops exp_f32's steps for large x
    and reduces to |r| <= ln2/2, where a polynomial one degree shorter serves: on
    x <= 0 it is within 1 ulp, gives exp(0) = 1, exp(-inf) = 0 and NaN for NaN, and
    flushes below ln(FLT_MIN) exactly as exp_f32 does."""
    x = -sweep(1e-30, 87.33)
    err = ulp_error(run("exp_nonpos", x), np.exp(x.astype(np.float64)))
    assert err.max() <= 1.0, (x[np.argmax(err)], err.max())
    edge = np.array([0.0, -0.0, -np.inf, np.nan, -87.34, -100.0, -1e30], np.float32)
    y = run("exp_nonpos", edge)
    assert y[:2].tolist() == [1.0, 1.0] and np.isnan(y[3])
    assert np.array_equal(y, run("exp", edge), equal_nan=True)
    near = np.array([-87.33, -87.3365], np.float32)
    assert np.all(ulp_error(run("exp_nonpos", near), np.exp(near.astype(np.float64))) <= 1)


def test_log_domain_edges():
    x = np.array([0.0, -0.0, -1.0, -np.inf, np.inf, 1.0, 1e-45, 1.17549435e-38],
                 np.float32)
    y = run("log", x)
    assert y[0] == -np.inf and y[1] == -np.inf
    assert np.isnan(y[2]) and np.isnan(y[3]) and y[4] == np.inf and y[5] == 0.0
    np.testing.assert_allclose(y[6:], np.log(x[6:].astype(np.float64)), rtol=1e-7)
    z = run("log1p", np.array([-1.0, -2.0, np.inf, 1e-30], np.float32))
    assert z[0] == -np.inf and np.isnan(z[1]) and z[2] == np.inf and z[3] == np.float32(1e-30)


def test_saturating_functions():
    t = run("tanh", np.array([10.0, -10.0, 9.1, -0.0], np.float32))
    assert t[:3].tolist() == [1.0, -1.0, 1.0] and np.signbit(t[3])
    s = run("sigmoid", np.array([100.0, -100.0, -104.0, 0.0], np.float32))
    assert s[0] == 1.0 and s[1] == 0.0 and s[2] == 0.0 and s[3] == 0.5   # TF: 0
    e = run("erfc", np.array([10.0, 11.0, 50.0, -5.0, -50.0], np.float32))
    # erfc(10) = 2e-45 is below FLT_MIN: 0, as TF (whose exp flushes) also returns
    assert e[0] == 0.0 and e[1] == 0.0 and e[2] == 0.0 and e[3] == 2.0 and e[4] == 2.0


def test_tanh_small_odd_and_bounded():
    """tanh(x) = x exactly for tiny x and subnormals (signed zeros kept), exact odd
    symmetry, |tanh| <= 1 everywhere, +-1 past 9.011, nan/inf handled."""
    tiny = np.array([1e-45, 1e-40, 1.1754942e-38, 1e-30, 1e-20, 1e-10, 4.2e-8, 0.0],
                    np.float32)
    for x in (tiny, -tiny):
        y = run("tanh", x)
        assert np.array_equal(y.view(np.int32), x.view(np.int32)), (x, y)
    x = sweep(-20.0, 20.0)
    y = run("tanh", x)
    assert np.array_equal(run("tanh", -x), -y)
    assert np.abs(y).max() == 1.0
    assert np.all(y[np.abs(x) > 9.0110] == np.sign(x[np.abs(x) > 9.0110]))
    z = run("tanh", np.array([np.inf, -np.inf, np.nan, -np.nan, 3e38, -3e38], np.float32))
    assert z[0] == 1.0 and z[1] == -1.0 and np.isnan(z[2]) and np.isnan(z[3])
    assert z[4] == 1.0 and z[5] == -1.0


@numba.njit(fastmath={"contract"}, error_model="numpy")
def _softplus(x, thr, out):
    for i in range(x.size):
        out[i] = F.softplus_f32(x[i], thr)


def test_softplus_uses_tf_thresholds():
    thr = np.float32(math.log(2.0 ** -23) + 2.0)          # float32: about -13.94
    x = np.array([-100, -20, -14, -13, 0, 10, 13.9, 14, 20, np.nan, np.inf, -np.inf],
                 np.float32)
    out = np.empty_like(x)
    _softplus(x, thr, out)
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        ref = np.where(x64 > -thr, x64, np.where(x64 < thr, np.exp(x64), np.log1p(np.exp(x64))))
    np.testing.assert_allclose(out, ref, rtol=3e-7, atol=1.2e-38)   # exp flushes < FLT_MIN
    assert out[7] == 14.0 and np.isnan(out[9]) and out[10] == np.inf and out[11] == 0.0


@pytest.mark.parametrize("name", ["exp", "tanh", "erf", "log", "sigmoid", "sin", "cos"])
def test_loops_vectorize(name):
    """A loop over the helper compiles to 8-lane float vectors (AVX2) or at least
    4-lane ones: the whole point of these helpers."""
    run(name, np.ones(16, np.float32))
    llvm = _runners[name].inspect_llvm(_runners[name].signatures[0])
    assert "<8 x float>" in llvm or "<4 x float>" in llvm


@pytest.mark.parametrize("name", ["sin", "cos"])
def test_sin_cos_loops_vectorize_in_machine_code(name):
    """sin_f32/cos_f32 (big helpers over three small ones) are inlined whole into the
    loop, which runs packed float64 FMAs on ymm/zmm registers: no call is left (the
    former Sin lowering called libm's scalar sin per element)."""
    run(name, np.ones(16, np.float32))
    loop = _runners[name]
    asm = loop.inspect_asm(loop.signatures[0])
    packed = re.findall(r"\bvfmadd\w*pd\s+[^\n]*%[yz]mm", asm)
    assert len(packed) >= 8, asm
    assert not re.search(r"\bcall\w*\s+[^\n]*(sin|cos|trig|_sincos)", asm, re.I)


def test_two_over_pi_digits():
    """The 288 bits of 2/pi the reduction's pieces come from, against pi from Machin's
    formula (pi/4 = 4 atan(1/5) - atan(1/239)) in integer arithmetic."""
    def atan_inv(n, one):
        s, t, k, sign = 0, one // n, 1, 1
        while t:
            s, t, k, sign = s + sign * (t // k), t // (n * n), k + 2, -sign
        return s
    bits = 4 * len(F._TWO_OVER_PI_HEX) + 32
    one = 1 << bits
    pi = 4 * (4 * atan_inv(5, one) - atan_inv(239, one))      # pi 2^bits, error < 2^-20
    two_over_pi = (2 * one * one) // pi                     # 2/pi 2^bits
    assert two_over_pi >> 32 == int(F._TWO_OVER_PI_HEX, 16)
    digits, total = int(F._TWO_OVER_PI_HEX, 16), 4 * len(F._TWO_OVER_PI_HEX)
    bands = [(F._TP00, F._TP01, F._TP02, F._TP03, F._TP04),
             (F._TP10, F._TP11, F._TP12, F._TP13, F._TP14)]
    for b, pieces in zip(F._TRIG_DROP, bands):
        # each band's pieces are the 145 bits after the first b, 29 to a piece (exact)
        got = sum(int(p * 2.0 ** (b + 145)) for p in pieces)
        assert got == (digits >> (total - b - 145)) & ((1 << 145) - 1)
        assert all(math.frexp(p)[0] * 2 ** 29 % 1 == 0 for p in pieces)


# float32 arguments nearest to a multiple of pi/2 (|x 2/pi - n| smallest over all of
# float32, from 2^-1 to FLT_MAX, one per binade, the deepest first): the reduced argument
# cancels ~30 bits there.  Found by an exhaustive search in 2.62 fixed point (x 2/pi mod 4
# from 96-bit windows of 2/pi, as Eigen's trig_reduce_huge computes it).
HARD_TRIG = np.array([
    0x6f79be45, 0x50a3e87f, 0x6ff9be45, 0x5123e87f, 0x437ce5f1, 0x7079be45, 0x6a1976f1,
    0x53b146a6, 0x65898498, 0x51a3e87f, 0x43fce5f1, 0x77584625, 0x4c2332e9, 0x4096cbe4,
    0x6c55da58, 0x70f9be45, 0x6a9976f1, 0x5c07bcd0, 0x543146a6, 0x66098498, 0x5223e87f,
    0x474d246f, 0x723fa09a, 0x447ce5f1], np.uint32).view(np.float32)   # 7.73e28 first:
#   16367173 * 2^72, |x 2/pi - n| = 2^-29.86, the smallest of all


@pytest.mark.parametrize("name", ["sin", "cos"])
def test_sin_cos_nearest_multiples_of_half_pi(name):
    x = np.concatenate([HARD_TRIG, -HARD_TRIG])
    err = ulp_error(run(name, x), REF[name](x.astype(np.float64)))
    assert err.max() <= SINCOS_ULP, (x[np.argmax(err)], err.max())


def test_sin_cos_special_values_and_symmetry():
    """sin(x) = x for |x| < 2^-12 (bit for bit: subnormals, -0.0), sin is odd and cos even
    bit for bit, cos(0) = 1, +-inf and NaN give NaN, FLT_MAX is reduced exactly."""
    tiny = np.array([0.0, 1e-45, 1e-40, 1.1754942e-38, 1.17549435e-38, 1e-30, 1e-10,
                     2.0 ** -13, np.nextafter(np.float32(2 ** -12), np.float32(0))],
                    np.float32)
    for x in (tiny, -tiny):
        assert np.array_equal(run("sin", x).view(np.int32), x.view(np.int32)), x
        assert np.all(run("cos", x) == 1.0)
    x = sweep(-3.4e38, 3.4e38, 100_000)
    assert np.array_equal(run("sin", -x), -run("sin", x))
    assert np.array_equal(run("cos", -x), run("cos", x))
    bad = np.array([np.inf, -np.inf, np.nan, -np.nan], np.float32)
    assert np.isnan(run("sin", bad)).all() and np.isnan(run("cos", bad)).all()
    band = np.float32(F._TRIG_BAND1)        # the reduction's second band starts there
    big = np.array([3.4028235e38, -3.4028235e38, 2.0 ** 127, 1e38, 2.0 ** 52, band,
                    np.nextafter(band, np.float32(0)), np.nextafter(band, np.float32(np.inf))],
                   np.float32)
    for name in ("sin", "cos"):
        err = ulp_error(run(name, big), REF[name](big.astype(np.float64)))
        assert err.max() <= SINCOS_ULP, (name, err)


def test_f16_and_bf16_roundtrips_are_exact():
    @numba.njit
    def dec16(h, out):
        for i in range(h.size):
            out[i] = I.f16_to_f32(h[i])

    @numba.njit
    def enc(x, o16, ob):
        for i in range(x.size):
            o16[i] = I.f32_to_f16(x[i])
            ob[i] = I.f32_to_bf16(x[i])

    h = np.arange(65536, dtype=np.uint16)
    out = np.empty(65536, np.float32)
    dec16(h, out)
    ref = h.view(np.float16).astype(np.float32)
    same = (out.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(out) & np.isnan(ref))
    assert same.all()
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
        np.array([65504, 65520, 65519.996, 2.98e-8, 6e-8, -0.0, np.inf, -np.inf], np.float32)])
    o16 = np.empty(x.size, np.uint16)
    ob = np.empty(x.size, np.uint16)
    enc(x, o16, ob)
    fin = ~np.isnan(x)
    with np.errstate(over="ignore"):
        assert np.array_equal(o16[fin], x[fin].astype(np.float16).view(np.uint16))
    assert np.isnan(o16[~fin].view(np.float16)).all()
    bf = ((x.view(np.uint32).astype(np.uint64) + 0x7FFF +
           ((x.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)   # RNE by hand
    assert np.array_equal(ob[fin], bf[fin])
    assert (ob[~fin] & 0x7FC0 == 0x7FC0).all()


def test_float_to_int_follows_tf_on_x86():
    @numba.njit
    def conv(x, o32, o64):
        for i in range(x.size):
            o32[i] = I.f2i32(x[i])
            o64[i] = I.f2i64(x[i])

    x = np.array([np.nan, np.inf, -np.inf, 3e9, -3e9, -1.7, 1.7, -2147483648.0, 3e19],
                 np.float32)
    o32 = np.empty(x.size, np.int32)
    o64 = np.empty(x.size, np.int64)
    conv(x, o32, o64)
    m32, m64 = -2 ** 31, -2 ** 63
    assert o32.tolist() == [m32, m32, m32, m32, m32, -1, 1, m32, m32]
    assert o64.tolist() == [m64, m64, m64, 3000000000, -3000000000, -1, 1, -2 ** 31, m64]
