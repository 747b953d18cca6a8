"""Launch dimensions for the CUDA kernels of one schedule, at the run-time sizes.

    sizes ──pin_shapes──► spec with those sizes ──plan.cost.choose_launch(profile)──►
          threads per block, rows per block (the latency evaluator, pinned GPU profiles)
          ──map onto the kernel kind──► CudaLaunch: kernels, grid, block, shared bytes,
                                        scalar arguments, global workspaces

The latency evaluator (stitching/plan/cost.py) scores (rows_per_task, col_block, threads)
candidates for a kernel of R rows x L columns on a DeviceProfile; we take its threads per
block (at least MIN_THREADS) and map them as follows, with local rules measured on an
H100 where its CPU-shaped rows per task did not fit (names as in cuda/emitter.py):

  elementwise  block = EW_THREADS; grid = chunks of EW_VEC elements / block, capped;
               the 16-byte kernel when rows are a multiple of 4 long (the caller falls
               back to the scalar one for a buffer that is not 16-byte aligned)
  row          rows of a multiple of 4 that fit (k_row_r<C>, the row in registers):
               tpr = the power of two that leaves each thread ROW_CHUNK_ELEMS
               (emitter.chunk_tpr), in MIN_THREADS blocks; where the spec fixes the
               row length, the twin with that tpr in its code (k_row_r<C>_t<tpr>).
               Other rows (the looped kernels):
               tpr (threads per row) = the power of two that leaves each thread at most
               ROW_ELEMS of the row, at least ROW_MIN_TPR (their loads cover a 32-byte
               sector) unless the row is shorter, up to the block limit: a warp per row
               at 1024, no block-wide combine below 2048; block = max(threads, tpr),
               halved while its rows' scratch would not fit shared memory; rpb = block /
               tpr.  From tools/gpu_sweep.py on an H100 (blocks of 128 to
               512 x tpr 4 to 128; BENCHMARKS.md): 8192 x 1024 softmax and layer norm were
               fastest at tpr 32 (softmax 51 µs; 128 threads per row, 8 values each in
               registers: 68 µs), a 128-long softmax and a 256-long masked softmax at tpr
               8 (50 and 66 µs; a warp per row: 89 and 81 µs).
               Scratch rows: registers if L <= tpr * REG_SLOTS, else shared memory if
               rpb rows fit SMEM_LIMIT, else a global workspace.  Rows of a multiple
               of 4 run the _v4 kernel (4 consecutive elements per thread per step,
               16-byte accesses; the caller falls back as for element-wise).
  column       block = COL_THREADS (not the evaluator's: see the constant);
               tile tx_n = min(32, pow2 >= L) columns (a warp reads 128 contiguous
               bytes), ny = block / tx_n row slices.  The evaluator does not model
               splitting the reduced axis across blocks; a local rule does: when
               kept x tiles < COL_BLOCKS_PER_SM x SMs, split it ``nsplit`` ways, as
               many as keep the grid within those blocks (one launch per pass,
               partials through global memory).

Memoized per kernel on the input shapes, so a steady-state call costs a dict lookup.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir.graph import TensorType
from ...ir.ops import infer
from ...ir.spec import KernelSpec, SpecNode
from ...plan import cost
from ...schedule import KernelKind
from .emitter import (EW_VEC, REG_SLOTS, ROW_CHUNKS, WARP, chunk_tpr,
                      np_dtype, row_chunks)

SMEM_LIMIT = 48 << 10        # CUDA: dynamic shared memory per block without the opt-in
GRID_WAVES = 8               # arbitrary: grid-stride kernels launch at most 8 full waves
COL_BLOCKS_PER_SM = 4        # below this many column blocks per SM, split rows
COL_THREADS = 256            # column blocks: 32 columns x 8 row slices
# (tools/gpu_sweep.py on an H100, blocks of 256/512/1024 x splits 1..32: a mean over axis
# 0 of 8192 x 1024 ran 68 µs at 256 threads x 16 ways, 91 µs at the evaluator's 512-1024
# x 9; a squeeze-excite mean 53 µs at 256 x 9, 59 µs at 256 x 5: 4 blocks per SM)
MIN_ROWS_PER_THREAD = 8      # arbitrary: a split leaves each thread at least 8 rows
MAX_SPLIT = 64               # arbitrary: bounds the partials each column re-combines
ROW_ELEMS = 32               # row elements per thread (see "row" above)
ROW_MIN_TPR = 8              # fewest threads per row (see "row" above)
DEFAULT_THREADS = 256        # fallback when the evaluator has no finite candidate
# Element-wise blocks (not the evaluator's, which chose 1024 for a 4M-element swiglu):
# tools/gpu_sweep.py on an H200, 2026-11-28 (tools/gpu_results/): swiglu 25.3 µs at 128
# threads, 25.4 at 256, 26.1 at 512, 29.2 at 1024; BN-swish 27.1 / 27.3 / 28.0 / 36.6
EW_THREADS = 128
# An SM holds at most 32 blocks (sm_80, sm_90): smaller blocks than 4 warps cap occupancy
# below 100% however many are launched.  Measured on an H100: 32-thread blocks ran an
# element-wise kernel at 52% of copy bandwidth.
MIN_THREADS = 128


@dataclass(frozen=True)
class Limits:
    """What a launch may use.  The simulator runs one Python thread per CUDA thread and
    blocks one after another, so its limits are small; they change speed, not results."""
    max_threads: int = 1024
    max_blocks: int | None = None    # None: GRID_WAVES waves of the profile's device
    smem: int = SMEM_LIMIT


SIMULATOR_LIMITS = Limits(max_threads=64, max_blocks=4)


@dataclass(frozen=True)
class Sizes:
    D: tuple          # collapsed domain sizes
    rows: int         # CPU dims[R+3]: outer rows (row/elementwise) or reduced count (column)
    L: int            # last-axis length
    kept: int = 1     # column kind: product of the kept outer axes


@dataclass(frozen=True)
class CudaLaunch:
    kind: str
    strategy: str                 # one line, e.g. "one warp per row, 4 rows per block"
    steps: tuple                  # ((kernel, grid, block, shared bytes, {arg: value}), ...)
    args: dict                    # scalar kernel arguments shared by every step
    workspace: tuple = ()         # ((arg name, numpy dtype, elements), ...)
    threads: int = 0
    source: str = ""              # where the numbers came from


def _pow2ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pin_shapes(spec, in_shapes) -> KernelSpec:
    """The spec with its inputs at ``in_shapes`` and every node's type re-inferred."""
    ins = tuple(TensorType(t.dtype, tuple(int(d) for d in s))
                for t, s in zip(spec.inputs, in_shapes))
    nodes = []
    for n in spec.nodes:
        args = [ins[-a - 1] if a < 0 else nodes[a].type for a in n.args]
        attrs = n.attrs
        if n.op == "Reshape":
            attrs = dict(attrs, shape=reshape_target(args[0].shape, attrs["shape"]))
        nodes.append(SpecNode(n.op, n.args, attrs, infer(n.op, attrs, args)))
    return KernelSpec(ins, tuple(nodes), spec.outputs, {})


