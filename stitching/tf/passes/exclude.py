"""``Options(exclude=...)``: the TF ops a user keeps out of stitching, found by op type
or by name.

Bisecting a numerical difference or a slow kernel needs a way to hand chosen ops back
to TF without turning stitching off (XLA's ``jit_scope``, TF-TRT's exclusion lists).
An entry matches a node when it equals the node's op type (``"Softmax"``) or matches
its name with ``fnmatch.fnmatchcase`` (``"model/block3*"``); the first entry that
matches gives the reason.  Names are those of the graph after Grappler, which the
report lists.

This pass, right after Grappler, finds them (``ctx.excluded``: node name -> reason)
for the passes before lifting, and says which entries match nothing (a typo would
otherwise exclude nothing, silently).  The frontend pass (lift.py) matches again on
the graph it lifts, so nodes those passes made are covered too, and marks each one
``unfusible`` with its reason: the planner puts it in no kernel and the report lists
it as not fused.  Every pass that folds, removes or rewrites a node leaves these alone
(each says where).
"""
from __future__ import annotations

import fnmatch

from ..passmanager import Pass

WHY = "excluded by Options(exclude)"


def match(graph_def, entries) -> tuple[dict, list]:
    """({node name: reason} of the nodes of ``graph_def`` that ``entries`` match, [the
    entries that match none])."""
    found, used = {}, set()
    for nd in graph_def.node:
        for entry in entries:
            if nd.op == entry:
                why = f"{WHY}: op type {entry}"
            elif fnmatch.fnmatchcase(nd.name, entry):
                why = f"{WHY}: name matches {entry!r}"
            else:
                continue
            found.setdefault(nd.name, why)
            used.add(entry)
    return found, [e for e in dict.fromkeys(entries) if e not in used]


def note(entry: str) -> str:
    return f"Options(exclude): {entry!r} matches no op type or node name of this graph"


def _run(ctx):
    ctx.excluded, unmatched = match(ctx.graph_def, ctx.options.exclude)
    return [note(e) for e in unmatched] or None


def rematch(ctx) -> None:
    """At lifting: ``ctx.excluded`` gets the nodes of the graph lifted that the entries
    match (a strided gradient's Pad, a sparse xent's ops: nodes the passes since this
    one made), and an entry that matches one of them loses its note."""
    found, unmatched = match(ctx.graph_def, ctx.options.exclude)
    ctx.excluded.update(found)
    if "exclude" in ctx.notes:
        left = [note(e) for e in unmatched if note(e) in ctx.notes["exclude"]]
        if left:
            ctx.notes["exclude"] = left
        else:
            del ctx.notes["exclude"]


PASS = Pass("exclude", _run, option="exclude")
