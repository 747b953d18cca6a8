"""Regenerate the exp / erf / erfcx / tanh coefficients of fastmath.py (dev tool).

    python -m stitching.codegen.cpu.fastmath_fit

Polynomials: Lawson's algorithm (iteratively reweighted least squares) approximates
the minimax polynomial for the *relative* error against scipy's float64 functions.
Rational erf: Sanathanan-Koerner iterations (linearized P - g Q with weights
1/|g Q_prev|) plus Lawson reweighting, then alternate "round one polynomial to
float32, refit the other" keeping the pair with the fewest float32 ulps.  Needs
scipy; never imported by the kernels.

exp: exp(r) = 1 + r + r^2 P(r) on [-ln2/2, ln2] (fit_exp_poly, same method), and on
[-ln2/2, ln2/2] for exp_nonpos (one degree less).
erfcx: erfcx(x) = u R(t), u = 2/(2+x), t = 1 - u, on [0, 9.5] (fit_erfcx), minimax in
ulps of the float32 erfc(x) rather than relative error, coefficients rounded one at a time.
tanh: expm1(2u)/2 = u + u^2 P(u) on |u| <= ln2/4, minimax in relative error
(fit_tanh_poly: Lawson, coefficients rounded to float32 one at a time, refitting
the rest each time).  fit_tanh_rational fits the Eigen/XLA-style alternative
tanh(x) = x P(x^2)/Q(x^2) and reports its float32 error, which is why it is not
used (see tanh_f32's docstring).
"""
from __future__ import annotations

import numpy as np


def lawson(A, y, iters=200, rel=None):
    """Coefficients c minimizing max |A c - y| / |rel| (approximately; rel defaults
    to y, i.e. relative error, and then the least-squares weights are not scaled by
    it).  Returns (max error, c)."""
    scale = 1.0 if rel is None else np.abs(rel)
    rel = y if rel is None else rel
    w = np.ones(len(y))
    best = None
    for _ in range(iters):
        sw = np.sqrt(w) / scale
        c, *_ = np.linalg.lstsq(A * sw[:, None], y * sw, rcond=None)
        err = (A @ c - y) / rel
        m = np.abs(err).max()
        if best is None or m < best[0]:
            best = (m, c)
        w = w * np.abs(err)
        w = np.maximum(w / w.sum(), 1e-300)
    return best


def _horner32(c, z):
    acc = np.full_like(z, np.float32(c[-1]))
    for ck in c[-2::-1]:          # fma: one rounding per step
        acc = (acc.astype(np.float64) * z + np.float64(np.float32(ck))).astype(np.float32)
    return acc


def _rational_ulps(f, p, q, x, hi):
    x = np.minimum(x, np.float32(hi))
    z = (x * x).astype(np.float32)
    y = (x * _horner32(p, z)).astype(np.float32) / _horner32(q, z)
    ref = f(x.astype(np.float64))
    return (np.abs(y - ref) / np.spacing(np.abs(ref).astype(np.float32))).max()


def fit_rational(f, hi, m, n, iters=300):
    """f(x) ~ x P(x^2) / Q(x^2) on [0, hi]; returns (float32 ulps, P, Q)."""
    x = np.concatenate([np.linspace(1e-3, hi, 30000), np.geomspace(1e-5, hi, 3000)])
    z, g = x * x, f(x) / x
    Vp, Vq = np.vander(z, m + 1, increasing=True), np.vander(z, n + 1, increasing=True)
    A = np.hstack([Vp, -(g[:, None] * Vq[:, 1:])])
    Q, w, best = np.ones_like(z), np.ones_like(z), None
    for it in range(iters):                        # Sanathanan-Koerner + Lawson
        wt = np.sqrt(w) / np.abs(g * Q)
        c, *_ = np.linalg.lstsq(A * wt[:, None], g * wt, rcond=None)
        p, q = c[:m + 1], np.concatenate([[1.0], c[m + 1:]])
        Q = Vq @ q
        err = (Vp @ p) / Q / g - 1
        if np.all(Q > 0) and (best is None or np.abs(err).max() < best[0]):
            best = (np.abs(err).max(), p, q)
        if it >= 30:
            w = w * (np.abs(err) + 1e-3 * np.abs(err).max())
            w /= w.sum()
    _, p, q = best
    xt = np.linspace(0, hi + 1, 400001).astype(np.float32)[1:]
    f32 = lambda v: np.array([np.float32(c) for c in v], np.float64)   # noqa: E731
    out = (_rational_ulps(f, f32(p), f32(q), xt, hi), f32(p), f32(q))
    w = np.ones_like(z)
    for _ in range(120):                           # refit around float32 rounding
        P = Vp @ f32(p)
        q, *_ = np.linalg.lstsq((g[:, None] * Vq) * (np.sqrt(w) / np.abs(P))[:, None],
                                P * np.sqrt(w) / np.abs(P), rcond=None)
        Q = Vq @ f32(q)
        wt = np.sqrt(w) / np.abs(g * Q)
        p, *_ = np.linalg.lstsq(Vp * wt[:, None], g * Q * wt, rcond=None)
        err = (Vp @ f32(p)) / Q / g - 1
        w = w * (np.abs(err) + 1e-3 * np.abs(err).max())
        w /= w.sum()
        u = _rational_ulps(f, f32(p), f32(q), xt, hi)
        if u < out[0]:
            out = (u, f32(p), f32(q))
    return out


