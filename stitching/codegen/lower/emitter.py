"""What every backend's emitter shares: the source writer, typed loads and stores, the
canonical form of generated text, and the base emitter over a Schedule.

A backend (``codegen/cpu``, ``codegen/cuda``) subclasses ``Emitter`` with its loop nests
and its module text; this class owns what does not depend on the target: value names,
buffer tags and offsets, the shape program (run-time checks, sizes, work units), one
node's expression (``compute``, through ``exprs.node_expr``), reductions' final values,
and the phase/split bookkeeping both targets follow.  Generated text is built only from
templates here and in the backends, identifiers they make (``v{k}``, ``x{j}``,
``D{a}``...) and numbers re-formatted from validated values.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

from ...ir import dtypes as dt
from ...schedule import KernelKind
from ...schedule.schedule import (COL_BLOCK, COL_BLOCK_MIN, COL_CHUNK_ROWS, COL_SPLIT_UNITS,
                                  COL_UNITS, EW_BLOCK, ROW_UNIT_ELEMS)
from . import exprs as lower
from . import shape_program as SP


@dataclass(frozen=True)
class KernelSource:
    text: str
    errors: tuple
    program: tuple = ()     # the shape function, as a shape_program.py program


_NAME = re.compile(r"(?<![.\w])[A-Za-z_]\w*")
_ASSIGNED = re.compile(r"^\s*(?:for\s+)?([A-Za-z_]\w*)\s*(?:=(?!=)|\sin\s)")


class Writer:
    def __init__(self):
        self.lines: list = []
        self.depth = 0
        self._private: list = []        # (first line, end, suffix) of private blocks

    def __call__(self, line: str = "") -> None:
        self.lines.append("    " * self.depth + line if line else "")

    @contextmanager
    def block(self, header: str):
        self(header)
        self.depth += 1
        yield
        self.depth -= 1

    @contextmanager
    def private_block(self, header: str, suffix: str):
        """``block``, whose own names get ``suffix`` (``text``): for the second of two
        exclusive paths (if/else) that write the same loops.

        Numba rebuilds SSA form for every name assigned in more than one place, at a
        cost of about (such names) x (basic blocks): ResNet50's column kernel, when
        it still had separate split and whole paths, made 109 such names over 81
        blocks, 27% of its 1.2 s compile.  (Row kernels keep two paths: a split row
        runs its passes piecewise, in phases.)  A name is the block's own if its
        first appearance in the block assigns it (an ``=`` or ``for`` target) and
        nothing after the block reads it.  Generated bodies hold no string literals,
        so names are matched as words not preceded by a dot."""
        start = len(self.lines)
        with self.block(header):
            yield
        self._private.append((start + 1, len(self.lines), suffix))

    def text(self) -> list:
        """The lines, private blocks' own names renamed."""
        lines = list(self.lines)
        for start, end, suffix in self._private:
            after = {m for line in lines[end:] for m in _NAME.findall(line)}
            first: dict = {}
            for line in lines[start:end]:
                target = _ASSIGNED.match(line)
                rhs = line[target.end():] if target else line   # read before the target
                for name in _NAME.findall(rhs):
                    first.setdefault(name, False)
                if target:
                    first.setdefault(target.group(1), True)
            own = {n for n, assigns in first.items() if assigns and n not in after}
            lines[start:end] = [
                _NAME.sub(lambda m: m.group() + suffix if m.group() in own else m.group(),
                          line) for line in lines[start:end]]
        return lines


def load_expr(dtype: str, ptr: str, idx: str) -> str:
    if dtype == "float16":
        return f"h.f16_to_f32({ptr}[{idx}])"
    if dtype == "bfloat16":
        return f"h.bf16_to_f32({ptr}[{idx}])"
    if dtype == "bool":
        return f"({ptr}[{idx}] != 0)"
    return f"{ptr}[{idx}]"


def store_value(dtype: str, v: str) -> str:
    if dtype == "float16":
        return f"h.f32_to_f16({v})"
    if dtype == "bfloat16":
        return f"h.f32_to_bf16({v})"
    if dtype == "bool":
        return f"h.b2u8({v})"
    return v


# An identifier the emitter made: letters/underscores, a number, then anything; not an
# attribute (``np.float32``) and not inside a number (``1e-05``).
_NUMBERED = re.compile(r"(?<![.\w])([A-Za-z_]+?)(\d+)(\w*)")


