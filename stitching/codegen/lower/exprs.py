"""Scalar lowering: one expression per op, shared by every target emitter.

The emitters (cpu.py today, a CUDA emitter later) own the loop structure; this
module owns *what each op computes* on one element, as a Python expression over
argument variable names, typed constants, and helper functions reached as
``h.<name>``.  Each target supplies a helper module with the same names
(cpu/rt.py for the CPU): fabs, sqrt, floor, ceil, roundeven, maximum, minimum,
copysign, the fast-math functions ``<fn>_f32``/``<fn>_f64``, casts ``f2i32``/
``f2i64``/``quant_f16``/``quant_bf16``, ``acc_*`` reduction steps, ``mean_int``.

Security: the only text taken from a spec is none.  Op names select templates
from this table; numbers are re-formatted by ``Consts`` from validated Python
values (repr of a float/int, NaN and Inf through ``math.nan``/``math.inf``).

Semantics follow TensorFlow (checked against TF 2.21 on CPU): NaN propagates
through Maximum/Minimum/Relu/ClipByValue and reductions, Round is half-to-even,
float->int casts truncate (NaN/out of range give INT_MIN as on x86), int32
arithmetic wraps, DivNoNan(x, 0) = 0, Softplus uses TF's thresholds.  float16 and
bfloat16 compute in float32; an explicit Cast to them rounds to their precision.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...ir import dtypes as dt

CD = dt.COMPUTE     # storage dtype -> compute dtype


class Consts:
    """Typed module-level constants: ``name(value, compute_dtype)`` -> identifier.

    ``init=True`` marks a reduction's start value: the CPU emitter passes operands
    of the loop arithmetic through ``h.opaque`` (so LLVM hoists them, see
    intrinsics.opaque) but leaves start values literal, which the vectorizer
    needs to see to split a reduction into lanes."""

    def __init__(self):
        self.names: dict = {}

    def __call__(self, value, cdtype: str, init: bool = False) -> str:
        text = _literal(value, cdtype)
        key = (cdtype, text, init)
        if key not in self.names:
            self.names[key] = f"K{len(self.names)}"
        return self.names[key]

    def definitions(self, prefix: str = "") -> list:
        return [f"{prefix}{name} = np.{cd}({text})" if cd != "bool"
                else f"{prefix}{name} = {text}"
                for (cd, text, _), name in self.names.items()]

    def operands(self) -> list:
        """Names of the float constants that are not reduction start values."""
        return [name for (cd, _, init), name in self.names.items()
                if cd.startswith("float") and not init]


def _literal(value, cdtype: str) -> str:
    if cdtype == "bool":
        return "True" if bool(value) else "False"
    if cdtype in ("int32", "int64"):
        v = int(value)
        bits = 32 if cdtype == "int32" else 64
        v = (v + 2 ** (bits - 1)) % 2 ** bits - 2 ** (bits - 1)   # wrap like TF's cast
        return repr(v)
    v = float(value)
    if math.isnan(v):
        return "math.nan"
    if math.isinf(v):
        return "math.inf" if v > 0 else "-math.inf"
    return repr(v)


def quantize(value, dtype: str):
    """A constant as the tensor dtype stores it (float16/bfloat16 round to nearest even)."""
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return float(np.float16(value))
    if dtype == "bfloat16":
        return float(_round_bf16(np.float32(value)))
    return value


def _round_bf16(x: np.float32) -> np.float32:
    if np.isnan(x):
        return x
    u = int(np.array(x, np.float32).view(np.uint32))
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return np.array(u & 0xFFFFFFFF, np.uint32).view(np.float32)


def _wrap(cd: str, expr: str) -> str:
    """int32 arithmetic is done in 64 bits by Numba; truncate = two's complement wrap."""
    return f"np.int32({expr})" if cd == "int32" else expr


# ---- element-wise ops ---------------------------------------------------------------

