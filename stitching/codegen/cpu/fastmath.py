"""Branch-free, vectorizable float32 math for generated CPU kernels.

Numba's ``math.exp``/``math.tanh``/``math.erf`` on float32 become scalar libm calls
(no SVML here), so a loop that calls them never vectorizes: a GELU over 4M floats
took 70 ms that way against 4.3 ms under XLA.  These helpers are written the way
Cephes, Eigen and XLA write theirs: range reduction + polynomial, with every branch
turned into a select, so LLVM vectorizes the caller's loop (8 lanes with AVX2).

Conventions
* Inputs and outputs are float32; every constant is a typed float32 global.
* NaN in -> NaN out; +-Inf, overflow and underflow follow the C library (checked
  in tests/test_fastmath.py).  Selects use comparisons that are false for NaN so a
  NaN flows through to the result instead of being clamped away.
* Every FMA is an explicit ``fma`` intrinsic (kernels and helpers compile with no
  fast-math flags, so no multiply-add is contracted implicitly).
* Error bounds below are measured against float64 over a dense sweep of all float32
  exponents in the stated range (tests/test_fastmath.py asserts them), in ulps of
  the float32 result.

Polynomial coefficients: expm1 uses Taylor coefficients (degree 7 on
|r| <= ln2/2, truncation < 0.1 ulp); log uses the atanh series in s = f/(2+f);
exp, erf (rational), erfcx and tanh's expm1(2u) are our own minimax fits (Lawson's
iteratively reweighted least squares / Sanathanan-Koerner against scipy/numpy in
float64; stitching/codegen/cpu/fastmath_fit.py regenerates them).  sin and cos reduce
in float64, exactly for every float32 (see "sin, cos" below), and evaluate float64
minimax polynomials (Lawson's method as well).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from . import intrinsics as I

# Compiled once per process as ordinary Numba functions; LLVM's inliner then inlines
# them into the kernel loop, which vectorizes with them.  This is measured 20x
# cheaper to compile than Numba-IR inlining (inline="always": a kernel with 60 tanh
# calls took 36 s, now 1.7 s) with the same machine code.  Their compiled code is
# kept on disk by helper_cache.py, in a directory named by the toolchain tag (which
# hashes this file and intrinsics.py), so a new process loads each in ~2 ms instead
# of compiling it (0.05-0.2 s each).  Fast-math: none, not even ``contract`` (the
# FMAs these need are explicit ``I.fma``): a helper's rounding never depends on where
# it is inlined (see cpu/rt.py's FASTMATH).
_helper = njit(nogil=True, error_model="numpy", fastmath=False)
HELPERS = []        # every ``helper`` (here and in cpu/rt.py): what helper_cache.py caches


def helper(fn):
    d = _helper(fn)
    HELPERS.append(d)
    return d


# Helpers built from several others exceed LLVM's inline budget and would stay a
# call (no vectorization): those are inlined at Numba-IR level instead; the calls
# inside them are small helpers that LLVM then inlines.
_big_helper = njit(inline="always", nogil=True, error_model="numpy", fastmath=False)
BIG_HELPERS = []    # every ``big_helper``: helper_cache.prebuild types these too, so the
                    # helpers they call (erfc_f32's _erfc_pos) are in the installed cache


def big_helper(fn):
    d = _big_helper(fn)
    BIG_HELPERS.append(d)
    return d

f32 = np.float32
_ZERO, _HALF, _ONE, _TWO = f32(0.0), f32(0.5), f32(1.0), f32(2.0)
_INF = f32(np.inf)
_NAN = f32(np.nan)

# exp: x = n ln2 + r, |r| <= ln2/2; ln2 split so n * LN2_HI is exact for |n| < 2^15
_LOG2E = f32(1.4426950408889634)
_LN2_HI = f32(0.693359375)
_LN2_LO = f32(-2.12194440054690583e-4)
_EXP_HI = f32(89.0)     # above: overflow to inf (2^128 * 1.3 > FLT_MAX)
_EXP_LO = f32(-104.0)   # below: underflow to 0 (< half the smallest subnormal)
_E2, _E3, _E4 = f32(1 / 2), f32(1 / 6), f32(1 / 24)
_E5, _E6, _E7 = f32(1 / 120), f32(1 / 720), f32(1 / 5040)


@helper
def _expm1_reduced(x):
    """(n, q) with x = n ln2 + r and q = expm1(r); x finite, |x| <= 104."""
    K = I.opaque
    n_f = I.roundeven(x * K(_LOG2E))
    r = I.fma(n_f, K(-_LN2_HI), x)
    r = I.fma(n_f, K(-_LN2_LO), r)
    p = I.fma(I.fma(I.fma(I.fma(I.fma(K(_E7), r, K(_E6)), r, K(_E5)), r, K(_E4)), r,
                    K(_E3)), r, K(_E2))
    q = I.fma(p, r * r, r)
    return n_f, q


_EXP_MAX = f32(88.72283935546875)      # ln(FLT_MAX): above, +inf
_EXP_MIN = f32(-87.33654022216797)     # ln(FLT_MIN): below, 0 (TF's Eigen exp flushes)
# fma(x, 1/ln2, _EXP_SHIFT) rounds x/ln2 to an integer n (half to even; |x/ln2| < 2^22)
# and holds n + 127 in its low mantissa bits; capped at _EXP_SHIFT_MAX (n = 127)
_EXP_SHIFT = f32(1.5 * 2 ** 23 + 127)
_EXP_SHIFT_MAX = f32(1.5 * 2 ** 23 + 254)
# exp(r) = 1 + r + r^2 P(r) on [-ln2/2, ln2], minimax in relative error with float32
# coefficients (fastmath_fit.fit_exp_poly; 1.6e-9 before rounding)
_XP = (f32(0.49999994), f32(0.16666697), f32(0.041668184), f32(0.008326931),
       f32(0.0013833477), f32(0.0002328099))
_XP0, _XP1, _XP2, _XP3, _XP4, _XP5 = _XP
# the same on |r| <= ln2/2 only (n uncapped: exp_nonpos_f32), one degree less
# (fit_exp_poly(4, symmetric=True); 3.1e-9 before rounding)
_XS = (f32(0.49999994), f32(0.16666521), f32(0.041668274), f32(0.008368684),
       f32(0.0013820089))
_XS0, _XS1, _XS2, _XS3, _XS4 = _XS


@helper
def _exp_reduced(x, sh):
    """(r, 2^n) with r = x - n ln2, where ``sh`` holds n + 127 in its low mantissa
    bits (sh = fma(x, 1/ln2, _EXP_SHIFT), capped by the caller if needed)."""
    K = I.opaque           # constants stay loop-invariant values (see I.opaque)
    n = sh - K(_EXP_SHIFT)
    r = I.fma(n, K(-_LN2_HI), x)
    r = I.fma(n, K(-_LN2_LO), r)
    return r, I.bits_f32(np.int32(I.f32_bits(sh) << 23))   # n + 127 into the exponent


@helper
def _exp_shifted(x, sh):
    """2^n (1 + expm1(r)) for r in [-ln2/2, ln2] (see _exp_reduced)."""
    K = I.opaque
    r, s = _exp_reduced(x, sh)
    r2 = r * r
    p = I.fma(I.fma(I.fma(K(_XP5), r, K(_XP4)), r2, I.fma(K(_XP3), r, K(_XP2))), r2,
              I.fma(K(_XP1), r, K(_XP0)))
    return I.fma(I.fma(p, r2, r), s, s)


@helper
def exp_f32(x):
    """exp(x).  <= 1.1 ulp (1.02 measured); +inf above 88.7228, 0 below -87.3365
    (results under FLT_MIN flush to zero, as TF's float exp does); exp(nan) = nan.

    One exponent step: n = min(round(x / ln2), 127) keeps 2**n a normal float, so
    r = x - n ln2 lies in [-ln2/2, ln2] (the upper half only for x > 88.37); a
    degree-7 minimax polynomial covers that.  Written for the few instructions and
    the short dependency chain that bound a vectorized loop of it (the out-of-order
    window holds a few iterations): x is not clamped first (out-of-range lanes
    compute garbage that the two final selects replace; NaN flows through), one fma
    with a shifter constant rounds x / ln2 and leaves n + 127 in the low mantissa
    bits, from which 2^n is one shift (no round, no float-to-int conversion),
    Estrin's scheme keeps the polynomial three steps deep after r^2, and
    2^n (1 + q) is one fma.  0.68 -> 0.41 ns/element per core against clamping x,
    a degree-8 Taylor polynomial and an add and a multiply at the end
    (tools/fastmath_bench.py)."""
    K = I.opaque
    sh = I.fma(x, K(_LOG2E), K(_EXP_SHIFT))   # 1.5 * 2^23 + 127 + round(x / ln2)
    top = K(_EXP_SHIFT_MAX)
    # n <= 127; NaN -> 127.  Lanes with x < -87.34 get garbage, replaced below
    y = _exp_shifted(x, sh if sh < top else top)
    y = _INF if x > K(_EXP_MAX) else y
    return _ZERO if x < K(_EXP_MIN) else y


@helper
def exp_nonpos_f32(x):
    """exp(x) for x <= 0 or NaN (softmax's x - max(x)), <= 1 ulp (0.96 measured, as
    exp_f32) without exp_f32's two steps for large x (n capped at 127, +inf above
    88.72), and with n uncapped r = x - n ln2 stays in [-ln2/2, ln2/2], where a
    polynomial one degree shorter than exp_f32's is as accurate (_XS).  Per core,
    tools/fastmath_bench.py-style loop: exp_f32 0.31, with exp_f32's polynomial
    0.254, this 0.233 ns/element.  n = round(x / ln2) <= 0 keeps n + 127 in range
    down to x = -87.34, below which the select gives 0, as exp_f32's; a NaN flows
    through the arithmetic.  lower/exprs.py writes it only where the argument is provably
    <= 0 (x minus a max of x over some axes)."""
    K = I.opaque
    r, s = _exp_reduced(x, I.fma(x, K(_LOG2E), K(_EXP_SHIFT)))
    r2 = r * r
    p = I.fma(I.fma(K(_XS4), r2, I.fma(K(_XS3), r, K(_XS2))), r2, I.fma(K(_XS1), r, K(_XS0)))
    y = I.fma(I.fma(p, r2, r), s, s)
    return _ZERO if x < K(_EXP_MIN) else y


_TINY_EXPM1 = f32(2.0 ** -25)


@helper
def expm1_f32(x):
    """exp(x) - 1 without cancellation near 0.  <= 2 ulp; -1 below -17, inf above 88.72."""
    xc = _EXP_HI if x > _EXP_HI else x
    xc = f32(-30.0) if xc < f32(-30.0) else xc
    safe = xc if xc == xc else _ZERO
    n, q = _expm1_reduced(safe)
    small = n <= f32(60.0)
    s = I.exp2i_f32(n if small else _ZERO)
    near = I.fma(s, q, s - _ONE)              # 2^n (1 + q) - 1, one rounding
    far = I.ldexp_f32(q + _ONE, n)            # -1 is below half an ulp there
    y = near if small else far
    # |x| < 2^-25: expm1(x) = x exactly (rounded); this also keeps a subnormal x, which
    # TF returns, where the polynomial under TF's flush-to-zero mode gave 0
    y = x if I.fabs(x) < _TINY_EXPM1 else y
    return y if x == x else x


# log: x = 2^e m, m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(s), s = (m-1)/(m+1)
_SQRT_HALF = f32(0.70710678118654752)
_MIN_NORMAL = f32(1.1754943508222875e-38)
_TWO23 = f32(8388608.0)
_L3, _L5, _L7, _L9 = f32(2 / 3), f32(2 / 5), f32(2 / 7), f32(2 / 9)


@helper
def log_f32(x):
    """log(x).  <= 1 ulp; log(0) = -inf, log(x<0) = nan, log(inf) = inf, subnormals ok."""
    sub = x < _MIN_NORMAL
    xs = x * _TWO23 if sub else x
    e = I.f32_exponent(xs) - (f32(23.0) if sub else _ZERO)
    m = I.f32_mantissa_half(xs)               # [0.5, 1)
    lowm = m < _SQRT_HALF
    m = m + m if lowm else m
    ef = e - _ONE if lowm else e
    f = m - _ONE
    K = I.opaque
    s = f / (K(_TWO) + f)
    z = s * s
    R = z * I.fma(I.fma(I.fma(K(_L9), z, K(_L7)), z, K(_L5)), z, K(_L3))
    l1 = f - s * (f - R)
    y = I.fma(ef, K(_LN2_HI), I.fma(ef, K(_LN2_LO), l1))
    y = -_INF if x == _ZERO else y
    y = x if x == _INF else y
    return _NAN if x < _ZERO else (y if x == x else x)


@helper
def log1p_f32(x):
    """log(1 + x) accurate near 0 (x * log(u) / (u - 1), u = 1 + x).  <= 3 ulp."""
    u = x + _ONE
    lu = log_f32(u)
    d = u - _ONE
    y = x if d == _ZERO else x * (lu / d)
    return u if u == _INF else y


# tanh: a = |x| = n ln2/2 + u, |u| <= ln2/4; expm1(2u)/2 = u + u^2 P(u), P minimax
# (rel. error 4.4e-10 after rounding to float32; fastmath_fit.fit_tanh_poly)
_TANH_P = (f32(1.0), f32(0.6666666), f32(0.33333194), f32(0.13333671), f32(0.044583492),
           f32(0.012648573))
_TP0, _TP1, _TP2, _TP3, _TP4, _TP5 = _TANH_P
_TANH_CLAMP = f32(9.5)                  # tanh rounds to 1 past 9.011; n <= 28 below
_TWO_LOG2E = f32(2.0 * 1.4426950408889634)
_HALF_LN2_HI = f32(0.693359375 / 2)     # n * _HALF_LN2_HI exact for n < 2^15
_HALF_LN2_LO = f32(-2.12194440054690583e-4 / 2)
# 1.5 * 2^23 + 128: fma(a, 2 log2 e, _TANH_SHIFT) rounds to this + n (half to even),
# and its low 9 bits shifted into the exponent field give 2^(n+1)
_TANH_SHIFT = f32(12583040.0)
_SIGN_BIT = np.int32(-2 ** 31)


@helper
def tanh_f32(x):
    """tanh(x) = t / (t + 2), t = expm1(2|x|), sign restored.  <= 2.5 ulp (2.43
    measured over every float32); exactly +-1 past 9.011; tanh(x) = x for |x| < 4.2e-8
    (subnormals included), -0.0 stays -0.0, +-inf -> +-1, nan -> nan; |tanh| <= 1.

    expm1 specialized to 0 <= 2|x| <= 19: 2^n stays exact and normal, so there is no
    overflow/underflow/NaN select, and the range reduction shares one fma with the
    rounding of n (shifter constant) and with building 2^(n+1).  ~2.3x cheaper than the
    general expm1_f32 path, same error.  (The Eigen/XLA rational x P(x^2)/Q(x^2) is
    cheaper still, but in float32 its 9 rounded Horner steps reach the result in full
    where tanh is near +-1: 5.3 ulp measured for a (6, 3) minimax fit, see
    fastmath_fit.fit_tanh_rational.)"""
    K = I.opaque
    a = I.fabs(x)
    clamp = K(_TANH_CLAMP)
    a = clamp if a > clamp else a                     # nan stays nan
    shift = K(_TANH_SHIFT)
    sh = I.fma(a, K(_TWO_LOG2E), shift)
    n = sh - shift
    u = I.fma(n, K(-_HALF_LN2_HI), a)
    u = I.fma(n, K(-_HALF_LN2_LO), u)
    u2 = u * u
    p = I.fma(u2, I.fma(u2, I.fma(K(_TP5), u, K(_TP4)), I.fma(K(_TP3), u, K(_TP2))),
              I.fma(K(_TP1), u, K(_TP0)))
    h = I.fma(u2, p, u)                               # expm1(2u) / 2
    s2 = I.bits_f32(np.int32(I.f32_bits(sh) << 23))   # 2^(n+1)
    t = I.fma(s2, h, I.fma(s2, K(_HALF), K(-_ONE)))  # 2^n (1 + 2h) - 1 = expm1(2a) >= 0
    y = t / (t + K(_TWO))
    return I.bits_f32(np.int32(I.f32_bits(y) | (I.f32_bits(x) & _SIGN_BIT)))


@helper
def sigmoid_f32(x):
    """1 / (1 + exp(-x)), evaluated with z = exp(-|x|) on both sides.  <= 3 ulp.

    -|x| <= 0, so z is exp_nonpos_f32's (as accurate as exp_f32 there, without its
    capping step and with a polynomial one degree shorter), 1.24x faster per element
    than with exp_f32 on AVX2.  A BatchNorm + swish kernel over a large activation is
    bound by this exp there, not by memory (docs/internals/notes.md, EfficientNetB0)."""
    z = exp_nonpos_f32(-I.fabs(x))
    d = _ONE + z
    return _ONE / d if x >= _ZERO else (z / d if x < _ZERO else x)


# erfcx(x) = erfc(x) exp(x^2) = u R(t), u = 2 / (2 + x), t = 1 - u = x u / 2, R(t) =
# 1 + t S(t), 0 <= x <= 9.5: S of degree 8, minimax in ulps of the float32 erfc (0.27
# ulp with these float32 coefficients; fastmath_fit.fit_erfcx).  The two variables
# split the work: u carries erfcx's 1/x decay with a relative error of an ulp at any
# x (so large x stays accurate, where a polynomial in t alone, 1 + t S(t), ends in a
# cancellation to erfcx ~ 0.06 and was 27 ulp off), and t = x u / 2 is small wherever
# x is (R(t) = 1 + t S(t) stays accurate near x = 0, where the polynomial in u had to
# sum its coefficients to 1).  R falls only from 1 to 0.34, so one degree less than
# the former Q(u) of degree 11 is enough.
_ERFCX_R = (f32(1.0), f32(-1.2567562), f32(0.48639432), f32(0.21295415), f32(-0.10760713),
            f32(-0.06143531), f32(-0.07249092), f32(0.09821213), f32(-0.0020951023),
            f32(-0.015118062))
(_ER0, _ER1, _ER2, _ER3, _ER4, _ER5, _ER6, _ER7, _ER8, _ER9) = _ERFCX_R
_ERFC_CLAMP = f32(9.5)      # exp(-9.5^2) < FLT_MIN: 0, as every erfc past 9.2 is (flushed)


@helper
def _erfc_pos(a):
    """erfc(a) for a in [0, 9.5]: exp(-a^2) u R(t) (see _ERFCX_R); a^2's rounding
    error is folded back in with an fma so exp(-a^2) keeps float32 accuracy, and
    exp(-a^2) <= 1 takes exp_nonpos_f32 (no overflow path)."""
    K = I.opaque
    two = K(_TWO)
    u = two / (a + two)
    t = a * (u * K(_HALF))
    t2 = t * t
    # Estrin for S's high-order terms (short dependency chain), Horner for the last
    s = I.fma(I.fma(I.fma(K(_ER9), t, K(_ER8)), t2, I.fma(K(_ER7), t, K(_ER6))), t2 * t2,
              I.fma(I.fma(K(_ER5), t, K(_ER4)), t2, I.fma(K(_ER3), t, K(_ER2))))
    r = I.fma(I.fma(s, t, K(_ER1)), t, K(_ER0))
    a2 = a * a
    lo = I.fma(a, a, -a2)                       # a*a = a2 + lo exactly
    e = exp_nonpos_f32(-a2)
    return I.fma(-e, lo, e) * (u * r)


# erf(x) = x P(x^2) / Q(x^2) on |x| <= 3.925 (rational minimax, refit after rounding
# the coefficients to float32); one division, no exp: 3.5x cheaper than
# 1 - erfc, which matters for GELU.
_ERF_RP = (f32(1.1283792), f32(0.18514182), f32(0.05424942), f32(0.0038394765),
           f32(0.00037696472), f32(4.6147e-06), f32(-1.2829477e-08))
_ERF_RQ = (f32(1.0), f32(0.49741107), f32(0.11388051), f32(0.01543248),
           f32(0.0013019731), f32(6.245038e-05))
_RP0, _RP1, _RP2, _RP3, _RP4, _RP5, _RP6 = _ERF_RP
_RQ0, _RQ1, _RQ2, _RQ3, _RQ4, _RQ5 = _ERF_RQ
_ERF_CLAMP = f32(3.925)


@helper
def erf_f32(x):
    """erf(x).  <= 5.5 ulp, absolute error <= 3.2e-7; exactly +-1 past 3.925."""
    K = I.opaque
    hi, lo = K(_ERF_CLAMP), K(-_ERF_CLAMP)
    xc = hi if x > hi else x
    xc = lo if xc < lo else xc
    z = xc * xc
    p = I.fma(I.fma(I.fma(I.fma(I.fma(I.fma(K(_RP6), z, K(_RP5)), z, K(_RP4)), z, K(_RP3)),
                            z, K(_RP2)), z, K(_RP1)), z, K(_RP0))
    q = I.fma(I.fma(I.fma(I.fma(I.fma(K(_RQ5), z, K(_RQ4)), z, K(_RQ3)), z, K(_RQ2)), z,
                    K(_RQ1)), z, _RQ0)
    y = xc * p / q
    return I.copysign(_ONE, x) if I.fabs(x) > hi else y


# erfc near 0: 1 - x 2/sqrt(pi) in one fma for |x| < 2^-9; the next term, 2/sqrt(pi)
# x^3/3, is < 0.05 ulp there.
_ERFC_TINY = f32(2.0 ** -9)
_TWO_SQRTPI = f32(1.1283791670955126)


@big_helper
def erfc_f32(x):
    """erfc(x) = 1 - erf(x) without cancellation.  <= 4.4 ulp for x < 9.2 (relative;
    4.32 measured, near x = 5); results below FLT_MIN (x > 9.2) flush to 0 like TF;
    erfc(-inf) = 2, erfc(inf) = 0, erfc(nan) = nan.

    erfc(|x|) = exp(-x^2) erfcx(|x|), and 2 - erfc(|x|) for x < 0 (in [1, 2], no
    cancellation).  For |x| < 2^-9, 1 - x 2/sqrt(pi) in one fma is selected instead
    (0.5 ulp, where the product of exp(-x^2) and erfcx, both just below 1, is 2 ulp):
    TF's exact GELU, 0.5 x erfc(-x / sqrt 2), is 1.4 ulp for tiny x, and so is ours.
    A NaN flows through the arithmetic (no select catches it).  Cost, per core over
    L1-resident floats (tools/fastmath_bench.py style, 16 lanes): 0.63 -> 0.50 ns per
    element against the former Q(u) of degree 11 with exp_f32 and a four-term Taylor
    branch for |x| < 0.1."""
    K = I.opaque
    a = I.fabs(x)
    clamp = K(_ERFC_CLAMP)
    e = _erfc_pos(clamp if a > clamp else a)            # nan stays nan
    y = K(_TWO) - e if x < _ZERO else e
    return I.fma(-x, K(_TWO_SQRTPI), K(_ONE)) if a < K(_ERFC_TINY) else y


@big_helper
def softplus_f32(x, threshold):
    """TF's Softplus: x if x > -threshold, exp(x) if x < threshold, else
    log1p(exp(x)); threshold = log(epsilon) + 2 of the tensor's dtype."""
    e = exp_f32(x)
    mid = log1p_f32(e)
    return x if x > -threshold else (e if x < threshold else mid)