def _lawson_fixed(A, y, rel, fixed, iters=300):
    """Lawson for max |A c - y| / |rel| with c[:len(fixed)] = fixed."""
    k = len(fixed)
    m, c = lawson(A[:, k:], y - A[:, :k] @ np.asarray(fixed, np.float64), iters, rel)
    return m, np.concatenate([np.asarray(fixed, np.float64), c])


def fit_tanh_poly(deg=5):
    """P with expm1(2u)/2 ~ u + u^2 P(u) on |u| <= ln2/4 (a little wider for the
    range reduction's rounding), minimax relative error; float32 coefficients.
    Returns (max relative error with the rounded coefficients, [P0..Pdeg])."""
    half = np.log(2.0) / 4 * (1 + 2.0 ** -10)
    k = np.arange(8000)
    u = half * np.cos(np.pi * (2 * k + 1) / 16000)
    u = u[np.abs(u) > 1e-7]
    h = np.expm1(2 * u) / 2
    A = (u * u)[:, None] * np.vander(u, deg + 1, increasing=True)
    fixed = []
    for i in range(deg + 1):                      # round one coefficient, refit the rest
        _, c = _lawson_fixed(A, h - u, h, fixed)
        fixed.append(float(np.float32(c[i])))
    c = np.array(fixed)
    return np.abs((u + A @ c - h) / h).max(), [np.float32(v) for v in c]


def fit_exp_poly(deg=5, symmetric=False):
    """P with exp(r) ~ 1 + r + r^2 P(r) on [-ln2/2, ln2] (exp_f32's reduced range:
    n = round(x / ln2) is capped at 127), or on [-ln2/2, ln2/2] if ``symmetric``
    (exp_nonpos_f32: n uncapped), minimax relative error, float32 coefficients
    rounded one at a time.  Returns (max relative error, [P0..Pdeg])."""
    a = -np.log(2.0) / 2 * (1 + 2.0 ** -10)
    b = -a if symmetric else np.log(2.0) * (1 + 2.0 ** -10)
    k = np.arange(16000)
    r = (a + b) / 2 + (b - a) / 2 * np.cos(np.pi * (2 * k + 1) / 32000)
    r = r[np.abs(r) > 1e-7]
    e = np.expm1(r)
    A = (r * r)[:, None] * np.vander(r, deg + 1, increasing=True)
    fixed = []
    for i in range(deg + 1):
        _, c = _lawson_fixed(A, e - r, np.exp(r), fixed)
        fixed.append(float(np.float32(c[i])))
    c = np.array(fixed)
    return np.abs((r + A @ c - e) / np.exp(r)).max(), [np.float32(v) for v in c]


