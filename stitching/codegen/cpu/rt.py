"""The helper namespace ``h`` that generated CPU kernels import.

Every name the scalar lowering (lower/exprs.py) or the CPU emitter (cpu/emitter.py) writes as
``h.<name>`` is defined here, either re-exported from intrinsics.py / fastmath.py
or as a small inlined Numba function.  A CUDA emitter provides the same names in
its own helper module.
"""
from __future__ import annotations

import math

import numpy as np
from numba import types

from . import intrinsics as _I
from .fastmath import helper
from .fastmath import (elu_f32, elu_f64, erf_f32, erf_f64, erfc_f32, erfc_f64,  # noqa: F401
                       exp_f32, exp_f64, exp_nonpos_f32, exp_nonpos_f64, expm1_f32,
                       expm1_f64, log1p_f32, log1p_f64,
                       log_f32, log_f64, selu_f32, selu_f64, sigmoid_f32, sigmoid_f64,
                       sin_f32, sin_f64, cos_f32, cos_f64,
                       softplus_f32, softplus_f64, tanh_f32, tanh_f64)
from .intrinsics import (acc_add, acc_max, acc_min, acc_mul, aligned_alloc,  # noqa: F401
                         bf16_to_f32, ceil, copysign, f2i32, f2i64, f16_to_f32,
                         f32_to_bf16, f32_to_f16, fabs, floor, free, opaque, opaque_int,
                         prefetch,
                         ptr_float32, ptr_float64, ptr_int32, ptr_int64, ptr_uint8,
                         ptr_offset, ptr_uint16, roundeven, same_address, sqrt, store_fence,
                         stream, wide_vectors)

# column-block accumulator steps (see lower.Reduction.block_step)
block_max = _I.maximum
block_min = _I.minimum

# C ABI of a generated kernel's body (cpu.py; its shape function is the shared
# interpreter, shape_interp.py), and the cfunc options it is compiled with (kernel.py).
BODY_SIG = types.void(types.int64, types.int64, types.CPointer(types.voidptr),
                      types.CPointer(types.voidptr), types.CPointer(types.int64))

# Kernel-wide fast-math flags: none.  Reductions get reassoc/nsz on their accumulator
# instructions alone (intrinsics.acc_*); no nnan/ninf anywhere, no arcp/afn (1/x
# estimates change results near 0, Inf and subnormals), and no ``contract``: with it,
# LLVM fuses an IR op's multiply into its consumer's add where it sees both, so a
# value recomputed in two passes (kept in one, consumed by a Sub in the other) got
# two different roundings -- silu(x) - reduce_sum(silu(x), 0) over one row gave
# 1.2e-7, not TF's 0.  Without it every IR op rounds its result, as TF's kernels do
# (Eigen contracts nothing across ops), and the same IR value has the same bits
# wherever and in whichever launch variant it is computed.  FMAs we want are
# explicit (intrinsics.fma in the math helpers).
FASTMATH = set()
BODY_OPTIONS = {"nogil": True, "fastmath": FASTMATH, "error_model": "numpy"}

_F0, _F1 = np.float32(0.0), np.float32(1.0)


@helper
def maximum(x, y):
    """TF Maximum: NaN if either is NaN.  A compare-select (3 vector ops) rather than
    llvm.maximum, whose AVX2 expansion also orders -0 < +0 (TF does not care)."""
    return x if (x > y) | (x != x) else y


@helper
def minimum(x, y):
    return x if (x < y) | (x != x) else y


@helper
def quant_f16(x):
    """Round a float32 to float16 precision (Cast to float16 inside a kernel)."""
    return _I.f16_to_f32(_I.f32_to_f16(x))


@helper
def quant_bf16(x):
    return _I.bf16_to_f32(_I.f32_to_bf16(x))


@helper
def b2u8(b):
    return np.uint8(1) if b else np.uint8(0)


@helper
def floormod(x, y):
    """TF FloorMod on floats: fmod, then shifted into y's sign."""
    m = _I.fmod(x, y)
    return m + y if (m != 0 and ((y < 0) != (m < 0))) else m


@helper
def pow_f32(x, y):
    return np.float32(math.pow(np.float64(x), np.float64(y)))


@helper
def pow_f64(x, y):
    return math.pow(x, y)


@helper
def mean_int(s, n):
    """Integer mean as TF: truncating division; an empty mean is 0."""
    if n == 0:
        return np.int64(0)
    q = s // n
    return q + 1 if (q < 0 and q * n != s) else q
