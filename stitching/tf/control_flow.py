"""The bodies of functional control flow, stitched like any function.

``tf.cond`` and ``tf.while_loop`` (and AutoGraph's ``if``/``for``/``while`` over
tensors) trace to ``If``/``StatelessIf``/``While``/``StatelessWhile`` nodes whose
branches, condition and body are functions of the graph's library.  The main graph's
planner sees such a node as one opaque op, so the ops inside a loop body were neither
fused nor counted.  Here each of those functions goes through the same pipeline as a
traced function:

    FunctionDef ─▶ GraphDef (its arguments Placeholders, its results fetched, its
                   control results kept; the library beside it for nested calls)
                ─▶ stitch_graph_def (plan, compile, rewrite; a report of its own)
                ─▶ FunctionDef again: the same argument and result types in the same
                   order, under a new name (``<name>_stitched_<hash>``: the runtime
                   may hold the old one), which every control-flow node calling the
                   old name now calls

Every function called as control flow anywhere (the main graph, other bodies: a cond
inside a loop) is stitched once, on its own; nested calls keep working because only
names change.  A body whose stitch fails, or that has nothing to fuse, is kept as it
was (the report says which).  Gradients: TF's While/If gradients rebuild the forward
body from the library, where its kernel nodes differentiate as everywhere
(original.py).
"""
from __future__ import annotations

import hashlib

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import function_def_to_graph, graph_to_function_def

from .frontend import LIST_READ_ATTR

# control-flow op -> the attrs naming the functions it runs
CALLERS = {"If": ("then_branch", "else_branch"),
           "StatelessIf": ("then_branch", "else_branch"),
           "While": ("cond", "body"),
           "StatelessWhile": ("cond", "body")}
STITCHED = "_stitched_"          # in a stitched function's name: <name>_stitched_<hash>
BODY_SCOPE = "b"                 # a stitched function's nodes are named b/<traced name>


def is_stitched(name: str) -> bool:
    """Whether a library function is a stitched control-flow function."""
    return STITCHED in name


def called_functions(graph_def) -> list:
    """Names of the library functions some control-flow node (in the graph or in a
    library function) runs, in a deterministic order."""
    names = []
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    for n in nodes:
        for attr in CALLERS.get(n.op, ()):
            name = n.attr[attr].func.name
            if name and name not in names:
                names.append(name)
    return names


def stitch_bodies(graph_def, stitch, name: str, resources: dict | None = None) -> list:
    """Replaces, in ``graph_def`` (in place), every control-flow function by its
    stitched version.  ``stitch(body_graph_def, fetches, keep, body_name, resources)``
    is the pipeline (returns a StitchResult); ``resources``: the graph's variable
    shapes (tfgraph.resource_shapes), passed on to the bodies the variables reach
    (``body_resources``).  Returns [(function name, report or None, why not)] for the
    report."""
    library = {f.signature.name: f for f in graph_def.library.function}
    shapes = body_resources(graph_def, resources or {})
    lists = body_list_shapes(graph_def)
    out, renamed = [], {}
    for fname in called_functions(graph_def):
        fdef = library.get(fname)
        if fdef is None:
            continue
        if not fdef.signature.output_arg and not fdef.signature.control_output:
            # a branch that does nothing (tf.cond's `lambda: None`): Grappler would log
            # "Failed to detect the fetch node(s)" and refuse it
            out.append((fname, None, "an empty function: no outputs, no side effects"))
            continue
        try:
            new_fdef, report, body_library = _stitch_one(
                fdef, graph_def.library, stitch, f"{name}/{fname}", shapes.get(fname, {}),
                lists.get(fname, {}))
        except Exception as e:  # noqa: BLE001 — the body stays as traced; said why
            why = str(e).splitlines()[0][:200] if str(e) else ""
            out.append((fname, None, f"{type(e).__name__}: {why}"))
            continue
        if new_fdef is None:
            out.append((fname, report, "nothing to fuse"))
            continue
        renamed[fname] = new_fdef.signature.name
        have = {f.signature.name for f in graph_def.library.function}
        for f in list(body_library.function) + [new_fdef]:
            if f.signature.name not in have:
                graph_def.library.function.add().CopyFrom(f)
                have.add(f.signature.name)
        out.append((fname, report, ""))
    if renamed:
        _rename_calls(graph_def, renamed)
        # the functions replaced: nothing calls them now (every caller was renamed);
        # a trace's first call would import and register them for nothing
        functions = graph_def.library.function
        for i in reversed(range(len(functions))):
            if functions[i].signature.name in renamed:
                del functions[i]
    return out


