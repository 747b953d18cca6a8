"""CPU emitter: Schedule -> Python source of the body cfunc, and the shape program.

ABI (fixed; stitching/runtime/op.cc is written against it)::

    void  body(int64 begin, int64 end, void** ins, void** outs, const int64* dims)
    int64 shape_fn(const int64* in_dims, int64* dims, int64* out_dims, int64* sched)

``shape_fn`` validates the run-time input dims, writes the kernel parameters into
``dims`` (layout below; passed verbatim to ``body``), every output's dims into
``out_dims`` and ``sched[0]`` = work units, ``sched[1]`` = cycles per unit,
``sched[2]`` = phases, ``sched[3]`` = temp bytes; it returns 0 or k > 0 for
``errors[k-1]``.  The shape function of a generated kernel is one shared interpreter
called with the kernel's int64 program (shape_program.py; the op passes the program,
see op.cc).  ``body`` runs units [begin, end) of phase ``dims[31]``; the caller
runs every unit of a phase before the next, with a temp buffer of sched[3] bytes as
``outs[n_outputs]``.  On entry ``sched`` holds the launch hint (rows per unit and
column block the cost model chose for the calling node's spec; 0: none, the shape
function picks from the run-time sizes), 1, 0.  The hint is data, not code, so specs
that differ only in it share one compiled kernel.

    dims[0 .. R-1]   collapsed domain sizes D0..D{R-1}
    dims[R]          rows per unit (row / element-wise kinds)
    dims[R+1]        column block (element-wise: elements; column kind: columns)
    dims[R+2]        column blocks per row (element-wise) / per kept index (column)
    dims[R+3]        rows (product of the outer axes); column kind: reduced count
    dims[R+4 ..]     run-time offsets of views of an element from the end of a dim
                     known only at run time (Domain.picks, param_slot), then run-time
                     strides of views (Domain.scaled, scaled_slot)

Loop nests, per kind (names as in the generated code)::

    elementwise: rank <= 1: one flat loop over the units' elements
                 else     : for u: rows [r0,r1) x cols [c0,c1): for r: for j: ...
    packed:      lo, hi = begin * cb, end * cb over the segments' flat space; shared
                 scalars; per segment (off, n): for j in [max(lo-off,0), min(hi-off,n))
    row:         for u: for r in rows(u):  scalars0; pass0 for j<L; scalars1; pass1 ...
                 (float32 sums: per 1024-element chunk a float32 partial, merged
                 into a float64 accumulator, so the loop stays 8 lanes wide)
    row, piped:  (pass 0 a max-like reduction, a later pass transcendental: softmax)
                 over all rows of [begin, end): pass0(r0); for r: pass1(r) and
                 pass0(r + 1) in one loop; pass2(r) ...
    row, split:  (split_rows=1 and a hint cb < L; fewer rows than threads) a unit is
                 one piece [jb, je) of a row; phase p runs pass p over the piece and
                 stores its partial reductions, later phases combine them first;
                 the last phase stores the per-row results
    column:      for u: (kept index, block [c0,c0+n)):
                     block0; pass0: for s in reduced axes (innermost 4 rows per
                     trip): for c<n: acc[c] = step(acc[c], v); block1; pass1 ...

A vector output that may reach 16 MiB (_stream_min_bytes; memory-bound kernels only) is stored
through an L1 staging chunk and copied out with non-temporal stores (_staged).

Every loop body indexes typed pointers as ``p[base + j]`` with ``j`` the loop
variable and ``base`` loop-invariant, the form LLVM's loop vectorizer turns into
contiguous vector loads; values that do not carry the inner axis are loop
invariant and get hoisted.  Broadcast patterns are therefore static: each input's
strides are products of domain sizes, zero for axes it does not carry.

Generated text is built only from this module's templates, identifiers it makes
(``v{k}``, ``x{j}``, ``D{a}``...) and numbers re-formatted from validated values.
"""
from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager

from ...ir import dtypes as dt
from ...ir.ops import OPS
from ...schedule import KernelKind
from ...schedule import contract
from ...schedule.inplace import pairs as inplace_pairs
from ..lower import exprs as lower
from ..lower.emitter import Emitter, KernelSource, Writer, load_expr, store_value
from ..lower.specialize import SHORT_ROW as SHORT_ELEMENTWISE_ROW

ROW_CHUNK = 1024       # tuned: float32 partial sums per 1024 elements of a row
TIER1_CHUNK = 16       # the same at tier 1 (tier1_text): one vector's worth
ROW_TAIL = 64          # a row's remainder below a multiple of this is a chunk apart:
                       # 16 float32 lanes x LLVM's interleave of 4 (_chunk_loop_head)
PHASE_SLOT = 31        # dims[31]: the phase the op is running (op.cc kPhaseSlot)
PREFETCH_MIN_ROW = 512  # row kernels prefetch the next row from this length on
COL_UNROLL = 4         # tuned: rows of a column pass per trip of its column loop
PRODUCT_ROWS = 4       # tuned: weight rows of a SmallMatMul per trip of its vector loop
COL_PART_ROWS = 64     # arbitrary: rows a column's float32 partial sum takes before it
                       # is merged into the float64 sum (a row reduction's chunk: 1024)
SHORT_ROW = SHORT_ELEMENTWISE_ROW  # element-wise rows shorter than this: one flat loop
SHORT_BLOCK = 256      # over blocks of >= this many elements (arbitrary: _short_rows)
SHORT_LANES = 16       # the widest vector's float32 lanes: a block holds whole vectors


def _chunk_step(n: int) -> str:
    return f"j1 = j0 + {n} if je1 - j0 >= {n} else "


def tier1_text(text: str) -> str:
    """The kernel text a tier-1 build compiles (compile/kernel.py; the cache name and
    tier 2 keep ``text``).  A row's float32 partial sum runs over a chunk of ROW_CHUNK
    elements; tier-2 code vectorizes it into ROW_TAIL lane partials of 16 elements
    each, but tier 1's pipeline does not vectorize, so each chunk was one float32
    chain of 1024 additions: a mean of a 1000-long row of 0.1 came out 73 ulp off
    (TF's 2, tier 2's 2).  Tier 1 folds its partials into the float64 sum every
    TIER1_CHUNK elements instead: as accurate as tier 2, for one more addition per 16
    elements in code that is scalar anyway."""
    return text.replace(_chunk_step(ROW_CHUNK), _chunk_step(TIER1_CHUNK))


def _stream_min_bytes() -> int:
    """Outputs of at least this many bytes are written with non-temporal stores.

    A normal store to a line that is not cached first reads it (read for ownership),
    so a kernel streaming x -> y moves 3 bytes per byte of y; a non-temporal store
    writes the line without reading it, and without filling the cache with data the
    kernel will not read again.  The cost: a consumer that runs right after finds the
    output in DRAM, not in the last-level cache.  Measured on this project's 2-core
    Xeon (Emerald Rapids), a row kernel writing N MiB followed by a reduction reading
    it, 4 rotating buffer sets, NT / normal time: 16 MiB 0.64 (producer) and 0.81
    (producer + consumer), 32 MiB 0.72 / 0.84, 64 MiB 0.73 / 0.83; 8 MiB 0.79 / 1.00;
    4 MiB 1.31 / 1.53 (the output still cached).  So from 16 MiB per output on: the
    device profile's ``stream_min_bytes`` (a fact of the machine's caches, as every
    machine-dependent choice is); ``STITCHING_STREAM_MIN_MIB`` overrides it (0: never
    stream).  The threshold is written into the kernel text, so kernels built under
    different settings do not share a cache entry."""
    env = os.environ.get("STITCHING_STREAM_MIN_MIB", "").strip()
    if not env:
        from ...plan import profiles
        prof = profiles.default()
        return prof.stream_min_bytes if prof.backend == "cpu" else 16 << 20
    try:
        mib = float(env)
    except ValueError:
        raise ValueError(f"STITCHING_STREAM_MIN_MIB must be a number of MiB, got "
                         f"{env!r}") from None
    return int(mib * 2**20) if mib > 0 else 0

_PTR = {"float32": "float32", "float64": "float64", "int32": "int32", "int64": "int64",
        "float16": "uint16", "bfloat16": "uint16", "bool": "uint8"}


_H_CALL = re.compile(r"\bh\.(\w+)\(")


def _calls_helpers(lines) -> bool:
    """Whether generated lines call a compiled math helper (a Numba function, which
    LLVM may decline to inline), not only intrinsics (always inline)."""
    return any(name in _helper_names() for line in lines for name in _H_CALL.findall(line))


_HELPER_NAMES: frozenset | None = None


def _helper_names() -> frozenset:
    """Functions decorated ``@helper``/``@big_helper`` in fastmath.py and rt.py,
    read from their source: emitting code must not import Numba (a process that
    loads cached kernels never does)."""
    global _HELPER_NAMES
    if _HELPER_NAMES is None:
        import ast
        names = set()
        for mod in ("fastmath.py", "rt.py"):
            with open(os.path.join(os.path.dirname(__file__), mod)) as f:
                tree = ast.parse(f.read())
            names |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id in ("helper", "big_helper")
                for d in n.decorator_list)}
        _HELPER_NAMES = frozenset(names)
    return _HELPER_NAMES


def emit(sched) -> KernelSource:
    e = _Emitter(sched)
    program = tuple(e.shape_program())      # first: its error codes come first
    return KernelSource(e.module_text(), tuple(e.errors), program)