# Elu/Selu select on x < 0, as TF's kernels do: under TF's flush-to-zero (denormals-
# are-zero) mode a subnormal x compares equal to 0, so x > 0 ? x : expm1(x) would
# return 0 for a positive subnormal where TF returns x.
@helper
def elu_f32(x):
    return expm1_f32(x) if x < _ZERO else x


_SELU_SCALE = f32(1.0507009873554804934193349852946)
_SELU_ALPHA = f32(1.6732632423543772848170429916717)
_SELU_SA = f32(1.0507009873554804934193349852946 * 1.6732632423543772848170429916717)


@helper
def selu_f32(x):
    return _SELU_SA * expm1_f32(x) if x < _ZERO else _SELU_SCALE * x


# ---- sin, cos -------------------------------------------------------------------------
# Reduction: |x| 2/pi = n + f, n an integer, |f| <= 1/2, so sin |x| = +-sin or +-cos of
# r = f pi/2 by n mod 4.  Computed in float64, exactly enough for every float32 up to
# FLT_MAX, with no branch and no table (Payne-Hanek's idea, with the bits of 2/pi held as
# float64 pieces rather than integer words):
# * |x| = M 2^E, M < 2^24 an integer, E <= 104.  The bits of 2/pi of weight >= 2^-B add
#   M 2^E * (a multiple of 2^-B), a multiple of 4 when E >= B + 2: nothing mod 4 (whole
#   turns).  Two bands: B = 0 below 2^78, B = 51 from 2^78 (E >= 55), so D = E - B <= 54.
# * The 145 bits after the first B are five 29-bit pieces P0..P4 (exact float64s), so
#   each t_k = |x| P_k has at most 24 + 29 significant bits: exact.  t0 < 2^(D+24),
#   t1 < 2^(D-5) <= 2^49, t2 < 2^(D-34) <= 2^20, t3 < 2^-9, t4 < 2^-38; the bits after
#   P4 add less than 2^(D-121) <= 2^-67.
# * t0 mod 4 (t0 - 4 round(t0/4)) and the splits t_k = n_k + f_k (k <= 2, |f_k| <= 1/2)
#   are exact.  ns is the integer nearest the fractions' sum, taken off f0 (exact), and
#   f = ((((f0 - ns) + f1) + f2) + t3) + t4.  The first of these sums is exact when
#   below 2^(D-5) in magnitude, the second below 2^(D-34) (their operands' ulps are
#   2^(D-58), 2^(D-87)), and they are that small wherever f is: so f is off by ~2^-51
#   relative plus 2^-67 absolute, against |f| >= 2^-29.86 over all float32 (at x =
#   16367173 2^72; the closest approach to a multiple of pi/2, tests/test_fastmath.py).
# * n = n0 + n1 + n2 + ns + offset < 2^51 is exact; only n mod 4 is kept.
# Then sin or cos of r in float64 (minimax polynomials) and one rounding to float32: the
# result is within 0.502 ulp of the exact value for every float32 (checked exhaustively),
# i.e. nearly always the correctly rounded float32.  Cost: ~1.6 ns per element per core
# on an AVX-512 EPYC against 0.22 for exp_f32 (tools/fastmath_bench.py).  A float32
# Cody-Waite reduction (Eigen's fast path) is cheaper but wrong past ~1e5, where Eigen
# falls back to scalar code per element, which a vectorized loop cannot branch to.
# Measured alternatives: four bands of 4 pieces (t0 < 2^53, no mod 4), 1.8 ns (12
# selects of spilled constants cost more than a piece and a mod); float32 polynomials
# from r = rh + rl, slower (conversions) and 1.2 ulp.  The constants here are float64
# (Python floats, which Numba types float64), not the float32 ones of the helpers above.
_TWO_OVER_PI_HEX = "A2F9836E4E441529FC2757D1F534DDC0DB6295993C439041FE5163ABDEBBC561B7246E3A"
# 2/pi = 0.A2F9836E... (hex), 288 bits: fdlibm's ipio2 digits; tests/test_fastmath.py
# checks them against pi from Machin's formula


