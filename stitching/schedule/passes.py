"""Kernel kind, passes and where every value lives.

Kinds (from the collapsed domain of domain.py, R axes, last axis R-1)::

    elementwise   no reduction                 one pass over rows x column blocks
    row           every reduction reduces      per row: pass 0 | scalars | pass 1 | ...
                  exactly axis R-1             (softmax, LayerNorm, RMSNorm, ...)
    column        every reduction reduces the  per (kept index, column block):
                  same set S, R-1 not in S     passes loop over S, accumulators are
                                               column blocks (batch mean, NHWC pooling)

Stages.  stage(value) = number of reductions on the longest path from the kernel
inputs (a reduction is one more than its argument).  A *vector* value carries a
reduced axis and is computed inside the loop of pass stage(v); a *scalar* value
(row scalar; column block in a column kernel) carries none and is computed between
passes, after the pass that finished its reductions::

    softmax:   x ──max──► m          e = exp(x - m)  ──sum──► s       y = e / s
    stage:     0          1          1                        2       1/2 -> pass 2
               pass 0 ────┘ scalars  pass 1 ────────────────┘ scalars pass 2

Placement of each edge (producer -> consumer):

    load         the producer is a kernel input (re-read; rows are cache resident)
    register     same loop body
    recompute    vector value of an earlier pass, evaluated again (cheap chains)
    scratch      vector value of an earlier pass, kept in a per-row buffer (the CPU
                 analogue of shared memory), e.g. exp(x - max) in softmax
    row_scalar   per-row local between passes (row kind)
    column_block per-unit block of column values (column kind: reductions' results)
    unit_scalar  value constant over a unit (column kind)

The recompute/scratch choice is a small cost rule: recompute when the chain that
rebuilds the value costs at most RECOMPUTE_MAX_COST (a transcendental counts
TRANSCENDENTAL_COST), else scratch, within SCRATCH_BUDGET bytes per thread.
"""
from __future__ import annotations

import enum

from ..ir import dtypes as dt
from ..ir.ops import OPS, Kind
from .domain import Refusal
from .domain import live_nodes as domain_live_nodes

MAX_PASSES = 8                 # arbitrary: deeper reduction chains are split by the planner
RECOMPUTE_MAX_COST = 4         # tuned on LayerNorm (recompute x-mean) vs softmax (keep exp)
TRANSCENDENTAL_COST = 8        # rough: a vectorized exp/tanh ~ 8 simple ops
SCRATCH_BUDGET = 256 * 1024    # bytes of per-row scratch per thread: half of this L2


class KernelKind(str, enum.Enum):
    ELEMENTWISE = "elementwise"
    ROW = "row"
    COLUMN = "column"
    PACKED = "packed"        # independent element-wise chains of different sizes (packed.py)


class Placement(str, enum.Enum):
    LOAD = "load"
    REGISTER = "register"
    RECOMPUTE = "recompute"
    SCRATCH = "scratch"
    ROW_SCALAR = "row_scalar"
    COLUMN_BLOCK = "column_block"
    UNIT_SCALAR = "unit_scalar"


def is_reduction(node) -> bool:
    return OPS[node.op].kind == Kind.REDUCTION


live_nodes = domain_live_nodes


# ---- kind -------------------------------------------------------------------------

def classify(spec, dom, live):
    """(kind, reduced axes) or Refusal with the reason."""
    reds = [k for k in live if is_reduction(spec.nodes[k]) and dom.reduced[k]]
    R = dom.rank
    if not reds:
        kind, S = KernelKind.ELEMENTWISE, ()
    else:
        sets = {}
        for k in reds:
            sets.setdefault(dom.reduced[k], k)
        if len(sets) > 1:
            a, b = list(sets.values())[:2]
            raise Refusal(f"{_red_text(spec, a)} and {_red_text(spec, b)} reduce "
                          "different axes; one kernel handles one reduction shape")
        S = next(iter(sets))
        if S == (R - 1,):
            kind = KernelKind.ROW
        elif R - 1 not in S:
            kind = KernelKind.COLUMN
        else:
            raise Refusal(f"{_red_text(spec, reds[0])} is neither a row reduction "
                          "(innermost axes) nor a column reduction (innermost axis kept)")
    _check_parallel(spec, dom, live, reds, S)
    return kind, S


