#!/usr/bin/env python
"""The planner's hand-written graph algorithms against networkx, on the plan-bench graphs.

    python tools/acyclic_bench.py

Kahn's topological order (ir/graph.py) vs ``nx.topological_sort``; reachability bitsets
(plan/acyclic.py: ``Reach``) vs ``nx.transitive_closure_dag``; 2,000 convexity queries
(the planner asks hundreds per graph) vs a networkx walk (``nx.descendants`` of the
region's exits).  CPU time, best of 5 (the networkx closures: 1 run).  The numbers are
quoted at the top of plan/acyclic.py, which keeps the hand-written code because of them.
"""
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests"), REPO]
import networkx as nx  # noqa: E402

import irbuild  # noqa: E402
from stitching.ir.graph import kahn_order  # noqa: E402
from stitching.plan.acyclic import Reach, indexed, mask_of  # noqa: E402

def best(fn, n=5):
    b = float("inf")
    for _ in range(n):
        t = time.process_time(); out = fn(); b = min(b, time.process_time() - t)
    return b, out

for name, g in [("ln_chain", irbuild.ln_chain(154)), ("encoder", irbuild.encoder(49)), ("wide", irbuild.wide(500))]:
    names, order, succ = indexed(g)
    n = len(succ)
    pred = {v: [] for v in range(n)}
    sd = {v: list(s) for v, s in enumerate(succ)}
    for v, ss in enumerate(succ):
        for s in ss: pred[s].append(v)
    D = nx.DiGraph(); D.add_nodes_from(range(n)); D.add_edges_from((v, s) for v, ss in enumerate(succ) for s in ss)
    t_kahn, _ = best(lambda: kahn_order(sd, pred))
    t_nxtopo, _ = best(lambda: list(nx.topological_sort(D)))
    t_reach, R = best(lambda: Reach(succ))
    t_nxclos, _ = best(lambda: nx.transitive_closure_dag(D), 1)
    # convexity queries: random windows of consecutive topo indices
    rng = random.Random(0)
    qs = []
    for _ in range(2000):
        a = rng.randrange(n); k = rng.randrange(2, 12)
        qs.append(set(range(a, min(n, a + k))))
    t_conv, r1 = best(lambda: [R.convex(q, mask_of(q)) for q in qs])
    def nx_convex(q):
        # P convex iff no node outside P lies on a path between two members
        out = set().union(*(D.successors(v) for v in q)) - q
        reach = set()
        for s in out:
            reach |= nx.descendants(D, s) | {s}
        return not (reach & q)
    t_nxconv, r2 = best(lambda: [nx_convex(q) for q in qs], 1)
    assert r1 == r2
    print(f"{name:9s} n={n:5d}  topo: kahn {t_kahn*1e3:6.2f} ms  nx {t_nxtopo*1e3:6.2f} ms | "
          f"reach: bitsets {t_reach*1e3:7.2f} ms  nx closure {t_nxclos*1e3:8.1f} ms | "
          f"2000 convex: bitsets {t_conv*1e3:6.2f} ms  nx {t_nxconv*1e3:8.1f} ms")
