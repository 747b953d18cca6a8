"""Native-segment fallback: each rewritten region keeps its original subgraph.

With ``Options(fallback=True)`` (what ``stitching-rewrite`` uses) the rewriter copies
the TF nodes of every region into a function of the graph's library
(``stitching_fallback_<spec hash>``) and names it in the StitchedKernel node's
``fallback`` attribute.  When the op cannot get its kernel where the graph runs (no
Numba or compiler, kernels for another CPU, a compile error), it runs that function
with TF's own kernels instead, logs the reason once per node and counts it
(``stitching.runtime.stats()``); ``STITCHING_STRICT=1`` makes it an error again.

The function is built from the region's nodes exactly as the rewriter removed them:
its arguments are the kernel's inputs (in order), its results the kernel's outputs;
a member reading a ``Const`` outside the region (a constant the spec folded in) gets a
copy of it; control inputs stay on the kernel node.  A region whose nodes read
anything else from outside (so not self-contained) gets no fallback.
"""
from __future__ import annotations

from tensorflow.core.framework import graph_pb2

from . import frontend


def fallback_function(graph_def, reg, ir_graph, name):
    """FunctionDef of region ``reg``'s original nodes, or None where it cannot be
    built self-contained."""
    try:
        sub = _subgraph(graph_def, reg, ir_graph)
        return None if sub is None else _to_function(sub, reg, name)
    except (KeyError, ValueError, TypeError):   # a node the function cannot hold
        return None


def _subgraph(graph_def, reg, ir_graph):
    nodes = {n.name: n for n in graph_def.node}
    members = [nodes[m] for m in reg.nodes if m in nodes]
    names = {n.name for n in members}
    inputs = {_key(r.node, r.index): i for i, r in enumerate(reg.inputs)}
    sub = graph_pb2.GraphDef()
    sub.versions.CopyFrom(graph_def.versions)
    for i, r in enumerate(reg.inputs):
        ph = sub.node.add(name=f"stitching_in_{i}", op="Placeholder")
        ph.attr["dtype"].type = \
            frontend.TF_DTYPE[ir_graph.type_of(r).dtype].as_datatype_enum
    copied = set()
    for n in members:
        new = sub.node.add()
        new.CopyFrom(n)
        del new.input[:]
        new.attr.pop("_output_shapes", None)
        for x in n.input:
            if x.startswith("^"):
                continue
            node, _, idx = x.partition(":")
            key = _key(node, int(idx or 0))
            if node in names:
                new.input.append(x)
            elif key in inputs:
                new.input.append(f"stitching_in_{inputs[key]}")
            elif node in nodes and nodes[node].op == "Const" and not idx:
                if node not in copied:
                    c = sub.node.add()
                    c.CopyFrom(nodes[node])
                    del c.input[:]
                    copied.add(node)
                new.input.append(node)
            else:
                return None
    return sub


def _key(node, index):
    return f"{node}:{index}"


def _to_function(sub, reg, name):
    import tensorflow as tf
    from tensorflow.python.framework import graph_to_function_def
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(sub, name="")
    ins = [g.get_tensor_by_name(f"stitching_in_{i}:0") for i in range(len(reg.inputs))]
    outs = [g.get_tensor_by_name(f"{r.node}:{r.index}") for r in reg.outputs]
    fdef = graph_to_function_def.graph_to_function_def(g, g.get_operations(), ins, outs)
    fdef.signature.name = name
    return fdef