def _check_parallel(spec, dom, live, reds, S):
    par = set(range(dom.rank)) - set(S)
    for k in reds:
        a = spec.nodes[k].args[0]
        if not par <= set(dom.carries[a]):
            raise Refusal(f"{_red_text(spec, k)} reads a value broadcast along a kept "
                          "axis; it would be recomputed for every index of that axis")
    for i, o in enumerate(spec.outputs):
        if not par <= set(dom.carries[o]):
            raise Refusal(f"output {i} ({spec.nodes[o].op}, shape "
                          f"{_shape(spec.nodes[o].type.shape)}) does not span the "
                          "kernel's parallel axes; it would be written many times")


def _red_text(spec, k) -> str:
    n = spec.nodes[k]
    x = spec.type_of(n.args[0])
    return f"{n.op} over axes {tuple(n.attrs['axes'])} of {_shape(x.shape)}"


def _shape(s) -> str:
    return "[" + ",".join("?" if d < 0 else str(d) for d in s) + "]"


# ---- stages and homes ------------------------------------------------------------

def stages(spec, dom, live) -> dict:
    st = {}
    get = lambda a: 0 if a < 0 else st[a]   # noqa: E731
    for k in live:
        n = spec.nodes[k]
        if is_reduction(n) and dom.reduced[k]:
            st[k] = get(n.args[0]) + 1
        else:
            st[k] = max((get(a) for a in n.args), default=0)
    return st


def vector_test(kind, dom, S):
    """ref -> does the value live inside the pass loops?"""
    if kind == KernelKind.ELEMENTWISE:
        return lambda ref: True
    s = set(S)
    return lambda ref: bool(s & set(dom.carries[ref]))


# ---- recompute or scratch ------------------------------------------------------------

def _op_cost(node) -> int:
    return TRANSCENDENTAL_COST if OPS[node.op].transcendental else 1


def _rebuild_costs(spec, live, vec, scratch) -> dict:
    """node -> cost of evaluating it again from inputs, row scalars and scratch
    (one forward sweep in SSA order; shared ancestors count once per path, a
    deliberate over-estimate that favours scratch for deep chains)."""
    cost: dict = {}
    for u in live:
        if vec(u) and u not in scratch:
            cost[u] = _op_cost(spec.nodes[u]) + sum(cost.get(a, 0)
                                                    for a in spec.nodes[u].args)
    return cost


def choose_scratch(spec, dom, kind, live, st, vec, S):
    """Vector values consumed in a later pass -> (scratch set, notes)."""
    if kind != KernelKind.ROW:
        return set(), []
    if spec.schedule.get("split_rows") == 1:
        # pieces of one row run in different units and phases: nothing stays per row
        return set(), ["rows may be split across units: values reused across passes "
                       "are recomputed"]
    later = sorted({a for v in live if vec(v) for a in spec.nodes[v].args
                    if a >= 0 and vec(a) and st[v] > st[a]})
    mode = spec.schedule.get("scratch")
    L = dom.axes[S[0]].size
    scratch, notes, used = set(), [], 0
    cost = _rebuild_costs(spec, live, vec, scratch)
    for u in later:
        want = mode == 1 or (mode is None and cost[u] > RECOMPUTE_MAX_COST)
        if not want:
            continue
        size = dt.ITEMSIZE[dt.COMPUTE[spec.nodes[u].type.dtype]]
        if L >= 0 and used + L * size > SCRATCH_BUDGET:
            notes.append(f"node {u} ({spec.nodes[u].op}) recomputed: a row of {L} "
                         f"exceeds the {SCRATCH_BUDGET // 1024} KiB scratch budget")
            continue
        scratch.add(u)
        used += max(L, 0) * size
        cost = _rebuild_costs(spec, live, vec, scratch)
    if scratch and L < 0:
        notes.append("scratch rows have run-time length: "
                     f"{len(scratch)} buffer(s) of one row per thread")
    return scratch, notes


