"""Layout ops folded into loads: Transpose, Slice, ConcatV2, Pack, Pad and Reverse as
index maps.

FusionStitching and XLA call these ops *injective*: each output element is one input
element, found by an index map from the output index, with no arithmetic.  A kernel
never materializes them; this pass rewrites a spec so that every layout op disappears
into the indexing of the values that read it (XLA's elemental emitters do the same):

    y = x[:, :, :, :32]   ->  a *view* of kernel input x: its own shape [B,T,H,32],
                              strides (T*H*64, H*64, 64, 1), offset 0
    z = transpose(x + b)  ->  transpose(x) + transpose(b): the element-wise node is
                              evaluated again in z's index space (recomputed), each
                              argument read through the composed map
    c = concat([-x2, x1]) ->  select(piece0(i), -view2(i), view1(i)): each piece read
                              in c's index space, shifted by its offset; the piece an
                              index belongs to is a small constant bool table over the
                              concatenated axis (a view too, of no input)
    p = pad(f(x), lo, hi) ->  select(inside(i), f(view(i - lo)), value): a concatenation
                              of constant pieces around x (the gradient of a Slice)
    r = reverse(x, axis)  ->  a view whose stride along the axis is negative

Gradients are layout ops too: a Transpose's is a Transpose, a Slice's a Pad, a
strided slice's a Pad with a size-1 axis after each strided one and a Reshape TF runs
(tf/passes/strided_grad.py), a constant-index gather's a sum of padded strided slices
(the SegmentSum composite, ir/composites.py): no scatter reaches this pass.

Maps compose (a slice of a transpose of a kernel input is one view), and an element-wise
value read in two index spaces is computed in both: folding a layout op means
*recomputing what it reads* in its index space.  That is the cheap end of the ladder for
the ops that reach here (rotary embeddings' half-splits and concatenations, head
transposes): each folded op saves a full read and write of its tensor, and what is
recomputed is a few element-wise ops on values the kernel loads anyway.  Where the
value is expensive (a chain of transcendentals) and the kernel evaluates it anyway,
directly or through another map (a rotate-half evaluates each piece over the whole
axis), the lowering records what the fold evaluates again (``Recompute``, on the
LoweredSpec) and the planner weighs it against computing the value once and
*reloading* it: one kernel ends at the value, the next reads it through the view
(plan/cost.py, reuse_reason; the report names the choice where it cuts).  The third
choice, the layout op *computed* as a tensor of its own, is what happens where nothing
fuses with it (TF's op).  Computing the value once into scratch inside one kernel and
re-reading it through the map would need a second domain; it is not done.

A view is affine: ``source element = offset + sum(i[d] * strides[d])`` over the view's
dims.  The emitters need nothing new but the view's strides and offset: a view is a
kernel input whose pointer is the source's (or the table's), strides are constants
instead of products of the domain's sizes (or, where they depend on dims known only at
run time, kernel parameters the shape function computes), and the domain (domain.py)
keeps the axes where a view's strides are not contiguous apart.

What stays out, with the reason the report shows (``Refusal``):
  - a layout op over a reduction or any other non-element-wise value (its input would
    have to be computed in another index space, a second domain);
  - a view that reads a dim known only at run time other than whole or from a begin b
    to c elements short of the whole (``x[:, -3:]``, ``x[:, ::2]``), or at an offset
    with a run-time stride (``x[1:, 1:]``).  What does fold: the rest of such a dim
    less c (``x[:, 1:]``, ``x[:, :-1]``, View.less: a dim class of extent
    max(n - c, 0), as StridedSlice clamps, that the shape function computes from n,
    with the map entries' ``drop``), one element of such a dim (``x[:, -1]``,
    View.picks: an offset from the end and the check that the element exists, in the
    shape function), strides that depend on such dims on outer axes (View.scaled:
    kernel parameters; on the innermost axis a load would stride by a run-time
    amount: refused in domain.py),
    and a static dim read to a run-time extent (a position table cut to the sequence
    length, ops.RUN_TIME_COUNT: View.bounds, checked by the shape function; a backward
    or strided-from-outside read is refused, _most);
  - a concatenation or Pad on the innermost axis read in a column reduction (its loops
    index columns from a block start).  Every piece is evaluated at every index of the
    concatenated axis (the table selects afterwards); a piece's loads outside its own
    range (View.guards) are skipped by the innermost loop's index on the innermost
    axis, and on an outer axis the piece's row index is clamped into its range
    (domain.py, Domain.clamped: the load reads a row of the piece that the Select then
    drops), on as many axes as a view is guarded along (a Pad of H and W);
  - a Reverse of the innermost axis (a negative innermost stride: domain.py);
  - a view that moves the innermost axis (the emitters load the innermost axis
    contiguously): checked in domain.py, where the innermost axis is known.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..ir.graph import TensorType
from ..ir.ops import INDEX_MAPS, MAX_SHIFT, OPS, Kind, infer, rest_drop, slice_sizes
from ..ir.spec import KernelSpec, SpecNode
from .domain import Refusal, live_nodes

MAX_TABLE = 1 << 16     # arbitrary: a concatenated axis longer than this stays a TF op
_NONE = (-1, 0, 0, 0)   # a map entry: this value dim's index is a constant (0 here)


@dataclass(frozen=True)
class View:
    """A kernel input read through an affine index map (see the module docstring).

    ``source`` is the real input read (its position), or -1 for a constant bool
    ``table`` (a concatenation's piece selector).  ``strides[d]`` is the source element
    stride of view dim d (0 where the view broadcasts), ``offset`` the source element at
    index 0, ``src_dims[d]`` the source dim that view dim d covers whole (so the two are
    one dim class, checked at run time), or None where its size is static."""
    source: int
    strides: tuple
    offset: int
    src_dims: tuple
    table: tuple = ()
    # A concatenation's piece read over the whole concatenated axis leaves its tensor
    # at the other pieces' indices (rotate-half: -x[i + h] for i < h, x[i - h] after):
    # ``guards`` = ((view dim, bools), ...) say where along each such dim the load is
    # in range.  On the kernel's innermost axis the emitters load only there (0
    # elsewhere, which the piece selector discards); on an outer axis the index is
    # clamped into that range (domain.py, Domain.clamped), so the load reads a row the
    # selector discards.
    guards: tuple = ()
    # A slice of a static dim to a count known only at run time (ir/ops.py
    # RUN_TIME_COUNT: a position table cut to a sequence length): ``bounds`` =
    # ((view dim, most elements), ...), the view's run-time extent along each such dim
    # and the most it may be without reading past its source; the kernel's shape
    # function checks it (domain.py, Domain.bounds), as TF's Slice checks its size.
    bounds: tuple = ()
    # One element of a source dim known only at run time (``x[:, -1]``, the last token's
    # logits at an unknown sequence length): ``picks`` = ((source dim, index, stride),
    # ...); index b >= 0 is element b (in ``offset``), b < 0 element n + b, whose
    # (n + b) * stride the shape function adds to the offset at run time (a kernel
    # parameter, Domain.picks); it checks the element exists (n >= b + 1, n >= -b).
    picks: tuple = ()
    # Strides known only at run time: a view of x[B, S, V] that does not read S whole
    # (``x[:, -1]``) steps S * V elements along B.  ``scaled`` = ((view dim, factor,
    # source dims), ...): the stride along that view dim is factor times the run-time
    # sizes of those source dims (its ``strides`` entry is 0), a kernel parameter that
    # the shape function computes (Domain.scaled).
    scaled: tuple = ()
    # The rest of a source dim known only at run time less c elements (``x[:, 1:]``,
    # ``x[:, :-1]``: ops.rest_size): ``less`` = ((view dim, source dim, c), ...); the
    # view dim's extent is max(n - c, 0) for the source dim's run-time size n, a dim
    # class the shape function computes (Domain.less), read from offset b <= c (in
    # ``offset``), so no load passes the source's end.
    less: tuple = ()


@dataclass(frozen=True)
class Recompute:
    """What folding one layout op costs in arithmetic: the element-wise nodes it
    evaluates again in its own index space although the kernel evaluates them already
    (in their own index space, or through another map).  ``layout`` is the op, of
    output ``shape``; ``ops`` = ((op name, type, share), ...) the extra evaluations,
    each over that share of its type's elements; ``values`` the types, in their own
    index space, of the values that, computed once and written by an earlier kernel,
    would end the recomputation (the topmost recomputed nodes).  The planner prices
    the two (plan/cost.py, reuse_reason)."""
    layout: str
    shape: tuple
    ops: tuple
    values: tuple

    @property
    def where(self) -> str:
        """The layout op, for the report: "ConcatV2 of [?,32,4,64]"."""
        return f"{self.layout} of {_fmt(self.shape)}"


@dataclass(frozen=True)
class LoweredSpec(KernelSpec):
    """A spec whose layout ops were folded into views: ``inputs`` are the original
    inputs followed by one per view (``views``, in order).  What the schedule and the
    emitters see; the original spec is what graphs carry and caches key on.
    ``recomputed``: a Recompute per layout op whose fold evaluates element-wise nodes a
    second time."""
    views: tuple = ()
    origin: str = ""
    recomputed: tuple = ()
    _hash: str = field(default="", compare=False)

    @property
    def hash(self) -> str:
        return self._hash

    @property
    def n_real(self) -> int:
        return len(self.inputs) - len(self.views)

    def view_of(self, j: int):
        """The View of input position j, or None for a real input."""
        v = j - self.n_real
        return self.views[v] if v >= 0 else None


def has_layout(spec) -> bool:
    return any(n.op in INDEX_MAPS for n in spec.nodes)


def lower(spec) -> KernelSpec:
    """``spec`` with its layout ops folded into views (a LoweredSpec), or ``spec``
    itself when it has none; raises Refusal naming what cannot be folded."""
    if not has_layout(spec):
        return spec
    return _Lowering(spec).run()


def row_major_strides(shape) -> list:
    """Element strides of a row-major array; None where a dim inside is unknown."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc = None if acc is None or d < 0 else acc * d
    return out[::-1]


class _Lowering:
    def __init__(self, spec):
        self.spec = spec
        self.n_in = len(spec.inputs)
        self.nodes: list = []
        # per new node: (the original node it evaluates, or -1; the layout op in whose
        # index space it is, or -1 for the node's own)
        self.source: list = []
        self.under = -1
        self.views: list = []
        self.view_types: list = []
        self._view_at: dict = {}        # (view, type) -> its input ref (_add_view)
        self.value: dict = {}       # original ref -> new ref (its own index space)
        self.memo: dict = {}
        # remapping a FillLike's argument through index maps: only its shape is read
        # (a view at a constant index of a dim known only at run time is never loaded)
        self.shape_only = False

    # -- driver -----------------------------------------------------------------------
    def run(self) -> LoweredSpec:
        spec = self.spec
        live = live_nodes(spec)
        reader_ops: dict = {}       # node -> the ops of the live nodes that read it
        for r in live:
            for a in spec.nodes[r].args:
                reader_ops.setdefault(a, set()).add(spec.nodes[r].op)
        for k in live:
            n = spec.nodes[k]
            if n.op in INDEX_MAPS:
                shape = n.type.shape
                ident = tuple((d, 1, 0, 0) for d in range(len(shape)))
                self.under = k
                # read only by FillLike nodes, for its shape (composites.py)
                for_shape = k not in spec.outputs and reader_ops.get(k) == {"FillLike"}
                r = self._shape_only(for_shape, k, ident, shape)
                self.under = -1
                got = self.type_of(r).shape
                if got != shape:
                    raise Refusal(f"{n.op} of {_fmt(spec.type_of(n.args[0]).shape)} "
                                  f"broadcasts its pieces ({_fmt(got)}, not "
                                  f"{_fmt(shape)}): not fused yet")
                self.value[k] = r
            else:
                args = tuple(self.value_of(a) for a in n.args)
                self.nodes.append(SpecNode(n.op, args, n.attrs, n.type))
                self.source.append((k, -1))
                self.value[k] = len(self.nodes) - 1
        outputs = []
        for o in spec.outputs:
            r = self.value[o]
            if r < 0 or r in outputs:          # a bare view (or a repeat) needs a node
                r = self.emit("Identity", [r], {})
            outputs.append(r)
        return self.compact(outputs)

    def compact(self, outputs) -> LoweredSpec:
        """Drop what no output reads (the values of the layout ops' inputs in their own
        index space, views only they read) and renumber."""
        live = set(outputs)
        for k in range(len(self.nodes) - 1, -1, -1):
            if k in live:
                live.update(a for a in self.nodes[k].args if a >= 0)
        keep = sorted(live)
        read = sorted({-a - 1 for k in keep for a in self.nodes[k].args
                       if -a - 1 >= self.n_in})
        ref = {k: i for i, k in enumerate(keep)}
        ref.update({-(j + 1): -(self.n_in + i + 1) for i, j in enumerate(read)})
        new = lambda a: a if -a - 1 < self.n_in and a < 0 else ref[a]   # noqa: E731
        nodes = tuple(SpecNode(n.op, tuple(new(a) for a in n.args), n.attrs, n.type)
                      for n in (self.nodes[k] for k in keep))
        views = tuple(self.views[j - self.n_in] for j in read)
        types = tuple(self.view_types[j - self.n_in] for j in read)
        digest = hashlib.sha256((self.spec.hash + repr(views)).encode()).hexdigest()[:24]
        return LoweredSpec(tuple(self.spec.inputs) + types, nodes,
                           tuple(ref[o] for o in outputs), dict(self.spec.schedule),
                           self.spec.same_dims, views=views, origin=self.spec.hash,
                           recomputed=self.recomputed(keep, set(outputs)), _hash=digest)

    def recomputed(self, keep: list, outputs: set) -> tuple:
        """A Recompute per layout op whose copies (``keep``: the live new nodes) of an
        original node evaluate more elements than the node has: the copy in its own
        index space first, then the layout ops' copies in order, each counting beyond
        what the ones before it used up.  Two slices of disjoint halves evaluate each
        element once; a concatenation's pieces are evaluated over the whole axis (the
        table selects afterwards), so rotate-half of a value evaluates it twice."""
        copies: dict = {}
        for i in keep:
            k, under = self.source[i]
            if k >= 0:
                copies.setdefault(k, []).append((under, i))
        extra: dict = {}                 # layout node -> [(new node, extra share)]
        for k, cs in copies.items():
            left = _count(self.spec.nodes[k].type)
            for under, i in sorted(cs):
                n = _count(self.nodes[i].type)
                over = n - max(0, left)
                left -= n
                if over > 0:
                    extra.setdefault(under, []).append((i, over / n))
        out = []
        for layout, got in sorted(extra.items()):
            mine = {i for i, _ in got}
            read_by_others = {a for i in keep if i not in mine
                              for a in self.nodes[i].args} | outputs
            tops = sorted({self.source[i][0] for i in mine if i in read_by_others})
            out.append(Recompute(
                self.spec.nodes[layout].op, self.spec.nodes[layout].type.shape,
                tuple((self.nodes[i].op, self.nodes[i].type, share) for i, share in got),
                tuple(self.spec.nodes[k].type for k in tops)))
        return tuple(out)

    def value_of(self, ref: int) -> int:
        return ref if ref < 0 else self.value[ref]

    def type_of(self, r: int) -> TensorType:
        if r >= 0:
            return self.nodes[r].type
        j = -r - 1
        return self.spec.inputs[j] if j < self.n_in else self.view_types[j - self.n_in]

    def emit(self, op: str, args: list, attrs: dict, source: int = -1) -> int:
        """A new node (``source``: the original node it evaluates, if any)."""
        d = OPS[op]
        attrs = d.validate_attrs(attrs)
        try:
            t = infer(op, attrs, [self.type_of(a) for a in args])
        except ValueError as e:            # cannot happen for maps built here
            raise Refusal(f"folding a layout op: {e}") from None
        self.nodes.append(SpecNode(op, tuple(args), attrs, t))
        self.source.append((source, self.under))
        return len(self.nodes) - 1

    # -- remap: the value of ``ref`` at index M(i), for i over ``shape`` ------------------
    def remap(self, ref: int, M: tuple, shape: tuple) -> int:
        """M has one entry per dim of ``ref``: (out dim o, step, begin, drop), meaning
        index begin + step * i[o] (o = -1: the constant begin); ``drop``: along a dim
        known only at run time, the index space's extent there is this dim's less drop
        elements (x[:, 1:] reads x's dim n over n - 1 indices, View.less).  The layout node being
        lowered has no value yet, so it is always remapped through its own map."""
        t = self.spec.type_of(ref)
        M = tuple(_NONE if n == 1 else m for n, m in zip(t.shape, M))
        key = (ref, M, shape, self.shape_only)
        if key in self.memo:
            return self.memo[key]
        ident = len(shape) == len(t.shape) and all(
            m == (d, 1, 0, 0) or n == 1 for d, (m, n) in enumerate(zip(M, t.shape))) and \
            all(a == b or b == 1 for a, b in zip(shape, t.shape))
        if ident and (ref < 0 or ref in self.value):
            r = self.value_of(ref)
        elif ref < 0:
            r = self.view(-ref - 1, M, shape)
        else:
            r = self.remap_node(ref, M, shape)
        self.memo[key] = r
        return r

    def remap_node(self, k: int, M: tuple, shape: tuple) -> int:
        n = self.spec.nodes[k]
        if n.op in INDEX_MAPS:
            return getattr(self, "map_" + n.op.lower())(n, M, shape)
        if n.op == "Reshape":
            x = self.spec.type_of(n.args[0]).shape
            return self.remap(n.args[0], _reshape_map(x, n.type.shape, M), shape)
        if n.op == "FillLike":
            # a uniform value in its argument's shape: keep reading that shape (a Tile
            # broadcasting to a run-time batch gets its size from there, composites.py)
            # where the argument folds into a view, else a constant
            try:
                arg = self._shape_only(True, n.args[0], M, shape)
            except Refusal:
                return self.emit("Const", [], {"value": n.attrs["value"],
                                               "dtype": n.type.dtype,
                                               "shape": [1] * len(shape)})
            return self.emit("FillLike", [arg], n.attrs)
        if n.op == "Const":
            # a uniform value; its non-1 dims (the ones a broadcasting Tile multiplies
            # by) keep their extent in the new index space
            out = [1] * len(shape)
            for (o, _, _, _), size in zip(M, n.type.shape):
                if o >= 0 and size != 1:
                    out[o] = shape[o]
            return self.emit("Const", [], {"value": n.attrs["value"],
                                           "dtype": n.type.dtype, "shape": out})
        if OPS[n.op].kind != Kind.ELEMENTWISE:
            raise Refusal(f"a {n.op} result is read through a layout op: layout ops are "
                          "folded into the loads of kernel inputs and element-wise "
                          "values only")
        out = n.type.shape
        args = []
        for a in n.args:            # computed, so its arguments are loaded
            s = self.spec.type_of(a).shape
            off = len(out) - len(s)
            args.append(self._shape_only(False, a, tuple(M[i + off] for i in range(len(s))),
                                         shape))
        return self.emit(n.op, args, n.attrs, source=k)

    def _shape_only(self, flag: bool, ref: int, M: tuple, shape: tuple) -> int:
        """remap with ``shape_only`` set to ``flag`` (restored after)."""
        saved, self.shape_only = self.shape_only, flag
        try:
            return self.remap(ref, M, shape)
        finally:
            self.shape_only = saved

    # -- the index maps -----------------------------------------------------------------
    def map_transpose(self, n, M, shape):
        perm = n.attrs["perm"]
        Mx = [_NONE] * len(perm)
        for d, p in enumerate(perm):       # output dim d is input dim perm[d]
            Mx[p] = M[d]
        return self.remap(n.args[0], tuple(Mx), shape)

    def map_slice(self, n, M, shape):
        x = self.spec.type_of(n.args[0]).shape
        a = n.attrs
        sizes = slice_sizes(x, a["begin"], a["size"], a["strides"])
        Ms = _reshape_map(sizes, n.type.shape, M)      # node index -> sliced index
        Mx = []
        for (o, step, b, c), begin, k, stride in zip(Ms, a["begin"], a["size"],
                                                     a["strides"]):
            if rest_drop(k) is not None:    # the rest of a run-time dim, less e at its
                c += begin + rest_drop(k)   # end: the index space drops begin + e more
            Mx.append((o, stride * step, begin + stride * b, c) if o >= 0
                      else (-1, 0, begin + stride * b, 0))
        return self.remap(n.args[0], tuple(Mx), shape)

    def map_concatv2(self, n, M, shape):
        axis = n.attrs["axis"]
        sizes = [self.spec.type_of(a).shape[axis] for a in n.args]
        pieces = []
        off = 0
        for a, m in zip(n.args, sizes):
            Mp = list(M)
            o, step, b, c = M[axis]
            Mp[axis] = (o, step, b - off, c) if o >= 0 else (-1, 0, b - off, 0)
            pieces.append((a, tuple(Mp), off, m))
            off += m
        return self.select(pieces, M[axis], shape)

    def map_pack(self, n, M, shape):
        axis = n.attrs["axis"]
        Mp = M[:axis] + M[axis + 1:]
        pieces = [(a, Mp, p, 1) for p, a in enumerate(n.args)]
        return self.select(pieces, M[axis], shape)

    def map_reverse(self, n, M, shape):
        x = self.spec.type_of(n.args[0]).shape
        Mx = list(M)
        for d in n.attrs["axes"]:       # index n-1-i: the step turns around
            o, step, b, c = M[d]
            Mx[d] = (o, -step, x[d] - 1 - b, c) if o >= 0 else (-1, 0, x[d] - 1 - b, 0)
        return self.remap(n.args[0], tuple(Mx), shape)

    def map_pad(self, n, M, shape):
        """x shifted by each dim's ``lo``; where an index falls in the padding, the
        value: a select over a constant bool table per padded dim (as a
        concatenation's pieces), x's loads there guarded (View.guards)."""
        x = self.spec.type_of(n.args[0]).shape
        p, value = n.attrs["paddings"], n.attrs["value"]
        const = self.emit("Const", [], {"value": value, "dtype": n.type.dtype,
                                        "shape": [1] * len(shape)})
        Mx, inside = [], []
        for d, (o, step, b, c) in enumerate(M):
            lo = p[2 * d]
            if o < 0:
                if not 0 <= b - lo < max(x[d], 1):
                    return const                 # a constant index into the padding
                Mx.append((-1, 0, b - lo, 0))
                continue
            Mx.append((o, step, b - lo, c))
            if p[2 * d] or p[2 * d + 1]:
                inside.append((o, tuple(0 <= b - lo + step * i < x[d]
                                        for i in range(shape[o]))))
        acc = self.remap(n.args[0], tuple(Mx), shape)
        for o, bits in inside:
            if len(bits) > MAX_TABLE:
                raise Refusal(f"a padded axis of {len(bits)} elements (limit {MAX_TABLE})")
            if not all(bits):
                acc = self.emit("Select", [self.table(bits, o, len(shape)), acc, const], {})
        return acc

    def select(self, pieces, entry, shape):
        """The value of a concatenation: pieces = [(ref, map, offset, size)] along an
        axis whose index is ``entry`` = (o, step, begin, drop) of the output index."""
        o, step, b, _ = entry
        n = shape[o] if o >= 0 else 1
        if o >= 0 and n < 0:
            raise Refusal("a concatenation whose axis is read at run-time positions")
        if n > MAX_TABLE:
            raise Refusal(f"a concatenated axis of {n} elements (limit {MAX_TABLE})")
        # an index outside the concatenation (a Pad of it read in its padding, which
        # the Pad's own select discards) reads the first or last piece out of its range
        # too: that piece's loads there are guarded or clamped like any view's
        end = pieces[-1][2] + pieces[-1][3]
        pid = [next((p for p, (_, _, off, m) in enumerate(pieces) if off <= k < off + m),
                    0 if k < 0 else len(pieces) - 1)
               for k in (min(max(b + step * i, -1), end) for i in range(n))]
        used = sorted(set(pid))
        if len(used) == 1 or o < 0:
            p = used[0]
            return self.remap(pieces[p][0], pieces[p][1], shape)
        acc = self.remap(pieces[used[-1]][0], pieces[used[-1]][1], shape)
        for p in reversed(used[:-1]):
            cond = self.table(tuple(x == p for x in pid), o, len(shape))
            acc = self.emit("Select", [cond, self.remap(pieces[p][0], pieces[p][1], shape),
                                       acc], {})
        return acc

    # -- views ----------------------------------------------------------------------------
    def _add_view(self, view: View, t: TensorType) -> int:
        # one input per distinct view *and shape*: a slice's own view and the same
        # map read over a concatenation's longer axis (a gather's runs) are two inputs
        ref = self._view_at.get((view, t))
        if ref is None:
            self.views.append(view)
            self.view_types.append(t)
            ref = self._view_at[(view, t)] = -(self.n_in + len(self.views))
        return ref

    def table(self, values: tuple, o: int, rank: int) -> int:
        strides = tuple(1 if d == o else 0 for d in range(rank))
        shape = tuple(len(values) if d == o else 1 for d in range(rank))
        return self._add_view(View(-1, strides, 0, (None,) * rank, values),
                              TensorType("bool", shape))

    def view(self, j: int, M: tuple, shape: tuple) -> int:
        """Input j read at M(i) over ``shape`` (see remap)."""
        src = self.spec.inputs[j].shape
        st = row_major_strides(src)
        strides, offset = [0] * len(shape), 0
        vshape = [1] * len(shape)
        src_dims = [None] * len(shape)
        guards, bounds, picks, scaled, less = [], [], [], [], []
        for d, ((o, step, b, c), size) in enumerate(zip(M, src)):
            if size == 1:
                continue
            # (a view read only for its shape takes stride 0 there: never loaded)
            if st[d] is None and (step or b) and not self.shape_only:
                if o < 0 or b or any(g == o for g, _, _ in scaled):
                    raise Refusal(f"input {j} of {_fmt(src)} is read through a layout "
                                  f"op at an offset along dim {d}, and dims after it are "
                                  "known only at run time (the offset would not be a "
                                  "constant)")
                later = range(d + 1, len(src))
                factor = step
                for k in later:
                    factor *= max(src[k], 1)
                scaled.append((o, factor, tuple(k for k in later if src[k] < 0)))
            if o < 0:
                if size < 0 and not self.shape_only:
                    picks.append((d, b, st[d] or 0))
                    offset += max(b, 0) * (st[d] or 0)
                    continue
                if not self.shape_only and not 0 <= b < size:
                    raise Refusal(f"input {j} of {_fmt(src)} would be read at index {b} "
                                  f"of dim {d}")
                offset += b * (st[d] or 0)
                continue
            n = shape[o]
            whole = (step, b, c) == (1, 0, 0) and (n == size)
            if size < 0 and not whole:
                if n >= 0 or step != 1 or not 0 <= b <= c <= MAX_SHIFT:
                    raise Refusal(f"input {j} of {_fmt(src)}: dim {d}, known only at run "
                                  "time, is read by a layout op other than whole or from "
                                  "a begin to an end counted from its end (x[:, 1:], "
                                  "x[:, :-1]; not reversed, strided, or from the end)")
                less.append((o, d, c))
            if n < 0 and size >= 0:
                bounds.append((o, _most(d, size, step, b, j, src)))
            elif n > 0 and size >= 0 and not (0 <= b < size and 0 <= b + step * (n - 1)
                                                < size):
                if n > MAX_TABLE:
                    raise Refusal(f"input {j} of {_fmt(src)} is read outside its range "
                                  f"along an axis of {n} elements (limit {MAX_TABLE})")
                if any(g == o for g, _ in guards):      # a diagonal: one clamp per axis
                    raise Refusal(f"input {j} of {_fmt(src)} is read outside the ranges "
                                  "of two of its dims along one axis: not fused")
                guards.append((o, tuple(0 <= b + step * i < size for i in range(n))))
            strides[o] += step * (st[d] or 0)
            offset += b * (st[d] or 0)
            vshape[o] = n
            if whole:
                src_dims[o] = d
        if tuple(vshape) == tuple(src) and offset == 0 and not picks and not scaled and \
                not less and \
                tuple(strides) == tuple(s if n != 1 else 0 for s, n in
                                        zip(row_major_strides(src), src)):
            return -(j + 1)                    # the input itself
        for o, n in enumerate(vshape):
            if n == 1:
                strides[o] = 0
        scaled = [e for e in scaled if vshape[e[0]] != 1]
        if any(strides[o] for o, _, _ in scaled):        # a diagonal: not a product
            raise Refusal(f"input {j} of {_fmt(src)} is read along one axis through two "
                          "of its dims, one with a stride known only at run time")
        return self._add_view(View(j, tuple(strides), offset, tuple(src_dims), (),
                                   tuple(guards), tuple(bounds), tuple(picks),
                                   tuple(scaled), tuple(less)),
                              TensorType(self.spec.inputs[j].dtype, tuple(vshape)))


def _most(d, size, step, b, j, src) -> int:
    """The most indices i along a view dim of run-time extent for which b + step * i
    stays inside dim d (of static ``size``) of input j: what the shape function checks
    the extent against."""
    if step < 1 or not 0 <= b < size:
        raise Refusal(f"input {j} of {_fmt(src)}: dim {d} is read at run-time positions "
                      f"from {b} in steps of {step}: only forward slices from inside "
                      "the dim are checked")
    return (size - 1 - b) // step + 1


def _reshape_map(x_shape, y_shape, M):
    """Map for the input of a size-1 reshape (x -> y) from the map M of its output:
    non-1 dims pair up in order; x's size-1 dims are index 0."""
    ys = iter(m for m, d in zip(M, y_shape) if d != 1)
    return tuple(_NONE if d == 1 else next(ys) for d in x_shape)


def _count(t: TensorType) -> int:
    """Elements of a type, a dim known only at run time counted once: such dims are
    read whole (View), so every copy of a value has the same ones and they cancel."""
    n = 1
    for d in t.shape:
        n *= max(d, 1)
    return n


def _fmt(shape) -> str:
    return "[" + ",".join("?" if d < 0 else str(d) for d in shape) + "]"