def _unary(op, a, cd, ad, node, C):
    x = a[0]
    flt = cd in ("float32", "float64")
    fn = {"float32": "_f32", "float64": "_f64"}.get(ad, "")
    zero, one = C(0, ad), C(1, ad)
    if op == "Neg":
        return _wrap(cd, f"-{x}")
    if op == "Abs":
        return f"h.fabs({x})" if flt else _wrap(cd, f"abs({x})")
    if op == "Square":
        return _wrap(cd, f"{x} * {x}")
    if op == "Sign":
        return f"({one} if {x} > {zero} else (-{one} if {x} < {zero} else {x}))"
    if op == "Sqrt":
        return f"h.sqrt({x})"
    if op == "Rsqrt":
        return f"{one} / h.sqrt({x})"
    if op == "Reciprocal":
        return f"{one} / {x}"
    if op in ("Floor", "Ceil"):
        return f"h.{op.lower()}({x})"
    if op == "Round":
        return f"h.roundeven({x})"
    if op == "Relu":
        return f"h.maximum({x}, {zero})" if flt else _wrap(cd, f"max({x}, {zero})")
    if op == "Relu6":
        six = C(6, ad)
        if flt:
            return f"h.minimum(h.maximum({x}, {zero}), {six})"
        return _wrap(cd, f"min(max({x}, {zero}), {six})")
    if op == "Softsign":
        return f"{x} / ({one} + h.fabs({x}))"
    if op in ("Exp", "Expm1", "Log", "Log1p", "Tanh", "Sigmoid", "Erf", "Erfc", "Elu",
              "Selu", "Sin", "Cos"):
        return f"h.{op.lower()}{fn}({x})"
    if op == "Softplus":
        return f"h.softplus{fn}({x}, {C(_softplus_threshold(node), ad)})"
    if op == "LeakyRelu":
        return f"({x} if {x} > {zero} else {x} * {C(node.attrs['alpha'], ad)})"
    if op == "IsNan":
        return f"({x} != {x})"
    if op == "IsInf":
        return f"(h.fabs({x}) == {C(math.inf, ad)})"
    if op == "IsFinite":
        return f"(h.fabs({x}) < {C(math.inf, ad)})"
    if op == "LogicalNot":
        return f"(not {x})"
    if op == "Identity":
        return x
    raise NotImplementedError(op)


def _softplus_threshold(node) -> float:
    """TF: log(epsilon) + 2 of the op's dtype; float16 kernels run the float32 path."""
    eps = {"float64": 2.0 ** -52, "bfloat16": 2.0 ** -7}.get(node.type.dtype, 2.0 ** -23)
    return math.log(eps) + 2.0


def _binary(op, a, cd, ad, node, C):
    x, y = a
    flt = ad in ("float32", "float64")
    if op in ("Add", "Sub", "Mul"):
        sym = {"Add": "+", "Sub": "-", "Mul": "*"}[op]
        return _wrap(cd, f"{x} {sym} {y}")
    if op in ("Maximum", "Minimum"):
        if flt:
            return f"h.{op.lower()}({x}, {y})"
        return _wrap(cd, f"{'max' if op == 'Maximum' else 'min'}({x}, {y})")
    if op == "SquaredDifference":
        return _wrap(cd, f"({x} - {y}) * ({x} - {y})")
    if op == "Div":
        return f"{x} / {y}"
    if op == "DivNoNan":
        z = C(0, ad)
        return f"({z} if {y} == {z} else {x} / {y})"
    if op == "Pow":
        return f"h.pow{'_f32' if ad == 'float32' else '_f64'}({x}, {y})"
    if op == "FloorDiv":
        return f"h.floor({x} / {y})"
    if op == "FloorMod":
        return f"h.floormod({x}, {y})"
    cmp = {"Equal": "==", "NotEqual": "!=", "Less": "<", "LessEqual": "<=",
           "Greater": ">", "GreaterEqual": ">="}
    if op in cmp:
        return f"({x} {cmp[op]} {y})"
    if op == "LogicalAnd":
        return f"({x} & {y})"
    if op == "LogicalOr":
        return f"({x} | {y})"
    raise NotImplementedError(op)


def _ternary(op, a, cd, ad, node, C):
    if op == "Select":
        c, x, y = a
        return f"({x} if {c} else {y})"
    if op == "ClipByValue":   # TF: min(max(x, lo), hi), NaN-propagating
        x, lo, hi = a
        if cd in ("float32", "float64"):
            return f"h.minimum(h.maximum({x}, {lo}), {hi})"
        return _wrap(cd, f"min(max({x}, {lo}), {hi})")
    raise NotImplementedError(op)