def reshape_target(shape, target) -> tuple:
    """A Reshape's target with its unknown (-1) dims filled in for a concrete input
    ``shape``.  Reshapes only add or drop size-1 dims, so the input's non-1 dims must
    line up with the target's; an unknown target dim takes the next one while more remain
    than the target's later static non-1 dims need, else it is 1."""
    src = [d for d in shape if d != 1]
    out, at = [], 0
    for i, d in enumerate(target):
        if d == -1:
            later = sum(1 for e in target[i + 1:] if e not in (1, -1))
            take = len(src) - at > later
            out.append(src[at] if take else 1)
            at += take
        else:
            at += d != 1
            out.append(d)
    return tuple(out)


def evaluate(spec, in_shapes, profile) -> tuple:
    """(threads per block, rows per block, where from) from the latency evaluator."""
    try:
        lau = cost.choose_launch(pin_shapes(spec, in_shapes), profile)
    except (ValueError, IndexError) as e:   # shapes that do not infer / no finite candidate
        return DEFAULT_THREADS, 1, f"default ({type(e).__name__}: {e})"[:200]
    return (lau.threads, lau.params.get("rows_per_task", 1),
            f"latency evaluator ({profile.name}): {lau.describe()}")


def plan(src, kind, sizes: Sizes, evaluated: tuple, profile, limits: Limits,
         force: dict | None = None) -> CudaLaunch:
    """Map the evaluator's choice (or ``force``: threads, tpr, variant, tx, split) onto
    the kernels of ``src`` (a cuda_emit.CudaSource of a ``kind`` schedule)."""
    force = dict(force or {})
    threads, rpt, source = evaluated
    if force:
        source = "forced " + ", ".join(f"{k}={v}" for k, v in sorted(force.items()))
    th = force.get("threads") or max(int(threads), MIN_THREADS)
    th = max(WARP, min(int(th), limits.max_threads))
    if th % WARP or th & (th - 1):
        raise ValueError(f"threads per block must be a power of two >= {WARP}, got {th}")
    cap = _blocks_cap(th, profile, limits)
    fn = {KernelKind.ELEMENTWISE: _elementwise, KernelKind.ROW: _row,
          KernelKind.COLUMN: _column, KernelKind.PACKED: _packed}[kind]
    return fn(src, sizes, th, rpt, cap, profile, limits, force, source)