def body_resources(graph_def, resources: dict) -> dict:
    """Function name -> {argument name: (dtype, shape)} for the arguments of
    control-flow functions that are variables of known shape.  A FunctionDef does
    not carry a resource argument's shape (a Keras LSTM's loop body reads its weights
    through such arguments): without it every read of a weight inside the body had
    unknown rank.  A variable is followed from the graph's placeholders
    (``resources``) through Identity nodes and, for nested control flow, through the
    arguments of the function holding the caller (``_argument_facts``)."""
    def variable(src, by_name, have):
        return have.get(_variable_source(src, by_name))
    return _argument_facts(graph_def, resources, tf.resource, CALLERS, variable)


def body_list_shapes(graph_def) -> dict:
    """Function name -> {argument name: element shape (a list, -1 for an unknown
    dim)} for the TensorList arguments of loop bodies and conditions whose list was
    made with a known element shape.  A FunctionDef does not carry a list's element
    shape, and a gradient loop body pops the forward pass's values from its
    accumulators with ``element_shape=-1`` (while_v2): without it every value it
    reads, and all the math on them, had unknown rank and stayed TF's
    (``_shape_list_reads`` gives them their shapes).  A list is followed back through
    Identity nodes and through the While that carried it (output ``k`` is input
    ``k``: the forward loop's accumulator feeds the gradient loop) to the
    ``EmptyTensorList`` or ``TensorListReserve`` that made it, with a constant element
    shape, or to an argument of the function holding the caller."""
    loops = {op: CALLERS[op] for op in ("While", "StatelessWhile")}
    return _argument_facts(graph_def, {}, tf.variant, loops, _list_element_shape)


def _argument_facts(graph_def, top: dict, dtype, callers: dict, resolve) -> dict:
    """Function name -> {argument name: fact} for the ``dtype`` arguments of the
    functions that ``callers`` nodes ({op: function-valued attrs}) run, anywhere in
    the graph or its library.  A caller's argument ``i`` is its input ``i`` (While)
    or ``i + 1`` (If: input 0 is the condition); ``resolve(input, nodes by name,
    facts of the holding scope's arguments)`` gives that input's fact or None.  The
    graph's own facts are ``top``; a function's are those found for its arguments,
    so facts flow down nested control flow, one level a round."""
    facts = {}
    scopes = [(list(graph_def.node), "")]
    scopes += [(list(f.node_def), f.signature.name) for f in graph_def.library.function]
    library = {f.signature.name: f for f in graph_def.library.function}
    changed, rounds = True, 0
    while changed and rounds <= len(library) + 1:   # nesting depth bounds the rounds
        changed, rounds = False, rounds + 1
        for nodes, owner in scopes:
            have = facts.get(owner, {}) if owner else top
            by_name = {n.name: n for n in nodes}
            for n in nodes:
                first = 1 if n.op in ("If", "StatelessIf") else 0
                for attr in callers.get(n.op, ()):
                    callee = library.get(n.attr[attr].func.name)
                    if callee is None:
                        continue
                    got = facts.setdefault(callee.signature.name, {})
                    for i, a in enumerate(callee.signature.input_arg):
                        if a.type != dtype.as_datatype_enum or a.name in got \
                                or first + i >= len(n.input):
                            continue
                        fact = resolve(n.input[first + i], by_name, have)
                        if fact is not None:
                            got[a.name] = fact
                            changed = True
    return {k: v for k, v in facts.items() if v}


def _variable_source(name: str, by_name: dict) -> str:
    """The node (or function argument) a resource or TensorList input comes from,
    through Identity nodes."""
    name = name.split(":")[0]
    for _ in range(64):
        n = by_name.get(name)
        if n is None or n.op != "Identity" or not n.input:
            break
        name = n.input[0].split(":")[0]
    return name


