"""Shape functions as data: one interpreter, a small int64 program per kernel.

A kernel's shape function (the ``shape_fn`` of the ABI in cpu.py) checks the run-time
input dims, computes the collapsed domain sizes, the work decomposition and the output
dims.  It used to be generated as straight-line code per kernel, and Numba took as long
to compile it as the kernel body (0.15-0.4 s each, and as long again to load from the
disk cache).  Now the emitter writes a program and one interpreter runs every kernel's:
the ``interp`` cfunc, compiled once per installation (Numba's disk cache;
``precompile`` at install), which the op calls with the kernel's program (op.cc,
ABI 5).  The CUDA host (cuda.py) calls ``run`` from Python.

Program encoding (int64 words; a *value* ``v`` is the constant ``v`` when ``v >= 0``,
else ``in_dims[-v - 1]``)::

    EQ     pos value err      in_dims[pos] must equal value, else return err
    NONNEG pos err            in_dims[pos] must be >= 0, else return err
    AXIS   a n v1..vn err     dims[a] = v1 * .. * vn (err if over MAX_ELEMS)
    UNITS  kind R cost err row_elems ew_block col_units col_block col_min
           col_split col_chunk split passes reds nk k1..knk nr r1..rnr
                              work decomposition (cpu.py's module docstring); the
                              defaults used without a launch hint are words of the
                              program (schedule.py tunes them), so this cached code
                              holds no constant that lives in another file.
                              split = 1 (row kind): a column-block hint shorter than
                              the row splits it into nb pieces, one unit each, run in
                              passes + 1 phases with reds x rows x nb 8-byte partials
                              (sched[2] = phases, sched[3] = temp bytes).
                              split = 1 or 2 (column kind): with fewer than
                              col_units column units, the outermost reduced axis is
                              cut into rpt chunks (of at least col_chunk rows, for about
                              col_split units) of full-width blocks, run in passes + 1
                              (split = 1) or passes (2) phases with reds x units x cb
                              8-byte partials
    OUT    pos value          out_dims[pos] = value
    END                       return 0

Programs are built by the emitter from a validated schedule, never read from a graph.
"""
from __future__ import annotations

from numba import njit

# Cached on disk by Numba (keyed on this file): everything the code depends on is in
# this file or in the program it runs.
_jit = njit(cache=True, nogil=True, error_model="numpy")

END, EQ, NONNEG, AXIS, UNITS, OUT = 0, 1, 2, 3, 4, 5
ELEMENTWISE, ROW, COLUMN = 0, 1, 2

MAX_ELEMS = 1 << 48    # arbitrary sanity bound on any product of dims (no int64 overflow)
MAX_COST = 1 << 40     # cycles per unit, saturated


def value(v: int) -> str:
    """Human form of an encoded value (for generated comments and tests)."""
    return str(v) if v >= 0 else f"in_dims[{-v - 1}]"


@_jit
def _val(v, in_dims):
    return v if v >= 0 else in_dims[-v - 1]


@_jit
def _product(prog, at, n, in_dims, dims, axes):
    """Product of n values at prog[at:] (values, or with ``axes`` domain axes in dims);
    -1 if it exceeds MAX_ELEMS."""
    p = 1
    for k in range(n):
        f = dims[prog[at + k]] if axes else _val(prog[at + k], in_dims)
        if f != 0 and p > MAX_ELEMS // f:
            return -1
        p = p * f
    return p


@_jit
def _cost(a, b, c):
    """a * b * c saturated at MAX_COST (all >= 0)."""
    p = c
    for f in (a, b):
        if f != 0 and p > MAX_COST // f:
            return MAX_COST
        p = p * f
    return p


