"""CUDA emitter: Schedule -> Python source of numba-cuda kernels (+ a host shape function).

The CPU emitter (cpu/emitter.py) and this one walk the same Schedule over the shared
base emitter (lower/emitter.py: per-element lowering ``compute``, ``load_input``,
``store_output``, ``decompose``, ``bases``, ``finalize`` over lower/exprs.py, and the host
shape function); this one owns only the thread mapping.  Buffers are 1-D device arrays ``p_<tag>``; every domain size ``D<a>``
and launch parameter is a kernel argument, so one compiled kernel serves every value
of the unknown dims.

Thread mapping per kind (``tid`` = threadIdx.x; names as in the generated code)::

  elementwise  k_ew: grid-stride over chunks of EW_VEC consecutive elements of one row
               (chunk v: row r = v // nc, columns j0 = (v % nc) * EW_VEC ...); inputs
               that do not carry the last axis are loaded once per chunk.
               k_ew_v4 (rows a multiple of 4 long, buffers 16-byte aligned): the same
               chunks, float32/int32 buffers moved with one 16-byte load/store
               (h.load4/h.store4: ld.global.v4 / st.global.v4).

  packed       k_pk: grid-stride over the concatenated flat space of independent
               chains of different sizes (schedule/packed.py); per segment a loop from
               the thread's first index in it, one-element values computed per thread.

  row          k_row[_regs|_smem|_global]: a group of ``tpr`` threads (power of two) per
               row, ``rpb = blockDim / tpr`` rows per block, grid-stride over row groups.
                 tpr <  32  several rows per warp (very short rows)
                 tpr == 32  one warp per row
                 tpr >  32  one block (or part of one) per row
               Each pass: thread ``lane`` takes j = lane, lane + tpr, ...; reductions are
               combined by an xor-butterfly of warp shuffles (every lane ends with the
               row value: a row scalar lives in registers, reached by warp shuffle) and,
               for tpr > 32, through 32 shared slots per reduction.  A value the
               schedule keeps across passes (Placement.SCRATCH) is owned by the thread
               that computed it, so it needs no barrier; it lives in
                 _regs    a per-thread array of REG_SLOTS registers (L <= tpr * REG_SLOTS)
                 _smem    dynamic shared memory (rpb rows fit the block's budget)
                 _global  a global workspace of one row per resident row group
               Placement.RECOMPUTE and LOAD re-evaluate / re-read (L1/L2 hits).
               k_row_r<C>[_v4] (rows of a multiple of 4, up to tpr * 4 * C long): the
               same row groups, each thread owning C unrolled chunks of 4 consecutive
               elements, so inputs are read once per row and scratch values are named
               registers whatever the placement said (_row_chunked).

  column       k_col (one launch) or k_col_p<q> (one launch per pass, "split"):
               block = tx_n columns x ny row slices; unit u = (kept index ko, column
               tile, split sp); thread (tx, ty) owns column c and reduced rows
               s = sp*ny + ty, + ny*nsplit, ...  A pass accumulates per thread, then the
               ny partials of a column are combined through shared memory (the combine
               step); values of a column (column_block / unit_scalar placements) stay
               in the owning thread's registers.  When kept x tiles blocks cannot fill
               the GPU the reduced axis is also split across ``nsplit`` blocks: each pass
               is its own launch and block partials go through a global workspace
               ``wa<k>[(sp * kept + ko) * L + c]`` (AStitch's global stitching, the launch
               boundary being the grid barrier); the next phase re-combines them.

Every thread of a block runs the same number of unit/row-group iterations (inactive
ones with empty loops), so ``syncthreads`` and full-mask shuffles are always reached
uniformly.

Generated text is built only from this module's templates, identifiers it makes and
numbers re-formatted from validated values, as in cpu.py.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...ir import dtypes as dt
from ...plan.cost import GPU_ROW_VALUES_PER_THREAD
from ...schedule import KernelKind
from ..lower import exprs as lower
from ..lower.emitter import Emitter, Writer, load_expr, store_value

EW_VEC = 4            # arbitrary: elements per thread per step (4 x 4 B = one 16-byte chunk)
REG_SLOTS = GPU_ROW_VALUES_PER_THREAD   # row values a thread keeps in registers (cost.py)
WARP = 32
MAX_THREADS = 1024    # CUDA: threads per block
# Column passes: rows per loop trip, so each thread has this many independent loads in
# flight (one, before: 22% of copy bandwidth on an H100 for a mean over axis 0)
COL_UNROLL = 4
PART_ELEMS = 32       # row passes: float32 values a thread sums before a float64 merge
ROW_PART_CHUNKS = PART_ELEMS // EW_VEC   # wide row passes: 16-byte chunks per partial
ROW_VARIANTS = ("regs", "smem", "global")
ROW_CHUNKS = (1, 2, 4, 8)   # k_row_r<C>: 16-byte chunks of its row each thread keeps
# k_row_r<C> kernels: row elements per thread, in blocks of MIN_THREADS (not the
# evaluator's threads).  tools/gpu_sweep.py --variant chunks on an H100, blocks of 128 /
# 256 x tpr 4..64: 16 per thread (4 chunks) was fastest at every length: a 128-long
# softmax 28.8 µs (8 per thread 34.1, 32 per thread 35.4), a 256-long masked softmax
# 42.0 µs (32 per thread 51.8), a 1024-long softmax 30.9 µs (32: 32.8) and logsumexp
# 20.6 µs (32: 22.4); 256-thread blocks 2-17% slower throughout
ROW_CHUNK_ELEMS = 16

# numpy dtype of on-chip / workspace arrays holding compute values (bool as bytes)
_NP = {"float32": "np.float32", "float64": "np.float64", "int32": "np.int32",
       "int64": "np.int64", "bool": "np.uint8"}


@dataclass(frozen=True)
class CudaSource:
    text: str
    errors: tuple
    kernels: dict                 # kernel name -> argument names, in order
    scratch: tuple = ()           # row kind: (node, compute dtype) kept across passes
    accumulators: tuple = ()      # column kind: (node, accumulator dtype) per reduction
    phases: tuple = ()            # column kind, split: phase kernels launched in order
    passes: int = 1
    wide: tuple = ()              # element-wise: arguments k_ew_v4 moves 16 B at a time
    program: tuple = ()           # the shape function (shape_program.py), run on the host

    @property
    def scratch_np(self) -> list:
        """[(node, numpy dtype)] of the scratch values as on-chip / workspace arrays."""
        return [(k, np_dtype(cd)) for k, cd in self.scratch]


def chunk_tpr(L: int, max_threads: int = MAX_THREADS) -> int:
    """Threads per row of the k_row_r<C> kernels for rows of L: the power of two that
    leaves each thread ROW_CHUNK_ELEMS elements, at most ``max_threads``."""
    return min(1 << max(0, -(-L // ROW_CHUNK_ELEMS) - 1).bit_length(), max_threads)


def row_chunks(L: int, tpr: int) -> int:
    """Chunks per thread of the k_row_r<C> kernel that holds a row of L at tpr threads
    per row (the fewest that do), or 0 where none does (rows not a multiple of 4, empty
    rows: an idle chunk reads the row's first 4 elements)."""
    if L <= 0 or L % EW_VEC:
        return 0
    need = -(-L // (tpr * EW_VEC))
    return next((c for c in ROW_CHUNKS if c >= need), 0)


def np_dtype(compute_dtype: str) -> np.dtype:
    """On-chip / workspace arrays hold compute values; bool as bytes."""
    return np.dtype("uint8" if compute_dtype == "bool" else compute_dtype)


def helper_tag() -> str:
    """Hash of the helper modules kernels call: part of the source text, so a changed
    helper gives a new file and never reuses numba-cuda's cache of the old one."""
    codegen = Path(__file__).parent.parent
    h = hashlib.sha256()
    for name in ("cuda/rt.py", "cuda/gpu.py", "cuda/sim.py", "lower/exprs.py"):
        h.update((codegen / name).read_bytes())
    return h.hexdigest()[:12]


def emit(sched) -> CudaSource:
    if getattr(sched.spec, "views", ()):
        # the host passes one array per kernel input; a view (schedule/layout.py) would
        # need its source's array at an offset and constant tables: not done yet
        raise NotImplementedError("layout ops (Transpose, Slice, ConcatV2, Pack, Split) "
                                  "are folded into loads by the CPU backend only")
    if sched.products():
        # the products run in the CPU emitter's per-group prologue (schedule/contract.py)
        raise NotImplementedError("SmallMatMul (a 1x1 convolution over a 1x1 image) is "
                                  "computed by the CPU backend only")
    if sched.domain.windows:
        # the taps are summed per row by the CPU emitter (cpu/emitter.py, _windows)
        raise NotImplementedError("a depthwise convolution is computed by the CPU "
                                  "backend only")
    e = _CudaEmitter(sched)
    program = tuple(e.shape_program())      # first: its error codes come first
    text = e.module_text()
    return CudaSource(text, tuple(e.errors), dict(e.kernels), tuple(e.scratch_types()),
                      tuple(e.acc_types()), tuple(e.phases), len(sched.passes),
                      tuple(f"p_{e.tag(r)}" for r in e.wide_refs()), program)


class _CudaEmitter(Emitter):
    def column_split(self) -> int:
        """Column kernels here have their own tiling (cuda_launch); the CPU's
        chunked column split is not in this code."""
        return 0

    # Global accesses index with an unsigned value: numba then skips its negative-index
    # wraparound (a compare, select and two 64-bit adds per access; indices here are
    # never negative).
    def load_input(self, w, ref: int, index: str) -> None:
        super().load_input(w, ref, f"np.uint64({index})")

    def store_output(self, w, k: int, index: str) -> None:
        super().store_output(w, k, f"np.uint64({index})")

    def __init__(self, sched):
        super().__init__(sched)
        self.kernels: dict = {}
        self.phases: list = []

    # -- module -------------------------------------------------------------------------
    def module_text(self) -> str:
        body = Writer()
        {KernelKind.ELEMENTWISE: self._elementwise, KernelKind.ROW: self._rows,
         KernelKind.COLUMN: self._columns, KernelKind.PACKED: self._packed}[self.s.kind](body)
        head = ["# Generated by stitching.codegen.cuda.emitter; do not edit.",
                f"# spec {self.spec.hash}: {self.s.describe().splitlines()[0]}",
                f"# helpers {helper_tag()}",
                "import numpy as np", "from numba import cuda",
                "from stitching.codegen.cuda import rt as h", "", "math = h.math"]
        # dtype objects for dynamic shared arrays (the simulator needs .itemsize)
        head += [f"DT_{n} = np.dtype(np.{n})" for n in sorted({
            _NP[dt.COMPUTE[self.dtype(k)]][3:] for k in self.s.scratch})] + [""]
        return "\n".join(head + self.C.definitions() + ["", ""] + body.lines) + "\n"

    def scratch_types(self) -> list:
        return [(k, dt.COMPUTE[self.dtype(k)]) for k in self.s.scratch]

    def acc_types(self) -> list:
        return [(k, lower.reduction(self.spec, k, self.C).acc) for k in self._accumulated()]

    # -- shared pieces ------------------------------------------------------------------
    def kernel(self, w, name: str, extra: list):
        """Decorator + def line; records the argument list for the host."""
        refs = self.input_refs() + list(self.spec.outputs)
        args = [f"p_{self.tag(r)}" for r in refs] + [f"D{a}" for a in range(self.R)] + extra
        self.kernels[name] = tuple(args)
        w("")
        w("@cuda.jit(cache=True)")
        return w.block(f"def {name}({', '.join(args)}):")

    def prologue(self, w) -> None:
        # a size the spec fixes is a constant here, though the host still passes it (one
        # argument list for every kernel): the compiler folds the index arithmetic over
        # it (strides, row bases, chunk counts) into shifts and immediates.  The shape
        # function has checked the inputs against these sizes before any launch.
        for a in range(self.R):
            if self.static_size(a) >= 0:
                w(f"D{a} = {self.static_size(a)}")
        for ref in self.input_refs() + list(self.spec.outputs):
            t = self.tag(ref)
            car = self.dom.carries[ref]
            for n, a in enumerate(car):   # row-major strides over the carried axes (as cpu.py)
                rest = " * ".join(f"D{b}" for b in car[n + 1:]) or "1"
                w(f"st_{t}_{a} = {rest}")
        w(f"L = {'D' + str(self.R - 1) if self.R else '1'}")
        w("tid = cuda.threadIdx.x")

    def compute(self, w, k: int) -> None:
        """As the CPU's, except a float32 Rsqrt: CUDA's rsqrtf, as TF's GPU kernel
        (Eigen's prsqrt on float4), not an IEEE square root and an IEEE division (on
        an H200 a batch-norm + swish kernel was compute-bound on those)."""
        node = self.spec.nodes[k]
        if node.op == "Rsqrt" and dt.COMPUTE[self.dtype(k)] == "float32" and \
                k not in self._recip and k not in self._exp_guard:
            w(f"{self.var(k)} = h.rsqrt_f32({self.var(node.args[0])})")
            return
        super().compute(w, k)

    def static_size(self, a: int) -> int:
        """Collapsed axis a's size where the spec fixes it, else -1."""
        return self.dom.axes[a].size

    def reduction(self, k):
        return lower.reduction(self.spec, k, self.C)

    def step(self, k, a: str, v: str) -> str:
        return self.reduction(k).step.format(a=a, v=v)

    def load_inputs_of(self, w, nodes, base: str, done: set) -> None:
        """Load the kernel inputs ``nodes`` read at ``<base>_<tag>`` (+ c when the input
        carries the last axis)."""
        for k in nodes:
            for a in self.spec.nodes[k].args:
                if a < 0 and a not in done:
                    done.add(a)
                    self.load_input(w, a, self._inner(a, f"{base}_{self.tag(a)}"))

    # -- element-wise -------------------------------------------------------------------
    def wide_refs(self) -> list:
        """Buffers the wide kernels (k_ew_v4, k_row*_v4) move a chunk of 4 elements at a
        time: 4-byte dtypes along the row (one 16-byte access) and bool inputs (one
        4-byte access: a masked softmax's mask was 16 one-byte loads per thread)."""
        if self.s.kind in (KernelKind.COLUMN, KernelKind.PACKED):
            return []
        refs = [-(j + 1) for p in self.s.passes for j in p.loads] + \
            [k for p in self.s.passes for k in p.stores]
        if self.s.kind == KernelKind.ROW:
            refs = [r for r in refs if r >= 0 or self.s.is_vector(r)]
        return [r for r in dict.fromkeys(refs) if self.carries_last(r) and
                (self.dtype(r) in ("float32", "int32") or
                 (r < 0 and self.dtype(r) == "bool"))]

    def _chunk_load(self, w, j: int, index: str, names: list) -> None:
        """names[0..3] = elements index..index+3 of input j, one wide access."""
        if self.dtype(-(j + 1)) == "bool":
            raw = [f"{n}b" for n in names]
            w(f"{', '.join(raw)} = h.load4b(p_i{j}, {index})")
            for n, r in zip(names, raw):
                w(f"{n} = ({r} != 0)")
        else:
            w(f"{', '.join(names)} = h.load4(p_i{j}, {index})")

    def _elementwise(self, w) -> None:
        self._ew_scalar(w)
        if self.wide_refs():
            self._ew_wide(w)

    @contextmanager
    def _ew_chunks(self, w, name: str):
        """An element-wise kernel's grid-stride loop over EW_VEC-element chunks of rows;
        the body sees r (row), j0 (first element of the chunk) and the row bases."""
        with self.kernel(w, name, ["rows", "nc"]):
            self.prologue(w)
            if self.R and self.static_size(self.R - 1) >= 0:
                w(f"nc = {-(-self.static_size(self.R - 1) // EW_VEC)}")
            w("step = cuda.gridsize(1)")
            # a while loop, not range(): range with a run-time step computes its trip
            # count with a 64-bit division, and most threads take one trip
            w("total = rows * nc")
            w("v = cuda.grid(1)")
            with w.block("while v < total:"):
                if self.R > 1:
                    w("r = v // nc")
                    w(f"j0 = (v - r * nc) * {EW_VEC}")
                else:                 # one flat row (rows == 1): no division
                    w(f"j0 = v * {EW_VEC}")
                self.bases(w, self.decompose(w, "r", list(range(self.R - 1))))
                yield
                w("v += step")

    def _load_chunks(self, w, p, wide) -> None:
        """x<j>_0..3: one 16-byte load per wide input of pass ``p``, at element j0."""
        for j in p.loads:
            if -(j + 1) in wide:
                self._chunk_load(w, j, f"b_i{j} + j0", [f"x{j}_{e}" for e in range(EW_VEC)])

    def _store_chunks(self, w, p, wide) -> None:
        """One 16-byte store per wide output of pass ``p`` from y<tag>_0..3."""
        for k in p.stores:
            if k in wide:
                t = self.tag(k)
                w(f"h.store4(p_{t}, b_{t} + j0, "
                  f"{', '.join(f'y{t}_{e}' for e in range(EW_VEC))})")

    def _ew_wide(self, w) -> None:
        """k_ew_v4: as k_ew for rows whose length is a multiple of 4 (every chunk whole
        and 16-byte aligned in every wide buffer, which the host checks)."""
        p, wide = self.s.passes[0], set(self.wide_refs())
        with self._ew_chunks(w, "k_ew_v4"):
            self._load_chunks(w, p, wide)
            for j in p.loads:
                if -(j + 1) not in wide and not self.carries_last(-(j + 1)):
                    self.load_input(w, -(j + 1), f"b_i{j}")
            for e in range(EW_VEC):
                self._ew_wide_element(w, p, wide, e)
            self._store_chunks(w, p, wide)

    def _ew_wide_element(self, w, p, wide, e) -> None:
        w(f"j = j0 + {e}")
        for j in p.loads:
            ref = -(j + 1)
            if ref in wide:
                w(f"x{j} = x{j}_{e}")
            elif self.carries_last(ref):
                self.load_input(w, ref, f"b_i{j} + j")
        for k in p.compute:
            self.compute(w, k)
        for k in p.stores:
            self._store_element(w, k, wide, e)

    def _store_element(self, w, k, wide, e) -> None:
        """Element j of output k: into lane e of its 16-byte chunk (stored by
        _store_chunks) when k is wide, else straight to memory."""
        if k in wide:
            w(f"y{self.tag(k)}_{e} = {store_value(self.dtype(k), self.var(k))}")
        else:
            self.store_output(w, k, f"b_{self.tag(k)} + j")

    def _ew_scalar(self, w) -> None:
        p = self.s.passes[0]
        with self._ew_chunks(w, "k_ew"):
            lasts = [j for j in p.loads if self.carries_last(-(j + 1))]
            for j in p.loads:          # broadcast along the row: once per chunk
                if j not in lasts:
                    self.load_input(w, -(j + 1), f"b_i{j}")
            with w.block(f"for e in range({EW_VEC}):"):
                w("j = j0 + e")
                with w.block("if j < L:"):
                    for j in lasts:
                        self.load_input(w, -(j + 1), f"b_i{j} + j")
                    for k in p.compute:
                        self.compute(w, k)
                    for k in p.stores:
                        self.store_output(w, k, f"b_{self.tag(k)} + j")

    # -- packed --------------------------------------------------------------------------
    def _packed(self, w) -> None:
        """k_pk: one grid-stride walk of the segments' concatenated flat space
        (schedule/packed.py), thread g taking flat indices g, g + step, ...: per
        segment [off, off + n), a loop from the first such index >= off, indexed by the
        segment-local j.  The shared scalars are computed once per thread."""
        with self.kernel(w, "k_pk", []):
            self.prologue(w)
            w("g = cuda.grid(1)")
            w("step = cuda.gridsize(1)")
            self.packed_scalars(w)
            for p, (off, n) in zip(self.s.passes, self.s.segments):
                first = f"g if g >= {off} else g + ({off} - g + step - 1) // step * step"
                with w.block(f"for f in range({first}, {off + n}, step):"):
                    w(f"j = f - {off}")
                    for j in p.loads:
                        self.load_input(w, -(j + 1), "j")
                    for k in p.compute:
                        self.compute(w, k)
                    for k in p.stores:
                        self.store_output(w, k, "j")

    # -- row -----------------------------------------------------------------------------
    def _rows(self, w) -> None:
        for variant in (ROW_VARIANTS if self.s.scratch else (None,)):
            self._row_kernel(w, variant, False)
            if variant != "regs" and self.wide_refs():
                self._row_kernel(w, variant, True)
        if self.wide_refs():
            for chunks in ROW_CHUNKS:
                self._row_chunked(w, chunks, False)
                self._row_chunked(w, chunks, True)
            # rows of a length the spec fixes: the kernel the launch takes for them,
            # with its threads per row in the code (k_row_r<C>_t<tpr>)
            L = self.static_size(self.R - 1) if self.R else -1
            tpr = chunk_tpr(L) if L > 0 else 0
            if tpr and row_chunks(L, tpr):
                self._row_chunked(w, row_chunks(L, tpr), False, tpr)
                self._row_chunked(w, row_chunks(L, tpr), True, tpr)

    @contextmanager
    def _row_groups(self, w, name: str, extra: list, variant, tpr: int = 0):
        """A row kernel's prologue and its grid-stride loop over groups of rpb rows; the
        caller's lines go inside the loop, where r / act / Lr / the row bases and the
        row-scalar inputs are set.  ``tpr``: threads per row fixed in the code (else the
        kernel argument)."""
        with self.kernel(w, name, ["rows", "tpr"] + extra):
            if tpr:
                # fixed here (the host launches this kernel with it, launch._row): the
                # lane split, the chunk offsets and masks, the shuffle butterfly and the
                # block combine fold to constants (on an sm_90 softmax over 1024: 804
                # -> 603 PTX instructions, 96 -> 62 registers)
                w(f"tpr = {tpr}")
            self.prologue(w)
            w("g = tid // tpr")
            w("lane = tid - g * tpr")
            w("rpb = cuda.blockDim.x // tpr")
            self._row_buffers(w, variant)
            w("rb = cuda.blockIdx.x * rpb")
            with w.block("while rb < rows:"):       # not range(): see _ew_chunks
                w("r = rb + g")
                w("act = r < rows")
                w("Lr = L if act else 0")          # an idle row group loops over nothing
                w("rr = r if act else rb")         # ... and reads a valid row
                self.bases(w, self.decompose(w, "rr", list(range(self.R - 1))))
                for j in self._row_scalar_inputs():
                    self.load_input(w, -(j + 1), f"b_i{j}")
                yield
                w("rb += cuda.gridDim.x * rpb")

    def _row_kernel(self, w, variant, wide: bool) -> None:
        s = self.s
        name = "k_row" + (f"_{variant}" if variant else "") + ("_v4" if wide else "")
        extra = {"smem": [f"so{k}" for k in s.scratch],
                 "global": [f"ws{k}" for k in s.scratch]}.get(variant, [])
        with self._row_groups(w, name, extra, variant):
            self._row_stage(w, s.scalars[0])
            for p in s.passes:
                if wide:
                    self._row_pass_wide(w, p, variant)
                else:
                    self._row_pass(w, p, variant)
                self._row_stage(w, s.scalars[p.index + 1])

    # -- row, whole row in registers ---------------------------------------------------
    def _row_chunked(self, w, chunks: int, wide: bool, tpr: int = 0) -> None:
        """k_row_r<C>[_v4]: each thread owns C chunks of 4 consecutive elements of its
        row, chunk c at (lane + c * tpr) * 4 (a warp's chunks are contiguous), for rows
        of a multiple of 4 up to tpr * 4 * C long.  The chunks are unrolled in the
        source, so every value a later pass needs stays in named registers: the
        schedule's scratch values and, unlike the other row kernels, the inputs a later
        pass would re-read (loaded once per row).  An idle chunk (past the row's end)
        re-reads element 0..3 of the row, computes, and is masked out of reductions and
        stores.  _v4: one 16-byte load/store per chunk of each wide buffer (16-byte
        aligned, which the host checks; the twin without _v4 loads element-wise)."""
        name = f"k_row_r{chunks}" + (f"_t{tpr}" if tpr else "") + ("_v4" if wide else "")
        with self._row_groups(w, name, [], None, tpr):
            for c in range(chunks):
                w(f"jl{c} = (lane + {c} * tpr) * {EW_VEC}")
                w(f"ok{c} = jl{c} < Lr")
                w(f"jl{c} = jl{c} if ok{c} else 0")
            self._row_stage(w, self.s.scalars[0])
            cached: set = set()
            for p in self.s.passes:
                self._row_pass_chunked(w, p, chunks, wide, cached)
                self._row_stage(w, self.s.scalars[p.index + 1])

    def _row_pass_chunked(self, w, p, chunks: int, wide: bool, cached: set) -> None:
        parts = self._parts(p)
        wset = set(self.wide_refs()) if wide else set()
        vec = [j for j in p.loads if self.s.is_vector(-(j + 1))]
        self._acc_init(w, p)
        self._part_init(w, parts)
        for c in range(chunks):
            for j in vec:                       # this chunk of each input, once per row
                if j in cached:
                    continue
                ref = -(j + 1)
                names = [f"x{j}_{c}_{e}" for e in range(EW_VEC)]
                if ref in wset:
                    self._chunk_load(w, j, f"b_i{j} + jl{c}", names)
                else:
                    for e, n in enumerate(names):
                        w(f"{n} = " + load_expr(self.dtype(ref), f"p_i{j}",
                                                f"np.uint64(b_i{j} + jl{c} + {e})"))
            for e in range(EW_VEC):
                self._row_chunk_element(w, p, parts, vec, c, e)
            for k in p.stores:
                t = self.tag(k)
                with w.block(f"if ok{c}:"):
                    if k in wset:
                        w(f"h.store4(p_{t}, b_{t} + jl{c}, "
                          f"{', '.join(f'y{t}_{e}' for e in range(EW_VEC))})")
                    else:
                        for e in range(EW_VEC):
                            w(f"p_{t}[np.uint64(b_{t} + jl{c} + {e})] = y{t}_{e}")
        cached.update(vec)
        self._part_merge(w, parts)
        self._row_allreduce(w, p.accumulate)

    def _row_chunk_element(self, w, p, parts, vec, c, e) -> None:
        """Element e of chunk c: inputs and scratch values from their registers,
        reductions masked by the chunk's ok flag, stores into y<tag>_<e>."""
        for j in vec:
            w(f"x{j} = x{j}_{c}_{e}")
        for k in p.scratch_loads:
            w(f"v{k} = sc{k}_{c}_{e}")
        for k in p.compute:
            self.compute(w, k)
        for k in p.accumulate:
            w(self._accumulate(k, parts, f"ok{c}"))
        for k in p.scratch_stores:
            w(f"sc{k}_{c}_{e} = v{k}")
        for k in p.stores:
            w(f"y{self.tag(k)}_{e} = {store_value(self.dtype(k), self.var(k))}")

    def _row_scalar_inputs(self) -> list:
        s = self.s
        return sorted({j for p in s.passes for j in p.loads if not s.is_vector(-(j + 1))} |
                      {j for st in s.scalars for j in st.loads})

    def _row_buffers(self, w, variant) -> None:
        for k in self._accumulated():      # one warp partial per slot (tpr > 32)
            w(f"sr{k} = cuda.shared.array({MAX_THREADS // WARP}, "
              f"{_NP[self.reduction(k).acc]})")
        for k in self.s.scratch:
            npt = _NP[dt.COMPUTE[self.dtype(k)]]
            if variant == "regs":
                w(f"sc{k} = cuda.local.array({REG_SLOTS}, {npt})")
            elif variant == "smem":   # dynamic shared arrays alias: so<k> offsets them
                w(f"sm{k} = cuda.shared.array(0, DT_{npt[3:]})")
                w(f"sb{k} = so{k} + g * L")
        if variant == "global":
            w("gb = (cuda.blockIdx.x * rpb + g) * L")

    def _scratch_at(self, k, variant) -> tuple:
        """(buffer, index) of element j of scratch value k."""
        return {"regs": (f"sc{k}", "ti"), "smem": (f"sm{k}", f"sb{k} + j"),
                "global": (f"ws{k}", "gb + j")}[variant]

    def _row_stage(self, w, stage) -> None:
        self.row_values(w, stage)
        if stage.stores:
            with w.block("if act and lane == 0:"):
                for k in stage.stores:
                    self.store_output(w, k, f"b_{self.tag(k)}")

    def row_values(self, w, stage) -> None:
        for k in stage.compute:
            if k in self._accumulated():
                self.finalize(w, k, f"a{k}", "L")
            else:
                self.compute(w, k)

    def _row_pass(self, w, p, variant) -> None:
        parts = self._parts(p)
        self._acc_init(w, p)
        if variant == "regs":      # constant trip count: the slots stay in registers
            self._part_init(w, parts)
            with w.block(f"for ti in range({REG_SLOTS}):"):
                w("j = lane + ti * tpr")
                with w.block("if j < Lr:"):
                    self._row_element(w, p, variant, parts)
            self._part_merge(w, parts)
        elif parts:                # PART_ELEMS per thread into each float32 partial
            with w.block(f"for j0 in range(lane, Lr, tpr * {PART_ELEMS}):"):
                self._part_init(w, parts)
                with w.block(f"for j in range(j0, min(j0 + tpr * {PART_ELEMS}, Lr), tpr):"):
                    self._row_element(w, p, variant, parts)
                self._part_merge(w, parts)
        else:
            with w.block("for j in range(lane, Lr, tpr):"):
                self._row_element(w, p, variant, parts)
        self._row_allreduce(w, p.accumulate)

    def _row_pass_wide(self, w, p, variant) -> None:
        """A row pass over 16-byte chunks: each thread takes 4 consecutive elements per
        step (one vector load per 4-byte buffer along the row, the element work 4 times
        in the source), ROW_PART_CHUNKS steps into each float32 partial.  Rows of a
        multiple of 4 elements, every wide buffer 16-byte aligned (the host checks)."""
        parts = self._parts(p)
        wide = set(self.wide_refs())
        self._acc_init(w, p)
        span = f"tpr * {EW_VEC * ROW_PART_CHUNKS}"
        with w.block(f"for jc in range(lane * {EW_VEC}, Lr, {span}):"):
            self._part_init(w, parts)
            with w.block(f"for j0 in range(jc, min(jc + {span}, Lr), tpr * {EW_VEC}):"):
                self._load_chunks(w, p, wide)
                for e in range(EW_VEC):
                    w(f"j = j0 + {e}")
                    self._row_element(w, p, variant, parts, wide, e)
                self._store_chunks(w, p, wide)
            self._part_merge(w, parts)
        self._row_allreduce(w, p.accumulate)

    def _parts(self, p) -> dict:
        """Reductions of the pass that sum float32 values: each thread adds a few into a
        float32 partial, merged into the float64 accumulator (no float64 add per
        element; the CPU's vector lanes do the same)."""
        return {k: r for k in p.accumulate if (r := self.reduction(k)).part}

    def _accumulate(self, k, parts, ok: str = "") -> str:
        """The line adding this element into reduction k: into its float32 partial where
        it has one, else its accumulator; ``ok`` names a flag that masks it out."""
        v = self.var(self.spec.nodes[k].args[0])
        dst, new = (f"s{k}", parts[k].part_step.format(p=f"s{k}", v=v)) if k in parts \
            else (f"a{k}", self.step(k, f"a{k}", v))
        return f"{dst} = {new} if {ok} else {dst}" if ok else f"{dst} = {new}"

    def _acc_init(self, w, p) -> None:
        for k in p.accumulate:
            w(f"a{k} = {self.reduction(k).init}")

    def _part_init(self, w, parts) -> None:
        for k, r in parts.items():
            w(f"s{k} = {r.part_init}")

    def _part_merge(self, w, parts) -> None:
        for k, r in parts.items():
            w(f"a{k} = {r.merge.format(a=f'a{k}', p=f's{k}')}")

    def _row_element(self, w, p, variant, parts, wide=(), e=0) -> None:
        """One element j of a row pass; refs in ``wide`` are element ``e`` of the
        16-byte chunk loaded (or stored) by the wide pass."""
        for j in p.loads:
            if -(j + 1) in wide:
                w(f"x{j} = x{j}_{e}")
            elif self.s.is_vector(-(j + 1)):
                self.load_input(w, -(j + 1), f"b_i{j} + j")
        for k in p.scratch_loads:
            buf, idx = self._scratch_at(k, variant)
            w(f"v{k} = {load_expr(self._scratch_dtype(k), buf, idx)}")
        for k in p.compute:
            self.compute(w, k)
        for k in p.accumulate:
            w(self._accumulate(k, parts))
        for k in p.scratch_stores:
            buf, idx = self._scratch_at(k, variant)
            w(f"{buf}[{idx}] = {store_value(self._scratch_dtype(k), f'v{k}')}")
        for k in p.stores:
            self._store_element(w, k, wide, e)

    def _shfl(self, k, v: str) -> str:
        fn = "shfl_xor_bool" if self.reduction(k).acc == "bool" else "shfl_xor"
        return f"h.{fn}({v}, off)"

    def _row_allreduce(self, w, ks) -> None:
        """Every thread of a row group ends with the row's value (bitwise identical:
        the butterfly and the slot order are the same for every lane)."""
        if not ks:
            return
        w(f"off = (tpr if tpr < {WARP} else {WARP}) // 2")
        with w.block("while off > 0:"):
            for k in ks:
                w(f"a{k} = {self.step(k, f'a{k}', self._shfl(k, f'a{k}'))}")
            w("off = off // 2")
        with w.block(f"if tpr > {WARP}:"):         # uniform: tpr is a kernel argument
            with w.block(f"if lane % {WARP} == 0:"):
                for k in ks:
                    acc = self.reduction(k).acc
                    w(f"sr{k}[tid // {WARP}] = {store_value(acc, f'a{k}')}")
            w("cuda.syncthreads()")
            w(f"w0 = g * (tpr // {WARP})")
            for k in ks:
                w(f"a{k} = {self.reduction(k).init}")
            with w.block(f"for wi in range(w0, w0 + tpr // {WARP}):"):
                for k in ks:
                    part = load_expr(self.reduction(k).acc, f"sr{k}", "wi")
                    w(f"a{k} = {self.step(k, f'a{k}', part)}")
            w("cuda.syncthreads()")

    # -- column --------------------------------------------------------------------------
    def _columns(self, w) -> None:
        P = len(self.s.passes)
        accs = self._accumulated()
        with self.kernel(w, "k_col", ["kept", "rows", "nct", "usplit", "nsplit", "tx_n"]), \
                self._col_unit(w):
            self._col_stage(w, 0, from_ws=False, store=True)
            for p in self.s.passes:
                self._col_pass(w, p)
                self._col_stage(w, p.index + 1, from_ws=False, store=True)
        last = P + (1 if self.s.scalars[P].compute else 0)
        for q in range(last):
            name = f"k_col_p{q}"
            self.phases.append(name)
            with self.kernel(w, name, ["kept", "rows", "nct", "usplit", "nsplit", "tx_n"] +
                             [f"wa{k}" for k in sorted(accs)]), self._col_unit(w):
                for st in range(q + 1):
                    self._col_stage(w, st, from_ws=True, store=st == q)
                if q < P:
                    self._col_pass(w, self.s.passes[q], split=True)

    @contextmanager
    def _col_unit(self, w):
        """Prologue and the unit loop; the caller's lines go inside the loop."""
        R, s = self.R, self.s
        self.prologue(w)
        w("ty = tid // tx_n")
        w("tx = tid - ty * tx_n")
        w("ny = cuda.blockDim.x // tx_n")
        for acc in sorted({self.reduction(k).acc for k in self._accumulated()}):
            w(f"sc_{acc} = cuda.shared.array({MAX_THREADS}, {_NP[acc]})")
        w("nu = kept * nct * usplit")
        w("u = cuda.blockIdx.x")
        with w.block("while u < nu:"):               # not range(): see _ew_chunks
            w("sp = u % usplit")
            w("t = u // usplit")
            w("ko = t // nct")
            w("cx = (t - ko * nct) * tx_n + tx")
            w("act = cx < L")
            w("c = cx if act else L - 1")      # idle columns read a valid column
            w("nr = rows if act else 0")
            idx = self.decompose(w, "ko", [a for a in s.parallel_axes if a != R - 1])
            for ref in self.input_refs() + list(self.spec.outputs):
                w(f"k_{self.tag(ref)} = {self.offset(ref, idx)}")
            yield
            w("u += cuda.gridDim.x")

    def _col_stage(self, w, st: int, from_ws: bool, store: bool) -> None:
        """Column values of stage ``st``: per thread, for its column c."""
        stage = self.s.scalars[st]
        done: set = set()
        for k in stage.compute:
            if k in self._accumulated():
                if from_ws:
                    self._col_gather(w, k)
                self.finalize(w, k, f"a{k}", "rows")
            else:
                self.load_inputs_of(w, [k], "k", done)
                self.compute(w, k)
        if store and stage.stores:
            with w.block("if act and ty == 0 and sp == 0:"):
                for k in stage.stores:
                    self.store_output(w, k, self._inner(k, f"k_{self.tag(k)}"))

    def _col_gather(self, w, k) -> None:
        """Combine the nsplit block partials of reduction k from the workspace."""
        r = self.reduction(k)
        w(f"a{k} = {r.init}")
        with w.block("for s2 in range(nsplit):"):
            part = load_expr(r.acc, f"wa{k}", "(s2 * kept + ko) * L + c")
            w(f"a{k} = {self.step(k, f'a{k}', part)}")

    def _col_pass(self, w, p, split: bool = False) -> None:
        self._acc_init(w, p)
        # COL_UNROLL rows per trip, a constant inner trip count that the compiler unrolls:
        # that many independent loads in flight per thread (rows in the same order)
        w("s0 = sp * ny + ty")
        with w.block("while s0 < nr:"):             # not range(): see _ew_chunks
            with w.block(f"for su in range({COL_UNROLL}):"), \
                    w.block("if s0 + su * ny * usplit < nr:"):
                w("s = s0 + su * ny * usplit")
                idx = self.decompose(w, "s", list(self.s.reduce_axes))
                for ref in self.input_refs() + list(self.spec.outputs):
                    extra = self.offset(ref, idx)
                    w(f"b_{self.tag(ref)} = k_{self.tag(ref)}" +
                      (f" + {extra}" if extra != "0" else ""))
                for j in p.loads:
                    self.load_input(w, -(j + 1), self._inner(-(j + 1), f"b_i{j}"))
                for k in p.compute:
                    self.compute(w, k)
                for k in p.accumulate:
                    w(f"a{k} = {self.step(k, f'a{k}', self.var(self.spec.nodes[k].args[0]))}")
                for k in p.stores:
                    self.store_output(w, k, self._inner(k, f"b_{self.tag(k)}"))
            w(f"s0 += ny * usplit * {COL_UNROLL}")
        for k in p.accumulate:
            self._col_combine(w, k)
            if split:
                acc = self.reduction(k).acc
                with w.block("if ty == 0 and act:"):
                    w(f"wa{k}[(sp * kept + ko) * L + c] = {store_value(acc, f'a{k}')}")

    def _col_combine(self, w, k) -> None:
        """The combine step: the ny partials of each column, through shared memory, in
        slot order (every thread of the column gets the same value)."""
        r = self.reduction(k)
        w(f"sc_{r.acc}[tid] = {store_value(r.acc, f'a{k}')}")
        w("cuda.syncthreads()")
        # the first row slice combines (the others idle: an all-threads combine cost as
        # much as the pass itself, measured on an H100) and hands the result to the rest
        with w.block("if ty == 0:"):
            w(f"a{k} = {r.init}")
            with w.block("for y in range(ny):"):
                part = load_expr(r.acc, f"sc_{r.acc}", "y * tx_n + tx")
                w(f"a{k} = {self.step(k, f'a{k}', part)}")
            w(f"sc_{r.acc}[tx] = {store_value(r.acc, f'a{k}')}")
        w("cuda.syncthreads()")
        w(f"a{k} = {load_expr(r.acc, f'sc_{r.acc}', 'tx')}")
        w("cuda.syncthreads()")