def cast_expr(x: str, src: str, dst: str, C) -> str:
    """Cast between storage dtypes, on compute values."""
    cs, cdst = CD[src], CD[dst]
    if src == dst:
        return x
    if dst == "bool":
        return x if src == "bool" else f"({x} != {C(0, cs)})"
    if src == "bool":
        return f"({C(1, cdst)} if {x} else {C(0, cdst)})"
    if cdst in ("int32", "int64"):
        if cs in ("float32", "float64"):
            return f"h.f2i{cdst[3:]}({x})"
        return f"np.{cdst}({x})"
    v = x if cs == cdst else f"np.{cdst}({x})"
    if dst == "float16":
        return f"h.quant_f16({v})"
    if dst == "bfloat16":
        return f"h.quant_bf16({v})"
    return v


def node_expr(spec, k: int, args: list, C) -> str:
    """Expression for node k given its argument variable names."""
    n = spec.nodes[k]
    op = n.op
    cd = CD[n.type.dtype]
    arg_types = [spec.type_of(a) for a in n.args]
    ad = CD[arg_types[-1].dtype] if arg_types else cd
    if op == "Const":
        return C(quantize(n.attrs["value"], n.attrs["dtype"]), cd)
    if op == "FillLike":
        return C(quantize(n.attrs["value"], n.attrs["dtype"]), cd)
    if op == "Cast":
        return cast_expr(args[0], arg_types[0].dtype, n.type.dtype, C)
    if op == "Reshape":
        return args[0]
    if op == "Pow" and _const_exponent(spec, n) is not None:
        return _pow_const(args[0], _const_exponent(spec, n), cd, C)
    if op == "Div" and cd in ("float32", "float64"):
        r = const_reciprocal(spec, n.args[1], cd)
        if r is not None:
            return f"{args[0]} * {C(r, cd)}"
    if op == "Exp" and cd in ("float32", "float64") and _nonpositive(spec, n.args[0]):
        return f"h.exp_nonpos_{'f32' if cd == 'float32' else 'f64'}({args[0]})"
    arity = len(args)
    if arity == 1 and op not in _REDUCTIONS:
        return _unary(op, args, cd, ad, n, C)
    if op in _REDUCTIONS:        # a reduction over size-1 axes only: identity
        return _degenerate_reduction(op, args[0], cd)
    if arity == 2:
        return _binary(op, args, cd, ad, n, C)
    return _ternary(op, args, cd, ad, n, C)


# Divisors whose reciprocal is a normal number of the compute dtype (so that
# x * (1/d) is x / d up to rounding): 2^-(emax-1) <= |d| <= 2^(emax-1).
RECIPROCAL_RANGE = {"float32": (2.0 ** -126, 2.0 ** 126), "float64": (2.0 ** -1022, 2.0 ** 1022)}


def const_reciprocal(spec, ref, cd: str):
    """1/c (a Python float, rounded to ``cd``) when value ``ref`` is a constant c whose
    reciprocal is normal, else None.  Div(x, c) then lowers to x * (1/c), a multiply
    instead of a divide per element (divides are ~7x a multiply's cost in a vectorized
    loop here: 0.21 against 0.03 ns per float32).  Within rounding of x / c: exact
    when c is a power of two, else within 1.5 ulp (the rounding of 1/c and of the
    product); NaN, +-Inf and +-0 in x give what x / c gives.  XLA's algebraic
    simplifier makes the same rewrite (BERT's erf GELU divides by sqrt(2); in XLA's
    optimized HLO of it that is a multiply)."""
    if ref < 0 or spec.nodes[ref].op != "Const":
        return None
    c = quantize(spec.nodes[ref].attrs["value"], spec.nodes[ref].attrs["dtype"])
    ftype = np.float32 if cd == "float32" else np.float64
    c = ftype(c)
    lo, hi = RECIPROCAL_RANGE[cd]
    if not lo <= abs(float(c)) <= hi:       # NaN, 0, Inf, tiny or huge: divide
        return None
    return float(ftype(1) / c)