@_jit
def run(prog, in_dims, dims, out_dims, sched):
    """Interpret ``prog``; returns 0 or the 1-based error code it names."""
    rh = sched[0]       # launch hint (rows per unit, column block); <= 0: none
    ch = sched[1]
    i = 0
    while True:
        op = prog[i]
        if op == END:
            return 0
        if op == EQ:
            if in_dims[prog[i + 1]] != _val(prog[i + 2], in_dims):
                return prog[i + 3]
            i += 4
        elif op == NONNEG:
            if in_dims[prog[i + 1]] < 0:
                return prog[i + 2]
            i += 3
        elif op == AXIS:
            n = prog[i + 2]
            p = _product(prog, i + 3, n, in_dims, dims, False)
            if p < 0:
                return prog[i + 3 + n]
            dims[prog[i + 1]] = p
            i += 4 + n
        elif op == UNITS:
            kind, R, cost, err = prog[i + 1], prog[i + 2], prog[i + 3], prog[i + 4]
            row_elems, ew_block, col_units = prog[i + 5], prog[i + 6], prog[i + 7]
            col_block, col_min = prog[i + 8], prog[i + 9]
            col_split, col_chunk = prog[i + 10], prog[i + 11]
            split, passes, reds = prog[i + 12], prog[i + 13], prog[i + 14]
            ka = i + 16                 # the kept axes, after their count nk
            nk = prog[ka - 1]
            ra = ka + nk + 1            # the reduced axes, after their count nr
            nr = prog[ra - 1]
            phases, temp = 1, 0
            L = dims[R - 1] if R > 0 else 1
            if kind == COLUMN:
                kept = _product(prog, ka, nk, in_dims, dims, True)
                rows = _product(prog, ra, nr, in_dims, dims, True)
                if kept < 0 or rows < 0:
                    return err
                outer = dims[prog[ra]] if nr > 0 else 0
                rpt = 1
                if ch > 0:
                    cb = ch
                else:
                    cb = min(col_block, L)
                nb = (L + cb - 1) // cb if L > 0 else 0
                if split > 0 and 0 < kept * nb < col_units and outer >= 2 * col_chunk:
                    # too few column units: cut the outer reduced axis into chunks of
                    # rows (contiguous streams of wide blocks), partials combined in
                    # phases; measured faster than narrowing the blocks (8192x1024
                    # centring: 3.0 vs 4.2 ms)
                    u0 = kept * nb
                    rpt = min((col_split + u0 - 1) // u0, outer // col_chunk)
                    phases = passes + 1 if split == 1 else passes
                    temp = reds * kept * nb * rpt * cb * 8
                elif ch <= 0:   # widest block that still gives col_units units
                    want = (col_units + max(kept, 1) - 1) // max(kept, 1)
                    cb = min(col_block, max(col_min, (L + want - 1) // want))
                    cb = (cb + 15) // 16 * 16
                    if L > 0 and cb > L:
                        cb = L
                    nb = (L + cb - 1) // cb
                units = kept * nb * rpt
                work = _cost(cb, rows // rpt, cost)
            else:
                rows = _product(prog, ka, nk, in_dims, dims, True)
                if rows < 0 or (L != 0 and rows > MAX_ELEMS // L):
                    return err
                if kind == ROW and split == 1 and 0 < ch < L:
                    cb = ch                 # pieces of a row; partials combined in phases
                    nb = (L + cb - 1) // cb
                    rpt = 1
                    phases = passes + 1
                    if rows * nb > MAX_ELEMS // max(1, reds * 8):
                        return err          # the partials would not fit any memory
                    temp = reds * rows * nb * 8
                elif kind == ROW:
                    nb = 1
                    cb = L
                    rpt = rh if rh > 0 else max(1, row_elems // max(L, 1))
                else:
                    cb = ch if ch > 0 else ew_block
                    if L > cb:
                        nb = (L + cb - 1) // cb
                        rpt = 1
                    else:
                        nb = 1 if L > 0 else 0
                        rpt = rh if rh > 0 else max(1, cb // max(L, 1))
                units = ((rows + rpt - 1) // rpt) * nb
                work = _cost(rpt, min(L, cb), cost)
            dims[R] = rpt
            dims[R + 1] = cb
            dims[R + 2] = nb
            dims[R + 3] = rows
            sched[0] = units
            sched[1] = max(1, work)
            sched[2] = phases
            sched[3] = temp
            i = ra + nr
        elif op == OUT:
            out_dims[prog[i + 1]] = _val(prog[i + 2], in_dims)
            i += 3
        else:
            return -1   # not a program this module wrote


def _interp(prog, in_dims, dims, out_dims, sched):
    return run(prog, in_dims, dims, out_dims, sched)


_INTERP = None


def interp_address() -> int:
    """Address of the C entry point every generated kernel's shape function is:
    ``int64 interp(const int64* prog, const int64* in_dims, int64* dims,
    int64* out_dims, int64* sched)``.  Compiled on first use (or loaded from Numba's
    disk cache, ~40 ms)."""
    global _INTERP
    if _INTERP is None:
        from numba import cfunc, types
        ptr = types.CPointer(types.int64)
        _INTERP = cfunc(types.int64(ptr, ptr, ptr, ptr, ptr), nogil=True, cache=True,
                        error_model="numpy")(_interp)
    return _INTERP.address


def precompile() -> None:
    """Compile the interpreter into Numba's on-disk cache (a process then loads it
    instead of compiling it, ~0.9 s)."""
    interp_address()
