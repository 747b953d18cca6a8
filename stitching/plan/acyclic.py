"""Cycle-freedom by reachability bitsets.

A set of nodes may become one kernel only if no path leaves it and comes back (it is
*convex*); a plan of several kernels only if the graph with every kernel contracted to one
vertex stays acyclic.  Once every vertex knows the set of nodes it reaches (a Python int
used as a bitset over topological indices), both questions are a few big-int ANDs:

    reach[v] = ⋃ over successors s of v: {s} ∪ reach[s]         one reverse-topological sweep

    convex(P)        ⇔  no successor s ∉ P of P has reach[s] ∩ P ≠ ∅
    merge(G1..Gk)    ⇔  no successor group S ∉ {G1..Gk} of M = ⋃Gi has (S ∪ reach[S]) ∩ M ≠ ∅
    after merging M  every ancestor A of M gets reach[A] |= M ∪ reach[M]

        a ──▶ m (opaque) ──▶ d        {a, d} is not convex: a's successor m reaches d;
        └──────────────────▲          kernel(a, d) would both feed and read m.

This answers convexity without a walk (both planners use it), and extends it to already-contracted groups, which a node-level walk cannot
see: two convex groups can still form a cycle between them (A → B and B → A through
different members).  Memory is one bitset per vertex: n²/8 bytes at worst (0.5 MB for
2,000 nodes).  Edges are data and control edges.

Why hand-written and not networkx (the project's graph library, used by the tests'
oracles and the layering check): measured by ``tools/acyclic_bench.py`` on the ~2,000
node plan-bench graphs, CPU time, this 2-core machine:

    reachability of every vertex    bitsets 0.3 ms    nx.transitive_closure_dag 12-1700 ms
    2,000 convexity queries         bitsets 2.3 ms    nx.descendants walks 40-2000 ms
    topological order (ir/graph.py) Kahn    0.45 ms   nx.topological_sort 0.9-1.2 ms

The planner asks these questions hundreds of times per graph against a 1 s budget for
2,000 nodes (tools/plan_bench.py), so the bitsets stay.
"""
from __future__ import annotations

from ..ir.graph import kahn_order


def indexed(graph):
    """The graph in index form: topological names, name -> index, and each vertex's
    successors (data and control edges) as sorted index tuples."""
    names = graph.topo_order()
    order = {n: i for i, n in enumerate(names)}
    succ = [set() for _ in names]
    for n in graph:
        for p in graph.predecessors(n.name):
            succ[order[p]].add(order[n.name])
    return names, order, [tuple(sorted(x)) for x in succ]


class Reach:
    """Reachability over a DAG whose vertices are 0..n-1 in topological order."""

    def __init__(self, succ: list):
        self.succ = succ
        reach = [0] * len(succ)
        for v in range(len(succ) - 1, -1, -1):
            r = 0
            for s in succ[v]:
                r |= (1 << s) | reach[s]
            reach[v] = r
        self.reach = reach

    def convex(self, members, mask: int) -> bool:
        """True if no path leaves ``members`` (bitset ``mask``) and re-enters it."""
        reach, succ = self.reach, self.succ
        for v in members:
            for s in succ[v]:
                if s not in members and reach[s] & mask:
                    return False
        return True


def mask_of(members) -> int:
    m = 0
    for v in members:
        m |= 1 << v
    return m


class Contraction:
    """Kernels as contracted vertices: may these groups merge, and merge them.

    Group ids: a node not in any group is its own group (id = its index); the groups given
    to the constructor get ids n, n+1, ...  Raises CycleError naming the groups that could
    not be ordered if the contracted graph already has a cycle.
    """

    def __init__(self, succ: list, groups: list):
        n = len(succ)
        self.group_of = list(range(n))
        self.members = {v: (v,) for v in range(n)}
        for j, g in enumerate(groups):
            gid = n + j
            for v in g:
                del self.members[v]
                self.group_of[v] = gid
            self.members[gid] = tuple(sorted(g))
        self.mask = {g: (1 << m[0]) if len(m) == 1 else mask_of(m)
                     for g, m in self.members.items()}
        self.gsucc = {g: set() for g in self.members}
        self.gpred = {g: set() for g in self.members}
        for v, ss in enumerate(succ):
            a = self.group_of[v]
            for s in ss:
                b = self.group_of[s]
                if a != b:
                    self.gsucc[a].add(b)
                    self.gpred[b].add(a)
        self._next = n + len(groups)
        self.reach = self._sweep()

    def _sweep(self) -> dict:
        order = kahn_order(self.gsucc, {g: self.gpred[g] for g in sorted(self.gpred)})
        if len(order) != len(self.gsucc):
            placed = set(order)
            raise CycleError(sorted(g for g in self.gsucc if g not in placed))
        reach = {}
        for g in reversed(order):
            r = 0
            for h in self.gsucc[g]:
                r |= self.mask[h] | reach[h]
            reach[g] = r
        return reach

    def would_cycle(self, gids) -> bool:
        gids = set(gids)
        m = 0
        for g in gids:
            m |= self.mask[g]
        for g in gids:
            for h in self.gsucc[g]:
                if h not in gids and (self.mask[h] | self.reach[h]) & m:
                    return True
        return False

    def related(self, a: int, b: int) -> bool:
        """True if a path joins groups a and b (either way)."""
        return bool(self.reach[a] & self.mask[b] or self.reach[b] & self.mask[a])

    def merge(self, gids) -> int:
        """Contract ``gids`` into a new group (caller checked would_cycle); its id."""
        gids = set(gids)
        new = self._next
        self._next += 1
        m = r = 0
        succ, pred, members = set(), set(), []
        for g in gids:
            m |= self.mask.pop(g)
            r |= self.reach.pop(g)
            succ |= self.gsucc.pop(g)
            pred |= self.gpred.pop(g)
            members.extend(self.members.pop(g))
        succ -= gids
        pred -= gids
        self.members[new] = tuple(sorted(members))
        for v in members:
            self.group_of[v] = new
        self.mask[new], self.reach[new] = m, r & ~m
        self.gsucc[new], self.gpred[new] = succ, pred
        for h in succ:
            self.gpred[h] -= gids
            self.gpred[h].add(new)
        for h in pred:
            self.gsucc[h] -= gids
            self.gsucc[h].add(new)
        self._update_ancestors(new)
        return new

    def _update_ancestors(self, new: int):
        add = self.mask[new] | self.reach[new]
        seen, stack = set(), list(self.gpred[new])
        while stack:
            g = stack.pop()
            if g in seen:
                continue
            seen.add(g)
            if self.reach[g] & add == add:
                continue          # g, and so every ancestor of g, already reaches it all
            self.reach[g] |= add
            stack.extend(self.gpred[g])


class CycleError(ValueError):
    def __init__(self, groups):
        super().__init__(f"contracted graph has a cycle through groups {groups[:8]}")
        self.groups = groups