def canonical(text: str) -> str:
    """``text`` up to the names the emitter chose: comment lines dropped, and in each
    family of numbered identifiers (``v12``, ``hz3``, ``b_i5_0``...: same letters
    before the number) the numbers replaced by their order of first appearance.

    Two specs whose kernels differ only in how their nodes were numbered (the same
    region found twice in a graph, its nodes listed in another topological order), or
    in the spec hash of the header comment, get the same canonical text and so share
    one compiled kernel (kernel.code_name).  The renaming is a bijection within each
    family and keeps the family, so the result is the same program.  Generated text
    holds no string literals (everything is built from this module's templates); a
    text with a quote character is returned unchanged rather than renamed blindly."""
    if "'" in text or '"' in text:
        return text
    kept = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    families: dict = {}

    def rename(m):
        numbers = families.setdefault(m.group(1), {})
        return f"{m.group(1)}{numbers.setdefault(m.group(2), len(numbers))}{m.group(3)}"
    return _NUMBERED.sub(rename, kept)


_ARITH = re.compile(r"[A-Za-z_][\w]*|[\s+\-*/()]")


def typed(cd: str, expr: str, same=frozenset()) -> str:
    """Pin the compute dtype of a node's value (guards against silent promotion).

    ``same``: names known to hold ``cd`` values (the node's arguments of that type,
    typed constants).  A float expression built only from those with + - * / and
    parentheses keeps ``cd`` under Numba's typing, so it needs no pin: every pin is a
    call for Numba to type and lower, and dropping the redundant ones took a
    179-line ResNet50 kernel's compile from 0.62 to 0.54 s."""
    if cd == "bool" or expr.startswith(f"np.{cd}("):
        return expr
    if cd in ("float32", "float64") and same:
        tokens = _ARITH.findall(expr)
        if "".join(tokens) == expr and all(t in same for t in tokens if t[0].isalpha()
                                           or t[0] == "_"):
            return expr
    return f"np.{cd}({expr})"


def fmt_shape(shape) -> str:
    return "[" + ",".join("?" if d < 0 else str(d) for d in shape) + "]"


