"""A simple, correct planner: greedy region growing in topological order.

For each fusible node n (in topological order):
    1. try n ∪ (all regions of its fusible producers)   — e.g. add + LayerNorm
    2. else n ∪ (one producer region), largest first
    3. else n starts a region of its own
A merge is taken only if it is *legal*: the contracted graph stays acyclic
(``_creates_cycle``) and the schedule stage can generate one kernel for the
merged region (``legal(spec)`` returns None; otherwise a reason).

Regions with fewer than two ops that do work are dropped: one TF op replaced by
one generated kernel saves nothing.  Every memory-intensive op left out ends up in
``Plan.unfused`` with the reason.

(Issue #4 replaces the greedy rule with candidate search + a cost model; this
planner stays as the ``baseline`` for ablations.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..ir import Graph, ValueRef
from . import legality as _fus
from .region import Region, extract

Legal = Callable[["KernelSpec"], "str | None"]


@dataclass
class Plan:
    regions: list = field(default_factory=list)          # list[Region]
    unfused: list = field(default_factory=list)          # list[(node, op, reason)]
    boundaries: list = field(default_factory=list)       # list[(node, reason)] merges refused
    # Filled by the search planner (search.py); empty from this one:
    alternatives: list = field(default_factory=list)     # list[search.KernelChoice] (explain)
    skipped: list = field(default_factory=list)          # [(nodes, reason)] left alone by cost
    notes: list = field(default_factory=list)            # plan-wide remarks for the report


def plan(graph: Graph, legal: Legal, min_ops: int = 2) -> Plan:
    order = {n: i for i, n in enumerate(graph.topo_order())}
    consumers = graph.consumers()
    fetched = set(graph.outputs)
    succ = _successors(graph)
    region_of: dict[str, int] = {}
    regions: dict[int, set] = {}
    result = Plan()
    next_id = 0

    def try_merge(ids, n):
        members = set().union(*(regions[i] for i in ids), {n})
        if _creates_cycle(members, succ, order):
            return None, "merging would create a cycle through an unfused op"
        try:
            reg = extract(graph, list(members), consumers, fetched, order)
        except ValueError as e:
            return None, str(e)
        reason = legal(reg.spec)
        return (members, reason) if reason is None else (None, reason)

    for name in sorted(graph.nodes, key=order.__getitem__):
        node = graph[name]
        if not _fus.is_candidate(graph, node):
            continue
        prod = sorted({region_of[r.node] for r in node.inputs if r.node in region_of},
                      key=lambda i: -len(regions[i]))
        attempts = ([prod] if len(prod) > 1 else []) + [[p] for p in prod]
        chosen = None
        for ids in attempts:
            members, reason = try_merge(ids, name)
            if members is not None:
                chosen = (ids, members)
                break
            result.boundaries.append((name, reason))
        if chosen is None:
            members, reason = try_merge([], name)
            if members is None:
                result.unfused.append((name, node.op, reason))
                continue
            chosen = ([], members)
        ids, members = chosen
        for i in ids:
            del regions[i]
        regions[next_id] = members
        for m in members:
            region_of[m] = next_id
        next_id += 1

    for rid in sorted(regions, key=lambda i: min(order[m] for m in regions[i])):
        members = regions[rid]
        work = [m for m in members if _fus.work(graph[m])]
        if sum(_fus.work(graph[m]) for m in work) < min_ops:
            for m in work:
                result.unfused.append((m, graph[m].op,
                                       "a lone op: fusing it alone saves nothing"))
            continue
        result.regions.append(extract(graph, list(members), consumers, fetched, order))
    return result


def _successors(graph: Graph) -> dict:
    succ = {n: set() for n in graph.nodes}
    for n in graph:
        for p in graph.predecessors(n.name):
            succ[p].add(n.name)
    return succ


def _creates_cycle(members: set, succ: dict, order: dict) -> bool:
    """True if some node outside ``members`` is both reachable from and reaches it.

    Only nodes between the region's first and last topological positions can be
    on such a path, which bounds the search.
    """
    hi = max(order[m] for m in members)
    stack = [s for m in members for s in succ[m] if s not in members and order[s] < hi]
    seen = set(stack)
    while stack:
        v = stack.pop()
        for s in succ[v]:
            if s in members:
                return True
            if s not in seen and order[s] < hi:
                seen.add(s)
                stack.append(s)
    return False
