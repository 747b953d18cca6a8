"""GPU leaves of the CUDA helper namespace (see cuda/rt.py): one line each.

``math.*`` on float32 lowers to libdevice's single-precision function (``expf``,
``erff``, ...) and on float64 to the double one, so one definition serves both
types.  libdevice follows C99 on special values (exp(-inf) = 0, log(0) = -inf,
log(-1) = NaN, sqrt(-1) = NaN), which is what TF's kernels give; accuracy is the
CUDA Math API's (expf 2 ulp, erff 2 ulp, tanhf 2 ulp, powf 4 ulp; double ~1-2 ulp).

Not imported under the CUDA simulator (``numba.cuda.libdevice`` does not exist
there); cuda_sim.py has the same names.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import cuda
from numba.cuda import libdevice, types
from numba.cuda.core.errors import TypingError
from numba.cuda.extending import intrinsic, overload

FULL_MASK = 0xFFFFFFFF   # every lane of the warp takes part in each shuffle

device = cuda.jit(device=True, inline=True)


@device
def exp(x):
    return math.exp(x)


@device
def expm1(x):
    return math.expm1(x)


@device
def log(x):
    return math.log(x)


@device
def log1p(x):
    return math.log1p(x)


@device
def tanh(x):
    return math.tanh(x)


@device
def erf(x):
    return math.erf(x)


@device
def erfc(x):
    return math.erfc(x)


@device
def sqrt(x):
    return math.sqrt(x)


@device
def fabs(x):
    return math.fabs(x)


@device
def floor(x):      # numba-cuda's math.floor keeps the float type (CPU numba gives int)
    return math.floor(x)


@device
def ceil(x):
    return math.ceil(x)


@device
def fmod(x, y):
    return math.fmod(x, y)


@device
def copysign(x, y):
    return math.copysign(x, y)


@device
def pow(x, y):     # noqa: A001 - the name lower/exprs.py's pow_f32/pow_f64 map to
    return math.pow(x, y)


@device
def rsqrt_f32(x):
    """TF's float32 Rsqrt as TF's GPU kernel computes it: CUDA's rsqrtf (Eigen's prsqrt
    on float4; 2 ulp, one MUFU.RSQ instead of an IEEE square root and an IEEE
    division)."""
    return libdevice.rsqrtf(x)


def roundeven(x):
    """Half-to-even rounding (TF Round): rintf / rint by type."""


@overload(roundeven, target="cuda")
def _roundeven(x):
    if x == np.float32 or str(x) == "float32":
        return lambda x: libdevice.rintf(x)
    return lambda x: libdevice.rint(x)


@device
def shfl_xor(v, off):
    return cuda.shfl_xor_sync(FULL_MASK, v, off)


@device
def shfl_xor_bool(v, off):
    return cuda.shfl_xor_sync(FULL_MASK, np.int32(1) if v else np.int32(0), off) != 0


@device
def bf16_to_f32(u):
    return libdevice.int_as_float(np.int32(np.int64(u) << 16))


@device
def f32_to_bf16(x):
    """Round to nearest even; NaN stays a quiet NaN with its sign."""
    u = np.int64(libdevice.float_as_int(x))
    if x != x:
        return np.uint16(((u >> 16) | 0x40) & 0xFFFF)
    return np.uint16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)


# ---- 16-byte vector loads and stores (the element-wise kernel's wide path) -------------
# numba-cuda loads one array element per instruction; these load/store four 4-byte
# elements as one <4 x T> with align 16, which NVPTX emits as ld.global.v4 / st.global.v4.
# The caller guarantees the element index is a multiple of 4 and the buffer's base is
# 16-byte aligned (cuda_launch checks both before choosing the kernel that calls them).

def _vec_ptr(context, builder, aryty, ary, index):
    data = context.make_array(aryty)(context, builder, value=ary).data
    vty = ir.VectorType(context.get_data_type(aryty.dtype), 4)
    return builder.bitcast(builder.gep(data, [index]), vty.as_pointer())


def _load4_intrinsic(bits: int, align: int):
    """An intrinsic loading elements i..i+3 of a 1-D array of ``bits``-bit elements as one
    <4 x T> access of ``align`` bytes, returned as a 4-tuple."""
    def typer(typingctx, ary, index):
        if not isinstance(ary, types.Array) or ary.dtype.bitwidth != bits or ary.ndim != 1:
            raise TypingError(f"needs a 1-D array of a {bits}-bit type")
        sig = types.UniTuple(ary.dtype, 4)(ary, index)

        def codegen(context, builder, sig, args):
            v = builder.load(_vec_ptr(context, builder, sig.args[0], *args), align=align)
            vals = [builder.extract_element(v, ir.Constant(ir.IntType(32), e))
                    for e in range(4)]
            return context.make_tuple(builder, sig.return_type, vals)
        return sig, codegen
    typer.__name__ = typer.__qualname__ = f"load4_{bits}bit"   # numba names intrinsics by it
    return typer


# 4-byte elements, one 16-byte access (ld.global.v4.b32)
load4 = intrinsic(_load4_intrinsic(32, 16))
# 1-byte elements (bool inputs), one 4-byte access; the index a multiple of 4, the base
# 4-byte aligned (the host checks 16, as for load4)
load4b = intrinsic(_load4_intrinsic(8, 4))


@intrinsic
def store4(typingctx, ary, index, a, b, c, d):
    if not isinstance(ary, types.Array) or ary.dtype.bitwidth != 32 or ary.ndim != 1:
        raise TypingError("store4 needs a 1-D array of a 32-bit type")
    sig = types.void(ary, index, a, b, c, d)

    def codegen(context, builder, sig, args):
        ptr = _vec_ptr(context, builder, sig.args[0], args[0], args[1])
        v = ir.Constant(ptr.type.pointee, ir.Undefined)
        for e, (val, ty) in enumerate(zip(args[2:], sig.args[2:])):
            val = context.cast(builder, val, ty, sig.args[0].dtype)
            v = builder.insert_element(v, val, ir.Constant(ir.IntType(32), e))
        builder.store(v, ptr, align=16)
        return context.get_dummy_value()
    return sig, codegen