# ---- what each loop evaluates ------------------------------------------------------

def pass_contents(spec, live, st, vec, reds, scratch, n_passes):
    """Per pass: (compute, recomputed, loads, scratch_loads, scratch_stores,
    accumulate, stores), each a sorted tuple.  ``loads`` are the kernel inputs the
    pass reads; ``reds`` the (non-degenerate) reductions."""
    nodes = spec.nodes
    outs = set(spec.outputs)
    result = []
    for p in range(n_passes):
        accumulate = [k for k in reds if _accum_pass(spec, k, st) == p]
        stores = [k for k in live if k in outs and vec(k) and st[k] == p]
        sstores = [k for k in scratch if st[k] == p]
        wanted = set(stores + sstores) | {nodes[k].args[0] for k in accumulate}
        compute, loads, sloads = set(), set(), set()
        # one backward sweep: a node needed here pulls in its arguments (args have
        # smaller SSA indices, so every pull is seen later in the sweep)
        for a in range(len(nodes) - 1, -1, -1):
            if a not in wanted or not vec(a):
                continue
            if st[a] < p and a in scratch:
                sloads.add(a)
                continue
            compute.add(a)
            for b in _read_args(nodes[a]):
                if b < 0:
                    loads.add(-b - 1)
                else:
                    wanted.add(b)
        loads |= {-a - 1 for a in wanted if a < 0}
        recomputed = {a for a in compute if st[a] < p}
        result.append(tuple(tuple(sorted(x)) for x in (
            compute, recomputed, loads, sloads, sstores, accumulate, stores)))
    return result


def _read_args(node) -> tuple:
    """The arguments whose values a node reads: a FillLike reads only its argument's
    shape (the kernel's dims), never its data."""
    return () if node.op == "FillLike" else node.args


def _accum_pass(spec, k, st):
    a = spec.nodes[k].args[0]
    return 0 if a < 0 else st[a]


def scalar_contents(spec, live, st, vec, n_passes):
    """Per scalar stage s (before pass s; s == n_passes: epilogue):
    (compute, loads, stores); ``loads`` are the kernel inputs it reads."""
    nodes = spec.nodes
    outs = set(spec.outputs)
    result = []
    for s in range(n_passes + 1):
        compute = [k for k in live if not vec(k) and st[k] == s]
        loads = sorted({-a - 1 for k in compute for a in _read_args(nodes[k])
                        if a < 0 and not vec(a)})   # a reduction's vector input is read in its pass
        stores = [k for k in compute if k in outs]
        result.append((tuple(compute), tuple(loads), tuple(stores)))
    return result


def edge_placements(spec, kind, dom, live, st, vec, scratch):
    """[(src ref, dst node, Placement)] for every data edge of the live nodes."""
    nodes = spec.nodes
    last = dom.rank - 1
    edges = []
    for v in live:
        for a in dict.fromkeys(nodes[v].args):
            edges.append((a, v, _placement(kind, nodes, dom, st, vec, scratch, a, v, last)))
    return edges


def _placement(kind, nodes, dom, st, vec, scratch, a, v, last):
    if a < 0:
        return Placement.LOAD
    if kind == KernelKind.ELEMENTWISE:
        return Placement.REGISTER
    if vec(a):
        if not vec(v) or st[a] == st[v]:
            return Placement.REGISTER       # same loop (a reduction accumulates there)
        return Placement.SCRATCH if a in scratch else Placement.RECOMPUTE
    if kind == KernelKind.ROW:
        return Placement.ROW_SCALAR
    if not vec(v) and st[a] == st[v]:
        return Placement.REGISTER           # same block loop between passes
    return Placement.COLUMN_BLOCK if last in dom.carries[a] else Placement.UNIT_SCALAR
