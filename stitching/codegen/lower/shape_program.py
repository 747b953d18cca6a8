"""Shape functions as data: one interpreter, a small int64 program per kernel.

A kernel's shape function (the ``shape_fn`` of the ABI in cpu.py) checks the run-time
input dims, computes the collapsed domain sizes, the work decomposition and the output
dims.  It used to be generated as straight-line code per kernel, and Numba took as long
to compile it as the kernel body (0.15-0.4 s each, and as long again to load from the
disk cache).  Now the emitter writes a program and one interpreter runs every kernel's
(shape_interp.py: compiled once per toolchain into the kernel cache as native code,
which the op calls with the kernel's program, op.cc ABI 5; the CUDA host, cuda.py,
calls its ``run`` from Python).  This module is the encoding only, and imports no
Numba: a process that loads cached kernels never needs it.

Program encoding (int64 words; a *value* ``v`` is the constant ``v`` when ``v >= 0``,
``dims[-v - DIMS_REF]`` when ``v <= -DIMS_REF`` (a size LESS computed), else
``in_dims[-v - 1]``)::

    EQ     pos value err      in_dims[pos] must equal value, else return err
    NONNEG pos err            in_dims[pos] must be >= 0, else return err
    LE     value limit err    value must be <= limit, else return err (a slice's run-time
                              count against the static dim it reads, layout.py)
    GE     value least err    value must be >= least, else return err (a dim known only at
                              run time that a view indexes must hold the element)
    PARAM  slot value add     dims[slot] = value + add (a view's offset term, layout.py)
    LESS   slot value c       dims[slot] = max(value - c, 0) (the extent of x[:, c:] at
                              run-time n: StridedSlice clamps, layout.py View.less)
    SAME   value value err    the two values must be equal, else return err
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
                              split = 2 or 3 (element-wise kind, SmallMatMul): a
                              prologue phase computes reds hoisted values over the
                              last axis per row group (2: rows sharing every axis but
                              R-2; 3: each row) into reds x groups x L 8-byte slots,
                              then the element phase reads them (2 phases)
    OUT    pos value          out_dims[pos] = value
    END                       return 0

Programs are built by the emitter from a validated schedule, never read from a graph.
"""
from __future__ import annotations

END, EQ, NONNEG, AXIS, UNITS, OUT, LE, GE, PARAM, LESS, SAME = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10
DIMS_REF = 1 << 32     # values at or below -DIMS_REF name dims[] slots (in_dims are fewer)
ELEMENTWISE, ROW, COLUMN = 0, 1, 2

MAX_ELEMS = 1 << 48    # arbitrary sanity bound on any product of dims (no int64 overflow)
MAX_COST = 1 << 40     # cycles per unit, saturated


def value(v: int) -> str:
    """Human form of an encoded value (for generated comments and tests)."""
    if v <= -DIMS_REF:
        return f"dims[{-v - DIMS_REF}]"
    return str(v) if v >= 0 else f"in_dims[{-v - 1}]"


def dims_ref(slot: int) -> int:
    """The value that names dims[slot]."""
    return -DIMS_REF - slot