def _input_ref(name: str) -> tuple:
    """(node or argument name, output index) of a GraphDef input (``node:k``) or a
    FunctionDef one (``node:output_arg:k``, or an argument's bare name)."""
    parts = name.split(":")
    return parts[0], int(parts[-1]) if len(parts) > 1 else 0


def _list_element_shape(src: str, by_name: dict, args: dict):
    """The element shape of the TensorList ``src`` (see body_list_shapes), or None."""
    for _ in range(64):
        if src.startswith("^"):
            return None
        name, k = _input_ref(src)
        n = by_name.get(name)
        if n is None:
            return args.get(name)
        if n.op == "Identity" and n.input:
            src = n.input[0]
        elif n.op in ("While", "StatelessWhile") and k < len(n.input):
            src = n.input[k]
        elif n.op in ("EmptyTensorList", "TensorListReserve") and n.input:
            const = by_name.get(_input_ref(n.input[0])[0])
            if const is None or const.op != "Const":
                return None
            shape = tf.make_ndarray(const.attr["value"].tensor)
            # a scalar -1: unknown rank, nothing gained
            return [int(d) for d in shape.reshape(-1)] if shape.ndim == 1 else None
        else:
            return None
    return None


# TensorList reads: (op, the output that is the element read)
_LIST_READS = {"TensorListPopBack": 1, "TensorListGetItem": 0}


def _shape_list_reads(body, lists: dict) -> None:
    """In ``body`` (a function's GraphDef), every element read (``_LIST_READS``) from
    an argument in ``lists`` is followed by an ``EnsureShape`` to the list's element
    shape, which its readers read instead.  TF's shape functions for these reads use
    only the list's handle data, which a FunctionDef's argument does not carry; with
    it, TF's shape inference (and the planner) sees the values' ranks.  The check
    cannot fail: TF refused to push an element of any other shape on the list.  The
    frontend reads these EnsureShapes (``LIST_READ_ATTR``) as Identity, so a kernel
    that takes the value in leaves nothing of them behind."""
    by_name = {n.name: n for n in body.node}
    shaped = {}
    for n in list(body.node):
        if n.op not in _LIST_READS or not n.input:
            continue
        shape = lists.get(_variable_source(n.input[0], by_name))
        if shape is None:
            continue
        out = f"{n.name}:{_LIST_READS[n.op]}"
        check = body.node.add()
        check.name = f"{n.name}/stitching_element_shape"
        check.op = "EnsureShape"
        check.input.append(out)
        check.attr["T"].type = n.attr["element_dtype"].type
        check.attr[LIST_READ_ATTR].b = True
        check.attr["shape"].shape.CopyFrom(
            tf.TensorShape([None if d < 0 else d for d in shape]).as_proto())
        if n.device:
            check.device = n.device
        shaped[out] = check.name + ":0"
    if not shaped:
        return
    for n in body.node:
        if n.op == "EnsureShape" and n.name.endswith("/stitching_element_shape"):
            continue
        for i, x in enumerate(n.input):
            ref = x if ":" in x else x + ":0"
            if ref in shaped:
                n.input[i] = shaped[ref]


def _stitch_one(fdef, library, stitch, label, resources, lists=None):
    """(stitched FunctionDef or None where nothing was fused, report, the stitched
    body's library: its kernels' original functions).  ``lists``: the element shapes
    of its TensorList arguments (body_list_shapes)."""
    with tf.Graph().as_default():       # where the functions it calls are found
        _import_library(library)
        body, flat = function_def_to_graph.function_def_to_graph_def(fdef)
    for n in body.node:
        # a resource argument becomes a Placeholder without a shape, which Grappler's
        # import refuses ("Failed to import metagraph"); a handle is a scalar
        if n.op == "Placeholder" and "shape" not in n.attr \
                and n.attr["dtype"].type == tf.resource.as_datatype_enum:
            n.attr["shape"].shape.CopyFrom(tf.TensorShape([]).as_proto())
    if lists:
        _shape_list_reads(body, lists)
    body.library.CopyFrom(library)
    fetches = [_tensor(flat[fdef.ret[a.name]]) for a in fdef.signature.output_arg]
    keep = [fdef.control_ret[a] for a in fdef.signature.control_output]
    result = stitch(body, fetches, keep, label, resources)
    if not result.report.kernels:
        return None, result.report, None
    return (_to_function_def(fdef, result.graph_def, fetches, keep), result.report,
            result.graph_def.library)


