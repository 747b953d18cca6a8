"""The helper namespace ``h`` that generated CUDA kernels import.

Same names as cpu/rt.py (the scalar lowering in lower/exprs.py writes ``h.<name>``), plus
the CUDA-only ones the emitter uses (``shfl_xor``, ``shfl_xor_bool``, ``math``).

Two layers, so that the simulator tests the code that runs on the GPU wherever it can:

* **leaves** (one line each) differ by target: on a GPU they are device functions
  over ``math.*`` (libdevice), ``numba.cuda.libdevice`` and warp shuffles
  (cuda_gpu.py); under ``NUMBA_ENABLE_CUDASIM=1`` they are NumPy scalar functions
  and a shuffle emulation (cuda_sim.py), because Python's ``math`` raises where
  the GPU returns Inf/NaN and the simulator has no shuffles;
* **helpers written once** below, over the leaves: NaN-propagating max/min, TF's
  float->int cast, Sigmoid/Softplus/Elu/Selu, FloorMod, integer Mean, 16-bit float
  casts.  Under the simulator they run as plain Python; on a GPU each is wrapped
  as an inlined device function at import.

``load4``/``store4`` move four 4-byte elements as one 16-byte access (one line in the
simulator; an LLVM vector load/store on the GPU).

Storage as the kernels see it: float16 buffers are float16 arrays (``f16_to_f32`` /
``f32_to_f16`` convert values, not bit patterns as on the CPU), bfloat16 buffers
are uint16 bit patterns, bool buffers are uint8.
"""
from __future__ import annotations

import numpy as np
from numba.cuda.core import config as _config

# numba.cuda chose the simulator or the driver from this flag when it was imported.
SIMULATOR = bool(_config.ENABLE_CUDASIM)

if SIMULATOR:
    from .sim import (bf16_to_f32, ceil, copysign, erf, erfc, exp, expm1, f32_to_bf16, fabs,  # noqa: F401
                      floor, fmod, load4, load4b, log, log1p, math, pow, roundeven, rsqrt_f32,
                      shfl_xor, shfl_xor_bool, sqrt, store4, tanh)
else:
    from .gpu import (bf16_to_f32, ceil, copysign, erf, erfc, exp, expm1, f32_to_bf16, fabs,  # noqa: F401
                      floor, fmod, load4, load4b, log, log1p, math, pow, roundeven, rsqrt_f32,
                      shfl_xor, shfl_xor_bool, sqrt, store4, tanh)

_F32_0, _F32_1 = np.float32(0.0), np.float32(1.0)
_F64_0, _F64_1 = np.float64(0.0), np.float64(1.0)
_I32_MIN, _I64_MIN = np.int32(-(2 ** 31)), np.int64(-(2 ** 63))
_SELU_SCALE = 1.0507009873554804934193349852946
_SELU_SA = 1.0507009873554804934193349852946 * 1.6732632423543772848170429916717
_SELU_SCALE32, _SELU_SA32 = np.float32(_SELU_SCALE), np.float32(_SELU_SA)
_SELU_SCALE64, _SELU_SA64 = np.float64(_SELU_SCALE), np.float64(_SELU_SA)


# ---- helpers written once (plain Python over the leaves) ------------------------------

def maximum(x, y):
    """TF Maximum: NaN if either is NaN (fmaxf would drop the NaN)."""
    return x if (x > y or x != x) else y


def minimum(x, y):
    return x if (x < y or x != x) else y


def acc_add(a, b):
    return a + b


def acc_mul(a, b):
    return a * b


def f2i32(x):
    """Truncating cast; NaN and out of range give INT32_MIN as TF on x86 (and the CPU
    kernels) do.  A bare cvt.rzi on the GPU would saturate and map NaN to 0."""
    return np.int32(x) if (x >= -2147483648.0 and x < 2147483648.0) else _I32_MIN


def f2i64(x):
    ok = x >= -9223372036854775808.0 and x < 9223372036854775808.0
    return np.int64(x) if ok else _I64_MIN


def f16_to_f32(x):
    return np.float32(x)


def f32_to_f16(x):
    return np.float16(x)


def quant_f16(x):
    """Round a float32 to float16 precision (Cast to float16 inside a kernel)."""
    return np.float32(np.float16(x))


def quant_bf16(x):
    return bf16_to_f32(f32_to_bf16(x))


def b2u8(b):
    return np.uint8(1) if b else np.uint8(0)


def floormod(x, y):
    """TF FloorMod on floats: fmod, then shifted into y's sign."""
    m = fmod(x, y)
    return m + y if (m != 0 and ((y < 0) != (m < 0))) else m


def mean_int(s, n):
    """Integer mean as TF: truncating division; an empty mean is 0."""
    if n == 0:
        return np.int64(0)
    q = s // n
    return q + 1 if (q < 0 and q * n != s) else q


def sigmoid_f32(x):
    """1 / (1 + e^-|x|) for x >= 0, e^-|x| / (1 + e^-|x|) below, NaN kept: the same
    division either way, its numerator selected, so a warp does not diverge over two
    IEEE divisions (on an H200 that split BN + swish warps to 27 of 32 threads)."""
    z = exp(-fabs(x))
    s = (_F32_1 if x >= _F32_0 else z) / (_F32_1 + z)
    return s if x == x else x


def sigmoid_f64(x):
    z = exp(-fabs(x))
    s = (_F64_1 if x >= _F64_0 else z) / (_F64_1 + z)
    return s if x == x else x


def softplus(x, threshold):
    """TF's Softplus thresholds (threshold = log(epsilon) + 2 of the dtype)."""
    e = exp(x)
    return x if x > -threshold else (e if x < threshold else log1p(e))


def elu(x):
    return x if x > 0 else expm1(x)


def selu_f32(x):
    return _SELU_SCALE32 * x if x > 0 else _SELU_SA32 * expm1(x)


def selu_f64(x):
    return _SELU_SCALE64 * x if x > 0 else _SELU_SA64 * expm1(x)


def sin(x):
    """libdevice's sinf / sin by type on a GPU (NumPy's under the simulator)."""
    return math.sin(x)


def cos(x):
    return math.cos(x)


_WRITTEN_ONCE = ("maximum", "minimum", "acc_add", "acc_mul", "f2i32", "f2i64",
                 "f16_to_f32", "f32_to_f16", "quant_f16", "quant_bf16", "b2u8",
                 "floormod", "mean_int", "sigmoid_f32", "sigmoid_f64", "softplus", "elu",
                 "selu_f32", "selu_f64", "sin", "cos")

if not SIMULATOR:
    from numba import cuda as _cuda
    for _name in _WRITTEN_ONCE:
        globals()[_name] = _cuda.jit(device=True, inline=True)(globals()[_name])

# The names lower/exprs.py writes, mapped onto the helpers above.  float32 and float64
# share one (type-generic) definition where the math does not depend on the type.
acc_max, acc_min = maximum, minimum
exp_f32 = exp_f64 = exp_nonpos_f32 = exp_nonpos_f64 = exp
expm1_f32 = expm1_f64 = expm1
log_f32 = log_f64 = log
log1p_f32 = log1p_f64 = log1p
tanh_f32 = tanh_f64 = tanh
erf_f32 = erf_f64 = erf
erfc_f32 = erfc_f64 = erfc
softplus_f32 = softplus_f64 = softplus
elu_f32 = elu_f64 = elu
pow_f32 = pow_f64 = pow
sin_f32 = sin_f64 = sin
cos_f32 = cos_f64 = cos