def _two_over_pi_piece(first: int, count: int) -> float:
    """Bits first + 1 .. first + count after the point of 2/pi, as an exact float64."""
    total = 4 * len(_TWO_OVER_PI_HEX)
    v = (int(_TWO_OVER_PI_HEX, 16) >> (total - first - count)) & ((1 << count) - 1)
    return math.ldexp(float(v), -(first + count))


_TRIG_DROP = (0, 51)                    # bits of 2/pi dropped in each band of |x|
_TRIG_PIECE_BITS = 29                   # x 24 bits of mantissa: exact in float64
(_TP00, _TP01, _TP02, _TP03, _TP04), (_TP10, _TP11, _TP12, _TP13, _TP14) = (
    tuple(_two_over_pi_piece(b + _TRIG_PIECE_BITS * k, _TRIG_PIECE_BITS) for k in range(5))
    for b in _TRIG_DROP)
_TRIG_BAND1 = 2.0 ** 78                 # E >= 55 >= 51 + 2; D <= 54 in both bands
_PIO2 = math.pi / 2
# sin r = r + r^3 S(r^2), cos r = 1 - r^2/2 + r^4 C(r^2) on |r| <= pi/4 (+2^-30):
# minimax in relative error, float64 coefficients (Lawson's iteratively reweighted least
# squares on a dense grid, as fastmath_fit.py fits the others): relative error 2^-37.5
# for sin, 2^-33.0 for cos, against float32's 2^-24
_SC = (-0.16666666640797095, 0.008333329304847314, -0.00019839312270877356,
       2.718121640361791e-06)
