"""The schedule of one kernel, and the legality check the planner calls.

    spec ──layout.lower────► layout ops folded into views of the inputs (layout.py)
         ──domain.analyze──► Domain (collapsed axes)
         ──passes.classify─► kind (elementwise | row | column), reduced axes
         ──stages/scratch──► home of every value, recompute-or-scratch choices
         ──contents────────► Schedule: passes, scalar stages, edge placements, units

``check(spec)`` runs the same steps and returns a ``Decision`` (falsy = legal,
otherwise ``.reason`` is a sentence for the user's report).  ``build_schedule``
returns the ``Schedule`` or raises ``ScheduleError`` with that reason.  Both are
deterministic: same spec, same schedule.  Nothing here is target specific: the CPU
emitter (codegen/cpu/emitter.py) and a CUDA emitter walk the same Schedule.

Work units (the op splits [0, units) across threads)::

    elementwise  rows x column blocks: a unit is rows_per_task whole rows when rows
                 are short, else one block of col_block elements of one row
    row          a unit is rows_per_task rows; each row runs every pass
    column       a unit is one index of the kept outer axes x col_block columns;
                 each unit loops over the reduced axes once per pass
    packed       chains of different sizes (packed.py): a unit is col_block elements
                 of their concatenated flat index space; one Pass per chain (segment),
                 the shared one-element values in scalars[0]

``rows_per_task`` / ``col_block`` come from spec.schedule when the cost model set
them, else the shape function picks them at run time (defaults below).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..ir import dtypes as dt
from . import passes as P
from . import packed as PK
from . import contract
from . import layout
from .domain import Domain, Refusal, analyze, strided_innermost
from .passes import KernelKind, Placement

ROW_UNIT_ELEMS = 4096     # tuned: a row unit touches >= ~16 KiB, per-unit overhead < 1%
EW_BLOCK = 16384          # tuned: elements per element-wise unit (64 KiB of float32)
COL_BLOCK = 2048          # tuned: widest column block (the per-row loop entry cost
COL_UNITS = 8             #   amortizes over wide blocks) ... narrowed until a column
COL_BLOCK_MIN = 64        #   kernel has COL_UNITS units, not below 64 columns.  8, not
                          #   the 4 (2 threads x 2) it was: 5 units on 2 threads idle
                          #   one for a sixth of the call; now such a kernel cuts its
                          #   rows (squeeze-excite [5, 57, 57, 256]: 5 -> 20 units, 1.17
                          #   -> 1.29x XLA); 16 measured slower (4m, 64m: narrow blocks)
PHASE_MIN_MACS = 16384   # tuned: SmallMatMul products of at least this many multiply-adds
                         # per row group run once per group in a phase of their own (the
                         # op's extra pass over its units and the temp buffer cost ~5-20
                         # us); smaller ones are recomputed by every unit that starts a
                         # group (EfficientNet's SE blocks of 32..240 channels: 512 to
                         # 4800; 480..1152 channels: 19k to 110k)
COL_SPLIT_UNITS = 16      # tuned: fewer column units than COL_UNITS: cut the reduced
COL_CHUNK_ROWS = 128      #   rows into chunks for ~16 units, each >= 128 rows (cpu/emitter.py)


class ScheduleError(ValueError):
    """The spec cannot be one kernel; str(e) is the reason."""


@dataclass(frozen=True)
class Decision:
    """Falsy when legal (like XLA's FusionDecision); else ``reason`` says why not."""
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def __bool__(self) -> bool:
        return self.reason is not None

    def __str__(self) -> str:
        return "ok" if self.ok else self.reason


@dataclass(frozen=True)
class Pass:
    index: int
    compute: tuple          # vector nodes evaluated in the loop, SSA order
    recomputed: tuple       # of those, the ones whose home is an earlier pass
    loads: tuple            # kernel inputs read in the loop
    scratch_loads: tuple    # values of earlier passes read back from scratch
    scratch_stores: tuple   # values written to scratch for later passes
    accumulate: tuple       # reductions fed in this pass
    stores: tuple           # outputs written in this pass


@dataclass(frozen=True)
class ScalarStage:
    index: int              # runs before pass `index`; index == len(passes): epilogue
    compute: tuple          # row scalars / column-block values (reductions finalized)
    loads: tuple
    stores: tuple


@dataclass(frozen=True)
class Edge:
    src: int                # ref: node k >= 0 or input -(j + 1)
    dst: int                # node
    placement: Placement


# Ops that cost nothing per element (views and casts of a loaded value): hoisting a
# region made only of these would replace a load with a load.
_FREE_OPS = frozenset({"Reshape", "Identity", "Cast"})


@dataclass(frozen=True)
class Schedule:
    spec: object
    domain: Domain
    kind: KernelKind
    reduce_axes: tuple      # collapsed axes reduced (row: (R-1,); column: S)
    live: tuple             # nodes some output needs, SSA order
    stage: dict             # node -> stage
    vector: frozenset       # refs (nodes and inputs) that live inside the pass loops
    passes: tuple
    scalars: tuple          # ScalarStage per position 0..len(passes)
    edges: tuple
    scratch: tuple          # nodes kept in per-row scratch (row kind)
    blocks: tuple           # nodes kept in column blocks (column kind)
    rows_per_task: int | None
    col_block: int | None
    notes: tuple = field(default=())
    split_rows: bool = False   # row kind: the code can split a row across units
    segments: tuple = ()       # packed kind: (offset, size) of each pass's flat range
    side_groups: tuple = ()    # SmallMatMul's side loops, in run order (contract.py)

    # -- queries the emitters use -----------------------------------------------------
    @property
    def rank(self) -> int:
        return self.domain.rank

    @property
    def parallel_axes(self) -> tuple:
        return tuple(a for a in range(self.rank) if a not in self.reduce_axes)

    def is_vector(self, ref: int) -> bool:
        return ref in self.vector

    def carries(self, ref: int) -> tuple:
        return self.domain.carries[ref]

    def hoisted(self) -> tuple:
        """Element-wise kernels over rank >= 2: the values that do not vary along axis
        R-2 (the innermost row axis) -- per-column parameter math such as inference
        batch norm's ``rsqrt(var + eps) * gamma`` (carries only the last axis), or a
        squeeze-excite gate ``sigmoid(s)`` with s of shape [N,1,1,C] over x [N,H,W,C]
        (carries batch and channels, domain [N, H*W, C]) -- are computed over a
        last-axis scratch once per group of rows that shares them (hoist_per_group)
        instead of once per element.  Returns (nodes computed in that prologue, SSA
        order; the ones the element loop reads back from the scratch).  Empty for
        other kinds: row/column kernels already evaluate values that do not carry the
        parallel axes outside their element loops."""
        if self.kind != KernelKind.ELEMENTWISE or self.rank < 2 and not self.side_groups \
                and not self.products():
            return (), ()
        last, mid = self.rank - 1, self.rank - 2
        p = self.passes[0]
        side = self.domain.side
        # a kernel whose products vary along the row axis (one [N, M] row per image, or
        # rank 1) computes everything in the prologue, per row (or once per call)
        per_row = self.products_per_row() or self.rank < 2
        inner = [k for k in p.compute
                 if (per_row or mid not in self.carries(k)) and k not in side]
        vec = {k for k in inner if last in self.carries(k)}
        if not vec:
            return (), ()
        inner_set = set(inner)
        used_outside = {a for k in p.compute if k not in inner_set
                        for a in self.spec.nodes[k].args}
        outputs = set(self.spec.outputs)
        front = tuple(k for k in inner if k in vec and (k in used_outside or k in outputs))
        # only worth it when the element loop stops computing something
        if all(self.spec.nodes[k].op in _FREE_OPS for k in vec):
            return (), ()
        return tuple(inner), front

    def products(self) -> tuple:
        """The SmallMatMul nodes (contract.py)."""
        return tuple(k for k in self.live if contract.is_contraction(self.spec.nodes[k]))

    def products_per_row(self) -> bool:
        """Whether the SmallMatMuls or their side values vary along the row axis R-2
        (a kernel over [N, M] rows ending in a product): its prologue groups are single
        rows."""
        R = self.rank
        return R >= 2 and any(R - 2 in self.carries(k) for k in
                              self.products() + tuple(k for g in self.side_groups
                                                      for k in g.nodes))

    def prologue_phase(self) -> bool:
        """Whether the products run in a prologue phase (PHASE_MIN_MACS), not in the
        element loops' per-group prologue."""
        macs = sum(math.prod(self.spec.type_of(self.spec.nodes[k].args[1]).shape)
                   for k in self.products())
        return macs >= PHASE_MIN_MACS

    def hoist_per_group(self) -> bool:
        """Whether the hoisted prologue depends on the row: some value it computes or
        input it reads carries an outer axis (the SE gate's batch axis).  Then it runs
        again whenever the row's group ``r // D[R-2]`` changes (rows of one group share
        every hoisted value); else once per call."""
        if self.products_per_row():
            return True
        inner, _ = self.hoisted()
        inner = list(inner) + [k for g in self.side_groups for k in g.nodes]
        last = self.rank - 1
        refs = set(inner) | {a for k in inner for a in self.spec.nodes[k].args
                             if a not in self.domain.weights}
        return any(a != last for r in refs for a in self.carries(r))

    def placement(self, src: int, dst: int) -> Placement:
        for e in self.edges:
            if e.src == src and e.dst == dst:
                return e.placement
        raise KeyError((src, dst))

    def placement_counts(self) -> dict:
        out: dict = {}
        for e in self.edges:
            out[e.placement.value] = out.get(e.placement.value, 0) + 1
        return out

    def describe(self) -> str:
        from .describe import describe
        return describe(self)


def build_schedule(spec) -> Schedule:
    """Schedule of a validated spec; raises ScheduleError with the reason."""
    got = _memo_build(spec)
    if isinstance(got, str):
        raise ScheduleError(got)
    return got


def check(spec) -> Decision:
    """Can this spec be one kernel?  Decision() if yes, Decision(reason) if not."""
    got = _memo_build(spec)
    return Decision(got) if isinstance(got, str) else Decision()


_MEMO: dict = {}        # spec hash -> Schedule, or the refusal's reason
_MEMO_MAX = 8192        # arbitrary: the planner asks again about the same regions


def _memo_build(spec):
    """The Schedule, or the reason it is refused; memoized by content hash (the
    planner checks the same region structure many times: ResNet50 repeats its blocks)."""
    got = _MEMO.get(spec.hash)
    if got is None:
        try:
            got = _build(spec)
        except Refusal as e:
            got = str(e)
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        _MEMO[spec.hash] = got
    return got


def _build(spec) -> Schedule:
    _check_dtypes(spec)
    lowered = layout.lower(spec)        # the Schedule's spec: what the emitters see
    try:
        dom = analyze(lowered)
        return _build_on(lowered, dom)
    except Refusal as e:
        # chains that share no domain may still run as one packed kernel (not with
        # views: a packed kernel reads its inputs flat); if not, the refusal the user
        # reads is the ordinary one
        if lowered is not spec or isinstance(PK.segments(spec), str):
            raise e from None
        return _build_packed(spec)


def _build_packed(spec) -> Schedule:
    """The packed kind's Schedule: one Pass per chain, shared scalars before them."""
    dom, table, segs, scalars, vec = PK.plan(spec)

    def reads(nodes) -> list:       # the kernel inputs (positions) ``nodes`` read
        return sorted({-a - 1 for k in nodes for a in spec.nodes[k].args if a < 0})

    outputs = set(spec.outputs)
    passes = tuple(Pass(i, nodes, (), tuple(j for j in reads(nodes) if -(j + 1) in vec),
                        (), (), (), tuple(k for k in nodes if k in outputs))
                   for i, nodes in enumerate(segs))
    live = tuple(sorted(set(scalars) | {k for s in segs for k in s}))
    scalar_loads = tuple(j for j in reads(live) if -(j + 1) not in vec)
    edges = tuple(Edge(a, k, P.Placement.LOAD if a < 0 else P.Placement.REGISTER)
                  for k in live for a in spec.nodes[k].args)
    refs = [-(j + 1) for j in range(len(spec.inputs))] + list(live)
    return Schedule(
        spec=spec, domain=dom, kind=KernelKind.PACKED, reduce_axes=(), live=live,
        stage=dict.fromkeys(live, 0), vector=frozenset(r for r in refs if r in vec),
        passes=passes, scalars=(ScalarStage(0, tuple(scalars), scalar_loads, ()),),
        edges=edges, scratch=(), blocks=(), rows_per_task=None,
        col_block=spec.schedule.get("col_block"),
        notes=(f"packed {len(segs)} chains",), segments=table)


def _build_on(spec, dom) -> Schedule:
    live = P.live_nodes(spec)
    kind, S = P.classify(spec, dom, live)
    if kind == KernelKind.COLUMN and dom.inner_guard:
        # its loops index columns from a block start, not the guard's absolute index
        # (a guard on an outer axis is in the row bases: Domain.clamped)
        raise Refusal("a concatenation or Pad on the innermost axis read in a column "
                      "reduction: not fused yet")
    side_groups = contract.groups(spec, dom, kind, live)
    if dom.windows and (kind == KernelKind.ROW or side_groups or any(
            contract.is_contraction(spec.nodes[k]) for k in live)):
        # the emitter sums a window's taps per row of an element-wise or column loop
        # nest (codegen/cpu/emitter.py, _windows); a row reduction's row is its channels
        raise Refusal(f"a depthwise convolution in a {kind.value} kernel"
                      f"{'' if kind == KernelKind.ROW else ' with a SmallMatMul'}: its "
                      "taps are summed per row of element-wise and column kernels only")
    strided = strided_innermost(dom)
    if strided and kind != KernelKind.ELEMENTWISE:
        # row and column loops load rows and tiles contiguously (prefetch, pipelining)
        raise Refusal(f"input {-strided[0] - 1} is read through a layout op that moves "
                      f"its innermost axis, in a {kind.value} kernel: only element-wise "
                      "kernels load along a stride")
    st = P.stages(spec, dom, live)
    vec = P.vector_test(kind, dom, S)
    reds = [k for k in live if P.is_reduction(spec.nodes[k]) and dom.reduced[k]]
    n_passes = 1 + max([st[k] for k in live if vec(k)] +
                       [P._accum_pass(spec, k, st) for k in reds] + [0])
    if n_passes > P.MAX_PASSES:
        raise Refusal(f"{n_passes} dependent reductions in one kernel "
                      f"(limit {P.MAX_PASSES})")
    scratch, notes = P.choose_scratch(spec, dom, kind, live, st, vec, S)
    passes = tuple(Pass(p, *c) for p, c in enumerate(
        P.pass_contents(spec, live, st, vec, reds, scratch, n_passes)))
    scalars = tuple(ScalarStage(s, *c) for s, c in enumerate(
        P.scalar_contents(spec, live, st, vec, n_passes)))
    if kind == KernelKind.ELEMENTWISE:
        scalars = ()
    edges = tuple(Edge(*e) for e in P.edge_placements(spec, kind, dom, live, st, vec,
                                                        scratch))
    blocks = tuple(sorted({e.src for e in edges
                           if e.placement == Placement.COLUMN_BLOCK}))
    refs = [-(j + 1) for j in range(len(spec.inputs))] + list(live)
    return Schedule(
        spec=spec, domain=dom, kind=kind, reduce_axes=tuple(S), live=tuple(live),
        stage=st, vector=frozenset(r for r in refs if vec(r)), passes=passes,
        scalars=scalars, edges=edges, scratch=tuple(sorted(scratch)), blocks=blocks,
        rows_per_task=spec.schedule.get("rows_per_task"),
        col_block=spec.schedule.get("col_block"), notes=tuple(notes),
        split_rows=kind == KernelKind.ROW and spec.schedule.get("split_rows") == 1,
        side_groups=side_groups)


def _check_dtypes(spec):
    for t in list(spec.inputs) + [n.type for n in spec.nodes]:
        if t.dtype not in dt.ALL_DTYPES:
            raise Refusal(f"dtype {t.dtype} is not supported in generated kernels")
