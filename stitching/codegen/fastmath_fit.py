"""Regenerate the erf / erfcx polynomial coefficients of fastmath.py (dev tool).

    python -m stitching.codegen.fastmath_fit

Lawson's algorithm (iteratively reweighted least squares) approximates the minimax
polynomial for the *relative* error against scipy's float64 erf/erfcx on a dense
grid; coefficients are then rounded to float32.  Needs scipy; never imported by
the kernels.
"""
from __future__ import annotations

import numpy as np


def lawson(A, y, iters=200):
    """Coefficients c minimizing max |A c - y| / |y| (approximately)."""
    w = np.ones(len(y))
    best = None
    for _ in range(iters):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(A * sw[:, None], y * sw, rcond=None)
        err = (A @ c - y) / y
        m = np.abs(err).max()
        if best is None or m < best[0]:
            best = (m, c)
        w = w * np.abs(err)
        w = np.maximum(w / w.sum(), 1e-300)
    return best


def fit():
    from scipy import special
    k = np.arange(4000)
    cheb = 0.5 + 0.5 * np.cos(np.pi * (2 * k + 1) / 8000)        # nodes on (0, 1)
    x = np.concatenate([np.maximum(cheb, 1e-4), np.linspace(1e-4, 1, 4000)])
    m1, erf_p = lawson(np.vander(x * x, 7, increasing=True), special.erf(x) / x)
    x = np.linspace(0.5, 11.0, 30000)
    m2, erfcx_q = lawson(np.vander(2 / (2 + x), 11, increasing=True), special.erfcx(x))
    return (m1, [np.float32(c) for c in erf_p]), (m2, [np.float32(c) for c in erfcx_q])


if __name__ == "__main__":
    (m1, p), (m2, q) = fit()
    print(f"erf(x) = x P(x^2), |x| < 1: max rel error {m1:.2e}\n  {[repr(c) for c in p]}")
    print(f"erfcx(x) = Q(2/(2+x)), 0.5 <= x <= 11: max rel error {m2:.2e}\n"
          f"  {[repr(c) for c in q]}")
