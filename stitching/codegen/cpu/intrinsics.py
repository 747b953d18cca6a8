"""Small LLVM-level helpers for generated kernels (numba ``@intrinsic``).

Why intrinsics and not plain Numba code:

* typed pointers from ``void*`` with no index wrap-around checks, so a load
  ``x[base + j]`` is one affine GEP the loop vectorizer understands;
* exact control of fast-math flags *per instruction*: kernels compile with none
  (not even ``contract``); the reduction accumulators alone carry ``reassoc nsz`` (what the
  vectorizer needs to split a sum or a max into lanes), so user arithmetic is never
  reassociated and NaN/Inf semantics stay IEEE;
* NaN-propagating ``llvm.maximum``/``llvm.minimum`` (TF's Maximum and reduce_max
  propagate NaN; LLVM 20 vectorizes these reductions);
* bit casts and 16-bit float encode/decode written as integer ops on i32 lanes
  (Numba's own integer typing would widen everything to int64 and stop
  vectorization).

Every helper here is branch-free and inlines into the caller's loop.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

_F32, _F64 = ir.FloatType(), ir.DoubleType()
_I16, _I32, _I64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
_ACC_FLAGS = ("reassoc", "nsz")

# ---- typed pointers ----------------------------------------------------------------


def _ptr_intrinsic(elem):
    @intrinsic
    def cast(typingctx, p):
        if not isinstance(p, (types.RawPointer, types.CPointer)):
            raise TypingError("expected a pointer")
        sig = types.CPointer(elem)(p)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], context.get_value_type(sig.return_type))
        return sig, codegen
    return cast


ptr_float32 = _ptr_intrinsic(types.float32)
ptr_float64 = _ptr_intrinsic(types.float64)
ptr_int32 = _ptr_intrinsic(types.int32)
ptr_int64 = _ptr_intrinsic(types.int64)
ptr_uint8 = _ptr_intrinsic(types.uint8)
ptr_uint16 = _ptr_intrinsic(types.uint16)


@intrinsic
def ptr_offset(typingctx, p, n):
    """``p + n`` elements, same pointer type: a view's first element (its source's
    pointer moved by the view's constant offset, schedule/layout.py)."""
    if not isinstance(p, types.CPointer) or not isinstance(n, types.Integer):
        raise TypingError("expected a typed pointer and an integer")
    sig = p(p, types.int64)

    def codegen(context, builder, sig, args):
        # not inbounds: a guarded view's first element may lie before its source's
        # (it is never loaded there, schedule/layout.py View.guards)
        return builder.gep(args[0], [args[1]])
    return sig, codegen


@intrinsic
def aligned_alloc(typingctx, nbytes):
    """64-byte aligned heap block of at least ``nbytes`` (never zero-initialized)."""
    sig = types.voidptr(types.int64)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(cgutils.voidptr_t, [_I64, _I64])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "aligned_alloc")
        n = builder.add(args[0], ir.Constant(_I64, 127))
        n = builder.and_(n, ir.Constant(_I64, ~63))        # multiple of 64, >= 64
        return builder.call(fn, [ir.Constant(_I64, 64), n])
    return sig, codegen


@intrinsic
def free(typingctx, p):
    if not isinstance(p, (types.RawPointer, types.CPointer)):
        raise TypingError("expected a pointer")
    sig = types.void(p)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "free")
        builder.call(fn, [builder.bitcast(args[0], cgutils.voidptr_t)])
        return context.get_dummy_value()
    return sig, codegen


# ---- LLVM math intrinsics on float32/float64 ---------------------------------------

def _check_floats(*tys):
    if not all(isinstance(t, types.Float) for t in tys) or len(set(tys)) != 1:
        raise TypingError(f"expected matching float arguments, got {tys}")
    return tys[0]


def _llvm_fn(name, nargs, flags=()):
    def typer(typingctx, *args):
        t = _check_floats(*args)
        sig = t(*args)

        def codegen(context, builder, sig, llargs):
            ty = llargs[0].type
            f = builder.module.declare_intrinsic(name, [ty], ir.FunctionType(ty, [ty] * nargs))
            return builder.call(f, llargs, fastmath=flags)
        return sig, codegen

    # numba's @intrinsic needs a fixed arity in the Python signature
    if nargs == 1:
        def fn(typingctx, a):
            return typer(typingctx, a)
    elif nargs == 2:
        def fn(typingctx, a, b):
            return typer(typingctx, a, b)
    else:
        def fn(typingctx, a, b, c):
            return typer(typingctx, a, b, c)
    fn.__name__ = name.replace(".", "_")
    return intrinsic(fn)


