"""Iteration domain of one kernel: which loop axis each tensor dimension runs along.

Algorithm
---------
1. **Unify dims** (union-find).  Every dimension of every value (kernel inputs and
   nodes) that is not a static 1 gets a variable.  Each op says which dims are the
   same loop axis::

       Add(x[?,768], b[768]) -> y[?,768]        x.0 = y.0, x.1 = b.0 = y.1
       Mean(x[?,768], axes=[1], keep_dims)      x.0 = m.0; x.1 is reduced
       Reshape(x[?,1,768] -> [?,768])           non-1 dims pair up in order

   A static size-1 dim broadcasts and takes part in nothing.  Unknown vs unknown is
   assumed equal (the shape function checks it at run time); unknown vs n is n
   (also checked).  A class pinned to size 1 (an unknown dim that a node claims is
   1) is *degenerate*: no axis, but its input dims are checked to be 1 at run time.

2. **Order** the classes so that every value's dims appear in increasing order, i.e.
   every value is a row-major sub-array of the domain.  Each value adds edges
   dim i -> dim i+1; a topological sort (smallest first-seen class first, so the
   result is deterministic) gives the order.  A cycle means some value is a
   transpose of another: refused.

3. **Collapse** adjacent axes that every value carries together or not at all and
   every reduction reduces together or not at all (XLA/TVM dim collapse)::

       x[N,H,W,C] - mean(x, axes=[1,2]) -> axes (N, H*W, C)

   A *view* (an input read through folded layout ops, layout.py) has strides of its
   own: two of its dims merge only where they are contiguous in its source
   (stride[p] == stride[p+1] * size[p+1]), and the innermost axis it carries must have
   stride 1 (the emitters load it contiguously).  A view's dim that covers a source dim
   whole is the source dim's class, so the shape function still checks the source.
   Each axis of a concatenation or Pad that a view is read outside its range along (a
   guard) stays an axis of its own: its loop index is the guard's index
   (``Domain.inner_guard`` on the innermost axis, ``Domain.clamped`` on the others).

4. **Contractions** (SmallMatMul, x[..., K] @ w[K, M]): the output's leading dims are
   x's, its last is the weight's M; K is *contracted*.  K's class and everything that
   carries it (the hidden vector of a squeeze-excite block between its two products)
   is a *side* class: not an axis of the domain.  A value carrying one has it as its
   last dim, of static size (``Domain.side``), and is computed per row group in a loop
   of its own (codegen/cpu/emitter.py); the weights are read whole (``Domain.weights``:
   static kernel inputs no other node reads) and take no part in the domain either.

5. **Windows** (DepthwiseConv2D, x[N, H, W, C] -> [N, Ho, Wo, C]): the output's N and C
   are x's; x's H and W are not axes of the domain.  x is a *window input*
   (``Domain.windows``): a kernel input read only through the window, so every output
   element may read any pixel of it (a stencil: its producer is materialized, not
   fused in); its filter is a weight like a contraction's.  The output's channel class
   is an axis of its own, the innermost (``Domain.window_channels``), so that each row
   of the domain is one output pixel (n, i, j) at the flat row index (the emitter
   recovers i and j from it) and the window's taps are contiguous along the row.

Nothing here knows about loops; ``passes.py`` decides the kernel kind from the
collapsed axes and ``reduced`` sets.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..ir.ops import OPS, Kind

MAX_DOMAIN_RANK = 16   # arbitrary: dims[] holds the collapsed sizes plus a few params
MAX_PARAM_SLOT = 31    # dims[31] is the phase (op.cc kMaxParams 32, kPhaseSlot 31)
# A view read with a stride along the innermost axis (a transpose of the last dim) loads
# one cache line per element; the next rows reuse those lines while they stay cached.
# 4096 lines are 256 KiB, half the smallest L2 of this project's machines (arbitrary
# within that bound); longer rows stay TF's transpose, which tiles.
MAX_STRIDED_ROW = 4096
LINE_ELEMS = 16        # a 64-byte cache line of float32


class Refusal(Exception):
    """This spec cannot be one kernel; the message is the user-facing reason."""


@dataclass(frozen=True)
class DimClass:
    size: int            # static size, 1 for a degenerate class, or -1 (run time)
    input_dims: tuple    # ((input j, dim i), ...) in this class, first one = size source
    # ((input j, dim i, c), ...): views' dims of extent max(n - c, 0) for input j's dim
    # i of run-time size n (layout.py View.less) in this class; the size source where
    # no input dim is in it (x[:, 1:] - x[:, :-1]), each checked equal to it
    derived: tuple = ()


@dataclass(frozen=True)
class Axis:
    classes: tuple       # dim classes merged into this axis, outer to inner
    size: int            # static product, or -1 when some class is unknown


@dataclass(frozen=True)
class Domain:
    classes: tuple       # DimClass per class id
    axes: tuple          # collapsed Axis, outer to inner
    value_dims: dict     # ref -> tuple(class id or None per dim); None = static 1
    carries: dict        # ref -> tuple of collapsed axis indices, increasing
    reduced: dict        # reduction node -> tuple of collapsed axes it reduces
    # view input ref -> {collapsed axis: element stride in its source} (layout.py);
    # every other value is row-major over the axes it carries
    view_strides: dict = field(default_factory=dict)
    # contractions (step 4): ref -> the side class of its last dim (static size), for
    # the values that carry a contracted class; the weight inputs, read whole
    side: dict = field(default_factory=dict)
    weights: frozenset = frozenset()
    # windows (step 5): the window inputs (refs), read only through a DepthwiseConv2D
    windows: frozenset = frozenset()
    # guarded views (step 3, layout.py View.guards): on outer axes, view ref ->
    # {collapsed axis: (first, last)}: the view's index along that axis is clamped to
    # [first, last] in its address, so every load reads its source (the piece selector
    # discards the rest); on the innermost axis, view ref -> the guard's bools (the
    # emitters load where it holds)
    clamped: dict = field(default_factory=dict)
    inner_guard: dict = field(default_factory=dict)
    # bounded views (layout.py View.bounds): ((dim class, most, source input), ...)
    # for the run-time classes that a view slices from a static dim; the shape function
    # checks each class's size against its most, so no load reads past the source
    bounds: tuple = ()
    # views of one element of a run-time dim (layout.py View.picks): ((view ref, dim
    # class, index, stride), ...); the shape function checks the element exists and,
    # for an index from the end, puts (n + index) * stride in a kernel parameter
    # (param_slot) that the view's pointer adds
    picks: tuple = ()

    # views with strides known only at run time (layout.py View.scaled): ((view ref,
    # axis, factor, dim classes), ...), the axis's stride factor times the classes'
    # sizes, a kernel parameter (scaled_slot) the shape function computes; the view's
    # view_strides entry for that axis is None
    scaled: tuple = ()

    @property
    def less(self) -> tuple:
        """Dims of views of extent max(n - c, 0) (DimClass.derived), in class order:
        ((dim class, input j, dim i, c), ...); the shape function computes each into a
        kernel parameter (less_slot), which is the class's size where no input dim is
        in it."""
        return tuple((c, *m) for c, cl in enumerate(self.classes) for m in cl.derived)

    def param_slot(self, p: int) -> int:
        """dims[] slot of the p-th pick's run-time offset: after the axes' sizes and
        the four work-decomposition words (cpu/emitter.py's ABI)."""
        return len(self.axes) + 4 + p

    def scaled_slot(self, q: int) -> int:
        """dims[] slot of the q-th run-time stride, after the picks'."""
        return self.param_slot(len(self.picks) + q)

    def less_slot(self, q: int) -> int:
        """dims[] slot of the q-th derived dim's size (Domain.less), after the strides'."""
        return self.param_slot(len(self.picks) + len(self.scaled) + q)

    @property
    def rank(self) -> int:
        return len(self.axes)

    def axis_size_text(self, a: int) -> str:
        s = self.axes[a].size
        return "?" if s < 0 else str(s)


# ---- step 1: union-find over dims ---------------------------------------------------

class _Union:
    def __init__(self):
        self.parent: list[int] = []
        self.size: list[int] = []

    def new(self, size: int) -> int:
        self.parent.append(len(self.parent))
        self.size.append(size)
        return len(self.parent) - 1

    def find(self, v: int) -> int:
        while self.parent[v] != v:
            self.parent[v] = self.parent[self.parent[v]]
            v = self.parent[v]
        return v

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        sa, sb = self.size[ra], self.size[rb]
        if sa >= 0 and sb >= 0 and sa != sb:
            raise Refusal(f"dimensions of size {sa} and {sb} meet on one axis")
        lo, hi = min(ra, rb), max(ra, rb)   # keep the older root: stable numbering
        self.parent[hi] = lo
        self.size[lo] = sa if sa >= 0 else sb

    def pin_one(self, v: int) -> None:
        r = self.find(v)
        if self.size[r] not in (-1, 1):
            raise Refusal(f"a dimension of size {self.size[r]} is broadcast to size 1")
        self.size[r] = 1


def _vars(uf: _Union, shape) -> list:
    return [None if d == 1 else uf.new(d) for d in shape]


def _bind(uf: _Union, src, dst) -> None:
    """src dim and dst dim are the same axis (dst None = static 1: src must be 1)."""
    if src is None:
        return
    if dst is None:
        uf.pin_one(src)
    else:
        uf.union(src, dst)


def _bind_node(uf, node, arg_vars, out) -> list:
    """Unify one node's output dims with its arguments'; returns reduced dim vars."""
    kind = OPS[node.op].kind
    if kind == Kind.ELEMENTWISE or node.op == "FillLike":
        for av in arg_vars:
            off = len(out) - len(av)
            for i, v in enumerate(av):
                _bind(uf, v, out[i + off])
        return []
    if kind == Kind.REDUCTION:
        (av,) = arg_vars
        axes, keep = node.attrs["axes"], node.attrs["keep_dims"]
        kept = [v for i, v in enumerate(av) if i not in axes]
        outs = [o for i, o in enumerate(out) if i not in axes] if keep else out
        for v, o in zip(kept, outs):
            _bind(uf, v, o)
        return [av[i] for i in axes if av[i] is not None]
    if node.op == "Reshape":
        (av,) = arg_vars
        src = [v for v in av if v is not None]
        target = node.attrs["shape"]
        dst = [out[i] for i, s in enumerate(target) if s != 1]
        for v, o in zip(src, dst):
            _bind(uf, v, o)
        return []
    return []   # Const: its own static dims only


def live_nodes(spec) -> list:
    """Nodes that some output depends on, in SSA order (dead nodes shape nothing)."""
    live = set(spec.outputs)
    for k in range(len(spec.nodes) - 1, -1, -1):
        if k in live:
            live.update(a for a in spec.nodes[k].args if a >= 0)
    return sorted(live)


def _views(spec) -> dict:
    """Input ref -> View for the views of a lowered spec (layout.py)."""
    views = getattr(spec, "views", ())
    n_real = len(spec.inputs) - len(views)
    return {-(n_real + v + 1): view for v, view in enumerate(views)}


def _unify(spec, live):
    uf = _Union()
    dims = {-(j + 1): _vars(uf, t.shape) for j, t in enumerate(spec.inputs)}
    for ref, view in _views(spec).items():       # a dim read whole: the source's class
        for o, d in enumerate(view.src_dims):
            if d is not None:
                _bind(uf, dims[-(view.source + 1)][d], dims[ref][o])
    ghosts = {r: [None] * len(v) for r, v in dims.items()}
    reduced_vars = {}
    contracted = []
    for k in live:
        n = spec.nodes[k]
        out = _vars(uf, n.type.shape)
        dims[k] = out
        if OPS[n.op].kind == Kind.CONTRACTION:
            x = dims[n.args[0]]
            for v, o in zip(x[:-1], out[:-1]):
                _bind(uf, v, o)
            contracted.append(x[-1])
            ghosts[k] = [None] * len(out)
            continue
        if OPS[n.op].kind == Kind.WINDOW:     # step 5: N and C are x's, H and W not
            x = dims[n.args[0]]
            _bind(uf, x[0], out[0])
            _bind(uf, x[3], out[3])
            ghosts[k] = [None] * len(out)
            continue
        red = _bind_node(uf, n, [dims[a] for a in n.args], out)
        ghosts[k] = _bind_ghosts(uf, n, [dims[a] for a in n.args],
                                 [ghosts[a] for a in n.args], out)
        if OPS[n.op].kind == Kind.REDUCTION:
            reduced_vars[k] = red
    _pack_components(uf, spec, live, dims)
    return uf, dims, reduced_vars, contracted


def _pack_components(uf, spec, live, dims):
    """Horizontal packing: a kernel made of independent element-wise chains (no path
    between them, e.g. one optimizer update per variable, or grouped-query attention's
    K and V head transposes) gets one iteration domain when every output has the same
    shape: the chains' outputs share their axes, so one loop nest computes all of them.
    A dim known only at run time is shared only where the graph proves it equal
    (``spec.same_dims``, ir/symdims.py: both K and V are [batch, ...] of one input);
    two unknown dims merely assumed equal would make the kernel refuse inputs TF runs.
    Chains with a reduction, or with outputs of different shapes or unproven unknown
    dims, keep their own axes (and the kernel is refused as before: an output would
    not span the parallel axes)."""
    parent = {}

    def root(v):
        while parent.setdefault(v, v) != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for k in live:                       # components: union each node with its args
        for a in spec.nodes[k].args:
            ra, rk = root(a), root(k)
            if ra != rk:
                parent[max(ra, rk)] = min(ra, rk)
    comp = {o: root(o) for o in spec.outputs}
    heads = {}
    for o in spec.outputs:
        heads.setdefault(comp.get(o, o), o)
    if len(heads) < 2:
        return
    shapes = {spec.type_of(o).shape for o in spec.outputs}
    if len(shapes) != 1 or any(
            OPS[spec.nodes[k].op].kind == Kind.REDUCTION for k in live):
        return
    proven = _proven_classes(uf, spec, dims)
    first, *rest = heads.values()
    for o in rest:
        if not all(a is None or uf.find(a) == uf.find(b) or uf.size[uf.find(a)] >= 0 or
                   proven.get(uf.find(a), set()) & proven.get(uf.find(b), set())
                   for a, b in zip(dims[first], dims[o])):
            return
    for o in rest:
        for a, b in zip(dims[first], dims[o]):
            _bind(uf, a, b)


def _proven_classes(uf, spec, dims) -> dict:
    """Dim class root -> the ``same_dims`` groups (by index) of the input dims in it."""
    out: dict = {}
    for g, group in enumerate(spec.same_dims):
        for j, i in group:
            v = dims[-(j + 1)][i]
            if v is not None:
                out.setdefault(uf.find(v), set()).add(g)
    return out


def _bind_ghosts(uf, node, arg_vars, arg_ghosts, out) -> list:
    """Reduce-then-broadcast-back: the size-1 dim a keep_dims reduction leaves *is*
    the reduced axis.  When such a dim (a "ghost") meets a real dim of the same
    static size in an element-wise op (LayerNorm's rsqrt(var)[?,1] * gamma[1,64]),
    the two are the same loop axis; without this, gamma's axis would be a new axis
    and the region an outer product the row schedule must refuse.  Only equal static
    sizes are unified: with unknown sizes TF would broadcast an outer product.
    Returns the output's ghosts (one var or None per output dim).
    """
    kind = OPS[node.op].kind
    if kind == Kind.REDUCTION:
        if not node.attrs["keep_dims"]:
            return [None] * len(out)
        (av,) = arg_vars
        return [av[i] if i in node.attrs["axes"] else None for i in range(len(out))]
    if kind != Kind.ELEMENTWISE:
        return [None] * len(out)
    res = [None] * len(out)
    for i in range(len(out)):
        real = out[i]
        for av, ag in zip(arg_vars, arg_ghosts):
            j = i - (len(out) - len(av))
            if j < 0 or av[j] is not None or ag[j] is None:
                continue
            g = uf.find(ag[j])
            if real is None:
                res[i] = res[i] if res[i] is not None else g
            elif uf.size[g] >= 0 and uf.size[g] == uf.size[uf.find(real)]:
                uf.union(g, real)
    return res


# ---- step 2: classes and their order ------------------------------------------------

def _classes(uf, dims, views):
    """Number the non-degenerate roots by first appearance; build DimClass records.
    A view's dims are not input dims of the class (the op passes no dims for it); the
    ones that are the rest of a source dim less c (View.less) are its derived dims."""
    ids: dict[int, int] = {}
    sizes, members = [], []
    value_dims = {}
    for ref in sorted(dims, key=lambda r: (r >= 0, abs(r))):   # inputs first, then nodes
        vd = []
        for i, v in enumerate(dims[ref]):
            if v is None:
                vd.append(None)
                continue
            r = uf.find(v)
            if r not in ids:
                ids[r] = len(sizes)
                sizes.append(uf.size[r])
                members.append([])
            c = ids[r]
            if ref < 0 and ref not in views:
                members[c].append((-ref - 1, i))
            vd.append(c)
        value_dims[ref] = tuple(vd)
    derived = [[] for _ in sizes]
    for ref, view in views.items():
        for o, d, c in view.less:
            derived[value_dims[ref][o]].append((view.source, d, c))
    classes = tuple(DimClass(s, tuple(m), tuple(dv))
                    for s, m, dv in zip(sizes, members, derived))
    for c, cl in enumerate(classes):
        if cl.size < 0 and not cl.input_dims and not cl.derived:
            raise Refusal("a dimension of unknown size is not set by any kernel input")
    return classes, value_dims, ids


def _live_axes(classes, vd) -> list:
    return [c for c in vd if c is not None and classes[c].size != 1]


def _order(classes, value_dims) -> list:
    """Topological order of the non-degenerate classes of ``value_dims`` (step 2)."""
    succ = {c: set() for vd in value_dims.values() for c in _live_axes(classes, vd)}
    indeg = dict.fromkeys(succ, 0)
    for ref, vd in value_dims.items():
        live = _live_axes(classes, vd)
        if len(set(live)) != len(live):
            raise Refusal(f"{_name(ref)} has two dimensions on one loop axis "
                          "(a transpose-like layout)")
        for a, b in zip(live, live[1:]):
            if b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
    ready = [c for c, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        c = heapq.heappop(ready)
        order.append(c)
        for s in sorted(succ[c]):
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(ready, s)
    if len(order) != len(succ):
        raise Refusal("values disagree on the order of their dimensions "
                      "(a transpose-like layout); only broadcasts and size-1 reshapes "
                      "are fused")
    return order


# ---- step 3: collapse ----------------------------------------------------------------

def _collapse(classes, order, value_dims, reduced_classes, view_class_strides=(),
              apart=()):
    """``apart``: classes that stay an axis of their own (windows' channels, the
    axes of concatenations and Pads that a piece is read outside its range along)."""
    pos = {c: i for i, c in enumerate(order)}
    carried = [frozenset(pos[c] for c in _live_axes(classes, vd))
               for vd in value_dims.values()]
    carried += [frozenset({pos[c]}) for c in apart if c in pos]
    reds = [frozenset(pos[c] for c in cs) for cs in reduced_classes.values()]

    def contiguous(p):  # every view carrying classes p and p+1 has them contiguous
        a, b = order[p], order[p + 1]    # (a stride None, known at run time: never)
        return all(a not in st or b not in st or
                   (classes[b].size >= 0 and None not in (st[a], st[b]) and
                    st[a] == st[b] * classes[b].size)
                   for st in view_class_strides)

    def together(p):  # may axis p and p+1 merge?
        return all((p in s) == (p + 1 in s) for s in carried + reds) and contiguous(p)

    groups = [[0]] if order else []
    for p in range(len(order) - 1):
        if together(p):
            groups[-1].append(p + 1)
        else:
            groups.append([p + 1])
    axes = []
    for g in groups:
        cls = tuple(order[p] for p in g)
        sz = 1
        for c in cls:
            sz = -1 if (sz < 0 or classes[c].size < 0) else sz * classes[c].size
        axes.append(Axis(cls, sz))
    axis_of = {c: a for a, ax in enumerate(axes) for c in ax.classes}
    return tuple(axes), axis_of


def analyze(spec) -> Domain:
    """Build the collapsed iteration domain of a validated spec (raises Refusal).

    Only live values (nodes an output needs, inputs they read) make axes; every
    input keeps its dim classes so the shape function still checks it."""
    live = live_nodes(spec)
    uf, dims, reduced_vars, contracted = _unify(spec, live)
    views = _views(spec)
    classes, value_dims, ids = _classes(uf, dims, views)
    weights, windows = _weights(spec, live, views)
    side_classes = {ids[uf.find(v)] for v in contracted}
    side = _side_sizes(classes, value_dims, side_classes, weights)
    if any(r in views for r in side):
        raise Refusal("a SmallMatMul's vector read through a layout op: not fused")
    reduced_classes = {
        k: sorted({ids[uf.find(v)] for v in vs if ids.get(uf.find(v)) is not None
                   and classes[ids[uf.find(v)]].size != 1})
        for k, vs in reduced_vars.items()}
    if any(side_classes & set(cs) for cs in reduced_classes.values()):
        raise Refusal("a reduction over a SmallMatMul's contracted dimension: not fused")
    used = (set(live) | {a for k in live for a in spec.nodes[k].args if a < 0}) - weights \
        - windows
    # the domain's dims: side classes and weights take no part (step 4)
    main_dims = {r: tuple(None if c in side_classes else c for c in vd)
                 for r, vd in value_dims.items() if r in used}
    order = _order(classes, main_dims)
    if len(order) > MAX_DOMAIN_RANK:
        raise Refusal(f"the kernel would loop over {len(order)} independent axes "
                      f"(limit {MAX_DOMAIN_RANK})")
    class_strides = {r: {c: None if any(o == e[0] for e in v.scaled) else st
                         for o, (c, st) in enumerate(zip(value_dims[r], v.strides))
                         if c is not None}
                     for r, v in views.items() if r in used}
    channels = _window_channels(spec, live, value_dims)
    guards = _guard_classes(views, value_dims, used)
    axes, axis_of = _collapse(classes, order, main_dims, reduced_classes,
                              list(class_strides.values()),
                              channels + [c for cs in guards.values() for c, _ in cs])
    carries = {ref: tuple(sorted({axis_of[c] for c in _live_axes(classes, vd)
                                  if c in axis_of}))
               for ref, vd in value_dims.items()}
    reduced = {k: tuple(sorted({axis_of[c] for c in cs}))
               for k, cs in reduced_classes.items()}
    view_strides = {r: _view_axis_strides(r, axes, carries[r], st)
                    for r, st in class_strides.items()}
    clamped, inner_guard = _clamps(guards, axes, axis_of)
    _check_windows(spec, live, axes, axis_of, carries, channels)
    picks, scaled = _params(views, value_dims, used, axis_of, len(axes), classes)
    return Domain(classes, axes, value_dims, carries, reduced, view_strides, side,
                  weights, windows, clamped, inner_guard,
                  _bounds(views, value_dims, classes, used), picks, scaled)


def _params(views, value_dims, used, axis_of, rank, classes) -> tuple:
    """(Domain.picks, Domain.scaled) of the views the kernel reads (layout.py
    View.picks and View.scaled): run-time offsets and strides, in kernel parameters,
    which with the derived sizes (View.less: Domain.less) must fit the slots."""
    picks = tuple((r, value_dims[-(v.source + 1)][d], b, stride)
                  for r, v in views.items() if r in used for d, b, stride in v.picks)
    scaled = tuple((r, axis_of[value_dims[r][o]], factor,
                    tuple(value_dims[-(v.source + 1)][d] for d in dims))
                   for r, v in views.items() if r in used for o, factor, dims in v.scaled
                   if value_dims[r][o] in axis_of)     # (a dim of size 1 has no stride)
    n = len(picks) + len(scaled) + sum(len(cl.derived) for cl in classes)
    if rank + 4 + n > MAX_PARAM_SLOT:
        raise Refusal(f"{n} run-time offsets, strides and sizes of views in a kernel of "
                      f"{rank} axes (at most {MAX_PARAM_SLOT} parameter slots)")
    return picks, scaled


def _bounds(views, value_dims, classes, used) -> tuple:
    """Domain.bounds of the bounded views the kernel reads (layout.py View.bounds).  A
    class that met a static dim (the slice added to a tensor of static size) is checked
    here instead, once."""
    out = []
    for r, v in views.items():
        if r not in used:
            continue
        for o, most in v.bounds:
            c = value_dims[r][o]
            size = classes[c].size
            if size < 0:
                out.append((c, most, v.source))
            elif size > most:
                raise Refusal(f"a slice takes {size} elements of a dim that holds {most} "
                              "from its begin (TF's error when it runs)")
    return tuple(out)


def _guard_classes(views, value_dims, used) -> dict:
    """View ref -> ((dim class, bools), ...) of its guards (layout.py View.guards), for
    the guarded views the kernel reads.  Each such class stays an axis of its own
    (step 3), so that the loop index along it is the guard's index."""
    out = {}
    for r, v in views.items():
        if not v.guards or r not in used:
            continue
        cs = [(value_dims[r][o], bits) for o, bits in v.guards]
        if any(c is None for c, _ in cs):   # cannot happen: a guard spans a dim > 1
            raise Refusal("a concatenation or Pad reads a piece outside its range "
                          "along a dimension of size 1")
        out[r] = cs
    return out


def _clamps(guards, axes, axis_of) -> tuple:
    """(Domain.clamped, Domain.inner_guard) of the guarded views.

    On the innermost axis the emitters load a piece only where its guard holds (the
    element loop's index is the guard's); on an outer axis the view's row base is
    computed from its index along that axis, clamped into the piece's range: every
    load then reads the piece's own memory, and the piece selector (a Select, which
    does not propagate its discarded side) drops the values read at clamped rows.
    A guard's in-range indices are one interval (the index map is affine)."""
    clamped, inner = {}, {}
    for r, cs in guards.items():
        for c, bits in cs:
            a = axis_of[c]
            if a == len(axes) - 1:
                inner[r] = bits
                continue
            inside = [i for i, ok in enumerate(bits) if ok]
            if not inside:
                raise Refusal("a Pad of an empty tensor on an axis other than the "
                              "kernel's innermost: no element to read in place of the "
                              "padding")
            clamped.setdefault(r, {})[a] = (inside[0], inside[-1])
    return clamped, inner


def _weights(spec, live, views) -> tuple:
    """The contractions' and windows' weight inputs (steps 4, 5): static kernel inputs
    that no other node reads, not views; and the window inputs (step 5): kernel inputs
    read only by windows, not views (a value computed in the kernel would have to be
    computed at every pixel a window reads: its producer stays a kernel of its own)."""
    weights, windows, other = {}, set(), set()     # weight -> the op reading it
    for k in live:
        n = spec.nodes[k]
        if OPS[n.op].kind in (Kind.CONTRACTION, Kind.WINDOW):
            weights[n.args[1]] = "a SmallMatMul" if OPS[n.op].kind == Kind.CONTRACTION \
                else "a depthwise convolution"
            (windows if OPS[n.op].kind == Kind.WINDOW else other).add(n.args[0])
        else:
            other.update(n.args)
    for w, what in weights.items():
        t = spec.type_of(w)
        if w >= 0 or w in views or w in other or w in windows or any(d < 0 for d in t.shape):
            raise Refusal(f"the weight of {what} ({_name(w)}) must be a kernel "
                          "input of static shape read by nothing else")
    for x in windows:
        if x >= 0:
            raise Refusal(f"a depthwise convolution reads {_name(x)}, computed in the "
                          "same kernel, through its window: its producer stays a kernel "
                          "of its own (a stencil reads its input at other pixels)")
        if x in views or x in other:
            raise Refusal(f"the input of a depthwise convolution ({_name(x)}) is read "
                          "through a layout op or element-wise too: not fused")
    return frozenset(weights), frozenset(windows)


def _window_channels(spec, live, value_dims) -> list:
    """The channel class of each window's output (step 5)."""
    return [value_dims[k][3] for k in live if OPS[spec.nodes[k].op].kind == Kind.WINDOW]


def _check_windows(spec, live, axes, axis_of, carries, channels) -> None:
    """Each window's output spans the domain, its channels the innermost axis alone,
    its pixels static (step 5: the emitter finds the pixel from the row index)."""
    for k, c in zip([k for k in live if OPS[spec.nodes[k].op].kind == Kind.WINDOW],
                    channels):
        shape = spec.nodes[k].type.shape
        if c is None or axis_of.get(c) != len(axes) - 1 or axes[-1].classes != (c,) \
                or carries[k] != tuple(range(len(axes))) or len(axes) < 2:
            raise Refusal(f"a depthwise convolution's output {list(shape)} is not the "
                          "kernel's whole domain with its channels innermost: not fused")


def _side_sizes(classes, value_dims, side_classes, weights) -> dict:
    """ref -> the class of its side dim, for the values that carry a contracted
    class (step 4); refused unless that is their last dim, of static size, and their
    only one."""
    side = {}
    for ref, vd in value_dims.items():
        if ref in weights:
            continue
        at = [i for i, c in enumerate(vd) if c in side_classes]
        if not at:
            continue
        size = classes[vd[at[0]]].size
        if at != [len(vd) - 1] or size < 0:
            raise Refusal(f"{_name(ref)} carries a contracted dimension other than as "
                          "its last, or one known only at run time: a SmallMatMul's "
                          "vector must be [..., K] with K static")
        side[ref] = vd[at[0]]
    return side


def _view_axis_strides(ref, axes, carried, class_stride) -> dict:
    """A view's stride per collapsed axis it carries: its innermost class's (the
    classes of an axis are contiguous in the view's source, _collapse).  A stride
    other than 1 on the innermost axis (a transpose that moves the last dim) is a
    strided load, which only element-wise kernels emit (schedule.py checks the kind);
    its row of lines must stay in cache for the next rows to reuse them."""
    out = {a: class_stride[axes[a].classes[-1]] for a in carried}
    if carried and out[carried[-1]] is None and carried[-1] == len(axes) - 1:
        raise Refusal(f"{_name(ref)} is read along the innermost axis with a stride "
                      "known only at run time")
    if carried and carried[-1] == len(axes) - 1 and out[carried[-1]] != 1:
        n = axes[-1].size
        # a short stride walks lines in order (a slice ::2): no row to keep cached
        if abs(out[carried[-1]]) > LINE_ELEMS and (n < 0 or n > MAX_STRIDED_ROW):
            raise Refusal(f"{_name(ref)} is read through a layout op that moves its "
                          "innermost axis (a transpose of the last dim, a strided slice "
                          "or a reverse of it) over "
                          f"{'a run-time number of' if n < 0 else n} elements: a strided "
                          f"load runs over at most {MAX_STRIDED_ROW}")
    return out


def strided_innermost(dom) -> list:
    """The views read with a stride other than 1 along the innermost axis."""
    last = len(dom.axes) - 1
    return [r for r, st in dom.view_strides.items() if st.get(last, 1) != 1]


def _name(ref: int) -> str:
    return f"input {-ref - 1}" if ref < 0 else f"node {ref}"
