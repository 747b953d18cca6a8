"""Drop the nodes of a rewritten GraphDef that nothing needs (and merge the ones that
are the same constant, and forward the Identity nodes function inlining left).

The rewrite replaces each region by one kernel node and copies every other node, so
what only a fused node read stays behind, unread: constants, shape arithmetic (the
Transformer's rewritten graph had 52 unread Consts of 260 and unread Shape/Prod/
GatherV2 chains).  TF's Grappler prunes them at every instantiation anyway, but a
SavedModel stores them, and ``tf.saved_model.load`` turns every stored node into a
Python object (~0.1 ms each, and garbage-collector pressure), so they cost load time.

A node is kept if an output, a ``keep`` node, a Placeholder (a function argument:
callers map inputs by name) or a stateful op (its side effect is the point) needs it,
through data or control edges; everything else goes.
"""
from __future__ import annotations

import re

from tensorflow.python.framework import op_def_registry

from ..passmanager import Pass

# TF's function inlining (Grappler, and the rewrite's own inlining of Keras' call
# layers) forwards each argument and result of an inlined call through an Identity
# named "<call>/Func/.../input/_N" (or output/_N): one per argument per level, 529 of
# MobileNetV2's 1,176 rewritten nodes (two levels of calls, 263 arguments).
_INLINED = re.compile(r"(^|/)Func/.*/(input|output)/_\d+$")


def dead_nodes(graph_def, roots) -> int:
    """Remove from ``graph_def`` (in place) the nodes no root needs; ``roots``: tensor
    or node names.  Returns how many were removed."""
    by_name = {n.name: n for n in graph_def.node}
    live = set()
    todo = [r.lstrip("^").split(":")[0] for r in roots]
    todo += [n.name for n in graph_def.node if _always_kept(n)]
    while todo:
        name = todo.pop()
        if name in live or name not in by_name:
            continue
        live.add(name)
        todo.extend(i.lstrip("^").split(":")[0] for i in by_name[name].input)
    dead = [n for n in graph_def.node if n.name not in live]
    for n in dead:
        graph_def.node.remove(n)
    gone = {n.name for n in dead}
    from .rewrite import _drop_colocation_with     # a colocation naming a dropped node
    for n in graph_def.node:
        _drop_colocation_with(n, gone)
    return len(dead)


def _always_kept(node) -> bool:
    if node.op in ("Placeholder", "PlaceholderWithDefault"):
        return True
    op_def = op_def_registry.get(node.op)
    return op_def is None or op_def.is_stateful     # unknown: keep, to be safe


def bypass_inlined_identities(graph_def, roots) -> int:
    """Forward the Identity nodes function inlining left (``_INLINED``) to their
    input, in place: a consumer reads the Identity's input instead and inherits its
    control inputs (so no ordering is lost); the Identity is then unread and
    ``dead_nodes`` drops it.  Roots are left alone.  Returns how many were bypassed."""
    keep = {r.lstrip("^").split(":")[0] for r in roots}
    fwd = {}                        # identity name -> (data input, [control inputs])
    for n in graph_def.node:
        if n.op != "Identity" or n.name in keep or not _INLINED.search(n.name):
            continue
        data = [i for i in n.input if not i.startswith("^")]
        if len(data) == 1:
            fwd[n.name] = (data[0], [i for i in n.input if i.startswith("^")])
    if not fwd:
        return 0
    # a control edge on a function argument orders nothing (arguments exist before
    # anything runs), and import_graph_def's input_map does not remap control edges:
    # one on a Placeholder would name an unfed placeholder in the imported graph
    args = {n.name for n in graph_def.node if n.op == "Placeholder"}

    for n in graph_def.node:
        if n.name in fwd or not any(i.lstrip("^").split(":")[0] in fwd for i in n.input):
            continue
        out, work = [], list(n.input)
        while work:        # chains (an Identity of an Identity, or its control input)
            i = work.pop(0)
            name = i.lstrip("^").split(":")[0]
            if name not in fwd:
                out.append(i)
                continue
            data, ctrl = fwd[name]
            work.insert(0, "^" + data.lstrip("^").split(":")[0] if i.startswith("^")
                        else data)
            work.extend(ctrl)
        del n.input[:]
        n.input.extend([i for i in out if not i.startswith("^")] +
                       list(dict.fromkeys(i for i in out if i.startswith("^")
                                          and i[1:] not in args)))
    return len(fwd)


def merge_constants(graph_def, roots) -> int:
    """Keep one Const per distinct (attributes, control inputs), in place: consumers of
    the others read it instead.  Grappler's folding and rewrites leave one copy of a
    shape or axis constant per use (the rewritten Transformer: 208 Consts, 24 distinct),
    each a node to store and to load.  Roots are never merged away.  Returns how many
    nodes were merged."""
    keep = {r.lstrip("^").split(":")[0] for r in roots}
    first, alias = {}, {}
    for n in graph_def.node:
        if n.op != "Const":
            continue
        attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                             for k, v in n.attr.items() if k != "_output_shapes"))
        key = (attrs, tuple(sorted(n.input)))
        if key not in first:
            first[key] = n.name
        elif n.name not in keep:
            alias[n.name] = first[key]
    if not alias:
        return 0
    for n in graph_def.node:
        if not any(i.lstrip("^").split(":")[0] in alias for i in n.input):
            continue
        new = []
        for i in n.input:
            node, sep, idx = i.lstrip("^").partition(":")
            if node in alias:
                i = ("^" if i.startswith("^") else "") + alias[node] + sep + idx
            new.append(i)
        data = [i for i in new if not i.startswith("^")]
        del n.input[:]
        n.input.extend(data + list(dict.fromkeys(i for i in new if i.startswith("^"))))
    return len(alias)


def _run(ctx):
    # after the folds: the shape ops they left unread go too.  Options(exclude)'s
    # nodes are roots here: none is forwarded, merged or dropped (the passes before
    # leave none unread; this keeps one such pass from dropping it silently)
    roots = ctx.roots + sorted(ctx.excluded)
    bypass_inlined_identities(ctx.graph_def, roots)
    merge_constants(ctx.graph_def, roots)
    dead_nodes(ctx.graph_def, roots)                # what only regions read


PASS = Pass("prune", _run)