fabs = _llvm_fn("llvm.fabs", 1)
sqrt = _llvm_fn("llvm.sqrt", 1)
floor = _llvm_fn("llvm.floor", 1)
ceil = _llvm_fn("llvm.ceil", 1)
trunc = _llvm_fn("llvm.trunc", 1)
roundeven = _llvm_fn("llvm.roundeven", 1)   # half to even (TF Round)
fma = _llvm_fn("llvm.fma", 3)                # one rounding; never re-associated
copysign = _llvm_fn("llvm.copysign", 2)
maximum = _llvm_fn("llvm.maximum", 2)        # NaN-propagating max (TF Maximum)
minimum = _llvm_fn("llvm.minimum", 2)
acc_max = _llvm_fn("llvm.maximum", 2, _ACC_FLAGS)
acc_min = _llvm_fn("llvm.minimum", 2, _ACC_FLAGS)


@intrinsic
def prefetch(typingctx, p, i):
    """Hint the cache line holding ``p[i]`` into L1 (``llvm.prefetch``, read, high
    locality); never faults, even past the end of a buffer."""
    if not isinstance(p, types.CPointer) or not isinstance(i, types.Integer):
        raise TypingError("expected (typed pointer, integer index)")
    sig = types.void(p, i)

    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        addr = builder.bitcast(builder.gep(args[0], [args[1]]), i8p)
        f = builder.module.declare_intrinsic(
            "llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p] + [_I32] * 3))
        builder.call(f, [addr, ir.Constant(_I32, 0), ir.Constant(_I32, 3),
                         ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return sig, codegen


# ---- non-temporal (streaming) stores ------------------------------------------------
# A kernel writing a large output stages each chunk of it in a small buffer that stays
# in L1, then copies the chunk out with these (cpu_rt.stream): a 64-byte store that
# bypasses the caches skips the read for ownership a normal store pays for a line that
# is not cached, a third of a streaming kernel's memory traffic (codegen/cpu/emitter.py,
# STREAM_MIN_BYTES, has the measurements).

LINE = 64   # bytes per non-temporal store: a cache line (one AVX-512 register)


def _check_pointer(p):
    if not isinstance(p, types.CPointer):
        raise TypingError(f"expected a typed pointer, got {p}")
    return p.dtype.bitwidth // 8


@intrinsic
def stream(typingctx, dst, i, src, j, n):
    """``dst[i : i + n] = src[j : j + n]``: the 64-byte lines of ``dst`` that the
    range covers whole as non-temporal stores (``!nontemporal``: vmovntps and the
    like on x86), the ragged ends as ordinary ones; ``src`` may be unaligned.  These
    stores are not ordered with others: the kernel ends with ``store_fence``.

    Written as IR (_stream_function), not as a Numba function: a call to one returns
    a status the caller must check, which links Numba's exception runtime into the
    kernel."""
    size = _check_pointer(dst)
    if src != dst or not all(isinstance(t, types.Integer) for t in (i, j, n)):
        raise TypingError("expected (pointer, index, pointer of the same type, index, "
                          "count)")
    sig = types.void(dst, i, src, j, n)

    def codegen(context, builder, sig, args):
        d, di, s, si, cnt = [context.cast(builder, a, t, types.int64)
                             if isinstance(t, types.Integer) else a
                             for a, t in zip(args, sig.args)]
        fn = _stream_function(builder.module, d.type, size)
        builder.call(fn, [d, di, s, si, cnt])
        return context.get_dummy_value()
    return sig, codegen


def _stream_function(module, ptr, size: int):
    """The copy loops of ``stream`` as one internal function per module and element
    type: written out at every call site (five in a column kernel), the copies of
    its three loops added ~0.03 s of LLVM time to each kernel's compile."""
    name = "stitching_stream_" + "".join(ch if ch.isalnum() else "_" for ch in str(ptr.pointee))
    try:
        fn = module.get_global(name)
    except KeyError:
        fn = None
    if fn is not None:
        return fn
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [ptr, _I64, ptr, _I64, _I64]),
                     name)
    fn.linkage = "internal"
    fn.attributes.add("noinline")     # one copy; a call per chunk of >= 1 KiB is cheap
    d, di, s, si, cnt = fn.args
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    zero = ir.Constant(_I64, 0)
    cnt = builder.select(builder.icmp_signed("<", cnt, zero), zero, cnt)
    vec = ir.VectorType(ptr.pointee, LINE // size)
    shift = ir.Constant(_I64, size.bit_length() - 1)

    def copy(c):              # one element, an ordinary store
        v = builder.load(builder.gep(s, [builder.add(si, c)]), align=size)
        builder.store(v, builder.gep(d, [builder.add(di, c)]), align=size)

    # elements up to the first 64-byte boundary of dst (all of them when dst is not
    # aligned to its element size: then no element ever starts a line)
    a = builder.add(builder.ptrtoint(d, _I64), builder.shl(di, shift))
    gap = builder.lshr(builder.and_(builder.sub(zero, a), ir.Constant(_I64, LINE - 1)),
                       shift)
    odd = builder.icmp_unsigned("!=", builder.and_(a, ir.Constant(_I64, size - 1)), zero)
    head = builder.select(odd, cnt, gap)
    head = builder.select(builder.icmp_signed("<", head, cnt), head, cnt)
    with cgutils.for_range(builder, head) as loop:
        copy(loop.index)
    lshift = ir.Constant(_I64, (LINE // size).bit_length() - 1)
    lines = builder.ashr(builder.sub(cnt, head), lshift)
    with cgutils.for_range(builder, lines) as loop:
        c = builder.add(head, builder.shl(loop.index, lshift))
        v = builder.load(builder.bitcast(builder.gep(s, [builder.add(si, c)]),
                                         vec.as_pointer()), align=size)
        st = builder.store(v, builder.bitcast(builder.gep(d, [builder.add(di, c)]),
                                              vec.as_pointer()), align=LINE)
        st.set_metadata("nontemporal", module.add_metadata([ir.Constant(_I32, 1)]))
    done = builder.add(head, builder.shl(lines, lshift))
    with cgutils.for_range(builder, builder.sub(cnt, done)) as loop:
        copy(builder.add(done, loop.index))
    builder.ret_void()
    return fn


@intrinsic
def store_fence(typingctx):
    """A full fence (``mfence`` on x86): this thread's non-temporal stores are
    visible before anything it stores after, so before the op's thread pool reports
    the work done."""
    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM vectorize the calling function with the CPU's widest registers.

    LLVM's tuning for recent Intel server cores (Skylake-SP on) prefers 256-bit
    vectors even where AVX-512 exists; this sets the calling function's
    ``"prefer-vector-width"="512"`` attribute (per function, not Numba's process-wide
    target options, which the user's own Numba code shares).  On CPUs without
    AVX-512 it changes nothing.  Measured on a 2-core Xeon (Emerald Rapids): exp over
    L1-resident floats 0.40 -> 0.30 ns per element."""
    def codegen(context, builder, sig, args):
        # llvmlite knows only enum attributes by name; a string attribute is
        # printed as given, so it goes into the set directly
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()
    return types.void(), codegen


@intrinsic
def opaque(typingctx, a):
    """``a`` itself, as a value LLVM cannot fold (``llvm.arithmetic.fence``).

    For the float constants of the fastmath helpers and of generated kernels: a
    constant the loop needs as a vector is either kept in a register or re-made from
    the constant pool each iteration, and with 20-30 constants in a loop (erf, exp,
    erfc) and 16 vector registers LLVM re-makes them (under Numba's large code model
    a ``movabs`` + broadcast each).  An opaque value is hoisted out of the loop once
    and, when registers run out, spilled to the stack and folded into the arithmetic
    as a memory operand: measured 4.13 -> 3.36 ms for bias + GELU(erf) over 8M
    floats, bit-identical results."""
    t = _check_floats(a)
    sig = t(t)

    def codegen(context, builder, sig, args):
        ty = args[0].type
        f = builder.module.declare_intrinsic("llvm.arithmetic.fence", [ty],
                                             ir.FunctionType(ty, [ty]))
        return builder.call(f, args)
    return sig, codegen


@intrinsic
def same_address(typingctx, p, q):
    """Whether two ``void*`` are one address (an in-place kernel's input and output:
    codegen/cpu/emitter.py picks the loop nest that stores through the input)."""
    if p != types.voidptr or q != types.voidptr:
        raise TypingError("same_address takes two voidptr")
    sig = types.boolean(types.voidptr, types.voidptr)

    def codegen(context, builder, sig, args):
        a, b = (builder.ptrtoint(v, _I64) for v in args)
        return builder.icmp_unsigned("==", a, b)
    return sig, codegen


@intrinsic
def opaque_int(typingctx, a):
    """An int64 ``a`` LLVM cannot see the value of (an empty inline asm returning it
    in a register).  For the bound of a row's chunk loop (codegen/cpu/emitter.py): with a row length
    known at compile time LLVM fully unrolls a short float32 partial sum into a
    near-linear chain (64 positive values: 5.2 ulp off float64 against 1.7 for the
    vectorized tree it builds when the length is a run-time value)."""
    if not isinstance(a, types.Integer):
        raise TypingError("opaque_int takes an integer")
    sig = types.int64(types.int64)

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_I64, [_I64])
        return builder.asm(fnty, "", "=r,0", [args[0]], side_effect=False)
    return sig, codegen


def _acc_binop(op):
    @intrinsic
    def fn(typingctx, a, b):
        t = _check_floats(a, b)
        sig = t(a, b)

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1], flags=_ACC_FLAGS)
        return sig, codegen
    return fn


@intrinsic
def fmod(typingctx, a, b):
    """C fmod (LLVM frem): exact remainder with the sign of a."""
    t = _check_floats(a, b)
    sig = t(a, b)

    def codegen(context, builder, sig, args):
        return builder.frem(args[0], args[1])
    return sig, codegen


acc_add = _acc_binop("fadd")   # reduction step: may be split into vector lanes
acc_mul = _acc_binop("fmul")


# ---- bit casts -----------------------------------------------------------------------

def _bitcast(src, dst):
    @intrinsic
    def fn(typingctx, x):
        if x != src:
            raise TypingError(f"expected {src}, got {x}")
        sig = dst(x)

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], context.get_value_type(dst))
        return sig, codegen
    return fn


f32_bits = _bitcast(types.float32, types.int32)
bits_f32 = _bitcast(types.int32, types.float32)
f64_bits = _bitcast(types.float64, types.int64)
bits_f64 = _bitcast(types.int64, types.float64)


def _pow2_bits(builder, n):
    """float32 2**n from an i32 n in [-126, 127] (exponent field)."""
    e = builder.shl(builder.add(n, ir.Constant(_I32, 127)), ir.Constant(_I32, 23))
    return builder.bitcast(e, _F32)


@intrinsic
def exp2i_f32(typingctx, n_f):
    """2.0**n for a float32 n holding an integer in [-126, 127]."""
    sig = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        return _pow2_bits(builder, builder.fptosi(args[0], _I32))
    return sig, codegen


@intrinsic
def ldexp_f32(typingctx, y, n_f):
    """y * 2**n for a float32 n holding an integer in [-252, 254], in two exact
    power-of-two steps so neither intermediate overflows (subnormal results are
    rounded once, by the second step)."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, sig, args):
        n = builder.fptosi(args[1], _I32)
        n1 = builder.ashr(n, ir.Constant(_I32, 1))
        n2 = builder.sub(n, n1)
        t = builder.fmul(args[0], _pow2_bits(builder, n1))
        return builder.fmul(t, _pow2_bits(builder, n2))
    return sig, codegen


@intrinsic
def f32_exponent(typingctx, x):
    """Unbiased exponent + 1 of a normal float32, as float32 (x = m 2^e, m in [.5, 1))."""
    sig = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        b = builder.bitcast(args[0], _I32)
        e = builder.and_(builder.lshr(b, ir.Constant(_I32, 23)), ir.Constant(_I32, 0xFF))
        return builder.sitofp(builder.sub(e, ir.Constant(_I32, 126)), _F32)
    return sig, codegen


@intrinsic
def f32_mantissa_half(typingctx, x):
    """float32 with x's mantissa and exponent of 0.5: m in [0.5, 1) for normal x > 0."""
    sig = types.float32(types.float32)

    def codegen(context, builder, sig, args):
        b = builder.bitcast(args[0], _I32)
        b = builder.and_(b, ir.Constant(_I32, 0x007FFFFF))
        b = builder.or_(b, ir.Constant(_I32, 0x3F000000))
        return builder.bitcast(b, _F32)
    return sig, codegen


# ---- float -> int with TF's x86 semantics ----------------------------------------------

def _f2i(dst):
    bits = dst.bitwidth

    @intrinsic
    def fn(typingctx, x):
        if not isinstance(x, types.Float):
            raise TypingError("expected a float")
        sig = dst(x)

        def codegen(context, builder, sig, args):
            v = args[0]
            lo = ir.Constant(v.type, -float(2 ** (bits - 1)))
            hi = ir.Constant(v.type, float(2 ** (bits - 1)))
            ok = builder.and_(builder.fcmp_ordered(">=", v, lo),
                              builder.fcmp_ordered("<", v, hi))
            safe = builder.select(ok, v, ir.Constant(v.type, 0.0))
            i = builder.fptosi(safe, ir.IntType(bits))
            return builder.select(ok, i, ir.Constant(ir.IntType(bits), -(2 ** (bits - 1))))
        return sig, codegen
    return fn


f2i32 = _f2i(types.int32)   # truncates; NaN / out of range -> INT32_MIN (as TF on x86)
f2i64 = _f2i(types.int64)


# ---- 16-bit floats (storage only; compute is float32) ----------------------------------

@intrinsic
def bf16_to_f32(typingctx, h):
    sig = types.float32(types.uint16)

    def codegen(context, builder, sig, args):
        w = builder.shl(builder.zext(args[0], _I32), ir.Constant(_I32, 16))
        return builder.bitcast(w, _F32)
    return sig, codegen


@intrinsic
def f32_to_bf16(typingctx, x):
    """Round to nearest even; NaN stays a quiet NaN with its sign."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, sig, args):
        c = lambda v: ir.Constant(_I32, v)   # noqa: E731
        u = builder.bitcast(args[0], _I32)
        lsb = builder.and_(builder.lshr(u, c(16)), c(1))
        r = builder.lshr(builder.add(builder.add(u, c(0x7FFF)), lsb), c(16))
        q = builder.or_(builder.lshr(u, c(16)), c(0x40))
        isnan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.trunc(builder.select(isnan, q, r), _I16)
    return sig, codegen


@intrinsic
def f16_to_f32(typingctx, h):
    """IEEE half bits -> float32, exact (normals, subnormals, Inf, NaN)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, sig, args):
        c = lambda v: ir.Constant(_I32, v)   # noqa: E731
        w = builder.shl(builder.zext(args[0], _I32), c(16))
        sign = builder.and_(w, c(0x80000000 - 2 ** 32))
        two_w = builder.add(w, w)
        norm = builder.bitcast(builder.add(builder.lshr(two_w, c(4)), c(0xE0 << 23)), _F32)
        norm = builder.fmul(norm, ir.Constant(_F32, 2.0 ** -112))
        den = builder.bitcast(builder.or_(builder.lshr(two_w, c(17)), c(126 << 23)), _F32)
        den = builder.fsub(den, ir.Constant(_F32, 0.5))
        small = builder.icmp_unsigned("<", two_w, c(1 << 27))
        mag = builder.select(small, builder.bitcast(den, _I32), builder.bitcast(norm, _I32))
        return builder.bitcast(builder.or_(sign, mag), _F32)
    return sig, codegen


@intrinsic
def f32_to_f16(typingctx, x):
    """float32 -> IEEE half bits, round to nearest even, overflow to Inf, NaN kept."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, sig, args):
        c = lambda v: ir.Constant(_I32, v if v < 2 ** 31 else v - 2 ** 32)   # noqa: E731
        f = args[0]
        fabs_fn = builder.module.declare_intrinsic("llvm.fabs", [_F32],
                                                   ir.FunctionType(_F32, [_F32]))
        base = builder.fmul(builder.call(fabs_fn, [f]), ir.Constant(_F32, 2.0 ** 112))
        base = builder.fmul(base, ir.Constant(_F32, 2.0 ** -110))
        w = builder.bitcast(f, _I32)
        shl1 = builder.add(w, w)
        sign = builder.and_(w, c(0x80000000))
        bias = builder.and_(shl1, c(0xFF000000))
        low = builder.icmp_unsigned("<", bias, c(0x71000000))
        bias = builder.select(low, c(0x71000000), bias)
        adj = builder.bitcast(builder.add(builder.lshr(bias, c(1)), c(0x07800000)), _F32)
        base = builder.bitcast(builder.fadd(adj, base), _I32)
        exp_bits = builder.and_(builder.lshr(base, c(13)), c(0x7C00))
        mant = builder.and_(base, c(0x0FFF))
        nonsign = builder.add(exp_bits, mant)
        isnan = builder.icmp_unsigned(">", shl1, c(0xFF000000))
        mag = builder.select(isnan, c(0x7E00), nonsign)
        return builder.trunc(builder.or_(builder.lshr(sign, c(16)), mag), _I16)
    return sig, codegen