def _nonpositive(spec, ref) -> bool:
    """Whether value ``ref`` is <= 0 (or NaN) wherever it is defined: ``a - m`` with
    ``m`` a Max of ``a`` itself kept at rank (keep_dims: each element minus the max
    of the elements it was reduced with), Identity in between allowed.  Softmax's
    shifted logits, as TF's Softmax composite and hand-written softmaxes build
    them."""
    return nonpositive_when(spec, ref) is True


def nonpositive_when(spec, ref):
    """True if value ``ref`` is <= 0 (or NaN) everywhere (``_nonpositive``); the ref of
    a boolean value under which it is, for ``a - where(is_finite(m), m, c)`` with
    ``m`` the kept-rank Max of ``a`` (TF's reduce_logsumexp: where the row's max is
    finite that is ``a - max``; an infinite or NaN max leaves ``a - c``, which may be
    positive); else None."""
    def through(r):
        while r >= 0 and spec.nodes[r].op == "Identity":
            r = spec.nodes[r].args[0]
        return r

    def is_max_of(m, a):
        return (m >= 0 and spec.nodes[m].op == "Max" and spec.nodes[m].args[0] == a
                and bool(spec.nodes[m].attrs.get("keep_dims")))

    if ref < 0 or spec.nodes[ref].op != "Sub":
        return None
    a, s = spec.nodes[ref].args
    s = through(s)
    if is_max_of(s, a):
        return True
    if s < 0 or spec.nodes[s].op != "Select":
        return None
    c, m, _ = spec.nodes[s].args
    m = through(m)
    if (is_max_of(m, a) and c >= 0 and spec.nodes[c].op == "IsFinite"
            and through(spec.nodes[c].args[0]) == m):
        return c
    return None


def _const_exponent(spec, n):
    b = n.args[1]
    if b >= 0 and spec.nodes[b].op == "Const":
        v = float(spec.nodes[b].attrs["value"])
        if v in (0.0, 1.0, 2.0, 3.0, -1.0):
            return v
    return None


def _pow_const(x, v, cd, C):
    """pow(x, small integer) as products: exact for the cases libm is exact, within
    1-2 ulp otherwise (pow(x, 0) = 1 even for NaN, like C)."""
    one = C(1, cd)
    return {0.0: one, 1.0: x, 2.0: f"{x} * {x}", 3.0: f"{x} * {x} * {x}",
            -1.0: f"{one} / {x}"}[v]


_REDUCTIONS = frozenset({"Sum", "Mean", "Prod", "Max", "Min", "All", "Any"})


def _degenerate_reduction(op, x, cd):
    return x


# ---- reductions ---------------------------------------------------------------------

@dataclass(frozen=True)
class Reduction:
    acc: str          # accumulator compute dtype
    init: str         # constant name
    step: str         # template: {a} accumulator, {v} value
    final: str        # template: {a} accumulator, {n} element count (int64 expr)
    # Optional chunked form (float32 sums): a float32 partial per chunk of a row,
    # merged into the float64 accumulator.  Keeps the loop 8 lanes wide (a float64
    # accumulator would make it 4) while bounding the float32 error to one chunk.
    part: str | None = None        # partial accumulator dtype
    part_init: str | None = None
    part_step: str | None = None   # template: {p} partial, {v} value
    merge: str | None = None       # template: {a} accumulator, {p} partial
    # Step for a block of independent accumulators (column kernels: acc[c] updated
    # in place, no cross-lane reduction); None means ``step``.
    block_step: str | None = None


