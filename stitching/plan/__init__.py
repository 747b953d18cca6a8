"""Planning: which ops become which kernels, and why (TF-free).

    baseline  XLA-like loop fusion: a reduction ends a kernel      (baseline.py)
    greedy    greedy region growing in topological order           (planner.py)
    search    candidate DP + beam + remote fusion + cost model     (search.py, cost.py)

Every planner has the contract ``plan(graph, legal, min_ops) -> planner.Plan``.
"""
PLANNERS = ("baseline", "greedy", "search")
ALIASES = {"full": "search"}   # tools/bench.py --planner full


def get_planner(name: str):
    """The plan function for a planner name (see PLANNERS)."""
    name = ALIASES.get(name, name)
    if name == "baseline":
        from .baseline import plan
    elif name == "greedy":
        from .planner import plan
    elif name == "search":
        from .search import plan
    else:
        raise ValueError(f"unknown planner {name!r}; choose one of {', '.join(PLANNERS)}")
    return plan