_SC1, _SC2, _SC3, _SC4 = _SC
_CC = (0.04166664568298327, -0.0013887316254755412, 2.443315710426696e-05)
_CC2, _CC3, _CC4 = _CC
_SIN_TINY = f32(2.0 ** -12)             # below: sin(x) rounds to x (x^2/6 < 2^-25)


@helper
def _trig_pieces(a):
    """P0..P4 of the band of a = |x| (float64; see above)."""
    K = I.opaque            # constants before the selects: selects of values, no branch
    p00, p01, p02, p03, p04 = K(_TP00), K(_TP01), K(_TP02), K(_TP03), K(_TP04)
    p10, p11, p12, p13, p14 = K(_TP10), K(_TP11), K(_TP12), K(_TP13), K(_TP14)
    hi = a >= K(_TRIG_BAND1)
    return ((p10 if hi else p00), (p11 if hi else p01), (p12 if hi else p02),
            (p13 if hi else p03), (p14 if hi else p04))


@helper
def _trig_reduce(a, p0, p1, p2, p3, p4, off):
    """(f, q): a 2/pi + off = n + f, |f| <= 1/2, q = n mod 4 (float64; see above)."""
    K = I.opaque
    t0, t1, t2, t3, t4 = a * p0, a * p1, a * p2, a * p3, a * p4     # exact
    m0 = I.fma(I.roundeven(t0 * K(0.25)), K(-4.0), t0)                # t0 mod 4
    n0, n1, n2 = I.roundeven(m0), I.roundeven(t1), I.roundeven(t2)
    f0, f1, f2 = m0 - n0, t1 - n1, t2 - n2                            # exact
    ns = I.roundeven(((f0 + f1) + f2) + t3)
    f = ((((f0 - ns) + f1) + f2) + t3) + t4
    n = (((n0 + n1) + n2) + ns) + off
    return f, I.fma(I.floor(n * K(0.25)), K(-4.0), n)


