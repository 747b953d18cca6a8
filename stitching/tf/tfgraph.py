"""A GraphDef as TensorFlow sees it: imported into a scratch ``tf.Graph`` for its shapes.

Every floor of the TF edge needs this (the pass manager's context imports the graph
again after a pass changes it; the frontend lifts the imported graph to the IR; the
rewrite writes dtypes back), so it sits below them all.  A GraphDef does not carry a
resource handle's shape: ``resource_shapes`` reads them from the live FuncGraph and
``import_for_shapes`` types the variable reads with them.
"""
from __future__ import annotations

import tensorflow as tf

from . import opnames

DTYPE_NAMES = {tf.float16: "float16", tf.bfloat16: "bfloat16", tf.float32: "float32",
               tf.float64: "float64", tf.int32: "int32", tf.int64: "int64", tf.bool: "bool"}
TF_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}


def resource_shapes(func_graph) -> dict:
    """Resource placeholder name -> (dtype, shape) of the variable it holds.

    A GraphDef does not carry a resource handle's shape, so after serialization
    every ``ReadVariableOp`` would read a tensor of unknown rank (and so would
    everything downstream).  The live FuncGraph still knows it.
    """
    from tensorflow.python.ops import handle_data_util
    out = {}
    for t in func_graph.inputs:
        if t.dtype != tf.resource:
            continue
        data = handle_data_util.get_resource_handle_data(t)
        if data is None or not data.is_set or len(data.shape_and_type) != 1:
            continue
        st = data.shape_and_type[0]
        if st.shape.unknown_rank:
            continue
        out[t.op.name] = (tf.as_dtype(st.dtype), [d.size if d.size >= 0 else None
                                                 for d in st.shape.dim])
    return out


# Ops whose outputs' shapes TF's Python code sets on the live graph
# (``Tensor.set_shape``) and the op's C++ shape function cannot infer, which a
# GraphDef (and a FunctionDef in its library) does not carry: a table lookup
# (``tf.lookup``'s StaticHashTable, Keras's StringLookup and IntegerLookup: its shape
# function needs the table handle's data, which no table handle carries), Keras's
# multi-hot and count encodings (DenseBincount of a run-time size), a SparseToDense
# of a known dense shape (Keras's HashedCrossing), a tf.numpy_function given its shape.
LOSSY_OPS = frozenset({"LookupTableFindV2", "LookupTableFind", "DenseBincount", "Bincount",
                       "SparseToDense", "RaggedTensorToTensor", "EagerPyFunc", "PyFunc",
                       "PyFuncStateless"})


def annotate_live_shapes(graph_def, func_graph) -> int:
    """Give each node of LOSSY_OPS in ``graph_def``, and in the functions of its
    library (a loaded SavedModel's call), the output shapes the live ``func_graph`` (or
    the nested function graph of that name) knows, as an ``_output_shapes`` attribute,
    in place; returns how many nodes.  TF's importer refines the node's shapes with it
    (so does every scratch import: import_for_shapes), and Grappler's function inlining
    keeps it (passes/grappler.py puts back the top graph's, which it drops).  Without
    it such an output had unknown rank or dims in every graph stitching imports, and
    so had everything downstream: after a StringLookup, an embedding's index
    arithmetic, the gathered rows, the Dense stack after them ("a tensor of unknown
    rank", with inputs of known rank); after a multi-hot encoding, the concatenation
    of the features.  The kernels check their static dims when they run, so a
    ``set_shape`` that lied is TF's InvalidArgument error, never a wrong read."""
    n = _annotate_lossy(graph_def.node, func_graph)
    if graph_def.library.function:
        graphs = _nested_graphs(func_graph)
        for f in graph_def.library.function:
            g = graphs.get(f.signature.name)
            if g is not None:
                n += _annotate_lossy(f.node_def, g)
    return n


def _annotate_lossy(nodes, graph) -> int:
    n = 0
    for nd in nodes:
        if nd.op not in LOSSY_OPS or "_output_shapes" in nd.attr:
            continue
        try:
            op = graph.get_operation_by_name(nd.name)
        except (KeyError, ValueError):
            continue
        if not op.outputs or all(t.shape.rank is None for t in op.outputs):
            continue
        attr = nd.attr["_output_shapes"].list.shape
        for t in op.outputs:
            attr.add().CopyFrom(t.shape.as_proto())
        n += 1
    return n


def _nested_graphs(func_graph) -> dict:
    """Function name -> its live FuncGraph, for the functions ``func_graph`` calls,
    at any depth (those TF knows a graph of)."""
    out, todo = {}, [func_graph]
    while todo:
        g = todo.pop()
        for name, fn in getattr(g, "_functions", {}).items():
            inner = getattr(fn, "graph", None)
            if name in out or inner is None:
                continue
            out[name] = inner
            todo.append(inner)
    return out


def seeded_random_ops(graph_def) -> list:
    """The kinds of seeded stateful random op in ``graph_def`` and its library: a
    new graph's instances of them draw the numbers of an earlier graph's again."""
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    return sorted({n.op for n in nodes if n.op in opnames.STATEFUL_RANDOM and any(
        k in n.attr and n.attr[k].i for k in ("seed", "seed2"))})


