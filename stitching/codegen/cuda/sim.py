"""Simulator leaves of the CUDA helper namespace (see cuda/rt.py).

Under ``NUMBA_ENABLE_CUDASIM=1`` every CUDA thread is a Python thread running the
kernel's Python source, so the leaves are NumPy scalar functions with the GPU's IEEE
behaviour (Python's ``math.exp(1000)`` raises where ``expf`` returns inf).  Results
agree with libdevice to within its stated ulps, not bit for bit: the simulator checks
the kernels' structure (indexing, passes, reductions, placements), not libdevice.

Warp shuffles do not exist in the simulator.  ``shfl_xor`` emulates
``shfl_xor_sync(0xffffffff, v, off)`` with a per-warp exchange: each lane posts its
value, waits for its warp on a barrier, reads its partner's, and waits again before
the slots are reused.  Like the real instruction it needs every lane of the warp to
call it (the generated kernels guarantee that: reductions run on uniform control flow).
"""
from __future__ import annotations

import math as _math
import threading
import types

import numpy as np

# cuda/rt.py's sin and cos call ``math.sin(x)``; under the simulator this namespace is that math.
math = types.SimpleNamespace(sin=np.sin, cos=np.cos, nan=_math.nan, inf=_math.inf)

exp, expm1, log, log1p, tanh = np.exp, np.expm1, np.log, np.log1p, np.tanh
sqrt, fabs, floor, ceil = np.sqrt, np.fabs, np.floor, np.ceil
fmod, copysign, pow, roundeven = np.fmod, np.copysign, np.power, np.rint  # noqa: A001

WARP = 32
BARRIER_TIMEOUT_S = 300   # arbitrary: a lane that never arrives fails the launch, not hangs


def rsqrt_f32(x):
    """The GPU's rsqrtf is within 2 ulp of this (1 / sqrt in float64, rounded once)."""
    return np.float32(1.0 / np.sqrt(np.float64(x)))


def erf(x):
    """NumPy has no erf; math.erf never raises and is correctly rounded in float64."""
    return np.asarray(x).dtype.type(_math.erf(x))


def erfc(x):
    return np.asarray(x).dtype.type(_math.erfc(x))


def bf16_to_f32(u):
    return (np.uint32(u) << np.uint32(16)).view(np.float32)


def f32_to_bf16(x):
    x = np.float32(x)
    u = int(x.view(np.uint32))
    if x != x:
        return np.uint16((u >> 16) | 0x40)
    return np.uint16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)


_lock = threading.Lock()


def _warp_slots():
    """(barrier, slots, lane, lanes in this warp) for the calling simulated thread."""
    th = threading.current_thread()
    block = th._manager                    # simulator's BlockManager: one per block
    wid, lane = divmod(th.thread_id, WARP)
    with _lock:
        warps = block.__dict__.setdefault("_stitching_warps", {})
        if wid not in warps:
            n = min(WARP, int(np.prod(block._block_dim)) - wid * WARP)
            warps[wid] = (threading.Barrier(n, timeout=BARRIER_TIMEOUT_S), [None] * n)
    bar, slots = warps[wid]
    return bar, slots, lane, len(slots)


def shfl_xor(v, off):
    bar, slots, lane, n = _warp_slots()
    slots[lane] = v
    bar.wait()
    src = lane ^ int(off)
    out = slots[src] if src < n else v
    bar.wait()
    return out


def shfl_xor_bool(v, off):
    return bool(shfl_xor(bool(v), off))


def load4(a, i):
    """Four consecutive elements (on a GPU: one 16-byte vector load; load4b: one 4-byte
    load of 1-byte elements)."""
    return a[i], a[i + 1], a[i + 2], a[i + 3]


def store4(a, i, x0, x1, x2, x3):
    a[i], a[i + 1], a[i + 2], a[i + 3] = x0, x1, x2, x3


load4b = load4