@helper
def _sincos_poly(f, q):
    """sin((q + f) pi/2) for q in 0..3, |f| <= 1/2, in float64; NaN for a NaN f."""
    K = I.opaque
    r = f * K(_PIO2)
    r2 = r * r
    ps = I.fma(I.fma(I.fma(K(_SC4), r2, K(_SC3)), r2, K(_SC2)), r2, K(_SC1))
    ys = I.fma(r * r2, ps, r)
    pc = I.fma(I.fma(K(_CC4), r2, K(_CC3)), r2, K(_CC2))
    yc = I.fma(I.fma(pc, r2, K(-0.5)), r2, K(1.0))
    y = yc if (q == K(1.0)) | (q == K(3.0)) else ys
    return -y if q >= K(2.0) else y


@big_helper
def _sincos(x, off):
    """sin(|x| + off pi/2) rounded to float32: off = 0 gives sin |x|, 1 gives cos x.
    Three small helpers that LLVM inlines; this and its callers are inlined at Numba-IR
    level (together they exceed LLVM's inline budget)."""
    a = np.float64(I.fabs(x))
    p0, p1, p2, p3, p4 = _trig_pieces(a)
    f, q = _trig_reduce(a, p0, p1, p2, p3, p4, off)
    return np.float32(_sincos_poly(f, q))


