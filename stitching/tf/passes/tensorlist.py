"""TensorList reads and writes at constant indices, as the slices and the stack they are.

A Keras RNN reads its input through a TensorList (``TensorListFromTensor`` of the
sequence, ``TensorListGetItem`` at the step) and writes its outputs into another
(``TensorListSetItem`` per step, ``TensorListStack`` after the loop).  Once the loop
is unrolled (passes/unroll.py) and Grappler has folded the step counters, every index
is a constant: a read of element ``i`` of a list made from a tensor is that tensor's
``[i]`` (a ``StridedSlice``, which a kernel reads in place), and a stack of a list
written once at each index 0..n-1 is a ``Pack`` of what was written.  Keras's own
``unroll=True`` writes the graph that way.  The TensorList ops are opaque to the
planner and each is one more op for TF's executor per step.

Rewritten only where the value cannot differ:
  - a read: the list is the ``TensorListFromTensor`` itself (through ``Identity`` /
    ``IdentityN``), the index a constant inside the tensor's static first dim;
  - a stack: the chain of ``TensorListSetItem`` back to a ``TensorListReserve`` of
    ``n`` elements is linear (each list in it is read by the next write only), every
    index 0..n-1 is written (the last write of an index counts), none may resize the
    list, and no node of the chain carries a control edge.
The rewritten nodes keep their names and control inputs.  A loop result that only
the stack read (the unrolled loop's ``IdentityN``) then takes the empty reserved list,
so the writes have no reader left and TF prunes them; and an ``IdentityN``'s list slots
that nothing reads are taken out of it (``_drop_unread_lists``), so the lists are not
built at all.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import node_def_pb2
from tensorflow.python.framework import tensor_util

from ..passmanager import Pass

_FORWARD = ("Identity", "IdentityN")


def _split(ref: str):
    ref = ref.lstrip("^")
    name, _, idx = ref.partition(":")
    return name, int(idx or 0)


class _Graph:
    def __init__(self, graph_def):
        self.nodes = {n.name: n for n in graph_def.node}
        self.readers: dict = {}              # (name, output) -> [(node, input index)]
        for n in graph_def.node:
            for k, i in enumerate(n.input):
                if not i.startswith("^"):
                    self.readers.setdefault(_split(i), []).append((n, k))

    def source(self, ref: str):
        """(node, output, [forwarding (node, output) on the way]) behind ``ref``."""
        path = []
        name, idx = _split(ref)
        node = self.nodes.get(name)
        while node is not None and node.op in _FORWARD:
            data = [i for i in node.input if not i.startswith("^")]
            if idx >= len(data):
                return None, 0, path
            path.append((node, idx))
            name, idx = _split(data[idx] if node.op == "IdentityN" else data[0])
            node = self.nodes.get(name)
        return node, idx, path

    def const_int(self, ref: str):
        node, _, _ = self.source(ref)
        if node is None or node.op != "Const":
            return None
        v = tensor_util.MakeNdarray(node.attr["value"].tensor)
        if v.shape != () or v.dtype.kind not in "iu":
            return None
        return int(v)


def _const(name: str, values, dtype=np.int32) -> node_def_pb2.NodeDef:
    n = node_def_pb2.NodeDef(name=name, op="Const")
    n.attr["dtype"].type = tf.as_dtype(dtype).as_datatype_enum
    n.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(np.asarray(values, dtype)))
    return n


def _read_as_slice(g, node, tf_graph, extra) -> bool:
    if len(node.input) < 2 or node.input[0].startswith("^"):
        return False
    src, out, _ = g.source(node.input[0])
    i = g.const_int(node.input[1])
    if src is None or src.op != "TensorListFromTensor" or out != 0 or i is None:
        return False
    tensor = src.input[0]
    try:
        shape = tf_graph.get_tensor_by_name("%s:%d" % _split(tensor)).shape
    except (KeyError, ValueError):
        return False
    if shape.rank is None or shape.rank < 1 or shape[0] is None or not 0 <= i < shape[0]:
        return False
    dtype = node.attr["element_dtype"].type
    if src.attr["element_dtype"].type != dtype:
        return False
    controls = [c for c in node.input if c.startswith("^")]
    b, e, s = (_const(f"{node.name}/{what}", [v]) for what, v in
               (("begin", i), ("end", i + 1), ("strides", 1)))
    extra += [b, e, s]
    node.op = "StridedSlice"
    del node.input[:]
    node.input.extend([tensor, b.name, e.name, s.name] + controls)
    node.attr.clear()
    node.attr["T"].type = dtype
    node.attr["Index"].type = tf.int32.as_datatype_enum
    for mask in ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask"):
        node.attr[mask].i = 0
    node.attr["shrink_axis_mask"].i = 1
    return True


def _stack_as_pack(g, node, pinned, fetched) -> list | None:
    """The forwarding slots to re-point once ``node`` (a TensorListStack) is a Pack,
    or None where it stays.  ``pinned``: nodes no write of the chain may be;
    ``fetched``: the (node, output) pairs whose values are fetched."""
    if node.input[0].startswith("^"):
        return None
    cur, out, path = g.source(node.input[0])
    writes, chain = {}, []
    while cur is not None and cur.op == "TensorListSetItem" and out == 0:
        if any(i.startswith("^") for i in cur.input) or cur.name in pinned or \
                cur.attr["resize_if_index_out_of_bounds"].b:
            return None
        i = g.const_int(cur.input[1])
        if i is None:
            return None
        writes.setdefault(i, cur.input[2])          # walking back: the last write wins
        chain.append(cur)
        cur, out, more = g.source(cur.input[0])
        path += more
    if cur is None or cur.op != "TensorListReserve" or not chain:
        return None
    n = g.const_int(cur.input[1])
    if n is None or n <= 0 or sorted(writes) != list(range(n)):
        return None
    dtype = node.attr["element_dtype"].type
    if cur.attr["element_dtype"].type != dtype or \
            node.attr["num_elements"].i not in (-1, n):
        return None
    # each list of the chain is read by the next write (or the forwarding to it) only
    for w in chain + [cur]:
        if len(g.readers.get((w.name, 0), [])) != 1:
            return None
    for fwd, idx in path:     # re-pointed below: a kept node (a loop's control
        # output) still runs, but no fetched value may change
        if (fwd.name, idx) in fetched or len(g.readers.get((fwd.name, idx), [])) != 1:
            return None
    controls = [c for c in node.input if c.startswith("^")]
    del node.input[:]
    node.input.extend([writes[k] for k in range(n)] + controls)
    node.op = "Pack"
    node.attr.clear()
    node.attr["T"].type = dtype
    node.attr["N"].i = n
    node.attr["axis"].i = 0
    return [(fwd, idx, cur.name) for fwd, idx in path]


def _drop_unread_lists(graph_def, fetched, excluded) -> int:
    """Take out of each ``IdentityN`` its TensorList slots that nothing reads (an
    unrolled loop's results: the sequence list every step read from, the emptied
    output list), renumbering the readers of the slots after them, so the
    ``TensorListFromTensor`` / ``TensorListReserve`` behind them have no reader left and
    TF prunes them instead of building the lists at every call.  One slot always stays
    (an IdentityN has at least one).  Returns the slots taken out."""
    readers = _Graph(graph_def).readers     # after the rewrites: read afresh
    variant = tf.variant.as_datatype_enum
    dropped = 0
    for node in graph_def.node:
        if node.op != "IdentityN" or node.name in excluded:
            continue
        data = [i for i in node.input if not i.startswith("^")]
        types = list(node.attr["T"].list.type)
        if len(types) != len(data):
            continue
        keep = [k for k, t in enumerate(types)
                if t != variant or readers.get((node.name, k)) or (node.name, k) in fetched]
        if len(keep) == len(types):
            continue
        keep = keep or [0]
        new_index = {old: new for new, old in enumerate(keep)}
        for old, new in new_index.items():
            for reader, k in readers.get((node.name, old), []):
                reader.input[k] = f"{node.name}:{new}"
        controls = [i for i in node.input if i.startswith("^")]
        del node.input[:]
        node.input.extend([data[k] for k in keep] + controls)
        del node.attr["T"].list.type[:]
        node.attr["T"].list.type.extend(types[k] for k in keep)
        if "_output_shapes" in node.attr:
            del node.attr["_output_shapes"]
        dropped += len(types) - len(keep)
    return dropped


def rewrite(graph_def, tf_graph, pinned=frozenset(), fetches=(), excluded=frozenset()):
    """A new GraphDef with such reads and stacks rewritten, or None; and the counts.
    ``pinned``: nodes no list write may be; ``fetches``: tensors whose values must not
    change; ``excluded``: nodes left as they are (Options(exclude))."""
    fetched = {_split(f) for f in fetches}
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    g = _Graph(out)
    extra, reads, stacks, repoint = [], 0, 0, []
    for node in list(out.node):
        if node.op == "TensorListGetItem" and node.name not in excluded:
            reads += _read_as_slice(g, node, tf_graph, extra)
    for node in list(out.node):
        if node.op == "TensorListStack" and node.name not in excluded:
            found = _stack_as_pack(g, node, pinned, fetched)
            if found is not None:
                stacks += 1
                repoint += found
    if not reads and not stacks:
        return None, 0, 0
    for fwd, idx, empty in repoint:       # the stack was its only reader: no writes
        data = [k for k, i in enumerate(fwd.input) if not i.startswith("^")]
        fwd.input[data[idx] if fwd.op == "IdentityN" else data[0]] = empty
    out.node.extend(extra)
    # a kept node (the loop's IdentityN is one: a control output of the function)
    # keeps its name and op, and its fetched slots; unread slots may go
    _drop_unread_lists(out, fetched, set(excluded))
    return out, reads, stacks


def _run(ctx):
    if not ctx.has_op("TensorListGetItem", "TensorListStack"):
        return None
    new, reads, stacks = rewrite(ctx.graph_def, ctx.tf_graph, ctx.pinned, ctx.fetches,
                                 ctx.excluded.keys())
    if new is None:
        return None
    ctx.replace(new)
    return (f"TensorList ops at constant indices: {reads} read(s) became slices of the "
            f"tensor the list was made from, {stacks} stack(s) a Pack of the values "
            "written")


PASS = Pass("tensorlist", _run)
