"""Packed kernels: independent element-wise chains of different sizes in one kernel.

An optimizer step updates every variable with the same element-wise formula, but the
variables have different shapes ([32], [864], [9216], [256, 1024] ...), so their
chains share no iteration domain (domain.py packs only chains whose outputs have one
static shape).  Run apart, each is a kernel dispatch of a few microseconds for work
that often takes less.  A *packed* kernel concatenates the chains' flat index spaces
(PyTorch's ``foreach`` / fused Adam, as one launch)::

    segment    0: v[32]        1: v[864]            2: v[9216]
    flat       [0, 32)         [32, 896)            [896, 10112)       T = 10112
    units      ─────────── blocks of cb elements over [0, T) ───────────────────────

A unit [lo, hi) of the flat space runs, for each segment [off, off + n) it overlaps,
that segment's chain over its own elements [lo - off, hi - off) clipped to [0, n):
one loop per segment, each a plain flat element-wise loop (vectorized), each with its
own inputs and outputs.  Values of one element (the learning rate, beta powers, their
casts and products) are computed once per unit, before the segments, and shared.

Which specs pack (``segments`` returns the reason when one does not):
  - no reduction; every shape static (the segment table is a compile-time constant);
  - every value has n elements (its chain's segment size) or one (shared scalar):
    an element-wise op whose operands have its output's element count or one reads
    them at the same flat index (broadcasting can only have added leading 1s), and a
    Reshape only adds or removes size-1 dims (ir/ops.py), so flat order is kept;
  - at least two segments (one is an ordinary element-wise kernel), none of size 1
    among the outputs (a packed kernel's outputs are its chains' vectors).
The segment table is derived here from the validated spec, never read from a graph:
a spec from a file carries no offsets that could point outside a buffer.
"""
from __future__ import annotations

import math

from ..ir.ops import OPS, Kind
from .domain import Axis, DimClass, Domain, Refusal, live_nodes

MAX_SEGMENTS = 256    # arbitrary: the planner's packs stay far below (spec limits)


def _count(t) -> int:
    return math.prod(t.shape)


def segments(spec):
    """``(scalars, [(size, nodes), ...])``: the shared one-element nodes, and per
    segment its element count and nodes (SSA order), segments by first node; or a
    ``str`` saying why ``spec`` is not a packed kernel."""
    live = live_nodes(spec)
    refs = [-(j + 1) for j in range(len(spec.inputs))] + live
    if any(d < 0 for r in refs for d in spec.type_of(r).shape):
        return "a packed kernel needs static shapes"
    if any(OPS[spec.nodes[k].op].kind == Kind.REDUCTION for k in live):
        return "a packed kernel holds no reduction"
    if any(OPS[spec.nodes[k].op].kind == Kind.CONTRACTION for k in live):
        return "a packed kernel holds no SmallMatMul"
    if any(OPS[spec.nodes[k].op].kind == Kind.WINDOW for k in live):
        return "a packed kernel holds no depthwise convolution"
    parent: dict = {}

    def root(v):
        while parent.setdefault(v, v) != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    scalars = [k for k in live if _count(spec.nodes[k].type) == 1]
    vector = [k for k in live if _count(spec.nodes[k].type) != 1]
    for k in vector:                    # chains: vector nodes joined by vector edges
        for a in spec.nodes[k].args:
            if a >= 0 and _count(spec.nodes[a].type) != 1:
                ra, rk = root(a), root(k)
                if ra != rk:
                    parent[max(ra, rk)] = min(ra, rk)
    chains: dict = {}
    for k in vector:
        chains.setdefault(root(k), []).append(k)
    segs = []
    for nodes in chains.values():
        n = _count(spec.nodes[nodes[0]].type)
        for k in nodes:
            bad = [a for a in (k, *spec.nodes[k].args)
                   if _count(spec.type_of(a)) not in (1, n)]
            if bad:
                return (f"a packed chain mixes {n} elements with "
                        f"{_count(spec.type_of(bad[0]))} (only one-element values are "
                        "shared between sizes)")
        segs.append((n, tuple(nodes)))
    if any(_count(spec.nodes[o].type) == 1 for o in spec.outputs):
        return "a packed kernel's outputs are vectors (a one-element output stays apart)"
    if len(segs) < 2:
        return "a packed kernel needs two independent chains"
    if len(segs) > MAX_SEGMENTS:
        return f"{len(segs)} chains in one packed kernel (limit {MAX_SEGMENTS})"
    return tuple(scalars), segs


def domain(spec, total: int, vector_refs) -> Domain:
    """One flat axis of ``total`` elements; vector values carry it, scalars do not.
    (Emitters index a segment's buffers by the segment-local j, never by the flat
    index: the axis only sizes the units.)"""
    refs = [-(j + 1) for j in range(len(spec.inputs))] + list(range(len(spec.nodes)))
    carries = {r: ((0,) if r in vector_refs else ()) for r in refs}
    value_dims = {r: tuple(None for _ in spec.type_of(r).shape) for r in refs}
    return Domain((DimClass(total, ()),), (Axis((0,), total),), value_dims, carries, {})


def plan(spec):
    """(Domain, segment table ((offset, size), ...), per segment its nodes, the
    shared scalar nodes, the refs that are vectors); raises Refusal."""
    got = segments(spec)
    if isinstance(got, str):
        raise Refusal(got)
    scalars, segs = got
    table, off = [], 0
    for n, _ in segs:
        table.append((off, n))
        off += n
    vec = set()
    for n, nodes in segs:
        for k in nodes:
            vec.add(k)
            vec.update(a for a in spec.nodes[k].args if _count(spec.type_of(a)) == n)
    return domain(spec, off, vec), tuple(table), [s for _, s in segs], scalars, vec