@big_helper
def sin_f32(x):
    """sin(x).  <= 0.502 ulp for every float32 (all 2^32 checked once against float64;
    tests/test_fastmath.py sweeps every binade), huge |x| included: the reduction above
    is exact up to FLT_MAX.  sin(x) = x for |x| < 2^-12 (subnormals and -0.0 too, also
    under flush-to-zero), sin(+-inf) = sin(nan) = nan.  Branch-free, so a loop of it
    vectorizes; its float64 lanes cost ~7-9 exp_f32 per element (tools/calibrate.py
    --ops measured 8.9, against 33.5 for the scalar libm sin kernels called before)."""
    y = _sincos(x, 0.0)
    y = I.bits_f32(np.int32(I.f32_bits(y) ^ (I.f32_bits(x) & _SIGN_BIT)))   # sin is odd
    return x if I.fabs(x) < I.opaque(_SIN_TINY) else y


@big_helper
def cos_f32(x):
    """cos(x) = sin(|x| + pi/2): sin_f32's reduction with n + 1.  <= 0.502 ulp for every
    float32; cos(0) = 1, cos(+-inf) = cos(nan) = nan."""
    return _sincos(x, 1.0)


# ---- float64: libm (scalar; float64 kernels are rare and not vectorized) -----------

_SELU_SCALE64 = 1.0507009873554804934193349852946
_SELU_SA64 = 1.0507009873554804934193349852946 * 1.6732632423543772848170429916717


