"""A simple, correct planner: greedy region growing in topological order.

For each fusible node n (in topological order):
    1. try n ∪ (all regions of its fusible producers)   — e.g. add + LayerNorm
    2. else n ∪ (one producer region), largest first
    3. else n starts a region of its own
A merge is taken only if it is *legal*: the contracted graph stays acyclic
(``acyclic.Reach.convex``) and the schedule stage can generate one kernel for the
merged region (``legal(spec)`` returns None; otherwise a reason).

Regions with fewer than two ops that do work are dropped: one TF op replaced by
one generated kernel saves nothing.  Every memory-intensive op left out ends up in
``Plan.unfused`` with the reason.

(Issue #4 replaces the greedy rule with candidate search + a cost model; this
planner stays as the ``baseline`` for ablations.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..ir import Graph
from . import legality as _fus
from . import profiles
from .acyclic import Reach, indexed, mask_of
from .region import extract

if TYPE_CHECKING:
    from ..ir.spec import KernelSpec

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
    profile = profiles.default()
    names, order, succ = indexed(graph)
    reach = Reach(succ)
    consumers = graph.consumers()
    fetched = set(graph.outputs)
    region_of: dict[str, int] = {}
    regions: dict[int, set] = {}
    result = Plan()
    next_id = 0

    def try_merge(ids, n):
        members = set().union(*(regions[i] for i in ids), {n})
        idx = {order[m] for m in members}
        if not reach.convex(idx, mask_of(idx)):
            return None, "merging would create a cycle through an unfused op"
        try:
            reg = extract(graph, list(members), consumers, fetched, order)
        except ValueError as e:
            return None, str(e)
        reason = legal(reg.spec) or _fus.backend_reason(reg.spec, profile)
        return (members, reason) if reason is None else (None, reason)

    for name in names:
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
