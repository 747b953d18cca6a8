"""The shape-program interpreter (encoding: shape_program.py), in Numba.

``run`` is a jitted function (the CUDA host calls it from Python); compiled as a C
callback of ``SIG`` (native.build, from ``run.py_func``) it is the entry point every
CPU kernel's shape function is::

    int64 stitching_interp(const int64* prog, const int64* in_dims, int64* dims,
                           int64* out_dims, int64* sched)

kernel.interp_address() loads that from the kernel cache, building it from here only
when the cache has none for this toolchain; this module is imported only then, so a
process that loads cached kernels imports no Numba.  ``run`` itself is the entry, not
a function calling it: then Numba's wrapper has no path that re-raises an exception
from a callee, which would need Numba's runtime (native.py).
"""
from __future__ import annotations

from numba import njit, types

from .shape_program import (AXIS, COLUMN, DIMS_REF, ELEMENTWISE, END, EQ, GE, LE, LESS,
                            MAX_COST, MAX_ELEMS, NONNEG, OUT, PARAM, ROW, SAME, UNITS)

OPTIONS = {"nogil": True, "error_model": "numpy"}
_jit = njit(**OPTIONS)
_ptr = types.CPointer(types.int64)
SIG = types.int64(_ptr, _ptr, _ptr, _ptr, _ptr)     # of the C entry point: ``run``


@_jit
def _val(v, in_dims, dims):
    if v >= 0:
        return v
    return dims[-v - DIMS_REF] if v <= -DIMS_REF else in_dims[-v - 1]


@_jit
def _product(prog, at, n, in_dims, dims, axes):
    """Product of n values at prog[at:] (values, or with ``axes`` domain axes in dims);
    -1 if it exceeds MAX_ELEMS."""
    p = 1
    for k in range(n):
        f = dims[prog[at + k]] if axes else _val(prog[at + k], in_dims, dims)
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
            if in_dims[prog[i + 1]] != _val(prog[i + 2], in_dims, dims):
                return prog[i + 3]
            i += 4
        elif op == NONNEG:
            if in_dims[prog[i + 1]] < 0:
                return prog[i + 2]
            i += 3
        elif op == LE:
            if _val(prog[i + 1], in_dims, dims) > prog[i + 2]:
                return prog[i + 3]
            i += 4
        elif op == GE:
            if _val(prog[i + 1], in_dims, dims) < prog[i + 2]:
                return prog[i + 3]
            i += 4
        elif op == PARAM:
            dims[prog[i + 1]] = _val(prog[i + 2], in_dims, dims) + prog[i + 3]
            i += 4
        elif op == LESS:
            dims[prog[i + 1]] = max(_val(prog[i + 2], in_dims, dims) - prog[i + 3], 0)
            i += 4
        elif op == SAME:
            if _val(prog[i + 1], in_dims, dims) != _val(prog[i + 2], in_dims, dims):
                return prog[i + 3]
            i += 4
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
                if kind == ELEMENTWISE and split >= 2:
                    # SmallMatMul's prologue phase: ``reds`` hoisted values per row
                    # group (split 2: rows sharing the outer axes; 3: each row)
                    groups = rows if split == 3 or R < 2 else rows // max(1, dims[R - 2])
                    phases = 2
                    temp = reds * groups * max(L, 1) * 8
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
            out_dims[prog[i + 1]] = _val(prog[i + 2], in_dims, dims)
            i += 3
        else:
            return -1   # not a program this module wrote
