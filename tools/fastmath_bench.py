"""Throughput of the fastmath helpers (stitching/codegen/cpu/fastmath.py), one core.

    python tools/fastmath_bench.py [exp tanh erf ...]

Each helper runs in a compiled loop over 4096 float32 values that stay in L1, 2000
times; the best of 5 runs is printed in ns per element, next to a multiply-by-constant
loop (the loop's own cost).  Data: standard normal x 2, so every range-reduction
branch is taken.  This is compute throughput only: a kernel over DRAM-resident data
adds the memory time where it does not overlap.
"""
from __future__ import annotations

import sys
import time

import numpy as np
from numba import njit

from stitching.codegen.cpu import fastmath as F

NAMES = ["exp", "expm1", "log", "log1p", "tanh", "sigmoid", "erf", "erfc", "sin", "cos"]


def _loop(fn):
    @njit(fastmath={"contract"}, nogil=True, error_model="numpy")
    def run(x, y, reps):
        for _ in range(reps):
            for i in range(x.shape[0]):
                y[i] = fn(x[i])
    return run


@njit(fastmath={"contract"}, nogil=True)
def _scale(x, y, reps):
    for _ in range(reps):
        for i in range(x.shape[0]):
            y[i] = x[i] * np.float32(1.5)


def _ns_per_elem(run, x, y, reps=2000) -> float:
    run(x, y, 1)
    best = min(_timed(run, x, y, reps) for _ in range(5))
    return best / (reps * x.size) * 1e9


def _timed(run, x, y, reps) -> float:
    t0 = time.perf_counter()
    run(x, y, reps)
    return time.perf_counter() - t0


def main(names) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 2).astype(np.float32)
    y = np.empty_like(x)
    print(f"{'x * 1.5 (loop)':16s} {_ns_per_elem(_scale, x, y):6.3f} ns/elem")
    for name in names:
        if name not in NAMES:
            raise SystemExit(f"unknown helper {name!r}; choose from {', '.join(NAMES)}")
        xs = np.abs(x) if name in ("log",) else (np.abs(x) - 0.5 if name == "log1p" else x)
        run = _loop(getattr(F, f"{name}_f32"))
        print(f"{name + '_f32':16s} {_ns_per_elem(run, xs, y):6.3f} ns/elem")


if __name__ == "__main__":
    main(sys.argv[1:] or NAMES)