def reduction(spec, k: int, C) -> Reduction:
    n = spec.nodes[k]
    op, cd = n.op, CD[n.type.dtype]
    if cd == "bool":
        init = C(op == "All", "bool", init=True)
        return Reduction("bool", init, "{a} & {v}" if op == "All" else "{a} | {v}", "{a}")
    if cd in ("float32", "float64"):
        if op in ("Sum", "Mean"):   # float32 sums accumulate in float64
            step = "h.acc_add({a}, np.float64({v}))" if cd == "float32" else \
                "h.acc_add({a}, {v})"
            final = "{a} / np.float64({n})" if op == "Mean" else "{a}"
            if cd == "float64":
                return Reduction("float64", C(0.0, "float64", init=True), step, final)
            return Reduction("float64", C(0.0, "float64", init=True), step,
                             f"np.float32({final})",
                             part="float32", part_init=C(0.0, "float32", init=True),
                             part_step="h.acc_add({p}, {v})",
                             merge="{a} + np.float64({p})")
        if op == "Prod":
            return Reduction(cd, C(1.0, cd, init=True), "h.acc_mul({a}, {v})", "{a}")
        init = C(-math.inf if op == "Max" else math.inf, cd, init=True)
        # Row reduction: llvm.maximum with reassoc (vectorizes across lanes).  Column
        # block: the flag-free llvm.maximum; with nsz, or as a compare-select, LLVM
        # turns acc[c] = max(acc[c], v) into a masked store (microcoded on AMD, 5x).
        return Reduction(cd, init, f"h.acc_{op.lower()}({{a}}, {{v}})", "{a}",
                         block_step=f"h.block_{op.lower()}({{a}}, {{v}})")
    # integers: sums and products in int64 (wraps to int32 at the end, like TF's
    # int32 accumulator); Mean of int32 does not wrap in TF (wider accumulator).
    if op in ("Sum", "Mean", "Prod"):
        init = C(1 if op == "Prod" else 0, "int64", init=True)
        step = "{a} * np.int64({v})" if op == "Prod" else "{a} + np.int64({v})"
        final = "h.mean_int({a}, {n})" if op == "Mean" else "{a}"
        return Reduction("int64", init, step, _wrap(cd, final))
    bits = 32 if cd == "int32" else 64
    init = C(-(2 ** (bits - 1)) if op == "Max" else 2 ** (bits - 1) - 1, cd, init=True)
    step = _wrap(cd, f"{'max' if op == 'Max' else 'min'}({{a}}, {{v}})")
    return Reduction(cd, init, step, "{a}")


# ---- cost (cycles per element, rough: the op's shares of work, inline or pool) ---------

def cycles_per_element(spec, passes) -> int:
    """Rough cycles per element of the domain, summed over the schedule's passes: a
    quarter cycle per simple op (vectorized), 3 per transcendental, and a cycle per 4
    bytes a pass streams from memory: the inputs and outputs that vary along the
    leading axis, the first time a pass touches them (a later pass re-reads a row or
    block from cache: a quarter cycle, like an op); per-channel vectors and row
    statistics stay in cache and are not streamed.

    It sizes the op's smallest share of work (op.cc, RunUnits) and, against op.cc's
    InlineCost, decides when work is too small to wake the pool for, so a fused
    kernel must not cost more than the kernels it replaces.  The former estimate (every live node and every input's
    item size, times the number of passes) put the Transformer block's add +
    LayerNorm at 33 cycles per element against 6 + 4 for two of the three kernels an
    unfused plan makes: at batch 1 (128 x 256) the fused kernel woke the pool and
    took 259 us a call, the three inline ones 188 us in all."""
    from ...ir.ops import OPS
    rank = max(len(t.shape) for t in list(spec.inputs) + spec.output_types)

    def streamed(t) -> bool:
        return len(t.shape) == rank and (rank == 0 or t.shape[0] != 1)

    quarters, seen = 0, set()
    for p in passes:
        for k in p.compute:
            quarters += 12 if OPS[spec.nodes[k].op].transcendental else 1
            if spec.nodes[k].op == "DepthwiseConv2D":    # a multiply-add per tap
                fs = spec.type_of(spec.nodes[k].args[1]).shape
                quarters += 2 * fs[0] * fs[1]
        for ref in p.loads:
            t = spec.inputs[ref]                 # loads are input positions
            quarters += dt.ITEMSIZE[t.dtype] if streamed(t) and ref not in seen else 1
            seen.add(ref)
        for k in p.stores:
            t = spec.nodes[k].type
            quarters += dt.ITEMSIZE[t.dtype] if streamed(t) else 1
    return max(1, -(-quarters // 4))
