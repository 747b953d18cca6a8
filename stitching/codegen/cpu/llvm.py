"""Direct LLVM backend: a kernel module's text -> an llvmlite IR module, no Numba front end.

The Numba path (compile/native.py) hands the generated module (cpu/emitter.py) to
Numba: bytecode analysis, type inference over ~40 templates per operator, lowering
through Numba's data models, then LLVM.  For these kernels that front end is ~60%
of a cold compile (BENCHMARKS.md, "compile phases"), ~2 ms per generated line.  Yet
the emitter writes a very small language: one function of int64, float32/float64,
bool and typed-pointer scalars; assignments, ``for .. in range``, ``while``,
``if``/``else``, ``continue``; + - * / // % & |, comparisons, ``x if c else y``,
``np.<dtype>(x)`` casts, ``min``/``max``/``abs`` and calls of ``h.<name>``.  This
module types that language by Numba's rules for scalars and writes the IR itself,
from the same text, so both backends run the same loop nests:

    module text ─ast─► types (fixed point over assignments) ─► llvmlite.ir.Module
        the body as ``void stitching_body(i64, i64, i8**, i8**, i64*)`` (op.cc's ABI)

What a call of ``h.<name>`` becomes is the caller's (``Calls``, compile/native.py):
there, Numba's own code for the helper -- an intrinsic's IR generator run on this
builder, or a helper function's compiled library linked in -- so the math is the
very code the Numba path inlines (same numerics, bit for bit).

Numba's typing, as far as this language reaches (numba/core/typing/builtins.py):
integer arithmetic is int64 (int32 values widen; the emitter wraps int32 results with
``np.int32``); an integer with a float is float64; two floats give the wider; ``/`` of
integers is float64; ``//`` and ``%`` of integers floor (Python), 0 for a 0 divisor
(error_model='numpy'); a float literal is float64, an integer literal int64; the two
arms of ``x if c else y`` unify (float32 with float64: float64).  Float arithmetic
carries no fast-math flags (cpu/rt.py FASTMATH: none); the reduction accumulators'
``reassoc nsz`` come with the acc_* intrinsics, as on the Numba path.

Anything outside this language raises Unsupported with the construct named: the
kernel is then built by the Numba path (kernel.py records the reason).  The text is
the emitter's own (kernel.py never passes text from a graph): module constants are
read from ``np.<dtype>(<number>)`` literals with ``ast``, nothing is evaluated.
"""
from __future__ import annotations

import ast
import math

from llvmlite import ir

BODY_ARGS = ("begin", "end", "ins", "outs", "dims")


class Unsupported(Exception):
    """The text uses something this backend does not translate (the message says what)."""


# -- scalar types ---------------------------------------------------------------------
# Types are Numba's type objects (the helpers' typers and code generators take them);
# imported on first use, as every caller already runs Numba's compiler.

def _numba_types():
    from numba import types
    return types


class _Types:
    def __init__(self):
        t = _numba_types()
        self.t = t
        self.i64, self.f32, self.f64, self.b = t.int64, t.float32, t.float64, t.boolean
        self.np_casts = {"float32": t.float32, "float64": t.float64, "int32": t.int32,
                         "int64": t.int64, "uint8": t.uint8, "uint16": t.uint16}

    def is_int(self, ty):
        return isinstance(ty, self.t.Integer)

    def is_float(self, ty):
        return isinstance(ty, self.t.Float)

    def is_ptr(self, ty):
        return isinstance(ty, (self.t.CPointer, self.t.RawPointer))

    def unify(self, a, b):
        """Numba's unification of two assignments' (or two arms') types."""
        if a is None or a == b:
            return b
        if b is None:
            return a
        if self.is_float(a) and self.is_float(b):
            return self.f64
        if self.is_int(a) and self.is_int(b) and a.signed and b.signed:
            return self.i64
        if (self.is_int(a) and self.is_float(b)) or (self.is_float(a) and self.is_int(b)):
            return self.f64
        raise Unsupported(f"cannot unify {a} and {b}")

    def arith(self, a, b):
        """Result type of + - * between scalars (Numba: integers in int64)."""
        if self.is_float(a) or self.is_float(b):
            if self.is_float(a) and self.is_float(b):
                return self.f64 if self.f64 in (a, b) else self.f32
            return self.f64
        if self.is_int(a) and self.is_int(b):
            if not (a.signed and b.signed):
                raise Unsupported(f"unsigned arithmetic ({a}, {b})")
            return self.i64
        raise Unsupported(f"arithmetic on {a} and {b}")