def fit_tanh_rational(m=6, n=3, hi=9.0, iters=200):
    """tanh(x) ~ x P(z)/Q(z), z = x^2, P(0) = Q(0) = 1 (tanh(x) = x for tiny x), on
    [0, hi]: Sanathanan-Koerner + Lawson in t = z / hi^2 (monomials in z are too
    ill-conditioned).  Returns (rel. error, float32 ulps over a dense grid when
    evaluated in float32 with fma Horner steps, P, Q) with float32 coefficients."""
    x = np.concatenate([np.linspace(0, hi, 40001)[1:], np.geomspace(1e-4, hi, 4000)])
    t, g = (x / hi) ** 2, np.tanh(x) / x
    Vp = np.vander(t, m + 1, increasing=True)[:, 1:]
    Vq = np.vander(t, n + 1, increasing=True)[:, 1:]
    A = np.hstack([Vp, -(g[:, None] * Vq)])
    Q, w, best = np.ones_like(t), np.ones_like(t), None
    for it in range(iters):
        wt = np.sqrt(w) / np.abs(g * Q)
        c, *_ = np.linalg.lstsq(A * wt[:, None], (g - 1) * wt, rcond=None)
        Q = 1 + Vq @ c[m:]
        err = (1 + Vp @ c[:m]) / Q / g - 1
        e = np.abs(err).max()
        if np.all(Q > 0) and (best is None or e < best[0]):
            best = (e, c)
        if it >= 30:
            w = w * (np.abs(err) + 1e-3 * e)
            w /= w.sum()
    e, c = best
    s = float(hi) ** -2
    p = [np.float32(v) for v in np.concatenate([[1.0], c[:m] * s ** np.arange(1, m + 1)])]
    q = [np.float32(v) for v in np.concatenate([[1.0], c[m:] * s ** np.arange(1, n + 1)])]
    xt = np.linspace(0, hi, 2_000_001).astype(np.float32)[1:]
    u = _rational_ulps(np.tanh, np.array(p, np.float64), np.array(q, np.float64), xt, hi)
    return e, u, p, q


def fit_erfcx(deg=9, hi=9.5):
    """R with erfcx(x) ~ u R(t), u = 2 / (2 + x), t = 1 - u, R(t) = 1 + t S(t) on
    [0, hi] (erfc_f32 = exp(-x^2) u R), minimax in ulps of the float32 erfc(x) (whose
    spacing halves just below 1, near x = 0), R(0) = 1 exactly, float32 coefficients
    rounded one at a time, lowest first.  Returns (max error in erfc ulps with the
    rounded coefficients, [R0..Rdeg])."""
    from scipy import special
    x = np.concatenate([np.linspace(0.0, hi, 40000), np.geomspace(1e-7, 0.05, 4000)])
    u = 2 / (2 + x)
    t = 1 - u
    y = special.erfcx(x) / u
    ec = special.erfc(x)
    ulp = np.spacing(ec.astype(np.float32)).astype(np.float64)
    rel = ulp / ec * y                  # an erfc ulp, as an error in R
    A = np.vander(t, deg + 1, increasing=True)
    fixed = [1.0]
    for i in range(1, deg + 1):
        _, c = _lawson_fixed(A, y, rel, fixed)
        fixed.append(float(np.float32(c[i])))
    c = np.array(fixed)
    return np.abs((A @ c - y) / rel).max(), [np.float32(v) for v in c]


if __name__ == "__main__":
    from scipy import special
    u, rp, rq = fit_rational(special.erf, 3.925, 6, 5)
    print(f"erf(x) = x P(x^2)/Q(x^2), |x| <= 3.925: {u:.2f} ulp in float32\n"
          f"  P {[repr(np.float32(c)) for c in rp]}\n  Q {[repr(np.float32(c)) for c in rq]}")
    m, p = fit_exp_poly()
    print(f"exp: exp(r) = 1 + r + r^2 P(r), -ln2/2 <= r <= ln2: max rel error {m:.2e}\n"
          f"  P {[repr(c) for c in p]}")
    m, p = fit_exp_poly(4, symmetric=True)
    print(f"exp_nonpos: the same, |r| <= ln2/2: max rel error {m:.2e}\n"
          f"  P {[repr(c) for c in p]}")
    m, p = fit_tanh_poly()
    print(f"tanh: expm1(2u)/2 = u + u^2 P(u), |u| <= ln2/4: max rel error {m:.2e}\n"
          f"  P {[repr(c) for c in p]}")
    e, u, rp, rq = fit_tanh_rational()
    print(f"(not used) tanh(x) = x P(x^2)/Q(x^2), |x| <= 9: rel error {e:.2e}, but "
          f"{u:.2f} ulp in float32\n  P {[repr(c) for c in rp]}\n  Q {[repr(c) for c in rq]}")
    m, q = fit_erfcx()
    print(f"erfcx(x) = u R(1 - u), u = 2/(2+x), 0 <= x <= 9.5: max error {m:.2f} erfc ulp\n"
          f"  {[repr(c) for c in q]}")