def _tensor(name: str) -> str:
    return name if ":" in name else name + ":0"


def _to_function_def(fdef, gdef, fetches, keep):
    """``gdef`` (a stitched body) as a FunctionDef with ``fdef``'s argument and result
    types, in order, and its control outputs (``keep``: the stateful ops without a data
    result, e.g. a cond branch's variable updates), named by a hash of its content.
    The control outputs must stay: TF inlines a lowered branch with its control
    outputs as the only control source (InlineFunctionBody's kControlOutputs), so a
    body without them has its side effects pruned (a LossScaleOptimizer's update, in
    a branch that returns nothing, silently never ran)."""
    g = tf.Graph()
    with g.as_default():
        _import_library(gdef.library)
        body = graph_pb2.GraphDef()
        body.CopyFrom(gdef)
        body.ClearField("library")
        present = {n.name for n in body.node}
        inputs = [tf.raw_ops.Placeholder(dtype=tf.as_dtype(a.type), shape=None,
                                         name="stitching_arg_" + a.name)
                  for a in fdef.signature.input_arg]
        input_map = {a.name + ":0": t for a, t in zip(fdef.signature.input_arg, inputs)
                     if a.name in present}
        outs = tf.graph_util.import_graph_def(body, input_map=input_map,
                                              return_elements=fetches + keep,
                                              name=BODY_SCOPE)
    args = {t.op for t in inputs}
    new = graph_to_function_def.graph_to_function_def(
        g, [op for op in g.get_operations() if op not in args], inputs,
        outs[:len(fetches)], [a.name for a in fdef.signature.output_arg])
    for name, op in zip(fdef.signature.control_output, outs[len(fetches):]):
        new.signature.control_output.append(name)
        new.control_ret[name] = op.name
    new.attr.MergeFrom(fdef.attr)
    digest = hashlib.sha256(new.SerializeToString(deterministic=True)).hexdigest()[:16]
    new.signature.name = f"{fdef.signature.name}{STITCHED}{digest}"
    return new


def _import_library(library) -> None:
    """The functions of ``library`` into the default graph (and nothing else)."""
    only = graph_pb2.GraphDef()
    only.library.CopyFrom(library)
    tf.graph_util.import_graph_def(only, name="")


def _rename_calls(graph_def, renamed) -> None:
    """Points every call of a function in ``renamed`` (any function-valued attr: a
    control-flow branch or body, a PartitionedCall's ``f``, in the graph and in its
    library) at the new name.  A library function whose body that edits gets a new name
    too (``<name>_stitched_<hash of its content>``), and so on up to the graph: the
    runtime keeps one definition per name, and the original still holds the old one
    (a SavedModel's signature calls a function that holds a tf.cond: saving both
    refused "a duplicate function with name ... where the definitions differ")."""
    renamed = dict(renamed)
    pending = dict(renamed)
    while pending:
        for n in graph_def.node:
            _retarget(n, pending)
        # every function's calls follow (a stitched body's too: nested control flow);
        # one edited here keeps a name it got in this loop or from stitching
        changed = [f for f in graph_def.library.function
                   if sum(_retarget(n, pending) for n in f.node_def) and
                   f.signature.name not in renamed.values()]
        pending = {}
        for f in changed:
            old = f.signature.name
            f.signature.name = ""
            digest = hashlib.sha256(f.SerializeToString(deterministic=True)).hexdigest()
            f.signature.name = pending[old] = renamed[old] = f"{old}{STITCHED}{digest[:16]}"


def _retarget(node, renamed) -> bool:
    """Renames, in place, the functions ``node``'s attrs call; whether any was."""
    hit = False
    for attr in node.attr.values():
        funcs = [attr.func] if attr.HasField("func") else list(attr.list.func)
        for fn in funcs:
            new = renamed.get(fn.name)
            if new is not None:
                fn.name, hit = new, True
    return hit