# -- module constants -------------------------------------------------------------------

def _number(node) -> float | int:
    """A numeric literal as the emitter writes one: 1.5, -3, math.nan, -math.inf."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_number(node.operand)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "math" and node.attr in ("nan", "inf"):
        return math.nan if node.attr == "nan" else math.inf
    raise Unsupported(f"module constant {ast.dump(node)[:80]}")


def _table(v) -> tuple | None:
    """``np.array([<ints>], dtype=np.uint8)`` (a view's piece selector or guard,
    cpu/emitter.py _tables) -> its values, else None."""
    if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
            and v.func.attr == "array" and len(v.args) == 1
            and isinstance(v.args[0], ast.List)
            and [(k.arg, getattr(k.value, "attr", None)) for k in v.keywords]
            == [("dtype", "uint8")]):
        return None
    vals = tuple(_number(x) for x in v.args[0].elts)
    if not all(isinstance(x, int) and 0 <= x < 256 for x in vals):
        raise Unsupported("a table value outside uint8")
    return vals


def _constants(tree, T) -> dict:
    """Module-level ``_K<n> = np.<dtype>(<number>)`` (or a bool literal) -> (type,
    value); a uint8 table -> (uint8 pointer, its values): Numba types it as an array,
    but the emitter only indexes it within its bounds, where the two load the same."""
    out = {}
    for st in tree.body:
        if isinstance(st, (ast.Import, ast.ImportFrom, ast.FunctionDef)):
            continue
        if not (isinstance(st, ast.Assign) and len(st.targets) == 1
                and isinstance(st.targets[0], ast.Name)):
            raise Unsupported(f"module statement {ast.dump(st)[:80]}")
        v = st.value
        if isinstance(v, ast.Constant) and isinstance(v.value, bool):
            out[st.targets[0].id] = (T.b, v.value)
        elif (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)
              and isinstance(v.func.value, ast.Name) and v.func.value.id == "np"
              and v.func.attr in T.np_casts and len(v.args) == 1):
            out[st.targets[0].id] = (T.np_casts[v.func.attr], _number(v.args[0]))
        elif _table(v) is not None:
            out[st.targets[0].id] = (T.t.CPointer(T.t.uint8), _table(v))
        else:
            raise Unsupported(f"module constant {st.targets[0].id} "
                              f"({ast.dump(v)[:60]}): only np.<dtype>(<number>) scalars")
    return out


# -- the translator ---------------------------------------------------------------------

def _abi_slot(node) -> bool:
    """``ins[i]``, ``outs[o]`` or ``dims[d]`` at a literal index: always readable."""
    return (isinstance(node.value, ast.Name) and node.value.id in ("ins", "outs", "dims")
            and isinstance(node.slice, ast.Constant))


class _Loop:
    def __init__(self, cont, brk):
        self.cont, self.brk = cont, brk


class Translator:
    """One kernel module's ``body`` -> a function in a new llvmlite module.

    ``calls``: the helper-call provider, an object with
        ``type_call(name, argtypes) -> return type`` (raises Unsupported) and
        ``emit_call(name, builder, argtypes, args) -> (value, return type)``."""

    def __init__(self, text: str, calls, symbol: str, context):
        self.T = _Types()
        self.calls = calls
        # Numba's target context (error model 'numpy'): the LLVM types of its types,
        # and its lowering of integer // and %
        self.context = context
        tree = ast.parse(text)
        self.consts = _constants(tree, self.T)
        fns = [st for st in tree.body if isinstance(st, ast.FunctionDef)]
        if len(fns) != 1 or fns[0].name != "body" or \
                tuple(a.arg for a in fns[0].args.args) != BODY_ARGS:
            raise Unsupported("the module must define body(begin, end, ins, outs, dims) only")
        self.fn_ast = fns[0]
        self.symbol = symbol
        t = self.T.t
        self.vars: dict = {"begin": t.int64, "end": t.int64, "ins": t.CPointer(t.voidptr),
                           "outs": t.CPointer(t.voidptr), "dims": t.CPointer(t.int64)}
        self._infer()

    # ---- typing: every variable's type, unified over its assignments ------------------
    def _infer(self) -> None:
        for _ in range(64):
            self._changed = False
            self._type_block(self.fn_ast.body)
            if not self._changed:
                break
        else:
            raise Unsupported("types do not settle")
        self._final = True
        self._type_block(self.fn_ast.body)      # every expression typed, or raise

    _final = False

    def _assign_type(self, name: str, ty) -> None:
        if ty is None:
            return
        new = self.T.unify(self.vars.get(name), ty)
        if new != self.vars.get(name):
            self.vars[name] = new
            self._changed = True

    def _type_block(self, stmts) -> None:
        for st in stmts:
            self._type_stmt(st)

    def _type_stmt(self, st) -> None:
        if isinstance(st, ast.Assign):
            if len(st.targets) != 1:
                raise Unsupported("multiple assignment targets")
            tgt, ty = st.targets[0], self.type_of(st.value)
            if isinstance(tgt, ast.Name):
                self._assign_type(tgt.id, ty)
            elif isinstance(tgt, ast.Subscript):
                self._pointee(tgt.value)
                self.type_of(tgt.slice)
            else:
                raise Unsupported(f"assignment to {type(tgt).__name__}")
        elif isinstance(st, ast.Expr):
            self.type_of(st.value, statement=True)
        elif isinstance(st, ast.For):
            if not isinstance(st.target, ast.Name) or st.orelse:
                raise Unsupported("for loop form")
            for a in self._range_args(st.iter):
                self.type_of(a)
            self._assign_type(st.target.id, self.T.i64)
            self._type_block(st.body)
        elif isinstance(st, (ast.While, ast.If)):
            if isinstance(st, ast.While) and st.orelse:
                raise Unsupported("while/else")
            self.type_of(st.test)
            self._type_block(st.body)
            self._type_block(st.orelse)
        elif not isinstance(st, (ast.Continue, ast.Break, ast.Pass)):
            raise Unsupported(f"statement {type(st).__name__}")

    def _range_args(self, it) -> list:
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name)
                and it.func.id == "range" and 1 <= len(it.args) <= 3 and not it.keywords):
            raise Unsupported("for loops iterate range(...) only")
        if len(it.args) == 3 and not (isinstance(it.args[2], ast.Constant)
                                      and isinstance(it.args[2].value, int)
                                      and it.args[2].value > 0):
            raise Unsupported("range step must be a positive literal")
        return it.args

    def _pointee(self, node):
        ty = self.type_of(node)
        if ty is not None and not isinstance(ty, self.T.t.CPointer):
            raise Unsupported(f"indexing a {ty}")
        return None if ty is None else ty.dtype

    def type_of(self, e, statement=False):
        """The Numba type of expression ``e``; None while a variable it reads has no
        type yet (first rounds of _infer)."""
        T = self.T
        if isinstance(e, ast.Constant):
            v = e.value
            if isinstance(v, bool):
                return T.b
            if isinstance(v, int):
                return T.i64
            if isinstance(v, float):
                return T.f64
            raise Unsupported(f"literal {v!r}")
        if isinstance(e, ast.Name):
            if e.id in self.vars:
                return self.vars[e.id]
            if e.id in self.consts:
                return self.consts[e.id][0]
            if self._final:
                raise Unsupported(f"name {e.id} read but never assigned")
            return None
        if isinstance(e, ast.Subscript):
            self.type_of(e.slice)
            return self._pointee(e.value)
        if isinstance(e, ast.BinOp):
            a, b = self.type_of(e.left), self.type_of(e.right)
            if a is None or b is None:
                return None
            return self._binop_type(e.op, a, b)
        if isinstance(e, ast.UnaryOp):
            a = self.type_of(e.operand)
            if a is None:
                return None
            if isinstance(e.op, ast.Not):
                return T.b
            if isinstance(e.op, ast.USub):
                return T.i64 if T.is_int(a) else (a if T.is_float(a) else self._bad(e))
            return self._bad(e)
        if isinstance(e, ast.Compare):
            for x in [e.left] + e.comparators:
                self.type_of(x)
            return T.b
        if isinstance(e, ast.BoolOp):
            # both sides are evaluated (expr): a load could fault where Python's
            # short circuit would have skipped it, so none may stand there but the
            # ABI's own arrays at a literal index (the in-place test's ins[i], outs[o])
            if any(isinstance(n, ast.Subscript) and not _abi_slot(n)
                   for v in e.values for n in ast.walk(v)):
                raise Unsupported("a load inside and/or")
            tys = [self.type_of(v) for v in e.values]
            if any(t is not None and t != T.b for t in tys):
                raise Unsupported("and/or of non-booleans")
            return T.b
        if isinstance(e, ast.IfExp):
            self.type_of(e.test)
            a, b = self.type_of(e.body), self.type_of(e.orelse)
            if a is None or b is None:
                return a or b
            return T.unify(a, b)
        if isinstance(e, ast.Call):
            return self._call_type(e, statement)
        return self._bad(e)

    @staticmethod
    def _bad(e):
        raise Unsupported(f"expression {ast.dump(e)[:80]}")

    def _binop_type(self, op, a, b):
        T = self.T
        if isinstance(op, (ast.Add, ast.Sub, ast.Mult)):
            return T.arith(a, b)
        if isinstance(op, ast.Div):
            return T.f64 if not (T.is_float(a) and T.is_float(b)) else T.arith(a, b)
        if isinstance(op, (ast.FloorDiv, ast.Mod)):
            if T.is_int(a) and T.is_int(b):
                return T.arith(a, b)
            raise Unsupported("// or % of floats")
        if isinstance(op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            if a == T.b and b == T.b:
                return T.b
            if T.is_int(a) and T.is_int(b):
                return T.arith(a, b)
            raise Unsupported(f"bitwise op on {a}, {b}")
        raise Unsupported(f"operator {type(op).__name__}")

    def _call_type(self, e, statement):
        T = self.T
        if e.keywords:
            raise Unsupported("keyword arguments")
        tys = [self.type_of(a) for a in e.args]
        f = e.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            if f.value.id == "np" and f.attr in T.np_casts and len(e.args) == 1:
                return T.np_casts[f.attr]
            if f.value.id == "h":
                if any(t is None for t in tys):
                    return None
                return self.calls.type_call(f.attr, tys)
            if f.value.id == "math" and f.attr in ("sin", "cos") and len(e.args) == 1:
                if tys[0] is None:
                    return None
                if T.is_float(tys[0]):          # Numba: llvm.sin / llvm.cos, same type
                    return tys[0]
            raise Unsupported(f"call of {f.value.id}.{f.attr}")
        if isinstance(f, ast.Name) and f.id in ("min", "max") and len(e.args) == 2:
            if any(t is None for t in tys):
                return None
            if all(T.is_int(t) for t in tys):
                return T.arith(*tys)
            raise Unsupported(f"{f.id} of non-integers")
        if isinstance(f, ast.Name) and f.id == "abs" and len(e.args) == 1:
            if tys[0] is None:
                return None
            if T.is_int(tys[0]):
                return T.i64
            raise Unsupported("abs of a float (h.fabs expected)")
        return self._bad(e)

    # ---- code -----------------------------------------------------------------------
    def module(self) -> ir.Module:
        mod = ir.Module(name=self.symbol)
        lt = self.context.get_value_type
        fnty = ir.FunctionType(ir.VoidType(), [lt(self.vars[n]) for n in BODY_ARGS])
        fn = ir.Function(mod, fnty, self.symbol)
        entry = fn.append_basic_block("entry")
        self.b = b = ir.IRBuilder(entry)
        self.slots = {}
        for name, ty in self.vars.items():      # one stack slot per variable (SROA: SSA)
            self.slots[name] = b.alloca(lt(ty), name=name)
        for name, arg in zip(BODY_ARGS, fn.args):
            b.store(arg, self.slots[name])
        self.loops: list = []
        self._block(self.fn_ast.body)
        if not b.block.is_terminated:
            b.ret_void()
        return mod

    def _block(self, stmts) -> None:
        for st in stmts:
            if self.b.block.is_terminated:      # after continue/break: unreachable code
                self.b.position_at_end(self.b.append_basic_block("dead"))
            self._stmt(st)

    def _stmt(self, st) -> None:
        b = self.b
        if isinstance(st, ast.Assign):
            tgt = st.targets[0]
            v, ty = self.expr(st.value)
            if isinstance(tgt, ast.Name):
                b.store(self.cast(v, ty, self.vars[tgt.id]), self.slots[tgt.id])
            else:
                ptr, pty = self.expr(tgt.value)
                i, ity = self.expr(tgt.slice)
                b.store(self.cast(v, ty, pty.dtype), b.gep(ptr, [self.cast(i, ity, self.T.i64)]))
        elif isinstance(st, ast.Expr):
            self.expr(st.value)
        elif isinstance(st, ast.For):
            self._for(st)
        elif isinstance(st, ast.While):
            self._while(st)
        elif isinstance(st, ast.If):
            self._if(st)
        elif isinstance(st, ast.Continue):
            b.branch(self.loops[-1].cont)
        elif isinstance(st, ast.Break):
            b.branch(self.loops[-1].brk)

    def _if(self, st) -> None:
        b = self.b
        cond = self.truth(st.test)
        then, done = b.append_basic_block("then"), b.append_basic_block("endif")
        other = b.append_basic_block("else") if st.orelse else done
        b.cbranch(cond, then, other)
        for blk, body in ((then, st.body), (other, st.orelse if st.orelse else None)):
            if body is None:
                continue
            b.position_at_end(blk)
            self._block(body)
            if not b.block.is_terminated:
                b.branch(done)
        b.position_at_end(done)

    def _while(self, st) -> None:
        b = self.b
        head, body, done = (b.append_basic_block(n) for n in ("while", "wbody", "wend"))
        b.branch(head)
        b.position_at_end(head)
        b.cbranch(self.truth(st.test), body, done)
        b.position_at_end(body)
        self._loop_body(st.body, head, done)

    def _loop_body(self, stmts, head, done) -> None:
        """A loop's statements (``continue``: to ``head``, ``break``: to ``done``), back
        to ``head``; then code goes on at ``done``."""
        b = self.b
        self.loops.append(_Loop(head, done))
        self._block(stmts)
        self.loops.pop()
        if not b.block.is_terminated:
            b.branch(head)
        b.position_at_end(done)

    def _for(self, st) -> None:
        """``for v in range(lo, hi, step)`` as Numba's range iterator runs it: the trip
        count computed once (0 where hi - lo and step differ in sign), counted down;
        v set from the iterator's value at the top of each trip (the body may assign
        v).  The same shape as Numba's keeps what LLVM proves about the loop (trip
        count ranges it unrolls by) the same."""
        b = self.b
        i64 = ir.IntType(64)
        zero, one = ir.Constant(i64, 0), ir.Constant(i64, 1)
        args = [self.cast(*self.expr(a), self.T.i64) for a in self._range_args(st.iter)]
        lo, hi = (zero, args[0]) if len(args) == 1 else args[:2]
        step = args[2] if len(args) == 3 else one
        it = self._entry_alloca(i64, "it." + st.target.id)
        count = self._entry_alloca(i64, "n." + st.target.id)
        b.store(lo, it)
        diff = b.sub(hi, lo)
        pos_diff = b.icmp_signed(">", diff, zero)
        rem = b.srem(diff, step)
        rem = b.select(pos_diff, rem, b.neg(rem))
        n = b.add(b.sdiv(diff, step), b.select(b.icmp_signed(">", rem, zero), one, zero))
        b.store(b.select(pos_diff, n, zero), count)     # the step is a positive literal
        head, body, done = (b.append_basic_block(n) for n in ("for", "fbody", "fend"))
        b.branch(head)
        b.position_at_end(head)
        left = b.load(count)
        b.cbranch(b.icmp_signed(">", left, zero), body, done)
        b.position_at_end(body)
        value = b.load(it)
        b.store(b.sub(left, one, flags=["nsw"]), count)
        b.store(b.add(value, step), it)
        b.store(value, self.slots[st.target.id])
        self._loop_body(st.body, head, done)

    def _entry_alloca(self, ty, name):
        b = self.b
        here = b.block
        b.position_at_start(b.function.entry_basic_block)
        slot = b.alloca(ty, name=name)
        b.position_at_end(here)
        return slot

    # ---- expressions --------------------------------------------------------------------
    def truth(self, e):
        v, ty = self.expr(e)
        return self.to_bool(v, ty)

    def to_bool(self, v, ty):
        T = self.T
        if ty == T.b:
            return v
        if T.is_int(ty):
            return self.b.icmp_unsigned("!=", v, ir.Constant(v.type, 0))
        if T.is_float(ty):
            return self.b.fcmp_unordered("!=", v, ir.Constant(v.type, 0.0))
        raise Unsupported(f"truth value of {ty}")

    def cast(self, v, src, dst):
        """Numba's scalar conversions (context.cast), the ones this language needs."""
        T, b = self.T, self.b
        if src == dst:
            return v
        lt = self.context.get_value_type(dst)
        if T.is_float(src) and T.is_float(dst):
            return b.fpext(v, lt) if dst.bitwidth > src.bitwidth else b.fptrunc(v, lt)
        if T.is_int(src) and T.is_float(dst):
            return b.sitofp(v, lt) if src.signed else b.uitofp(v, lt)
        if T.is_float(src) and T.is_int(dst):
            return b.fptosi(v, lt) if dst.signed else b.fptoui(v, lt)
        if T.is_int(src) and T.is_int(dst):
            if dst.bitwidth < src.bitwidth:
                return b.trunc(v, lt)
            if dst.bitwidth == src.bitwidth:
                return v
            return b.sext(v, lt) if src.signed else b.zext(v, lt)
        if src == T.b and T.is_int(dst):
            return b.zext(v, lt)
        if src == T.b and T.is_float(dst):
            return b.uitofp(v, lt)
        if T.is_ptr(src) and T.is_ptr(dst):
            return b.bitcast(v, lt)
        raise Unsupported(f"conversion {src} -> {dst}")

    def expr(self, e):
        """(LLVM value, Numba type) of expression ``e``."""
        T, b = self.T, self.b
        ty = self.type_of(e)
        if isinstance(e, ast.Constant):
            return ir.Constant(self.context.get_value_type(ty), e.value), ty
        if isinstance(e, ast.Name):
            if e.id in self.vars:
                return b.load(self.slots[e.id]), ty
            cty, value = self.consts[e.id]
            if isinstance(value, tuple):
                return self._table_global(e.id, value), cty
            return ir.Constant(self.context.get_value_type(cty), value), cty
        if isinstance(e, ast.Subscript):
            ptr, _ = self.expr(e.value)
            i, ity = self.expr(e.slice)
            return b.load(b.gep(ptr, [self.cast(i, ity, T.i64)])), ty
        if isinstance(e, ast.BinOp):
            return self._binop(e, ty), ty
        if isinstance(e, ast.UnaryOp):
            v, vty = self.expr(e.operand)
            if isinstance(e.op, ast.Not):
                return b.not_(self.to_bool(v, vty)), ty
            if T.is_float(vty):
                return b.fneg(v), ty
            return b.neg(self.cast(v, vty, T.i64)), ty
        if isinstance(e, ast.Compare):
            return self._compare(e), ty
        if isinstance(e, ast.BoolOp):
            vals = [self.truth(v) for v in e.values]     # no loads (type_of): eager
            out = vals[0]
            for v in vals[1:]:
                out = b.and_(out, v) if isinstance(e.op, ast.And) else b.or_(out, v)
            return out, ty
        if isinstance(e, ast.IfExp):
            return self._ifexp(e, ty), ty
        if isinstance(e, ast.Call):
            return self._call(e, ty)
        raise Unsupported(f"expression {ast.dump(e)[:80]}")

    def _table_global(self, name: str, values: tuple):
        """A pointer to the module's constant uint8 array ``name``."""
        mod = self.b.module
        try:
            g = mod.get_global(name)
        except KeyError:
            aty = ir.ArrayType(ir.IntType(8), len(values))
            g = ir.GlobalVariable(mod, aty, name)
            g.initializer = ir.Constant(aty, bytearray(values))
            g.global_constant, g.linkage = True, "internal"
        return self.b.bitcast(g, ir.IntType(8).as_pointer())

    def _ifexp(self, e, ty):
        """``x if c else y`` as branches (the arms may call helpers or divide)."""
        b = self.b
        cond = self.truth(e.test)
        then, other, done = (b.append_basic_block(n) for n in ("sel.t", "sel.f", "sel"))
        b.cbranch(cond, then, other)
        vals = []
        for blk, arm in ((then, e.body), (other, e.orelse)):
            b.position_at_end(blk)
            v, vty = self.expr(arm)
            vals.append((self.cast(v, vty, ty), b.block))
            b.branch(done)
        b.position_at_end(done)
        phi = b.phi(self.context.get_value_type(ty))
        for v, blk in vals:
            phi.add_incoming(v, blk)
        return phi

    def _binop(self, e, ty):
        T, b = self.T, self.b
        (x, xt), (y, yt) = self.expr(e.left), self.expr(e.right)
        op = e.op
        if isinstance(op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
            f = {ast.BitAnd: b.and_, ast.BitOr: b.or_, ast.BitXor: b.xor}[type(op)]
            return f(self.cast(x, xt, ty), self.cast(y, yt, ty))
        if isinstance(op, ast.Div) and T.is_int(xt) and T.is_int(yt):
            return b.fdiv(self.cast(x, xt, T.f64), self.cast(y, yt, T.f64))
        x, y = self.cast(x, xt, ty), self.cast(y, yt, ty)
        if T.is_float(ty):
            f = {ast.Add: b.fadd, ast.Sub: b.fsub, ast.Mult: b.fmul, ast.Div: b.fdiv}[type(op)]
            return f(x, y)
        if isinstance(op, (ast.FloorDiv, ast.Mod)):
            # Numba's own lowering (Python's floor semantics; 0 for a 0 divisor under
            # the numpy error model): its branches tell LLVM the ranges it unrolls by
            from numba.core.typing import signature
            from numba.cpython.numbers import int_floordiv_impl, int_rem_impl
            impl = int_rem_impl if isinstance(op, ast.Mod) else int_floordiv_impl
            return impl(self.context, b, signature(ty, ty, ty), (x, y))
        return {ast.Add: b.add, ast.Sub: b.sub, ast.Mult: b.mul}[type(op)](x, y)

    _CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
            ast.GtE: ">="}

    def _compare(self, e):
        """``a < b <= c``: each pair in the common type of its two operands; NaN
        compares false except with != (ordered / unordered as Python's float)."""
        T, b = self.T, self.b
        out = None
        left = self.expr(e.left)
        for op, right_node in zip(e.ops, e.comparators):
            right = self.expr(right_node)
            (x, xt), (y, yt) = left, right
            if type(op) not in self._CMP:
                raise Unsupported(f"comparison {type(op).__name__}")
            sym = self._CMP[type(op)]
            if T.is_float(xt) or T.is_float(yt):
                ct = T.arith(xt, yt) if xt != T.b and yt != T.b else self._bad(e)
                x, y = self.cast(x, xt, ct), self.cast(y, yt, ct)
                c = b.fcmp_unordered(sym, x, y) if sym == "!=" else b.fcmp_ordered(sym, x, y)
            elif xt == T.b and yt == T.b:
                c = b.icmp_unsigned(sym, x, y)
            else:
                x, y = self.cast(x, xt, T.i64), self.cast(y, yt, T.i64)
                c = b.icmp_signed(sym, x, y)
            out = c if out is None else b.and_(out, c)
            left = right
        return out

    def _call(self, e, ty):
        T, b = self.T, self.b
        f = e.func
        args = [self.expr(a) for a in e.args]
        if isinstance(f, ast.Attribute) and f.value.id == "np":
            v, vt = args[0]
            if vt == T.b:
                raise Unsupported("np.<dtype>(bool)")
            return self.cast(v, vt, ty), ty
        if isinstance(f, ast.Attribute) and f.value.id == "math":   # sin, cos
            v, vt = args[0]
            fn = b.module.declare_intrinsic(f"llvm.{f.attr}", [v.type],
                                            ir.FunctionType(v.type, [v.type]))
            return b.call(fn, [v]), vt
        if isinstance(f, ast.Attribute):          # h.<name>
            v, rt = self.calls.emit_call(f.attr, b, [t for _, t in args],
                                         [v for v, _ in args])
            return v, rt
        if f.id in ("min", "max"):
            (x, xt), (y, yt) = args
            x, y = self.cast(x, xt, T.i64), self.cast(y, yt, T.i64)
            # Python: min(x, y) is y only when y < x (max: y > x)
            pick_y = b.icmp_signed("<" if f.id == "min" else ">", y, x)
            return b.select(pick_y, y, x), ty
        (x, xt), = args                            # abs of an integer
        x = self.cast(x, xt, T.i64)
        return b.select(b.icmp_signed("<", x, ir.Constant(x.type, 0)), b.neg(x), x), ty


def translate(text: str, calls, symbol: str, context) -> ir.Module:
    """The IR module of kernel module ``text`` (its ``body`` as ``symbol``); raises
    Unsupported where the text leaves this backend's language."""
    try:
        return Translator(text, calls, symbol, context).module()
    except RecursionError:
        raise Unsupported("expression nesting too deep") from None