class Emitter:
    """The target-independent half of an emitter over one Schedule (see the module)."""

    _sfx = ""   # column passes: suffix of the unrolled row being emitted
    _recip: dict = {}        # node -> (reciprocal, guard) where a division is a multiply
    _exp_guard: dict = {}    # exp node -> row scalar: exp's argument is <= 0 when true

    def __init__(self, sched):
        self.s = sched
        self.spec = sched.spec
        self.dom = sched.domain
        self.R = sched.rank
        self.C = lower.Consts()
        self.errors: list = []
        self.out_index = {k: m for m, k in enumerate(self.spec.outputs)}
        # element-wise per-column prologue (Schedule.hoisted): all its nodes, the ones
        # read back from scratch, and the vector ones the element loop no longer computes
        self.hoist, self.front = sched.hoisted()
        self.hoisted_vectors = {k for k in self.hoist if self.R - 1 in self.dom.carries[k]}

    def store_output(self, w, k: int, index: str) -> None:
        w(f"p_{self.tag(k)}[{index}] = {store_value(self.dtype(k), self.var(k))}")

    def error(self, msg: str) -> int:
        self.errors.append(msg)
        return len(self.errors)

    def var(self, ref: int) -> str:
        name = f"x{-ref - 1}" if ref < 0 else f"v{ref}"
        return name + self._sfx if self._sfx and self.s.is_vector(ref) else name

    def tag(self, ref: int) -> str:
        """Buffer tag of a kernel input or output value."""
        return f"i{-ref - 1}" if ref < 0 else f"o{self.out_index[ref]}"

    def dtype(self, ref: int) -> str:
        return self.spec.type_of(ref).dtype

    def carries_last(self, ref: int) -> bool:
        return self.R > 0 and (self.R - 1) in self.dom.carries[ref]

    def offset(self, ref: int, axes) -> str:
        """Sum of idx * stride over the axes in ``axes`` (a dict axis -> index var).
        A view guarded on an outer axis (Domain.clamped) takes its index along that
        axis clamped into its range: every address of a view passes through here."""
        t = self.tag(ref)
        clamp = self.dom.clamped.get(ref, {})
        terms = []
        for a in self.dom.carries[ref]:
            if a not in axes:
                continue
            q = axes[a]
            if a in clamp:
                q = f"min(max({q}, {clamp[a][0]}), {clamp[a][1]})"
            terms.append(f"{q} * st_{t}_{a}")
        return " + ".join(terms) if terms else "0"

    def shape_program(self) -> list:
        """Checks, domain sizes, work decomposition and output dims, as an int64 program
        (encoding in shape_program.py); error codes index ``self.errors``."""
        spec, dom, P = self.spec, self.dom, []
        off, o = [], 0
        real = spec.inputs[:len(spec.inputs) - len(getattr(spec, "views", ()))]
        for t in real:          # views (schedule/layout.py) have no dims of their own
            off.append(o)
            o += len(t.shape)
        for j, t in enumerate(real):
            for i, d in enumerate(t.shape):
                if d >= 0:
                    P += [SP.EQ, off[j] + i, d, self.error(
                        f"input {j} dim {i} must be {d} (the kernel was built for input "
                        f"{j} of shape {fmt_shape(t.shape)})")]
                else:
                    P += [SP.NONNEG, off[j] + i, self.error(f"input {j} dim {i} is negative")]
        # a dim class's value: its static size, the first input dim that carries it, or
        # else the first of its derived dims (max(n - c, 0), Domain.less)
        less = [SP.dims_ref(dom.less_slot(q)) for q in range(len(dom.less))]
        first = {}
        for q, (c, _, _, _) in enumerate(dom.less):
            first.setdefault(c, less[q])
        cls = [cl.size if cl.size >= 0 else
               -(off[cl.input_dims[0][0]] + cl.input_dims[0][1] + 1) if cl.input_dims
               else first[c] for c, cl in enumerate(dom.classes)]
        for q, (c, j, i, drop) in enumerate(dom.less):
            P += [SP.LESS, dom.less_slot(q), -(off[j] + i + 1), drop]
        for q, (c, j, i, drop) in enumerate(dom.less):
            if cls[c] != less[q]:
                P += [SP.SAME, cls[c], less[q], self.error(
                    f"input {j} dim {i} less {drop} (a slice of it) differs from the dim "
                    "it meets: shapes do not broadcast (a size-1 dim is not broadcast at "
                    "run time)")]
        for c, cl in enumerate(dom.classes):
            for n, (j, i) in enumerate(cl.input_dims):
                if spec.inputs[j].shape[i] >= 0 or (cl.size < 0 and n == 0):
                    continue
                if cl.size == 1:
                    msg = f"input {j} dim {i} must be 1 (the kernel broadcasts it)"
                elif cl.size >= 0:
                    msg = (f"input {j} dim {i} must be {cl.size}: shapes do not broadcast "
                           "(a size-1 unknown dim is not broadcast at run time)")
                else:
                    j0, i0 = cl.input_dims[0]
                    msg = (f"input {j} dim {i} differs from input {j0} dim {i0}: shapes "
                           "do not broadcast (unknown dims are assumed equal; a size-1 "
                           "unknown dim is not broadcast at run time)")
                P += [SP.EQ, off[j] + i, cls[c], self.error(msg)]
        for p, (r, c, b, _) in enumerate(dom.picks):
            j = spec.view_of(-r - 1).source
            P += [SP.GE, cls[c], b + 1 if b >= 0 else -b, self.error(
                f"input {j} ({fmt_shape(spec.inputs[j].shape)}) is indexed at {b} along "
                "a dim known only at run time that does not hold it (TF's StridedSlice "
                "fails the same way)")]
            if b < 0:
                P += [SP.PARAM, dom.param_slot(p), cls[c], b]
        for c, most, j in dom.bounds:
            P += [SP.LE, cls[c], most, self.error(
                f"a slice of input {j} ({fmt_shape(spec.inputs[j].shape)}) takes more "
                f"elements than the {most} its dim holds from the slice's begin (TF's "
                "Slice fails the same way)")]
        big = self.error("a dimension product exceeds 2^48 elements")
        for q, (_, _, factor, classes) in enumerate(dom.scaled):   # run-time strides
            P += [SP.AXIS, dom.scaled_slot(q), len(classes) + 1, abs(factor),
                  *[cls[c] for c in classes], big]
        for a, ax in enumerate(dom.axes):
            P += [SP.AXIS, a, len(ax.classes), *[cls[c] for c in ax.classes], big]
        s, R = self.s, self.R
        cost = (self._packed_cycles() if s.kind == KernelKind.PACKED
                else lower.cycles_per_element(self.spec, s.passes))
        if s.kind == KernelKind.COLUMN:
            kind, kept, red = SP.COLUMN, self._kept_axes(), list(s.reduce_axes)
        else:
            kind, kept, red = (SP.ROW if s.kind == KernelKind.ROW else SP.ELEMENTWISE,
                               list(range(R - 1)), [])
        split = self.column_split() if s.kind == KernelKind.COLUMN else int(s.split_rows)
        reds = len(self._split_reds())
        if s.prologue_phase():
            # SmallMatMul's prologue phase (cpu/emitter.py): the hoisted values of each
            # row group (3: of each row) into the temp buffer, 8 bytes per element
            split, reds = (3 if s.products_per_row() or R < 2 else 2), len(self.front)
        P += [SP.UNITS, kind, R, cost, big, ROW_UNIT_ELEMS, EW_BLOCK, COL_UNITS, COL_BLOCK,
              COL_BLOCK_MIN, COL_SPLIT_UNITS, COL_CHUNK_ROWS, split, len(s.passes),
              reds, len(kept), *kept, len(red), *red]
        pos = 0
        for k in spec.outputs:
            for i, d in enumerate(spec.nodes[k].type.shape):
                P += [SP.OUT, pos, d if d >= 0 else cls[dom.value_dims[k][i]]]
                pos += 1
        return P + [SP.END]

    def _packed_cycles(self) -> int:
        """A packed kernel's cycles per element of its flat space: each segment's
        (a quarter per simple op, 3 per transcendental, one per 4 bytes it streams;
        as exprs.cycles_per_element) weighted by the segment's size."""
        from ...ir.ops import OPS
        total, quarters = 0, 0
        for p, (_, n) in zip(self.s.passes, self.s.segments):
            q = sum(12 if OPS[self.spec.nodes[k].op].transcendental else 1
                    for k in p.compute)
            q += sum(dt.ITEMSIZE[self.spec.inputs[j].dtype] for j in p.loads)
            q += sum(dt.ITEMSIZE[self.dtype(k)] for k in p.stores)
            total, quarters = total + n, quarters + q * n
        return max(1, -(-quarters // max(1, 4 * total)))

    def compute(self, w, k: int) -> None:
        node = self.spec.nodes[k]
        args = [self.var(a) for a in node.args]
        cd = dt.COMPUTE[self.dtype(k)]
        if k in self._recip:
            x, d = args
            rc, ok = self._recip[k]
            w(f"{self.var(k)} = {x} * {rc} if {ok} else {x} / {d}")
            return
        if k in self._exp_guard:
            f = "f32" if cd == "float32" else "f64"
            w(f"{self.var(k)} = h.exp_nonpos_{f}({args[0]}) if "
              f"{self.var(self._exp_guard[k])} else h.exp_{f}({args[0]})")
            return
        expr = lower.node_expr(self.spec, k, args, self.C)
        # values of cd: the arguments of that compute dtype (every variable holds its
        # node's compute dtype) and the constants typed as cd
        same = {v for a, v in zip(node.args, args) if dt.COMPUTE[self.dtype(a)] == cd}
        same.update(name for (c, _, _), name in self.C.names.items() if c == cd)
        w(f"{self.var(k)} = {typed(cd, expr, same)}")

    def packed_scalars(self, w) -> None:
        """A packed kernel's shared scalars (schedule/packed.py: values every segment
        reads), loaded and computed once before the segments' loops."""
        shared = self.s.scalars[0]
        for j in shared.loads:
            self.load_input(w, -(j + 1), "0")
        for k in shared.compute:
            self.compute(w, k)

    def finalize(self, w, k: int, acc: str, count: str) -> None:
        r = lower.reduction(self.spec, k, self.C)
        w(f"v{k} = {r.final.format(a=acc, n=count)}")

    def load_input(self, w, ref: int, index: str) -> None:
        w(f"{self.var(ref)} = {load_expr(self.dtype(ref), 'p_' + self.tag(ref), index)}")

    def decompose(self, w, flat: str, axes: list, q: str = "q") -> dict:
        """Row-major split of ``flat`` over ``axes``; returns axis -> index var."""
        names = {a: f"{q}{a}" for a in axes}
        if not axes:
            return names
        if len(axes) == 1:
            w(f"{q}{axes[0]} = {flat}")
            return names
        w(f"t = {flat}")
        for a in reversed(axes[1:]):
            w(f"{q}{a} = t % D{a}")
            w(f"t = t // D{a}")
        w(f"{q}{axes[0]} = t")
        return names

    def input_refs(self) -> list:
        return [-(j + 1) for j in range(len(self.spec.inputs))]

    def bases(self, w, idx: dict, prefix: str = "b", refs=None) -> None:
        refs = self.input_refs() + list(self.spec.outputs) if refs is None else refs
        for ref in refs:
            w(f"{prefix}_{self.tag(ref)} = {self.offset(ref, idx)}")

    def _scratch_dtype(self, k) -> str:
        cd = dt.COMPUTE[self.dtype(k)]
        return cd   # scratch holds compute values (float16 rows are float32 there)

    def _accumulated(self) -> set:
        return {k for p in self.s.passes for k in p.accumulate}

    def _inner(self, ref: int, base: str) -> str:
        return f"{base} + c" if self.carries_last(ref) else base

    def _kept_axes(self) -> list:
        """A column kernel's parallel axes other than the last (its columns)."""
        return [a for a in self.s.parallel_axes if a != self.R - 1]

    def _split_reds(self) -> list:
        """Reductions whose partials a split row (or split column kernel) passes between
        phases, in pass order."""
        split = self.s.split_rows or (self.s.kind == KernelKind.COLUMN and self.column_split())
        return [k for p in self.s.passes for k in p.accumulate] if split else []

    def column_split(self) -> int:
        """How the shape program may cut this column kernel's reduced rows into chunks
        (split = 1: a last phase stores the per-column results; 2: the last pass is the
        last phase).  A column kernel always reduces (schedule/passes.py)."""
        return 1 if any(st.stores for st in self.s.scalars) else 2