class _Emitter(Emitter):
    """The CPU loop nests (module docstring) over the shared Emitter."""

    def __init__(self, sched):
        super().__init__(sched)
        self.stream_min = _stream_min_bytes()
        self.streamed = self._streamed_outputs()     # output -> its element count
        self._staging: dict = {}     # (output, row suffix) -> (index base, loop var)
        self._through: dict = {}     # output node -> input tag it is stored through
        self._product_sizes = self._find_products()
        self._phase = sched.prologue_phase()     # products in a phase of their own
        # DepthwiseConv2D nodes: their taps summed per row into dz<k> (_windows)
        self._window_nodes = [k for k in sched.live if self.spec.nodes[k].op == "DepthwiseConv2D"]
        self._window_reads = {a for k in self._window_nodes for a in self.spec.nodes[k].args}
        self._once: set = set()      # element-wise: values computed before the loops
        self._tiled = None           # the short rows' flat loop: input ref -> its tile

    def store_output(self, w, k: int, index: str) -> None:
        if k in self._through:                  # the in-place loop nest (_in_place)
            w(f"p_{self._through[k]}[{index}] = {store_value(self.dtype(k), self.var(k))}")
            return
        if (k, self._sfx) in self._staging:     # a streamed output (_staged)
            base, var = self._staging[(k, self._sfx)]
            w(f"d_{self.tag(k)}[{base} + {var}] = {store_value(self.dtype(k), self.var(k))}")
            return
        super().store_output(w, k, index)

    # -- module ---------------------------------------------------------------------
    def module_text(self) -> str:
        body = Writer()
        self.body(body)
        head = ["# Generated by stitching.codegen.cpu.emitter; do not edit.",
                f"# spec {self.spec.hash}: {self.s.describe().splitlines()[0]}",
                "import math", "import numpy as np",
                "from stitching.codegen.cpu import rt as h", ""]
        # Constants are module globals _K<n>; the body binds K<n> to them once, float
        # operands through h.opaque so that LLVM hoists them out of the loops instead
        # of re-making them from the constant pool (intrinsics.opaque).
        lines = body.text()
        at = next(i for i, line in enumerate(lines) if line.startswith("def body(")) + 1
        operands = set(self.C.operands())
        binds = [f"    {n} = h.opaque(_{n})" if n in operands else f"    {n} = _{n}"
                 for n in self.C.names.values()]
        lines = lines[:at] + binds + lines[at:]
        return "\n".join(head + self.C.definitions("_") + self._tables() + ["", ""] +
                         lines) + "\n"

    # -- names ------------------------------------------------------------------------

    # -- shape function ---------------------------------------------------------------
    # -- body: prologue -----------------------------------------------------------------
    def body(self, w: Writer) -> None:
        # compiled by kernel.py as a cfunc of h.BODY_SIG with h.BODY_OPTIONS
        with w.block("def body(begin, end, ins, outs, dims):"):
            w("h.wide_vectors()")
            self._prologue(w)
            loops = {KernelKind.ELEMENTWISE: self._elementwise, KernelKind.ROW: self._row,
                     KernelKind.COLUMN: self._column, KernelKind.PACKED: self._packed}[self.s.kind]
            if self._phase:
                with w.block(f"if dims[{PHASE_SLOT}] == 0:"):
                    self._product_phase(w)
                with w.block("else:"):
                    if not self._in_place(w, loops):
                        loops(w)
            elif not self._in_place(w, loops):
                loops(w)
            for name in self._buffers():
                w(f"h.free({name})")
            if self.streamed:
                w("h.store_fence()")

    def _prologue(self, w) -> None:
        R = self.R
        for a in range(R):   # static sizes are compile-time constants: known trip counts
            size = self.dom.axes[a].size
            w(f"D{a} = {size}" if size >= 0 else f"D{a} = dims[{a}]")
        w(f"rpt = dims[{R}]")
        w(f"cb = dims[{R + 1}]")
        w(f"nb = dims[{R + 2}]")
        w(f"rows = dims[{R + 3}]")
        w(f"L = {'D' + str(R - 1) if R else '1'}")
        refs = [-(j + 1) for j in range(len(self.spec.inputs))] + list(self.spec.outputs)
        for ref in refs:
            t = self.tag(ref)
            if ref in self.dom.view_strides:
                self._view_pointer(w, ref)
                continue
            src = f"ins[{-ref - 1}]" if ref < 0 else f"outs[{self.out_index[ref]}]"
            w(f"p_{t} = h.ptr_{_PTR[self.dtype(ref)]}({src})")
            car = self.dom.carries[ref]
            # a SmallMatMul's vector [..., K]: its side dim K is innermost, static
            side = [str(self._side_size(ref))] if ref in self.dom.side else []
            for n, a in enumerate(car):
                rest = " * ".join([f"D{b}" for b in car[n + 1:]] + side) or "1"
                w(f"st_{t}_{a} = {rest}")
        for k in self.s.scratch:
            cd = dt.COMPUTE[self.dtype(k)]
            w(f"sc{k} = h.ptr_{_PTR[cd]}(h.aligned_alloc(L * {dt.ITEMSIZE[cd]}))")
        for k in self.s.blocks:
            cd = dt.COMPUTE[self.dtype(k)]
            w(f"kb{k} = h.ptr_{_PTR[cd]}(h.aligned_alloc(cb * {dt.ITEMSIZE[cd]}))")
        for k in self._column_accs():
            r = lower.reduction(self.spec, k, self.C)
            w(f"acc{k} = h.ptr_{_PTR[r.acc]}(h.aligned_alloc(cb * {dt.ITEMSIZE[r.acc]}))")
        for k in self._column_parts():
            r = lower.reduction(self.spec, k, self.C)
            w(f"pt{k} = h.ptr_{_PTR[r.part]}(h.aligned_alloc(cb * {dt.ITEMSIZE[r.part]}))")
        if self._phase:
            # the prologue phase's values per group: 8-byte slots of the temp buffer
            gr = "rows" if self.s.products_per_row() or R < 2 else f"rows // D{R - 2}"
            w(f"G = {gr}")
            for f, k in enumerate(self.front):
                cd = dt.COMPUTE[self.dtype(k)]
                slots = 8 // dt.ITEMSIZE[cd]
                w(f"hz{k} = h.ptr_offset(h.ptr_{_PTR[cd]}(outs[{len(self.spec.outputs)}]), "
                  f"{f * slots} * G * L)")
        else:
            for k in self.front:
                cd = dt.COMPUTE[self.dtype(k)]
                w(f"hz{k} = h.ptr_{_PTR[cd]}(h.aligned_alloc(L * {dt.ITEMSIZE[cd]}))")
        for k, size in self._product_sizes.items():
            w(f"ac{k} = h.ptr_float64(h.aligned_alloc({size} * 8))")
        for k in self._window_nodes:
            cd = dt.COMPUTE[self.dtype(k)]
            w(f"dz{k} = h.ptr_{_PTR[cd]}(h.aligned_alloc(L * {dt.ITEMSIZE[cd]}))")
        for k in self._side_scratch():
            cd = dt.COMPUTE[self.dtype(k)]
            w(f"sz{k} = h.ptr_{_PTR[cd]}(h.aligned_alloc({self._side_size(k)} * "
              f"{dt.ITEMSIZE[cd]}))")
        for k, size in self.streamed.items():
            t, item = self.tag(k), dt.ITEMSIZE[self.dtype(k)]
            w(f"ns_{t} = {size} >= {-(-self.stream_min // item)}")
            w(f"sb_{t} = h.ptr_{_PTR[self.dtype(k)]}(h.aligned_alloc({self._stage_len()} * "
              f"{item}))")

    def _view_pointer(self, w, ref: int) -> None:
        """A view (schedule/layout.py): its source's pointer moved to the view's first
        element, or a constant table (a module global, _T<j>); constant strides."""
        t, view = self.tag(ref), self.spec.view_of(-ref - 1)
        if view.source < 0:
            w(f"p_{t} = _T{-ref - 1}")
        else:
            p = f"h.ptr_{_PTR[self.dtype(ref)]}(ins[{view.source}])"
            # an element from the end of a run-time dim: its offset is a kernel parameter
            off = [str(view.offset)] if view.offset else []
            off += [f"dims[{self.dom.param_slot(q)}] * {stride}"
                    for q, (r, _, b, stride) in enumerate(self.dom.picks)
                    if r == ref and b < 0 and stride]
            w(f"p_{t} = h.ptr_offset({p}, {' + '.join(off)})" if off else f"p_{t} = {p}")
        runtime = {a: (q, factor) for q, (r, a, factor, _) in enumerate(self.dom.scaled)
                   if r == ref}
        for a, stride in self.dom.view_strides[ref].items():
            if a in runtime:     # known at run time: a kernel parameter (Domain.scaled)
                q, factor = runtime[a]
                sign = "-" if factor < 0 else ""
                w(f"st_{t}_{a} = {sign}dims[{self.dom.scaled_slot(q)}]")
            else:
                w(f"st_{t}_{a} = {stride}")

    def _tables(self) -> list:
        """Module globals of the views' constant tables: concatenations' piece
        selectors (_T<j>) and guards on the innermost axis (_G<j>; a guard on an outer
        axis clamps the view's row base instead: Emitter.offset)."""
        out = []
        for v, view in enumerate(getattr(self.spec, "views", ())):
            j = self.spec.n_real + v
            guard = self.dom.inner_guard.get(-(j + 1), ())
            for name, bits in (("T", view.table), ("G", guard)):
                if bits:
                    out.append(f"_{name}{j} = np.array([{', '.join(str(int(x)) for x in bits)}], "
                               "dtype=np.uint8)")
        return out

    def load_input(self, w, ref: int, index: str) -> None:
        """A view guarded on the innermost axis (Domain.inner_guard) loads where its
        guard holds: the axis's absolute index is the element loops' ``j`` (row and
        element-wise kinds; column kernels are refused with such guards).  Guards on
        outer axes are in the view's row base (Domain.clamped)."""
        view = self.spec.view_of(-ref - 1) if ref < 0 and hasattr(self.spec, "views") else None
        last = self.R - 1
        along = index == "j" or index.endswith(" + j")     # at the element loop's j
        if view is not None and self.carries_last(ref) and \
                self.dom.view_strides[ref].get(last, 1) != 1:
            # a strided innermost axis (element-wise kernels only, schedule.py)
            if not along:
                raise AssertionError(f"strided view loaded at {index!r}")
            index = f"{index} * st_{self.tag(ref)}_{last}"
        if view is None or ref not in self.dom.inner_guard:
            super().load_input(w, ref, index)
            return
        if not along:
            raise AssertionError(f"guarded view loaded at {index!r}, not along the "
                                 "innermost axis")
        zero = self.C(0, dt.COMPUTE[self.dtype(ref)])
        load = load_expr(self.dtype(ref), "p_" + self.tag(ref), index)
        w(f"{self.var(ref)} = {load} if _G{-ref - 1}[j] else {zero}")

    def _in_place(self, w, loops) -> bool:
        """Where the op may write outputs over inputs (schedule/inplace.py): one loop
        nest storing through the inputs' pointers when every pair aliases, the usual
        one otherwise (also correct when some alias, but the vectorizer's overlap
        check keeps it scalar).  Nothing is streamed in the in-place nest: a staged
        copy would not save the read it exists for.  Returns whether it emitted."""
        ps = inplace_pairs(self.spec, self.s)
        if not ps:
            return False
        cond = " and ".join(f"h.same_address(ins[{i}], outs[{o}])" for i, o in ps)
        streamed, self.streamed = self.streamed, {}
        self._through = {self.spec.outputs[o]: self.tag(-(i + 1)) for i, o in ps}
        with w.block(f"if {cond}:"):
            loops(w)
        self.streamed, self._through = streamed, {}
        with w.block("else:"):
            loops(w)
        return True

    def _streamed_outputs(self) -> dict:
        """Outputs that may be written with non-temporal stores (_stream_min_bytes):
        those stored inside the element loops (they carry the last axis), unless
        their static size is below the threshold; output -> its element count.

        Only in kernels that are bound by memory, not by arithmetic: where an element
        loop computes a transcendental (exp, erf, tanh...), staging the output costs
        more than the read it saves (bias + GELU(erf) over 2048x4096, kernel alone,
        2 threads: 2.09 -> 2.69 ms with its output streamed, 2.87 ms staged and
        copied out with ordinary stores; a chunked loop without staging 2.09).
        Through the op, streamed against not (2 rounds): bias + GELU + residual
        3.96 -> 4.46 ms, swiglu 2.66 -> 3.01, bn + swish 1.98 -> 2.30, softmax 2.24
        -> 2.40."""
        if self.stream_min <= 0 or self.R == 0:
            return {}
        if self.s.kind == KernelKind.PACKED:     # static sizes: each output's own count
            counts = {k: math.prod(self.spec.nodes[k].type.shape) for k in self.spec.outputs}
            return {k: str(n) for k, n in counts.items()
                    if n * dt.ITEMSIZE[self.dtype(k)] >= self.stream_min}
        if any(OPS[self.spec.nodes[k].op].transcendental and self.s.is_vector(k)
               for p in self.s.passes for k in p.compute if self.spec.nodes[k].op in OPS):
            return {}
        stored = ([k for p in self.s.passes for k in p.stores]
                  if self.s.kind != KernelKind.ELEMENTWISE else list(self.s.passes[0].stores))
        out = {}
        for k in stored:
            if not self.carries_last(k):
                continue
            axes = self.dom.carries[k]
            sizes = [self.dom.axes[a].size for a in axes]
            if all(d >= 0 for d in sizes) and \
                    math.prod(sizes) * dt.ITEMSIZE[self.dtype(k)] < self.stream_min:
                continue
            out[k] = " * ".join(f"D{a}" for a in axes)
        return out

    def _stage_len(self) -> str:
        """Elements of a staging buffer: a row chunk, or COL_UNROLL rows of a column
        block."""
        return f"{COL_UNROLL} * cb" if self.s.kind == KernelKind.COLUMN else str(ROW_CHUNK)

    @contextmanager
    def _staged(self, w, stores: list, var: str, first: str, count: str):
        """The loop emitted inside (over ``var``, from ``first``, ``count`` trips)
        stores the outputs ``stores`` = [(node, row suffix, base, staging offset)]:
        where an output is streamed (ns_), into its staging buffer at the offset, then
        copied out (h.stream) after the loop; else straight to ``base + var``.  The
        destination is chosen before the loop, so the loop itself has one store."""
        stores = [st for st in stores if st[0] in self.streamed]
        if not stores:
            yield
            return
        for k in dict.fromkeys(k for k, _, _, _ in stores):
            t = self.tag(k)
            w(f"d_{t} = sb_{t} if ns_{t} else p_{t}")
        for k, sfx, base, off in stores:
            t = self.tag(k)
            start = f"{off} - {first}" if first != "0" else off
            w(f"e_{t}{sfx} = {start} if ns_{t} else {base}")
        self._staging = {(k, sfx): (f"e_{self.tag(k)}{sfx}", var) for k, sfx, _, _ in stores}
        try:
            yield
        finally:
            self._staging = {}
        for k in dict.fromkeys(k for k, _, _, _ in stores):
            t = self.tag(k)
            with w.block(f"if ns_{t}:"):
                for k2, sfx, base, off in stores:
                    if k2 == k:
                        dst = f"{base} + {first}" if first != "0" else base
                        w(f"h.stream(p_{t}, {dst}, sb_{t}, {off}, {count})")

    def _column_accs(self) -> list:
        if self.s.kind != KernelKind.COLUMN:
            return []
        return [k for p in self.s.passes for k in p.accumulate]

    def _column_parts(self, passes=None) -> list:
        """The float32 sums of column passes that store their rows too: summed in a
        float32 partial per COL_PART_ROWS rows (pt<k>), merged into the float64 sum,
        so the pass's loop stays 8 lanes wide (_column_pass)."""
        if self.s.kind != KernelKind.COLUMN:
            return []
        return [k for p in (self.s.passes if passes is None else passes) if p.stores
                for k in p.accumulate if lower.reduction(self.spec, k, self.C).part]

    def _buffers(self) -> list:
        return ([f"sc{k}" for k in self.s.scratch] + [f"kb{k}" for k in self.s.blocks] +
                [f"acc{k}" for k in self._column_accs()] +
                [f"pt{k}" for k in self._column_parts()] +
                [f"hz{k}" for k in self.front if not self._phase] +
                [f"ac{k}" for k in self._product_sizes] +
                [f"dz{k}" for k in self._window_nodes] +
                [f"sz{k}" for k in self._side_scratch()] +
                [f"sb_{self.tag(k)}" for k in self.streamed])

    # -- node evaluation ------------------------------------------------------------------
    # row passes: Div node -> its divisor's reciprocal variables (_row_reciprocals);
    # Exp node -> the row scalar under which its argument is <= 0 (_row_exp_guards)

    # -- element-wise ----------------------------------------------------------------------
    def _elementwise(self, w) -> None:
        R = self.R
        p = self.s.passes[0]
        self._unit_values(w, p)
        if R <= 1:
            # One row: units are consecutive blocks, so [begin, end) is one flat range.
            # A single loop (not a unit loop around a block loop) lets LLVM keep the
            # helpers' constants in registers/stack slots (measured 17% on erf).
            if self.front and not self._phase:      # small products, once per call
                self._hoist_loop(w, p, flat=True)
            self._ew_loop(w, p, {}, "begin * cb", "min(end * cb, L)", flat=True)
            return
        products = self._phase      # hoisted values from the prologue phase
        per_group = bool(self.front) and self.s.hoist_per_group() and not products
        if self.front and not per_group and not products:
            # per-column values once per call (Schedule.hoisted), over the whole row
            self._hoist_loop(w, p, flat=True)
        period = self._short_rows()
        if period:
            with w.block("if nb == 1:"):
                self._short_row_loop(w, p, period)
            with w.block("else:"):
                self._ew_rows(w, p, products, per_group)
        else:
            self._ew_rows(w, p, products, per_group)

    def _short_rows(self) -> int:
        """Element-wise kernels over [rows, C] with C static and under SHORT_ROW (an
        image's 3 channels after its normalization; codegen/lower/specialize.py keeps C
        in their code): the length of the blocks of the flat loop that runs them
        (_short_row_loop), a multiple of C and of SHORT_LANES, at least SHORT_BLOCK; 0
        where the kernel keeps its loop per row.  A row loop pays its index arithmetic,
        base offsets and loop entry per row, a vector or less of work: EfficientNetB0's
        input kernel over [8 x 224 x 224, 3] ran 3 elements per row.  The flat loop
        needs every value to be row-major over both axes (no views, guards or windows),
        one per channel (read from a tiled copy, _short_row_loop), or one element, and
        every output whole."""
        R, s, dom = self.R, self.s, self.dom
        if R != 2 or s.kind != KernelKind.ELEMENTWISE or self._phase \
                or s.side_groups or self._product_sizes or self._window_nodes \
                or dom.view_strides or dom.inner_guard or dom.clamped:
            return 0
        C = dom.axes[1].size
        if not 0 < C < SHORT_ROW:
            return 0
        refs = [-(j + 1) for j in range(len(self.spec.inputs))] + list(s.live)
        if any(dom.carries[r] not in ((), (1,), (0, 1)) for r in refs if r in dom.carries):
            return 0
        if any(dom.carries[k] != (0, 1) for k in self.spec.outputs):
            return 0
        period = math.lcm(C, SHORT_LANES)
        period *= -(-SHORT_BLOCK // period)
        # a streamed output stages a block in its ROW_CHUNK buffer (_staged)
        return period if period <= ROW_CHUNK else 0

    def _short_row_loop(self, w, p, period: int) -> None:
        """The units' whole rows (nb == 1) as one flat loop over their elements, in
        blocks of ``period`` (_short_rows): a value of one channel per column is read at
        the element's offset in its block from a copy tiled over the block, made once
        per call (the prologue's scratch hz, or the kernel input), so the loop body
        is the flat kernel's, vectorized across rows; a streamed output is staged per
        block (_staged)."""
        C = self.dom.axes[1].size
        tiles = [(f"hp{k}", f"hz{k}", dt.COMPUTE[self.dtype(k)]) for k in self.front]
        self._tiled = {}
        for j in p.loads:
            ref = -(j + 1)
            if self.dom.carries[ref] == (1,) and ref not in self._once:
                self._tiled[ref] = f"tp_{self.tag(ref)}"
                tiles.append((self._tiled[ref], f"p_{self.tag(ref)}", self.dtype(ref)))
        for name, src, dtype in tiles:
            w(f"{name} = h.ptr_{_PTR[dtype]}(h.aligned_alloc({period} * "
              f"{dt.ITEMSIZE[dtype]}))")
            with w.block(f"for t in range({period}):"):
                w(f"{name}[t] = {src}[t % {C}]")
        with w.block("for u in range(begin, end):"):
            w(f"lo = u * rpt * {C}")
            w(f"hi = min(u * rpt + rpt, rows) * {C}")
            with w.block(f"for b in range(lo, hi, {period}):"):
                w(f"e = min(b + {period}, hi)")
                stores = [(k, "", "0", "0") for k in p.stores]
                with self._staged(w, stores, "j", "b", "e - b"):
                    with w.block("for j in range(b, e):"):
                        w("t = j - b")
                        self._ew_body(w, p, {}, flat=True)
        self._tiled = None
        for name, _, _ in tiles:
            w(f"h.free({name})")

    def _ew_rows(self, w, p, products: bool, per_group: bool) -> None:
        """The element-wise units' loop nest: rows, their bases, then the element loop."""
        R = self.R
        if per_group:
            w("hg = -1")      # the group whose values the scratch holds (none yet)
        with w.block("for u in range(begin, end):"):
            w("rg = u // nb")
            w("c0 = (u - rg * nb) * cb")
            w("c1 = min(c0 + cb, L)")
            w("r0 = rg * rpt")
            with w.block("for r in range(r0, min(r0 + rpt, rows)):"):
                idx = self.decompose(w, "r", list(range(R - 1)))
                self.bases(w, idx)
                if products:
                    w("hb = r * L" if self.s.products_per_row() else f"hb = (r // D{R - 2}) * L")
                if per_group:
                    # rows r // D[R-2] share every hoisted value (they differ only
                    # along axis R-2, which no hoisted value carries): recompute the
                    # scratch when the group changes, once per group and thread
                    # (products varying along the rows: one row per group)
                    w("g = r" if self.s.products_per_row() else f"g = r // D{R - 2}")
                    with w.block("if g != hg:"):
                        w("hg = g")
                        self._hoist_loop(w, p, flat=False)
                self._windows(w, "r", "c0", "c1")
                self._ew_loop(w, p, idx, "c0", "c1", flat=False)

    def _unit_values(self, w, p) -> None:
        """One-element values of an element-wise pass (a learning rate, an Adam step's
        bias corrections ``sqrt(1 - b2^t) / (1 - b1^t)``) and the one-element inputs it
        reads, computed and loaded once before the element loops (``self._once``),
        not per element.  LLVM hoists such code out of the loop only where it proves
        the loop's stores leave the inputs it loads them from alone: an Adam update
        writing its three new values kept libm's ``pow`` in the loop, 40x its time."""
        def one(t) -> bool:
            return t.num_elements() == 1
        side = {k for g in self.s.side_groups for k in g.nodes}
        loads = [j for j in p.loads if one(self.spec.inputs[j])
                 and -(j + 1) not in self._window_reads]
        done = {-(j + 1) for j in loads}
        nodes = []
        for k in p.compute:
            nd = self.spec.nodes[k]
            if one(nd.type) and k not in self.hoisted_vectors and k not in side \
                    and k not in self.hoist and k not in self.front \
                    and all(a in done for a in nd.args):
                nodes.append(k)
                done.add(k)
        for j in loads:
            self.load_input(w, -(j + 1), "0")
        for k in nodes:
            self.compute(w, k)
        self._once = done

    def _hoist_loop(self, w, p, flat: bool, at: str = "j") -> None:
        """The hoisted values (Schedule.hoisted) over the whole last axis into their
        scratch; ``flat``: they carry nothing but that axis, else the row bases of the
        current row locate the inputs they read; ``at``: where in the scratch.  Small
        SmallMatMul products (not in a phase of their own) run first."""
        if not self._phase:
            self._side_loops(w, flat)
        with w.block("for j in range(L):"):
            for j in p.loads:
                ref = -(j + 1)
                if not self._used_by(ref, self.hoist):
                    continue
                if flat:
                    self.load_input(w, ref, "j" if self.carries_last(ref) else "0")
                else:
                    base = f"b_{self.tag(ref)}"
                    self.load_input(w, ref, f"{base} + j" if self.carries_last(ref) else base)
            for k in self.hoist:
                self.compute(w, k)
            for k in self.front:
                w(f"hz{k}[{at}] = v{k}")

    def _ew_loop(self, w, p, idx, lo: str, hi: str, flat: bool) -> None:
        """The element loop over [lo, hi); in chunks of ROW_CHUNK when an output it
        stores may be streamed (_staged)."""
        if not any(k in self.streamed for k in p.stores):
            with w.block(f"for j in range({lo}, {hi}):"):
                self._ew_body(w, p, idx, flat)
            return
        w(f"je = {hi}")
        with w.block(f"for j0 in range({lo}, je, {ROW_CHUNK}):"):
            w(f"j1 = min(j0 + {ROW_CHUNK}, je)")
            stores = [(k, "", "0" if flat else f"b_{self.tag(k)}", "0") for k in p.stores]
            with self._staged(w, stores, "j", "j0", "j1 - j0"):
                with w.block("for j in range(j0, j1):"):
                    self._ew_body(w, p, idx, flat)

    def _used_by(self, ref: int, nodes) -> bool:
        """Whether a node of ``nodes`` reads ``ref`` element by element (a product
        reads its vector and weight whole: _product)."""
        return any(ref in self.spec.nodes[k].args for k in nodes
                   if k not in self._product_sizes)

    # -- SmallMatMul: side loops and products (schedule/contract.py) --------------------
    def _find_products(self) -> dict:
        """SmallMatMul node -> its output length (a side group's size, or L)."""
        out = {}
        for g in self.s.side_groups:
            out.update(dict.fromkeys(g.products, str(g.size)))
        out.update({k: "L" for k in self.hoist if contract.is_contraction(self.spec.nodes[k])})
        return out

    def _product_phase(self, w) -> None:
        """Phase 0 of a kernel with SmallMatMuls: units [begin, end) of the element
        phase's U take row groups [begin * G // U, end * G // U) (each group exactly
        once, spread over the units): per group its side loops and products, then the
        hoisted values over the last axis into the group's temp slots (hz), which the
        element phase reads."""
        R = self.R
        w("U = ((rows + rpt - 1) // rpt) * nb")
        axes = list(range(R - 1)) if self.s.products_per_row() else list(range(R - 2))
        with w.block("for gi in range(begin * G // U, end * G // U):"):
            self.bases(w, self.decompose(w, "gi", axes) if R >= 2 else {})
            self._side_loops(w, flat=False)
            self._hoist_loop(w, self.s.passes[0], flat=False, at="gi * L + j")

    def _side_scratch(self) -> list:
        """Side values a product reads back whole: kept in a scratch of their size."""
        side = {k for g in self.s.side_groups for k in g.nodes}
        return sorted({self.spec.nodes[k].args[0] for k in self._product_sizes} & side)

    def _side_size(self, ref: int) -> int:
        return self.dom.classes[self.dom.side[ref]].size

    def _side_loops(self, w, flat: bool) -> None:
        """Per side group: its products, then a loop over its size computing its
        values, the ones a later product reads stored to their scratch (sz); then the
        main prologue's products."""
        stored = set(self._side_scratch())
        for g in self.s.side_groups:
            for k in g.products:
                self._product(w, k, str(g.size), flat)
            with w.block(f"for j in range({g.size}):"):
                for k in g.scalars:
                    self.compute(w, k)
                for ref in sorted({a for k in g.nodes for a in self.spec.nodes[k].args
                                   if a < 0 and self._used_by(a, g.nodes)}, reverse=True):
                    at = "j" if ref in self.dom.side else "0"
                    self.load_input(w, ref, at if flat else f"b_{self.tag(ref)} + {at}")
                for k in g.nodes:
                    self.compute(w, k)
                    if k in stored:
                        w(f"sz{k}[j] = v{k}")
        for k, size in self._product_sizes.items():
            if size == "L":
                self._product(w, k, "L", flat)

    def _product(self, w, k: int, size: str, flat: bool) -> None:
        """ac{k}[j] = sum over kk of x[kk] * W[kk, j], j < size: the weight's rows
        streamed in order, PRODUCT_ROWS of them per trip of a vector loop over j (their
        products summed in the vector's dtype, as TF's own product sums float32), each
        trip's sum added to a float64 accumulator, rounded once at the end (compute).
        Adding every product straight to the float64 accumulator took 3x the time
        (672 x 28 per image: a loop 4 lanes wide that loads and stores the accumulator
        once per weight row)."""
        x, wt = self.spec.nodes[k].args
        K = self.spec.type_of(wt).shape[-2]
        cd = dt.COMPUTE[self.dtype(k)]
        with w.block(f"for j in range({size}):"):
            w(f"ac{k}[j] = 0.0")

        def xval(kk: str) -> str:
            if x >= 0:
                return f"sz{x}[{kk}]"
            return load_expr(self.dtype(x), f"p_{self.tag(x)}",
                             kk if flat else f"b_{self.tag(x)} + {kk}")

        wp = f"p_{self.tag(wt)}"
        for lo, hi, n in ((0, K - K % PRODUCT_ROWS, PRODUCT_ROWS),
                          (K - K % PRODUCT_ROWS, K, 1)):
            if lo >= hi:
                continue
            with w.block(f"for kk in range({lo}, {hi}, {n}):" if n > 1 else
                         f"for kk in range({lo}, {hi}):"):
                for i in range(n):
                    w(f"xk{i} = np.{cd}({xval(f'kk + {i}' if i else 'kk')})")
                w(f"wb = kk * {size}")
                terms = [f"xk{i} * {wp}[wb + {i} * {size} + j]" if i else f"xk0 * {wp}[wb + j]"
                         for i in range(n)]
                while len(terms) > 1:    # a balanced sum: (t0 + t1) + (t2 + t3)
                    terms = [f"({a} + {b})" for a, b in zip(terms[::2], terms[1::2])] + \
                            (terms[-1:] if len(terms) % 2 else [])
                with w.block(f"for j in range({size}):"):
                    w(f"ac{k}[j] = ac{k}[j] + np.float64({terms[0]})")

    # -- DepthwiseConv2D: a window's taps per row (schedule/domain.py, step 5) ----------
    def _windows(self, w, row: str, lo: str, hi: str, var: str = "j", shift: str = "") -> None:
        """For each depthwise convolution, its outputs at row ``row`` (one output pixel:
        the domain's rows are the output's N x Ho x Wo, its channels the last axis),
        columns [lo, hi) (``var``, at channel ``shift`` + ``var``), into dz<k>[var]
        (compute reads it there), summed in TF's order: row-major over the window, each
        product added to a sum in the compute dtype that starts at 0, as Eigen's kernel
        does (the taps in the padding add zeros there).

        A window wholly inside the input (most pixels) is one vector loop: every tap
        at a constant offset from the window's corner, so LLVM needs two pointer checks
        (the scratch against the input's and the filter's accesses) before it
        vectorizes.  A window over the padding loops per tap inside the input, adding
        into the scratch (the padded taps' zeros change no sum but the sign of a zero).
        The scratch is a row in L1, and the element loop that reads it stays as it
        was: with the taps in it, its stores would need a check against every input."""
        for k in self._window_nodes:
            node = self.spec.nodes[k]
            x, f = node.args
            _, H, W, C = self.spec.type_of(x).shape
            _, Ho, Wo, _ = node.type.shape
            KH, KW = self.spec.type_of(f).shape[:2]
            (sh, sw), (top, _, left, _) = node.attrs["strides"], node.attrs["pads"]
            acc, xp, fp = f"dz{k}", f"p_{self.tag(x)}", f"p_{self.tag(f)}"
            zero = self.C(0, dt.COMPUTE[self.dtype(k)])
            w(f"wt{k} = {row}")
            w(f"wn{k} = wt{k} // {Ho * Wo}")
            w(f"wt{k} = wt{k} - wn{k} * {Ho * Wo}")
            w(f"wi{k} = wt{k} // {Wo}")
            w(f"wh{k} = wi{k} * {sh} - {top}")
            w(f"ww{k} = (wt{k} - wi{k} * {Wo}) * {sw} - {left}")
            inside = (f"(wh{k} >= 0) & (wh{k} <= {H - KH}) & (ww{k} >= 0) & "
                      f"(ww{k} <= {W - KW})")
            with w.block(f"if {inside}:"):
                w(f"xb = (wn{k} * {H * W} + wh{k} * {W} + ww{k}) * {C}{shift}")
                total = zero
                for kh in range(KH):
                    for kw in range(KW):
                        xo, fo = (kh * W + kw) * C, (kh * KW + kw) * C
                        total = (f"({total} + {xp}[xb + {xo} + {var}] * "
                                 f"{fp}[{fo}{shift} + {var}])")
                with w.block(f"for {var} in range({lo}, {hi}):"):
                    w(f"{acc}[{var}] = {total[1:-1]}")
            with w.block("else:"):
                with w.block(f"for {var} in range({lo}, {hi}):"):
                    w(f"{acc}[{var}] = {zero}")
                self._window_taps(w, k, (H, W, C, KH, KW), lo, hi, var, shift)

    def _window_taps(self, w, k, sizes, lo, hi, var, shift) -> None:
        """A window over the padding (_windows): a loop per tap inside the input."""
        H, W, C, KH, KW = sizes
        x, f = self.spec.nodes[k].args
        acc, xp, fp = f"dz{k}", f"p_{self.tag(x)}", f"p_{self.tag(f)}"
        with w.block(f"for kh in range({KH}):"):
            w(f"hh = wh{k} + kh")
            with w.block("if hh >= 0:"), w.block(f"if hh < {H}:"):
                with w.block(f"for kw in range({KW}):"):
                    w(f"wc = ww{k} + kw")
                    with w.block("if wc >= 0:"), w.block(f"if wc < {W}:"):
                        w(f"xb = (wn{k} * {H * W} + hh * {W} + wc) * {C}{shift}")
                        w(f"fb = (kh * {KW} + kw) * {C}{shift}")
                        with w.block(f"for {var} in range({lo}, {hi}):"):
                            w(f"{acc}[{var}] = {acc}[{var}] + {xp}[xb + {var}] * "
                              f"{fp}[fb + {var}]")

    def _column_window_rows(self, w, p, q: str) -> None:
        """A column pass's row ``q`` (the innermost reduced axis): the windows it
        computes summed for the unit's column block (_windows), the row's flat index
        built from the kept and reduced axes' indices."""
        if not any(k in p.compute for k in self._window_nodes):
            return
        inner = self.s.reduce_axes[-1]
        row = ""
        for a in range(self.R - 1):
            at = f"({q})" if a == inner else f"q{a}"
            row = f"({row}) * D{a} + {at}" if row else at
        self._windows(w, row, "0", "n", var="c", shift=" + c0")

    def compute(self, w, k: int) -> None:
        if k in self._window_nodes:
            w(f"{self.var(k)} = dz{k}[{'c' if self.s.kind == KernelKind.COLUMN else 'j'}]")
            return
        if k in self._product_sizes:
            w(f"{self.var(k)} = np.{dt.COMPUTE[self.dtype(k)]}(ac{k}[j])")
            return
        super().compute(w, k)

    def _ew_body(self, w, p, idx, flat: bool) -> None:
        """Loads, computes and stores of one element; ``flat``: no row bases.  Values
        of the per-column prologue are read back from its scratch, not recomputed."""
        def at(ref):
            base = "" if flat else f"b_{self.tag(ref)}"
            if self.carries_last(ref):
                return "j" if flat else f"{base} + j"
            return "0" if flat else base
        side = {k for g in self.s.side_groups for k in g.nodes}
        once = self._once               # empty but in element-wise kernels
        rest = [k for k in p.compute if k not in self.hoisted_vectors and k not in side
                and k not in once]
        tiled = self._tiled                     # the flat loop of short rows
        for k in self.front:
            w(f"v{k} = hp{k}[t]" if tiled is not None else f"v{k} = hz{k}[j]"
              if flat or not self._phase else f"v{k} = hz{k}[hb + j]")
        for j in p.loads:
            if -(j + 1) in self._window_reads or -(j + 1) in once:
                continue                         # read per row by _windows, or once
            if not self.hoist or self._used_by(-(j + 1), rest):
                if tiled is not None and -(j + 1) in tiled:
                    w(f"{self.var(-(j + 1))} = "
                      f"{load_expr(self.dtype(-(j + 1)), tiled[-(j + 1)], 't')}")
                else:
                    self.load_input(w, -(j + 1), at(-(j + 1)))
        for k in rest:
            self.compute(w, k)
        for k in p.stores:
            self.store_output(w, k, at(k))

    # -- packed --------------------------------------------------------------------------------
    def _packed(self, w) -> None:
        """Units are blocks of cb elements of the segments' concatenated flat space
        (schedule/packed.py): the shared scalars once, then each segment's element
        loop over its part of [lo, hi), indexed by the segment-local j."""
        w("lo = begin * cb")
        w("hi = min(end * cb, L)")
        self.packed_scalars(w)
        for p, (off, n) in zip(self.s.passes, self.s.segments):
            self._ew_loop(w, p, {}, f"max(lo - {off}, 0)", f"min(hi - {off}, {n})",
                          flat=True)

    # -- row ---------------------------------------------------------------------------------
    def _row(self, w) -> None:
        s = self.s
        scalar_inputs = sorted({j for p in s.passes for j in p.loads
                                if not s.is_vector(-(j + 1))} |
                               {j for st in s.scalars for j in st.loads})
        if not s.split_rows:
            self._row_whole(w, scalar_inputs)
            return
        with w.block("if nb > 1:"):
            self._row_split(w, scalar_inputs)
        with w.private_block("else:", "_w"):
            self._row_whole(w, scalar_inputs)

    def _row_start(self, w, scalar_inputs) -> None:
        """Row r's base offsets and the inputs read once per row."""
        self.bases(w, self.decompose(w, "r", list(range(self.R - 1))))
        for j in scalar_inputs:
            self.load_input(w, -(j + 1), f"b_i{j}")

    def _row_whole(self, w, scalar_inputs) -> None:
        s = self.s
        if self._pipelined_first_pass():
            self._row_whole_pipelined(w, scalar_inputs)
            return
        with w.block("for u in range(begin, end):"):
            w("r0 = u * rpt")
            with w.block("for r in range(r0, min(r0 + rpt, rows)):"):
                self._row_start(w, scalar_inputs)
                self._row_scalars(w, s.scalars[0])
                for p in s.passes:
                    self._row_pass(w, p)
                    if p.index == 0:
                        self._prefetch_next_row(w)
                    self._row_scalars(w, s.scalars[p.index + 1])

    def _pipelined_first_pass(self) -> bool:
        """Whether row r + 1's first pass runs inside row r's second (_row_whole_
        pipelined): the first pass only reduces (max, min...: no chunked partial sums)
        what it computes from inputs that vary per row, nothing it reads is computed
        per row before it, and a later pass computes a transcendental (the passes that
        leave memory idle).  Where it holds, this is done instead of
        _prefetch_next_row."""
        s = self.s
        if len(s.passes) < 2 or self.R < 2:
            return False
        p0 = s.passes[0]
        if (p0.stores or p0.scratch_stores or p0.scratch_loads or not p0.accumulate
                or s.scalars[0].loads or s.scalars[0].stores):
            return False
        before = set(s.scalars[0].compute)     # per-row values of no input (constants)
        if any(a in before for k in list(p0.compute) + list(p0.accumulate)
               for a in self.spec.nodes[k].args):
            return False
        if any(lower.reduction(self.spec, k, self.C).part for k in p0.accumulate):
            return False
        if not p0.loads or len(self._row_inputs_of_first_pass()) != len(p0.loads):
            return False
        if not all(s.is_vector(k) for k in p0.compute):
            return False
        return self._later_pass_transcendental()

    def _later_pass_transcendental(self) -> bool:
        """A row pass after the first computes exp, erf, tanh..."""
        ops = (self.spec.nodes[k].op for p in self.s.passes[1:] for k in p.compute)
        return any(op in OPS and OPS[op].transcendental for op in ops)

    def _row_inputs_of_first_pass(self) -> list:
        """The inputs (refs) the first pass streams in per row: vector inputs that
        carry a row axis."""
        s = self.s
        return [-(j + 1) for j in s.passes[0].loads
                if s.is_vector(-(j + 1)) and any(a < self.R - 1
                                                 for a in self.dom.carries[-(j + 1)])]

    def _row_whole_pipelined(self, w, scalar_inputs) -> None:
        """Rows [begin * rpt, end * rpt) in one software pipeline: the first pass of
        the range's first row, then for each row r its passes from the second on, the
        second also running the first pass over row r + 1 (the last row re-reads
        itself).  The first pass is a memory-bound reduction (a softmax's max) and the
        second a compute-bound one (its exps): run one after the other they add up,
        as each core has too few outstanding misses to fetch a row during the exps
        (prefetching the next row after the first pass stalled on them); in one loop
        the next row's loads spread over the exps.  logsumexp 8192x1024, kernel alone,
        2 threads: 1.66 -> 1.41 ms (1.66 -> 1.53 pipelining only within a unit)."""
        s = self.s
        p0 = s.passes[0]
        axes = list(range(self.R - 1))
        refs = self._row_inputs_of_first_pass()      # all of its loads (_pipelined...)
        w("r0 = begin * rpt")
        w("r1 = min(end * rpt, rows)")
        for k in p0.accumulate:
            w(f"a{k} = {lower.reduction(self.spec, k, self.C).init}")
        with w.block("if r0 < r1:"):
            self.bases(w, self.decompose(w, "r0", axes, q="qp"), refs=refs)
            self._row_pass(w, p0)
        with w.block("for r in range(r0, r1):"):
            self._row_start(w, scalar_inputs)
            w("rn = r + 1 if r + 1 < r1 else r")
            self.bases(w, self.decompose(w, "rn", axes, q="qn"), prefix="n", refs=refs)
            self._row_scalars(w, s.scalars[0])
            self._row_scalars(w, s.scalars[1])
            for p in s.passes[1:]:
                self._row_pass(w, p, nxt=p0 if p.index == 1 else None)
                self._row_scalars(w, s.scalars[p.index + 1])
            for k in p0.accumulate:
                w(f"a{k} = an{k}")

    def _next_row_first_pass(self, w, p0) -> None:
        """One element of the first pass over row r + 1, inside a later pass's loop:
        its values under the suffix _n, its reductions into an<k>."""
        saved = self._recip, self._exp_guard
        self._recip, self._exp_guard, self._sfx = {}, {}, "_n"
        try:
            for j in p0.loads:
                self.load_input(w, -(j + 1), f"n_i{j} + j")
            for k in p0.compute:
                self.compute(w, k)
            for k in p0.accumulate:
                r = lower.reduction(self.spec, k, self.C)
                v = self.var(self.spec.nodes[k].args[0])
                w(f"an{k} = {r.step.format(a=f'an{k}', v=v)}")
        finally:
            (self._recip, self._exp_guard), self._sfx = saved, ""

    def _prefetch_next_row(self, w) -> None:
        """After the first pass has streamed row r in, ask for row r + 1's inputs.

        The later passes work on data in L1 and are compute-bound (exp, erf); without
        the hint, memory sits idle while they run and the next row's first pass waits
        for DRAM (the hardware prefetcher does not cross into the next row early
        enough).  Only where it measured faster: a later pass computes a
        transcendental and rows are long (>= PREFETCH_MIN_ROW elements); 8192x1024
        softmax, log-softmax and logsumexp 5-14% faster (A/B over 4-5 process pairs),
        while LayerNorm's light passes and 128-element attention rows were ~5% slower
        with it.  Only inputs that pass 0 streams per row."""
        if not self._later_pass_transcendental():
            return
        refs = self._row_inputs_of_first_pass()
        if not refs:
            return
        with w.block(f"if r + 1 < rows and L >= {PREFETCH_MIN_ROW}:"):
            self.bases(w, self.decompose(w, "r + 1", list(range(self.R - 1)), q="qn"),
                       prefix="pf", refs=refs)
            for ref in refs:
                t = self.tag(ref)
                line = max(1, 64 // dt.ITEMSIZE[self.dtype(ref)])
                with w.block(f"for j in range(0, L, {line}):"):
                    w(f"h.prefetch(p_{t}, pf_{t} + j)")

    def _row_split(self, w, scalar_inputs) -> None:
        """Rows cut into nb pieces of cb, one unit each, run by the op in phases:
        phase p runs pass p over the piece and writes its reductions' partials (one
        8-byte slot per reduction, row and piece, in the op's temp buffer, outs[n]);
        later phases first combine a row's partials, then go on.  The last phase
        stores the per-row results (from the row's first piece)."""
        s = self.s
        reds = self._split_reds()
        acc = {k: lower.reduction(self.spec, k, self.C) for k in reds}
        w(f"phase = dims[{PHASE_SLOT}]")
        for i, k in enumerate(reds):
            w(f"pp{k} = h.ptr_{_PTR[acc[k].acc]}(outs[{len(self.spec.outputs)}])")
            w(f"po{k} = {i} * rows * nb * {8 // dt.ITEMSIZE[acc[k].acc]}")
        with w.block("for u in range(begin, end):"):
            w("r = u // nb")
            w("c = u - r * nb")
            with w.block(f"if phase == {len(s.passes)} and c != 0:"):
                w("continue")
            w("jb = c * cb")
            w("je = min(L, jb + cb)")
            self._row_start(w, scalar_inputs)
            self._row_scalars(w, s.scalars[0], stores=False)
            for p in s.passes:
                with w.block(f"if phase == {p.index}:"):
                    self._row_pass(w, p, "jb", "je")
                    for k in p.accumulate:
                        w(f"pp{k}[po{k} + r * nb + c] = "
                          f"{store_value(acc[k].acc, f'a{k}')}")
                    w("continue")
                for k in p.accumulate:
                    w(f"a{k} = {acc[k].init}")
                    with w.block("for cc in range(nb):"):
                        part = load_expr(acc[k].acc, f"pp{k}", f"po{k} + r * nb + cc")
                        w(f"a{k} = {acc[k].step.format(a=f'a{k}', v=part)}")
                self._row_scalars(w, s.scalars[p.index + 1], stores=False)
            for st in s.scalars:        # the last phase, first piece of the row
                for k in st.stores:
                    self.store_output(w, k, f"b_{self.tag(k)}")

    def _row_scalars(self, w, stage, stores: bool = True) -> None:
        for k in stage.compute:
            if k in self._accumulated():
                self.finalize(w, k, f"a{k}", "L")
            else:
                self.compute(w, k)
        for k in stage.stores if stores else ():
            self.store_output(w, k, f"b_{self.tag(k)}")

    def _row_reciprocals(self, w, p) -> dict:
        """Divisions in pass ``p`` by a value fixed for the row (a row scalar: a
        finished reduction such as softmax's sum, or what was computed from one) become
        multiplies by its reciprocal, taken once per row: a divide per element costs
        ~7x a multiply in a vectorized loop (0.21 against 0.03 ns per float32), and a
        hand-written softmax's e / sum(e) is the costliest step of its last pass.
        The row divides as before unless the reciprocal is a normal number (divisor
        not 0, Inf, NaN, subnormal or near the top of the range: lower.RECIPROCAL_RANGE),
        so x * (1/d) stays within rounding (1.5 ulp) of x / d, NaN and Inf included.
        The test is loop-invariant; LLVM unswitches the loop on it (measured: 0.06 ns
        per element with the select in the loop, 0.04 with two hand-written loops)."""
        before = self._row_scalars_before(p)
        out = {}
        for k in p.compute:
            node = self.spec.nodes[k]
            cd = dt.COMPUTE[self.dtype(k)]
            if node.op != "Div" or cd not in lower.RECIPROCAL_RANGE:
                continue
            d = node.args[1]
            if d not in before or dt.COMPUTE[self.dtype(d)] != cd:
                continue
            lo, hi = lower.RECIPROCAL_RANGE[cd]
            dv = self.var(d)
            w(f"rc{k} = {self.C(1, cd)} / {dv}")
            w(f"ok{k} = {self.C(lo, cd)} <= h.fabs({dv}) <= {self.C(hi, cd)}")
            out[k] = (f"rc{k}", f"ok{k}")
        return out

    def _row_scalars_before(self, p) -> set:
        """Nodes computed once per row before pass ``p`` runs."""
        return {k for st in self.s.scalars[:p.index + 1] for k in st.compute}

    def _row_exp_guards(self, p) -> dict:
        """Exps in pass ``p`` of ``x - where(is_finite(max), max, c)`` (TF's
        reduce_logsumexp): where the row's max is finite the argument is <= 0, and the
        shorter exp_nonpos (as accurate there) serves; else the full exp.  The
        condition is a row scalar, and LLVM unswitches the loop on it (logsumexp
        8192x1024, 2 threads: 1.90 -> 1.68 ms)."""
        before = self._row_scalars_before(p)
        out = {}
        for k in p.compute:
            node = self.spec.nodes[k]
            if node.op != "Exp" or dt.COMPUTE[self.dtype(k)] not in ("float32", "float64"):
                continue
            c = lower.nonpositive_when(self.spec, node.args[0])
            if c is not None and c is not True and c in before:
                out[k] = c
        return out

    def _row_pass(self, w, p, lo: str = "0", hi: str = "L", nxt=None) -> None:
        """Pass ``p`` over [lo, hi) of the row; ``nxt``: the first pass, run over the
        next row in the same loop (_row_whole_pipelined)."""
        self._recip = self._row_reciprocals(w, p)
        self._exp_guard = self._row_exp_guards(p)
        try:
            self._row_pass_loops(w, p, lo, hi, nxt)
        finally:
            self._recip, self._exp_guard = {}, {}

    def _row_pass_loops(self, w, p, lo: str, hi: str, nxt=None) -> None:
        reds = {k: lower.reduction(self.spec, k, self.C) for k in p.accumulate}
        for k in p.accumulate:
            w(f"a{k} = {reds[k].init}")
        for k in (nxt.accumulate if nxt else ()):
            w(f"an{k} = {lower.reduction(self.spec, k, self.C).init}")
        chunked = [k for k in p.accumulate if reds[k].part]
        streamed = any(k in self.streamed for k in p.stores)
        if chunked:
            self._chunk_loop_head(w, lo, hi)
            for k in chunked:
                w(f"s{k} = {reds[k].part_init}")
        elif streamed:
            w(f"for j0 in range({lo}, {hi}, {ROW_CHUNK}):")
            w.depth += 1
            w(f"j1 = min(j0 + {ROW_CHUNK}, {hi})")
        stores = [(k, "", f"b_{self.tag(k)}", "0") for k in p.stores]
        with self._staged(w, stores, "j", "j0", "j1 - j0"), \
                w.block("for j in range(j0, j1):" if chunked or streamed
                        else f"for j in range({lo}, {hi}):"):
            for j in p.loads:
                if self.s.is_vector(-(j + 1)):
                    self.load_input(w, -(j + 1), f"b_i{j} + j")
            for k in p.scratch_loads:
                w(f"v{k} = {load_expr(self._scratch_dtype(k), f'sc{k}', 'j')}")
            for k in p.compute:
                self.compute(w, k)
            for k in p.accumulate:
                v = self.var(self.spec.nodes[k].args[0])
                if reds[k].part:
                    w(f"s{k} = {reds[k].part_step.format(p=f's{k}', v=v)}")
                else:
                    w(f"a{k} = {reds[k].step.format(a=f'a{k}', v=v)}")
            for k in p.scratch_stores:
                w(f"sc{k}[j] = {store_value(self._scratch_dtype(k), f'v{k}')}")
            for k in p.stores:
                self.store_output(w, k, f"b_{self.tag(k)} + j")
            if nxt is not None:
                self._next_row_first_pass(w, nxt)
        if chunked or streamed:
            self._merge_partials(w, p, chunked, reds)
            w.depth -= 1

    @staticmethod
    def _chunk_loop_head(w, lo: str, hi: str) -> None:
        """Open the loop over a row's chunks [j0, j1) for float32 partial sums: chunks
        of ROW_CHUNK, then what is left cut at a multiple of ROW_TAIL, then of 16
        (one vector), then the last < 16 elements: each a chunk of its own.  The vectorized loop sums a
        chunk in ROW_TAIL lane-interleaved partials (a short tree), but LLVM adds a
        loop's remainder one element at a time onto the already reduced partial:
        with the remainder in a chunk of its own, its rounding errors scale with the
        remainder's sum, not the row's (a row of 100 positive values: max 4 -> 1.5
        ulp against float64; TF's 1.8).  The bound is opaque to LLVM, so a row
        length known at compile time does not unroll the loop into a chain."""
        w(f"j1 = {lo}")
        w(f"je1 = h.opaque_int({hi})")      # see intrinsics.opaque_int
        w("while j1 < je1:")
        w.depth += 1
        w("j0 = j1")
        w(f"{_chunk_step(ROW_CHUNK)}j0 + ((je1 - j0) & -{ROW_TAIL})")
        w("j1 = j1 if j1 > j0 else (j0 + ((je1 - j0) & -16) if je1 - j0 >= 16 else je1)")

    def _merge_partials(self, w, p, chunked, reds) -> None:
        """Fold each chunk's float32 partial sums into the float64 accumulators.  A
        partial that is not finite may have overflowed where the float64 sum would
        not (+-3e38 values; lanes of one sign reach inf first): that chunk's terms
        are then summed again in float64, which gives the finite sum, or the NaN/Inf
        an Inf or NaN input makes.  Values recompute bit-identically (no fast-math
        contraction), so only the accumulation changes.

        Only for reductions whose terms recompute without calling a math helper
        (exp, tanh...): a second call site of a helper can stop LLVM inlining it,
        which would cost the hot loop its vectorization.  Terms made by helpers keep
        the plain merge; they overflow a chunk only if each is above FLT_MAX /
        ROW_CHUNK (3e35) and they cancel afterwards."""
        if not chunked:
            return
        safe = [k for k in chunked if not self._cone_calls_helpers(w, p, k)]
        for k in chunked:
            if k not in safe:
                w(f"a{k} = {reds[k].merge.format(a=f'a{k}', p=f's{k}')}")
        if not safe:
            return
        finite = " and ".join(f"s{k} - s{k} == 0.0" for k in safe)
        with w.block(f"if {finite}:"):
            for k in safe:
                w(f"a{k} = {reds[k].merge.format(a=f'a{k}', p=f's{k}')}")
        with w.block("else:"), w.block("for j in range(j0, j1):"):
            self._fallback_body(w, p, safe, reds)

    def _cone(self, p, k) -> list:
        """The nodes of pass ``p``'s compute list that reduction ``k``'s term needs."""
        todo, need = [self.spec.nodes[k].args[0]], set()
        compute = set(p.compute)
        while todo:
            r = todo.pop()
            if r >= 0 and r in compute and r not in need:
                need.add(r)
                todo.extend(self.spec.nodes[r].args)
        return [c for c in p.compute if c in need]

    def _fallback_body(self, w, p, ks, reds) -> None:
        """One element of the float64 re-summation: the terms of reductions ``ks``."""
        cone = sorted({c for k in ks for c in self._cone(p, k)}, key=list(p.compute).index)
        for j in p.loads:
            if self.s.is_vector(-(j + 1)):
                self.load_input(w, -(j + 1), f"b_i{j} + j")
        for k in p.scratch_loads:
            w(f"v{k} = {load_expr(self._scratch_dtype(k), f'sc{k}', 'j')}")
        for c in cone:
            self.compute(w, c)
        for k in ks:
            v = self.var(self.spec.nodes[k].args[0])
            w(f"a{k} = {reds[k].step.format(a=f'a{k}', v=v)}")

    def _cone_calls_helpers(self, w, p, k) -> bool:
        """Whether recomputing reduction ``k``'s term calls a math helper (emitted,
        inspected, then taken back out of ``w``)."""
        start = len(w.lines)
        for c in self._cone(p, k):
            self.compute(w, c)
        calls = _calls_helpers(w.lines[start:])
        del w.lines[start:]
        return calls

    # -- column ------------------------------------------------------------------------------
    def _column_unit(self, w, unit: str) -> None:
        """Unit ``unit``'s kept index, column block [c0, c0 + n) and unit bases."""
        kept = self._kept_axes()
        w(f"ko = {unit} // nb")
        w(f"c0 = ({unit} - ko * nb) * cb")
        w("n = min(cb, L - c0)")
        idx = self.decompose(w, "ko", kept)
        for ref in self.input_refs() + list(self.spec.outputs):
            off = self.offset(ref, idx)
            last = " + c0" if self.carries_last(ref) else ""
            w(f"k_{self.tag(ref)} = {off}{last}")

    def _column(self, w) -> None:
        """A column kernel, whole or split, with one copy of each pass.

        Split (rpt > 1): the outermost reduced axis cut into rpt chunks (rows [lo,
        hi)), a unit per (column unit, chunk), run by the op in phases as a split row
        is: phase p runs pass p over the unit's rows and writes its accumulators (one
        8-byte slot per reduction, column unit, chunk and column, in the op's temp
        buffer, outs[n]); later phases first combine all chunks' partials, then go
        on.  Per-column results are stored by the first chunk in the last phase.
        Whole (rpt = 1, one phase): a unit runs every pass over all rows in turn.
        The passes are written once for both (a second copy doubled the kernel's
        compile time)."""
        s = self.s
        reds = self._split_reds()
        acc = {k: lower.reduction(self.spec, k, self.C) for k in reds}
        final = self.column_split() == 1
        last = len(s.passes)
        w(f"phase = dims[{PHASE_SLOT}]")
        w("split = rpt > 1")
        w(f"nu = {' * '.join([f'D{a}' for a in self._kept_axes()] + ['nb'])}")
        for i, k in enumerate(reds):
            w(f"pp{k} = h.ptr_{_PTR[acc[k].acc]}(outs[{len(self.spec.outputs)}])")
            w(f"po{k} = {i} * nu * rpt * cb")
        outer = s.reduce_axes[0]
        with w.block("for u in range(begin, end):"):
            w("ch = u % rpt")
            w("uc = u // rpt")
            if final:
                with w.block(f"if phase == {last} and ch != 0:"):
                    w("continue")
            self._column_unit(w, "uc")
            w(f"lo = ch * D{outer} // rpt")
            w(f"hi = (ch + 1) * D{outer} // rpt")
            sv = None                   # no last phase: the stages store nothing
            if final:
                sv = "sv"
                w(f"sv = not split or phase == {last}")
            self._column_block(w, s.scalars[0], stores=sv)
            for p in s.passes:
                with w.block(f"if not split or phase == {p.index}:"):
                    self._column_pass(w, p, "lo", "hi")
                    with w.block("if split:"):
                        for k in p.accumulate:
                            w(f"ps = po{k} + (uc * rpt + ch) * cb")
                            self._partials(w, k, acc[k], store=True)
                        w("continue")
                if p.accumulate:        # split, a later phase: the chunks' partials
                    with w.block("else:"):
                        for k in p.accumulate:
                            self._column_acc_init(w, k)
                            with w.block("for cc in range(rpt):"):
                                w(f"ps = po{k} + (uc * rpt + cc) * cb")
                                self._partials(w, k, acc[k], store=False)
                self._column_block(w, s.scalars[p.index + 1], stores=sv)

    def _partials(self, w, k, r, store: bool) -> None:
        """acc{k}[c] to (store) or folded with (not store) the 8-byte partial slots
        from ``ps`` on, for c < n."""
        scale = 8 // dt.ITEMSIZE[r.acc]
        slot = f"(ps + c) * {scale}" if scale > 1 else "ps + c"
        cur = load_expr(r.acc, f"acc{k}", "c") if r.acc == "bool" else f"acc{k}[c]"
        with w.block("for c in range(n):"):
            if store:
                w(f"pp{k}[{slot}] = {store_value(r.acc, cur)}")
            else:
                part = load_expr(r.acc, f"pp{k}", slot)
                w(f"acc{k}[c] = {store_value(r.acc, r.step.format(a=cur, v=part))}")

    def _column_block(self, w, stage, stores: str | None = None) -> None:
        """A stage between column passes; ``stores``: a condition its stores run
        under (split kernels store per-column results once)."""
        if not stage.compute:
            return
        unit = [k for k in stage.compute if not self.carries_last(k)]
        block = [k for k in stage.compute if self.carries_last(k)]
        for k in unit:   # constant over the unit (only possible before any reduction)
            for a in self.spec.nodes[k].args:
                if a < 0:
                    self.load_input(w, a, f"k_{self.tag(a)}")
            self.compute(w, k)
        if not block:
            return
        with w.block("for c in range(n):"):
            done = self._accumulated()      # finalized from acc, their input is not read
            self._column_args(w, [k for k in block if k not in done], set(block))
            for k in block:
                if k in self._accumulated():
                    r = lower.reduction(self.spec, k, self.C)
                    acc = load_expr(r.acc, f"acc{k}", "c") if r.acc == "bool" \
                        else f"acc{k}[c]"
                    self.finalize(w, k, acc, "rows")
                else:
                    self.compute(w, k)
                if k in self.s.blocks:
                    cd = dt.COMPUTE[self.dtype(k)]
                    w(f"kb{k}[c] = {store_value(cd, f'v{k}')}")
            self._guarded(w, [k for k in stage.stores if k in block], stores,
                          lambda k: self._inner(k, f"k_{self.tag(k)}"))
        self._guarded(w, [k for k in stage.stores if k in unit], stores,
                      lambda k: f"k_{self.tag(k)}")

    def _guarded(self, w, nodes, cond, index) -> None:
        if not nodes:
            return
        if cond is not None:
            w(f"if {cond}:")
            w.depth += 1
        for k in nodes:
            self.store_output(w, k, index(k))
        if cond is not None:
            w.depth -= 1

    def _column_args(self, w, nodes, here: set, vector=None) -> None:
        """Load what ``nodes`` read that is not computed in this loop: kernel inputs
        and column-block values of earlier loops.  ``vector``: only the refs that
        carry a reduced axis (True; per-row bases ``b_``), only those that do not
        (False; unit bases ``k_``), or all (None, between passes: ``k_``)."""
        seen = set()
        for k in nodes:
            for a in self.spec.nodes[k].args:
                if a in seen or a in here or a in self._window_reads:
                    continue
                seen.add(a)
                if vector is not None and self.s.is_vector(a) != vector:
                    continue
                if a < 0:
                    base = f"b_{self.tag(a)}{self._sfx}" if vector else f"k_{self.tag(a)}"
                    self.load_input(w, a, self._inner(a, base))
                elif a in self.s.blocks:
                    cd = dt.COMPUTE[self.dtype(a)]
                    w(f"v{a} = {load_expr(cd, f'kb{a}', 'c')}")

    def _column_acc_init(self, w, k) -> None:
        """Reduction k's per-column accumulators of the block set to its start value."""
        r = lower.reduction(self.spec, k, self.C)
        with w.block("for c in range(n):"):
            w(f"acc{k}[c] = {store_value(r.acc, r.init)}")

    def _column_pass(self, w, p, lo: str | None = None, hi: str | None = None) -> None:
        """Accumulate over the reduced axes (the outermost over [lo, hi) when given).
        The innermost reduced axis runs COL_UNROLL rows per trip of the column loop
        (fewer loop entries and accumulator round trips), then the remaining rows one
        at a time; a pass that stores its rows too runs them one at a time."""
        s = self.s
        for k in p.accumulate:
            self._column_acc_init(w, k)
        red = list(s.reduce_axes)
        last = red[-1]
        bounds = {a: ("0", f"D{a}") for a in red}
        if lo is not None:
            bounds[red[0]] = (lo, hi)
        for a in red[:-1]:                 # one loop per reduced axis, outer first
            w(f"for q{a} in range({bounds[a][0]}, {bounds[a][1]}):")
            w.depth += 1
        # A pass that also stores each row unrolls nothing: U rows' stores and loads
        # through run-time row offsets need about U^2 pointer checks before LLVM may
        # vectorize the loop, past its limit (8) from U = 2 on, so the unrolled loop
        # stayed scalar, sigmoid and all (a BatchNorm + swish + mean over
        # [8, 3136, 144]: 3.5x the time of the same kernel without the mean).
        # Its float32 sums go through float32 partials (_column_parts): a float64
        # accumulator in the loop would make it 4 lanes wide, the sigmoid with it.
        # (a pass computing a window sums its taps per row into one scratch: one row)
        U = 1 if p.stores or any(k in p.compute for k in self._window_nodes) else COL_UNROLL
        b0, b1 = bounds[last]
        parts = self._column_parts([p])
        if parts:
            with w.block(f"for tb in range({b0}, {b1}, {COL_PART_ROWS}):"):
                for k in parts:
                    r = lower.reduction(self.spec, k, self.C)
                    with w.block("for c in range(n):"):
                        w(f"pt{k}[c] = {store_value(r.part, r.part_init)}")
                with w.block(f"for t{last} in range(tb, min(tb + {COL_PART_ROWS}, {b1})):"):
                    self._column_rows(w, p, [("", f"t{last}")], parts)
                for k in parts:
                    r = lower.reduction(self.spec, k, self.C)
                    merged = r.merge.format(a=f"acc{k}[c]", p=f"pt{k}[c]")
                    with w.block("for c in range(n):"):
                        w(f"acc{k}[c] = {store_value(r.acc, merged)}")
            w.depth -= len(red) - 1
            return
        rest = b0
        if U > 1:
            with w.block(f"for t{last} in range({b0}, {b1} - {U - 1}, {U}):"):
                self._column_rows(w, p, [(f"_{u}", f"t{last} + {u}") for u in range(U)])
            rest = f"D{last} - D{last} % {U}" if b0 == "0" else f"{b1} - ({b1} - {b0}) % {U}"
        with w.block(f"for t{last} in range({rest}, {b1}):"):
            self._column_rows(w, p, [("", f"t{last}")])
        w.depth -= len(red) - 1

    def _column_rows(self, w, p, rows, parts=()) -> None:
        """One trip of the column loop over the rows ``[(suffix, index of the
        innermost reduced axis)]``: shared loads once, each row's vector values
        under its suffix, the accumulators folded over the rows in order (those in
        ``parts`` into their float32 partials)."""
        s = self.s
        idx = {a: f"q{a}" for a in s.reduce_axes}
        here = set(p.compute)
        readers = list(p.compute) + list(p.accumulate)
        # per-row bases of what the pass itself reads along the rows or stores
        read = {a for k in readers for a in self.spec.nodes[k].args
                if a < 0 and a not in here and s.is_vector(a)}
        used = [r for r in self.input_refs() if r in read] + list(p.stores)
        for sfx, q in rows:
            idx[s.reduce_axes[-1]] = f"({q})"
            for ref in used:
                extra = self.offset(ref, idx)
                w(f"b_{self.tag(ref)}{sfx} = k_{self.tag(ref)}" +
                  (f" + {extra}" if extra != "0" else ""))
        if len(rows) == 1:
            self._column_window_rows(w, p, rows[0][1])
        stores = [(k, sfx, f"b_{self.tag(k)}{sfx}", f"{u} * cb")
                  for u, (sfx, _) in enumerate(rows) for k in p.stores]
        with self._staged(w, stores, "c", "0", "n"), w.block("for c in range(n):"):
            self._column_args(w, readers, here, vector=False)
            for sfx, _ in rows:
                self._sfx = sfx
                self._column_args(w, readers, here, vector=True)
                for k in p.compute:
                    self.compute(w, k)
                for k in p.stores:
                    self.store_output(w, k, self._inner(k, f"b_{self.tag(k)}{sfx}"))
            self._sfx = ""
            for k in p.accumulate:
                r = lower.reduction(self.spec, k, self.C)
                if k in parts:
                    v = self.var(self.spec.nodes[k].args[0])
                    w(f"pt{k}[c] = {r.part_step.format(p=f'pt{k}[c]', v=v)}")
                    continue
                acc = load_expr(r.acc, f"acc{k}", "c") if r.acc == "bool" else f"acc{k}[c]"
                for sfx, _ in rows:
                    self._sfx = sfx
                    acc = (r.block_step or r.step).format(
                        a=acc, v=self.var(self.spec.nodes[k].args[0]))
                self._sfx = ""
                w(f"acc{k}[c] = {store_value(r.acc, acc)}")