def import_for_shapes(graph_def, resources: dict | None = None) -> tf.Graph:
    """Import into a scratch graph so TF's shape inference types every tensor.

    Reads of variables whose shapes we know (``resources``) are imported as typed
    placeholders: the scratch graph is only for shapes, never run.  Colocations with
    nodes the graph no longer has are dropped from ``graph_def`` first.
    """
    drop_dangling_colocations(graph_def)
    if resources:
        graph_def = _typed_variable_reads(graph_def, resources)
    g = tf.Graph()
    try:
        with g.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except ValueError as e:
        if "_output_shapes" not in str(e):
            raise
        # a shape annotate_live_shapes gave a node that a pass has since made
        # inconsistent: TF's own inference then, without the annotations
        plain = type(graph_def)()
        plain.CopyFrom(graph_def)
        for nd in plain.node:
            nd.attr.pop("_output_shapes", None)
        g = tf.Graph()
        with g.as_default():
            tf.graph_util.import_graph_def(plain, name="")
    return g


def drop_nodes(graph_def, names) -> None:
    """Remove the nodes named in ``names`` from ``graph_def``, in place (the passes
    that fold a node into another: padfold, shapes, xladot, blas)."""
    if names:
        kept = [nd for nd in graph_def.node if nd.name not in names]
        del graph_def.node[:]
        graph_def.node.extend(kept)


def expand_nodes(graph_def, todo: dict, expand):
    """A copy of ``graph_def`` in which each node named in ``todo`` is replaced, in
    place, by the nodes ``expand(node, todo[name], taken)`` returns (``taken``: the
    node names in use, which it adds its new names to); the passes that rewrite one TF
    node into several (sparse_xent, strided_grad)."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    taken = {n.name for n in out.node}
    nodes = []
    for nd in out.node:
        nodes.extend(expand(nd, todo[nd.name], taken) if nd.name in todo else [nd])
    del out.node[:]
    out.node.extend(nodes)
    return out


def fresh_name(name: str, taken: set) -> str:
    """``name``, or with "_" appended until no node in ``taken`` has it; taken."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def drop_dangling_colocations(graph_def) -> None:
    """Grappler's function inlining leaves colocation constraints (``_class:
    loc:@Func/PartitionedCall_1/input/_4``, from TF's gradient of a function call)
    naming Identity nodes that its later passes, or bypass_identity_n, remove; an import
    refuses them ("expects to be colocated with unknown node").  They only placed a
    node beside one that no longer exists: drop those, in place."""
    present = {n.name for n in graph_def.node}
    for nd in graph_def.node:
        if "_class" not in nd.attr:
            continue
        locs = nd.attr["_class"].list.s
        keep = [c for c in locs if not c.startswith(b"loc:@") or c[5:].decode() in present]
        if len(keep) == len(locs):
            continue
        if keep:
            del locs[:]
            locs.extend(keep)
        else:
            del nd.attr["_class"]


def _typed_variable_reads(graph_def, resources):
    by_name = {n.name: n for n in graph_def.node}

    def source(name):   # follow Identity chains (inlined function arguments)
        seen = 0
        while name in by_name and by_name[name].op == "Identity" and seen < 64:
            name = by_name[name].input[0].split(":")[0].lstrip("^")
            seen += 1
        return name

    out = type(graph_def)()
    out.CopyFrom(graph_def)
    taken = {n.name for n in out.node}
    for nd in list(out.node):
        if nd.op in _RESOURCE_GATHERS:
            _typed_gather(out, nd, source, resources, taken)
            continue
        if nd.op != "ReadVariableOp":
            continue
        src = source(nd.input[0].split(":")[0])
        if src not in resources:
            continue
        dtype, shape = resources[src]
        ctrl = [i for i in nd.input if i.startswith("^")]
        nd.op = "Placeholder"
        del nd.input[:]
        nd.input.extend(ctrl)
        nd.attr.clear()
        nd.attr["dtype"].type = dtype.as_datatype_enum
        nd.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
        nd.attr[VARIABLE_READ].b = True     # a variable's value (frontend: ``held``)
    return out


# Marks the placeholders that stand for variable reads in a graph imported for shapes
VARIABLE_READ = "_stitching_variable_read"


# Reads of a variable at run-time indices (an embedding lookup: tf.gather of a
# ResourceVariable, tf_keras's Embedding, HF transformers' word and position embeddings).
_RESOURCE_GATHERS = frozenset({"ResourceGather", "ResourceGatherNd"})


def _typed_gather(graph_def, nd, source, resources, taken) -> None:
    """Type a ResourceGather of a variable whose shape we know: TF infers its output
    shape from the handle's data, which a GraphDef's resource placeholder does not
    carry, so it was of unknown rank, and so was everything downstream (a whole
    transformer's residual stream, unfusible: "a tensor of unknown rank").  In the
    scratch graph only (never run), its handle input becomes a VarHandleOp of the
    variable's dtype and shape, whose shape function gives the handle that data; the
    node keeps its name, type and indices."""
    src = source(nd.input[0].split(":")[0])
    if src not in resources:
        return
    dtype, shape = resources[src]
    handle = graph_def.node.add(name=fresh_name(f"{nd.name}/stitching_typed_handle", taken),
                                op="VarHandleOp")
    handle.attr["dtype"].type = dtype.as_datatype_enum
    handle.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
    handle.attr["shared_name"].s = handle.name.encode()
    handle.attr["container"].s = b""
    nd.input[0] = handle.name
