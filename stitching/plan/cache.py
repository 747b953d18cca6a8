"""Plans remembered per graph, so a second process skips the search.

A warm process (kernels already in the disk cache) still paid the planner's search
every time: ~0.5 s of the ~1.5 s stitching added to ResNet50's first call.  The plan
of a graph is a pure function of the graph, the options, the planner's code and the
device profile, so it is stored under the graph's key:

    $STITCHING_CACHE_DIR/plans/<graph key>_<planner salt>.json

(plans are data, valid under any Numba toolchain).  The salt hashes the contents of
the ir, plan and schedule packages' sources, the TF edge's (the
frontend and the graph passes before planning decide the IR a plan is made for: a
pass that drops a Shape consumer changes which values leave a kernel) and the device
profile; a changed op table, cost model, pass or another machine never reads an old
plan.

What is stored is data only (JSON): each region's node names and schedule
parameters, the unfused/boundary/skipped reasons, notes and the explanation
dicts.  Loading trusts none of it: every region is rebuilt from the *current* IR
with ``region.extract`` (which validates the spec), its schedule parameters go
through ``KernelSpec.with_schedule`` (validated ranges), and ``legal`` checks it
again, as do node legality (a node the front end now marks unfusible) and the
kernels' ordering (contracted, the graph must stay acyclic).  Anything that does not fit -- unknown node, wrong type, a spec the schedule
stage refuses -- makes ``load`` return None and the caller plans afresh.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .. import cachedir
from .acyclic import Contraction, CycleError, indexed
from .legality import node_reason
from .planner import Plan
from .region import extract

MAX_PLAN_BYTES = 64 << 20     # arbitrary: read as a file, never more (cachedir.read_file)

FORMAT = 1
_SALT = None


def _salt() -> str:
    """The planner's code (hashed once per process) and the device profile it plans
    with now (a process may switch profiles: tests pin one per test)."""
    global _SALT
    from . import profiles
    if _SALT is None:
        _SALT = f"{FORMAT} " + cachedir.sources_digest(("ir", "plan", "schedule", "tf"))
    h = hashlib.sha256(_SALT.encode())
    h.update(profiles.default().planning_key().encode())
    return h.hexdigest()[:12]


def _path(key: str) -> Path:
    return cachedir.root() / "plans" / f"{key}_{_salt()}.json"


@dataclass
class StoredChoice:
    """A search.KernelChoice as the report reads it back (to_dict and region.nodes)."""
    data: dict
    region: object = None

    def to_dict(self) -> dict:
        return dict(self.data)


def save(key: str, plan: Plan) -> None:
    """Write ``plan`` for ``key`` (best effort: a read-only cache only costs time)."""
    doc = {
        "format": FORMAT,
        "regions": [{"nodes": list(r.nodes), "schedule": dict(r.spec.schedule)}
                    for r in plan.regions],
        "unfused": [list(u) for u in plan.unfused],
        "boundaries": [list(b) for b in plan.boundaries],
        "skipped": [[list(nodes), why] for nodes, why in plan.skipped],
        "notes": list(plan.notes),
        "alternatives": [dict(c.to_dict(), region=list(c.region.nodes)
                              if c.region is not None else None)
                         for c in plan.alternatives],
    }
    cachedir.store(_path(key), json.dumps(doc).encode())


def load(key: str, graph, legal) -> Plan | None:
    """The plan stored for ``key``, rebuilt against ``graph``; None if there is none or
    it does not fit the graph (see the module note)."""
    try:
        doc = json.loads(cachedir.read_file(_path(key), MAX_PLAN_BYTES))
    except (OSError, ValueError):
        return None
    try:
        return _rebuild(doc, graph, legal)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _strs(xs) -> list:
    if not isinstance(xs, list) or not all(isinstance(x, str) for x in xs):
        raise TypeError("expected a list of strings")
    return xs


def _rebuild(doc, graph, legal) -> Plan | None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return None
    _, order, succ = indexed(graph)
    consumers, fetched = graph.consumers(), set(graph.outputs)
    plan = Plan()
    by_nodes = {}
    for r in doc["regions"]:
        nodes = _strs(r["nodes"])
        sched = r["schedule"]
        if not nodes or not isinstance(sched, dict) or any(n not in order for n in nodes):
            return None
        if any(node_reason(graph, graph[n]) is not None for n in nodes):
            return None             # a node the current front end will not let fuse
        if not all(isinstance(k, str) and type(v) is int for k, v in sched.items()):
            return None
        reg = extract(graph, nodes, consumers, fetched, order)
        spec = reg.spec.with_schedule(**sched)
        if legal(spec) is not None:
            return None
        reg.spec = spec
        plan.regions.append(reg)
        by_nodes[tuple(reg.nodes)] = reg
    try:                            # the kernels, contracted, still order (acyclic.py)
        Contraction(succ, [[order[n] for n in r.nodes] for r in plan.regions])
    except CycleError:
        return None
    plan.unfused = [tuple(_strs(u)) for u in doc["unfused"]]
    plan.boundaries = [tuple(_strs(b)) for b in doc["boundaries"]]
    plan.skipped = [(_strs(nodes), str(why)) for nodes, why in doc["skipped"]]
    plan.notes = _strs(doc["notes"])
    for d in doc["alternatives"]:
        if not isinstance(d, dict):
            return None
        nodes = d.pop("region", None)
        region = by_nodes.get(tuple(_strs(nodes))) if nodes is not None else None
        plan.alternatives.append(StoredChoice(d, region))
    return plan