@helper
def exp_f64(x):
    return math.exp(x)


@helper
def exp_nonpos_f64(x):
    return math.exp(x)


@helper
def expm1_f64(x):
    return math.expm1(x)


@helper
def log_f64(x):
    return math.log(x) if x > 0.0 else (-math.inf if x == 0.0 else (x if x != x else math.nan))


@helper
def log1p_f64(x):
    return math.log1p(x) if x > -1.0 else (-math.inf if x == -1.0 else (x if x != x else math.nan))


@helper
def tanh_f64(x):
    return math.tanh(x)


@helper
def sigmoid_f64(x):
    z = math.exp(-abs(x))
    return 1.0 / (1.0 + z) if x >= 0.0 else (z / (1.0 + z) if x < 0.0 else x)


@helper
def erf_f64(x):
    # TF 2.21's float64 Erf (Eigen's double erf) returns NaN for +-inf, unlike
    # float32 and libm; match TF, since stitched graphs must agree with stock TF.
    if math.isinf(x):
        return math.nan
    return math.erf(x)


@helper
def erfc_f64(x):
    return math.erfc(x)


@helper
def softplus_f64(x, threshold):
    e = math.exp(x)
    return x if x > -threshold else (e if x < threshold else math.log1p(e))


@helper
def elu_f64(x):
    return math.expm1(x) if x < 0.0 else x


@helper
def selu_f64(x):
    return _SELU_SA64 * math.expm1(x) if x < 0.0 else _SELU_SCALE64 * x


@helper
def sin_f64(x):
    return math.sin(x)


@helper
def cos_f64(x):
    return math.cos(x)