def _blocks_cap(th, profile, limits) -> int:
    """Most blocks a grid-stride launch of ``th``-thread blocks uses."""
    return limits.max_blocks or \
        profile.units * max(1, profile.max_threads_per_unit // th) * GRID_WAVES


def _grid(work: int, per_block: int, cap: int) -> int:
    return max(1, min(-(-work // per_block), cap))


def _elementwise(src, z, th, _rpt, cap, profile, limits, force, source):
    if "threads" not in force:
        th = min(EW_THREADS, limits.max_threads)
        cap = _blocks_cap(th, profile, limits)
    nc = -(-z.L // EW_VEC)
    chunks = z.rows * nc
    wide = bool(src.wide) and z.L % 4 == 0 and force.get("wide", True)
    name = "k_ew_v4" if wide else "k_ew"
    steps = ((name, _grid(chunks, th, cap), th, 0, {}),) if chunks else ()
    how = "16-byte loads/stores" if wide else "scalar loads"
    return CudaLaunch("elementwise", f"grid-stride, {EW_VEC} elements per thread per step, "
                      f"{how}", steps, {"rows": z.rows, "nc": nc}, (), th, source)


def _packed(src, z, th, _rpt, cap, _profile, _limits, _force, source):
    """k_pk: one thread per element of the segments' flat space, grid-stride."""
    total = z.D[0] if z.D else 0
    steps = (("k_pk", _grid(total, th, cap), th, 0, {}),) if total else ()
    return CudaLaunch("packed", "grid-stride over the segments' concatenated flat space",
                      steps, {}, (), th, source)


def _row(src, z, th, _rpt, cap, profile, limits, force, source):
    scratch = src.scratch_np
    tpr = force.get("tpr")
    # the register-resident kernels unless forced off (chunks=False, another variant)
    in_regs = force.get("chunks", True) and force.get("variant") in (None, "chunks")
    ctpr = chunk_tpr(z.L, limits.max_threads)
    if tpr is None and in_regs and _row_chunks(src, z.L, ctpr):
        tpr = ctpr
        if "threads" not in force:
            th = min(max(MIN_THREADS, tpr), limits.max_threads)
    elif tpr is None:
        tpr = max(_pow2ceil(-(-max(z.L, 1) // ROW_ELEMS)), min(ROW_MIN_TPR, _pow2ceil(z.L)))
        tpr = min(tpr, limits.max_threads)
        if "threads" not in force:
            th = max(th, tpr)
            # fewer rows per block rather than scratch rows in global memory (an H100:
            # 512-thread blocks of a 256-long masked softmax through global memory ran
            # 87 µs, 128-thread blocks through shared memory 66 µs)
            while th > max(tpr, MIN_THREADS) and scratch and \
                    _smem_layout(scratch, th // tpr * z.L)[1] > limits.smem:
                th //= 2
    cap = _blocks_cap(th, profile, limits)
    tpr = int(tpr)
    if tpr & (tpr - 1) or tpr > th:
        raise ValueError(f"threads per row must be a power of two <= {th}, got {tpr}")
    rpb = th // tpr
    chunks = _row_chunks(src, z.L, tpr) if in_regs else 0
    if force.get("variant") == "chunks" and not chunks:
        raise ValueError(f"no k_row_r<C> kernel holds rows of {z.L} at {tpr} threads per "
                         f"row (rows of a multiple of {EW_VEC}, at most "
                         f"{tpr * EW_VEC * ROW_CHUNKS[-1]} long, 4-byte buffers)")
    if chunks:
        wide = force.get("wide", True)
        name = f"k_row_r{chunks}"
        if f"{name}_t{tpr}" in src.kernels:    # the twin with tpr in its code (static L)
            name = f"{name}_t{tpr}"
        name += "_v4" if wide else ""
        steps = ((name, _grid(z.rows, rpb, cap), th, 0, {}),) if z.rows else ()
        text = _row_text(tpr, rpb, None) + \
            f"; the row in registers, {chunks} chunk(s) of {EW_VEC} per thread" + \
            ("; 16-byte loads/stores" if wide else "")
        return CudaLaunch("row", text, steps, {"rows": z.rows, "tpr": tpr}, (), th, source)
    variant = force.get("variant") or _row_variant(scratch, z.L, tpr, rpb, limits.smem)
    args = {"rows": z.rows, "tpr": tpr}
    smem, ws = 0, ()
    grid = _grid(z.rows, rpb, cap)
    if variant == "smem":
        offs, smem = _smem_layout(scratch, rpb * z.L)
        args.update({f"so{k}": o for (k, _), o in zip(scratch, offs)})
    elif variant == "global":
        ws = tuple((f"ws{k}", d, grid * rpb * max(z.L, 1)) for k, d in scratch)
    wide = bool(src.wide) and variant != "regs" and z.L % EW_VEC == 0 and \
        force.get("wide", True)
    name = "k_row" + (f"_{variant}" if variant else "") + ("_v4" if wide else "")
    steps = ((name, grid, th, smem, {}),) if z.rows else ()
    text = _row_text(tpr, rpb, variant) + ("; 16-byte loads/stores" if wide else "")
    return CudaLaunch("row", text, steps, args, ws, th, source)


def _row_chunks(src, L, tpr) -> int:
    """Chunks per thread of the k_row_r<C> kernel for a row of L at tpr threads per row
    (emitter.row_chunks), or 0 where none does or ``src`` has none."""
    if f"k_row_r{ROW_CHUNKS[0]}" not in src.kernels:
        return 0
    return row_chunks(L, tpr)


def _row_variant(scratch, L, tpr, rpb, smem_limit):
    if not scratch:
        return None
    if L <= tpr * REG_SLOTS:
        return "regs"
    return "smem" if _smem_layout(scratch, rpb * L)[1] <= smem_limit else "global"


def _smem_layout(scratch, elems_each):
    """Element offsets of each scratch region in the one dynamic shared buffer (regions
    8-byte aligned, so float64 views of it stay aligned) and the total bytes."""
    offs, at = [], 0
    for _k, d in scratch:
        offs.append(at // d.itemsize)
        at = -(-(at + elems_each * d.itemsize) // 8) * 8
    return offs, at


def _row_text(tpr, rpb, variant) -> str:
    if tpr < WARP:
        who = f"{tpr} threads per row, {WARP // tpr} rows per warp"
    elif tpr == WARP:
        who = "one warp per row (shuffles)"
    else:
        who = f"{tpr} threads per row (shuffles + shared-memory combine)"
    where = {None: "", "regs": "; row values kept in registers",
             "smem": "; row values kept in shared memory",
             "global": "; row values kept in a global workspace"}[variant]
    return f"{who}, {rpb} row(s) per block{where}"


def _column(src, z, th, _rpt, cap, profile, limits, force, source):
    if "threads" not in force:
        th = min(COL_THREADS, limits.max_threads)
        cap = _blocks_cap(th, profile, limits)
    tx = int(force.get("tx") or min(WARP, _pow2ceil(max(z.L, 1)), th))
    if tx & (tx - 1) or tx > th:
        raise ValueError(f"column tile must be a power of two <= {th}, got {tx}")
    ny = th // tx
    nct = -(-z.L // tx) if z.L else 0
    base = z.kept * nct
    nsplit = int(force.get("split") or _auto_split(base, z.rows, ny, profile))
    args = {"kept": z.kept, "rows": z.rows, "nct": nct, "nsplit": nsplit, "tx_n": tx}
    if not base:
        return CudaLaunch("column", "empty", (), args, (), th, source)
    if nsplit == 1:
        steps = (("k_col", _grid(base, 1, cap), th, 0, {"usplit": 1}),)
        text = f"{tx} columns x {ny} row slices per block, shared-memory combine"
        return CudaLaunch("column", text, steps, args, (), th, source)
    ws = tuple((f"wa{k}", np_dtype(acc), nsplit * z.kept * z.L)
               for k, acc in sorted(src.accumulators))
    steps = tuple((name, _grid(base * (nsplit if q < src.passes else 1), 1, cap), th, 0,
                   {"usplit": nsplit if q < src.passes else 1})
                  for q, name in enumerate(src.phases))
    text = (f"{tx} columns x {ny} row slices per block, reduced axis split {nsplit} ways: "
            f"{len(steps)} launches, partials through global memory")
    return CudaLaunch("column", text, steps, args, ws, th, source)


def _auto_split(base, rows, ny, profile) -> int:
    target = COL_BLOCKS_PER_SM * profile.units
    if base >= target or rows <= ny * MIN_ROWS_PER_THREAD:
        return 1
    # rounded down: one more block than the SMs hold runs as a second wave of its own
    # (an H200's ncu: 544 blocks of 4 per SM on 132 SMs, k_col_p0 at 27% of DRAM
    # bandwidth; the H100 sweep above was fastest at 16 ways, where rounding up gave 17)
    return max(1, min(target // base, rows // (ny * MIN_ROWS_PER_THREAD), MAX_SPLIT))


def describe(launch: CudaLaunch) -> str:
    grids = ", ".join(f"{n}<<<{g}, {b}{', ' + str(s) + ' B' if s else ''}>>>"
                      for n, g, b, s, _ in launch.steps)
    return f"{launch.kind}: {launch.strategy}; {grids or 'nothing to launch'} [{launch.source}]"
