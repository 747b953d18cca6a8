"""Reading a GraphDef file from elsewhere: every way it can be wrong is a clear error.

A graph file is untrusted input (a download, another team's export).  Protobuf's own
errors say what broke but not in which file, and TF's importer reports an unknown op
without the node that uses it; so this module checks, in order, and names the file and
the node:

    bytes  ─parse (.pbtxt: text format; else binary)─►  GraphDef
           ─check─►  unique node names, every op registered here (or a library
                     function), every input names a node, the fetches exist
                     (TF's importer: output index in range), no StitchedKernel node
                     (already rewritten: rewriting again is refused, never doubled)

Nothing read from the file is evaluated: the spec attributes of StitchedKernel nodes
are JSON validated by ``KernelSpec.from_json`` when a kernel is built from them.
"""
from __future__ import annotations


class GraphFileError(ValueError):
    """A graph file that cannot be used (message names the file and the node)."""


STITCHED_OP = "StitchedKernel"


def read_graph_def(path: str):
    """The GraphDef in ``path`` (.pbtxt: text format; anything else: binary)."""
    import tensorflow as tf
    from google.protobuf import message, text_format
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise GraphFileError(f"{path}: cannot read: {e.strerror or e}") from None
    if not data:
        raise GraphFileError(f"{path}: the file is empty")
    gd = tf.compat.v1.GraphDef()
    if path.endswith(".pbtxt"):
        try:
            text_format.Parse(data.decode("utf-8"), gd)
        except UnicodeDecodeError as e:
            raise GraphFileError(f"{path}: not a text GraphDef (not UTF-8: {e})") from None
        except text_format.ParseError as e:
            raise GraphFileError(f"{path}: text GraphDef syntax error at {e}") from None
        return gd
    try:
        gd.ParseFromString(data)
    except message.DecodeError as e:
        raise GraphFileError(f"{path}: not a binary GraphDef, or truncated or corrupt "
                             f"({len(data)} bytes: {e})") from None
    if not gd.node:
        raise GraphFileError(f"{path}: the GraphDef has no nodes")
    if not gd.versions.producer:
        # TF writes ``versions`` after the nodes: a file cut at a node's end still parses,
        # less its last nodes (an output among them), and has none
        raise GraphFileError(f"{path}: the GraphDef has no versions.producer, which TF "
                             f"writes last: the file is truncated (or was not written "
                             f"by TF's GraphDef serializer)")
    return gd


def check_graph_def(gd, where: str, fetches=()) -> None:
    """Raise GraphFileError naming the node for a graph TF could not run here, or one
    that holds StitchedKernel nodes already; ``fetches``: 'node:index' names."""
    from tensorflow.python.framework import op_def_registry
    functions = {f.signature.name for f in gd.library.function}
    names = set()
    for n in gd.node:
        if n.name in names:
            raise GraphFileError(f"{where}: two nodes are named {n.name!r}")
        names.add(n.name)
    for n in gd.node:
        if n.op == STITCHED_OP:
            raise GraphFileError(
                f"{where}: node {n.name!r} is a StitchedKernel: this graph was rewritten "
                f"by stitching already (rewriting it again is refused; rewrite the "
                f"original graph)")
        if n.op not in functions and op_def_registry.get(n.op) is None:
            raise GraphFileError(f"{where}: node {n.name!r} has op {n.op!r}, which this "
                                 f"TensorFlow does not know")
        if n.op in ("NextIteration", "RefNextIteration"):
            # its back edge makes the graph cyclic, which the IR (a DAG) cannot hold
            raise GraphFileError(
                f"{where}: node {n.name!r} is the back edge of a TF1 while loop "
                f"(Enter/Merge/NextIteration/Exit, as freeze_graph writes a "
                f"tf.compat.v1.while_loop): stitching rewrites TF2 control flow (While "
                f"ops) only; export the model from TF2 (control flow v2) to rewrite it")
        for i in n.input:
            src = i.lstrip("^").split(":")[0]
            if src not in names:
                raise GraphFileError(f"{where}: node {n.name!r} reads {i!r}, which names "
                                     f"no node in the graph")
    _check_fetches(gd, where, fetches)


def _check_fetches(gd, where, fetches) -> None:
    import tensorflow as tf
    g = tf.Graph()
    with g.as_default():
        try:
            tf.graph_util.import_graph_def(gd, name="")
        except (ValueError, tf.errors.OpError) as e:
            raise GraphFileError(f"{where}: TensorFlow cannot import the graph: "
                                 f"{_first_line(e)}") from None
    for f in fetches:
        try:
            g.get_tensor_by_name(f)
        except (KeyError, ValueError) as e:
            raise GraphFileError(f"{where}: output {f!r}: {_first_line(e)}") from None


def _first_line(e) -> str:
    text = str(e).strip().strip('"')
    return text.splitlines()[0] if text else type(e).__name__
