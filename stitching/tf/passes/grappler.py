"""TF's own value-changing graph rewrites, run before the frontend reads a graph.

Stock ``tf.function`` runs Grappler over every function it executes, and several of
Grappler's rewrites change the values a graph computes (usually for the better):
``exp(x) - 1`` becomes ``Expm1(x)``, ``log(x + 1)`` becomes ``Log1p(x)``.  A stitched
kernel replaces those nodes before TF's runtime Grappler sees them, so unless the
same rewrites happen first, ``stitching.function`` would lose them (``exp(x) - 1``
near 0: 1.6e7 ulp instead of 4).  Rather than re-implement them in the IR, we run
Grappler itself, with the optimizers that change values or the op set, on the
GraphDef before it is imported:

  function     inline PartitionedCall / StatefulPartitionedCall bodies (as TF-TRT)
  constfold    constant folding (also x*1, x+0, shape materialization...)
  arithmetic   the arithmetic optimizer, every default stage (arithmetic_optimizer.cc)

The arithmetic optimizer runs at AGGRESSIVE, whose only difference from the default
level is ``assume_valid_feeds``: a GraphDef's argument nodes are Placeholders, which
Grappler treats as feeds of unknown shape unless told to trust their declared shape,
and several stages (Log1p, Expm1) need shapes.  Inside ``tf.function`` the arguments
are ``_Arg`` nodes whose shapes Grappler trusts, so this is the level that reproduces
stock TF.  Constant folding stays at the default level: its AGGRESSIVE mode also
folds ``0 / y`` to 0, which stock TF does not do.

Arithmetic-optimizer stages (TF 2.21, ``ArithmeticOptimizerOptions``) and what comes
out of them; every op they may emit is either in the op table or stays a TF op:

  stage                                 emits                        here
  ConvertExpm1          exp(x)-1       Expm1                        op table
  ConvertLog1p          log(x+1)       Log1p                        op table
  ConvertPow            pow(x,c)       Square/Sqrt/Rsqrt/Reciprocal/ op table
                                       Identity/Const (c = 3 ->
                                       Mul(x, Square(x)) only for nodes
                                       placed on a CPU: ours carry no
                                       device, so Pow(x, 3) stays Pow)
  ReplaceMulWithSquare  x*x            Square                       op table
  FuseSquaredDiff       (x-y)^2        SquaredDifference            op table
  LogSoftmax            log(softmax)   LogSoftmax                   composite
  SqrtDivToRsqrtMul     x/sqrt(y)      Mul(x, Rsqrt(y))             op table
  RemoveNegation        x+(-y), x-(-y) Sub / Add                    op table
  RemoveInvolution      -(-x), 1/(1/x) (removed)                    -
  RemoveIdempotent      f(f(x)) -> f(x) for idempotent ops          -
  RemoveLogicalNot      !(a<b)         GreaterEqual...              op table
  RemoveRedundantCast/Reshape/Bitcast, RemoveIdentityTranspose       (removed)
  ReorderCastLikeAndValuePreserving    Cast moved across a reshape  op table
  HoistCommonFactorOutOfAggregation  x*a+x*b -> x*(a+b)             op table
  MinimizeBroadcasts    reorders Mul/Add chains                     op table
  OptimizeMaxOrMinOfMonotonic  max(f(x)) -> f(max(x))               op table
  SimplifyAggregation   AddN(x,x,x)    Mul(3, x)                    op table
  AddOpsRewrite         a+b+c          AddN                         expanded below
  UnaryOpsComposition   chains on CPU  _UnaryOpsComposition         expanded below
  HoistCWiseUnaryChains, ReplaceMulWithBroadcastByTile (Tile), ReplacePackWithTile-
  Reshape (Tile), FoldTransposeIntoMatMul, FoldMultiplyIntoConv, RemoveStackSlice-
  SameAxis, SimplifyEmbeddingLookup, RemoveCastIntoSegmentReduction, Combine-
  Bitcasts, FoldConjugateIntoTranspose, ReduceUpsamplingDims: layout / matmul / conv
  ops that are not fused here; they stay TF ops (opaque), as stock TF runs them.

Two emitted ops are not in the op table but are rewritten back into primitives here,
with the values TF's kernels give: ``AddN`` (a chain of Add in the order TF's CPU
kernel adds, so the sum is bit-identical) and ``_UnaryOpsComposition``
(TF's kernel applies each named op in turn).  The remapper's ``_Fused*`` ops (fused
matmul/conv epilogues that serve TF's own kernels) are not produced here -- the
remapper does not run -- and in a graph that already holds them they stay opaque TF
ops.  The remapper runs later, in TF's runtime Grappler over the rewritten graph; the
convolution epilogues it fuses there are left to it (plan/epilogue.py).  The tests in
tests/test_grappler_rewrites.py check each covered rewrite.
"""
from __future__ import annotations

import threading

from tensorflow.core.framework import node_def_pb2, types_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2, rewriter_config_pb2
from tensorflow.python.grappler import tf_optimizer

from .. import opnames
from ..tfgraph import LOSSY_OPS
from ..passmanager import Pass

_RC = rewriter_config_pb2.RewriterConfig

OPTIMIZERS = ("function", "constfold", "arithmetic")

# _UnaryOpsComposition's op names that are plain unary TF ops (unary_ops_composition.cc)
_UNARY_COMPOSABLE = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh",
    "Expm1", "Exp", "Floor", "Inv", "Log", "Log1p", "Neg", "Reciprocal", "Rint", "Round",
    "Rsqrt", "Sigmoid", "Sin", "Sinh", "Sqrt", "Square", "Tan", "Tanh", "Elu", "Relu",
    "Relu6", "Selu"})


def optimize(graph_def, preserve: list[str]):
    """Grappler's function inlining, constant folding and arithmetic optimizer, as
    stock ``tf.function`` runs them; ``preserve``: tensor or node names that must
    survive (fetches, nodes the caller refers to).  Returns a new GraphDef in which
    AddN and _UnaryOpsComposition are expanded back into primitive ops.

    A graph with functional control flow (tf.cond / tf.while_loop: If, While, Case,
    in the graph or a function it calls) is returned unchanged: Grappler's function
    optimizer lowers it to v1 Switch/Merge, which automatic control dependencies
    cannot take when the rewritten graph is imported into a TF2 function (Keras's
    mixed-precision train step, whose loss scaling is a tf.cond: "'NoneType' object
    has no attribute 'outer_context'"), and keeping it functional
    (SINGLE_THREADED_EXECUTOR) makes it specialize the branch functions under names
    the imported graph's runtime cannot resolve.  Such a graph misses the rewrites
    above (the report says so); its regions are planned as traced, with AddN and
    _UnaryOpsComposition still expanded (the IR knows neither)."""
    if has_control_flow(graph_def):
        return expand_tf_internal_ops(graph_def)
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    _first_outputs_unnumbered(meta.graph_def)
    fetch_coll = meta_graph_pb2.CollectionDef()
    fetch_coll.node_list.value.extend(sorted({f.split(":")[0] for f in preserve}))
    meta.collection_def["train_op"].CopyFrom(fetch_coll)
    config = config_pb2.ConfigProto()
    rw = config.graph_options.rewrite_options
    rw.min_graph_nodes = -1
    rw.meta_optimizer_iterations = _RC.ONE
    rw.optimizers[:] = list(OPTIMIZERS)
    rw.arithmetic_optimization = _RC.AGGRESSIVE      # assume_valid_feeds: see above
    with _cluster_lock:
        out = tf_optimizer.OptimizeGraph(config, meta, cluster=_cluster())
    out = drop_placeholder_control_inputs(out)
    _drop_marks(out)
    _keep_live_shapes(graph_def, out)
    return drop_dead_fusible(expand_tf_internal_ops(out), preserve)


def _keep_live_shapes(before, after) -> None:
    """Put back the ``_output_shapes`` that tfgraph.annotate_live_shapes gave the
    graph's own nodes and Grappler dropped (it keeps them on the nodes it inlines from a
    function, not on the top graph's, which then lost their shapes again), on the nodes
    of the same name and op.  Only of LOSSY_OPS, which no Grappler stage rewrites: the
    arithmetic optimizer may give a node of another op its name with other shapes."""
    shapes = {nd.name: (nd.op, nd.attr["_output_shapes"]) for nd in before.node
              if nd.op in LOSSY_OPS and "_output_shapes" in nd.attr}
    if not shapes:
        return
    for nd in after.node:
        op, attr = shapes.get(nd.name, (None, None))
        if op == nd.op and "_output_shapes" not in nd.attr:
            nd.attr["_output_shapes"].CopyFrom(attr)


def _drop_marks(graph_def) -> None:
    """Removes the ``_grappler_*`` attrs Grappler's stages leave on the nodes they
    processed (``_grappler_ArithmeticOptimizer_MinimizeBroadcasts``...): they tell TF's
    runtime Grappler, which runs again over the rewritten graph, that a stage is done,
    and so the ops left to TF were not optimized as in stock TF.  Measured: a bfloat16
    MatMul + BiasAdd + GELU left to TF ran as _MklNativeFusedMatMul and five GELU ops,
    where stock TF (and the same graph without the marks) runs one
    _MklNativeFusedMatMul with the GELU fused (plan/epilogue.py, GELU_ROUNDING)."""
    for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
        for nd in nodes:
            for k in [k for k in nd.attr if k.startswith("_grappler_")]:
                del nd.attr[k]


def _first_outputs_unnumbered(graph_def) -> None:
    """``node:0`` inputs written ``node``, as TF writes a graph (in place).  A body
    of control flow made from its FunctionDef names them ``node:0``, and Grappler's
    constant folding then writes a control input ``^node:0`` that its own next
    optimizer rejects ("Non-existent input"): the optimize failed on the gradient
    loop bodies of a Keras LSTM or GRU, which were then left unstitched."""
    for n in graph_def.node:
        if any(i.endswith(":0") and not i.startswith("^") for i in n.input):
            inputs = [i[:-2] if i.endswith(":0") and not i.startswith("^") else i
                      for i in n.input]
            del n.input[:]
            n.input.extend(inputs)


# One Grappler cluster (the local machine's devices) for every optimize: TF builds and
# tears down one per call otherwise, ~20 ms of each trace (a new Python scalar value
# retraces; measured here).  Calls take turns, as TF's own lock makes them.
_cluster_lock = threading.Lock()
_the_cluster = None


def _cluster():
    global _the_cluster
    if _the_cluster is None:
        from tensorflow.python.grappler import cluster as gcluster
        _the_cluster = gcluster.Cluster()
    return _the_cluster


_CONTROL_FLOW = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case",
                           "StatelessCase"})


def has_control_flow(graph_def) -> bool:
    """Functional control flow in the graph or in any function of its library."""
    return any(n.op in _CONTROL_FLOW for n in graph_def.node) or any(
        n.op in _CONTROL_FLOW for f in graph_def.library.function for n in f.node_def)


def drop_placeholder_control_inputs(graph_def):
    """Remove control inputs on Placeholders.  Grappler anchors the constants it
    makes to an input (x + x -> Mul(Const(2) ^x, x)); a function argument exists
    before anything runs, so the edge orders nothing -- but the rewritten graph is
    imported with its arguments remapped, and TF's ``input_map`` remaps data edges
    only: the edge kept the old Placeholder alive ("You must feed a value for
    placeholder tensor"; found by tests/test_differential.py)."""
    args = {n.name for n in graph_def.node if n.op == "Placeholder"}
    if not any(i.startswith("^") and i[1:] in args for n in graph_def.node for i in n.input):
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for nd in out.node:
        keep = [i for i in nd.input if not (i.startswith("^") and i[1:] in args)]
        if len(keep) != len(nd.input):
            del nd.input[:]
            nd.input.extend(keep)
    return out


def drop_dead_fusible(graph_def, preserve):
    """Remove nodes the rewrites left without consumers (``exp(x) - 1`` -> Expm1(x)
    leaves the Exp behind), if their op is one the fuser maps or counts, or a matmul
    (FoldTransposeIntoMatMul makes a new BatchMatMulV2 with ``adj_y`` and leaves the
    old one reading the Transpose: a Llama decoder's ``q @ transpose(k)``): otherwise
    the planner would count them, or fuse them and write an output nobody reads.
    Stateful and unknown ops stay: TF decides what runs."""
    keep = {p.split(":")[0].lstrip("^") for p in preserve}
    nodes = {n.name: n for n in graph_def.node}
    users: dict[str, int] = {}
    for n in graph_def.node:
        for i in n.input:
            src = i.lstrip("^").split(":")[0]
            users[src] = users.get(src, 0) + 1
    dead = set()
    todo = [n for n in nodes if _removable(nodes[n], keep) and not users.get(n)]
    while todo:
        name = todo.pop()
        if name in dead:
            continue
        dead.add(name)
        for i in nodes[name].input:
            src = i.lstrip("^").split(":")[0]
            users[src] -= 1
            if src in nodes and not users[src] and _removable(nodes[src], keep):
                todo.append(src)
    if not dead:
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    del out.node[:]
    out.node.extend(n for n in graph_def.node if n.name not in dead)
    return out


_MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"})


def _removable(nd, keep) -> bool:
    return nd.name not in keep and (opnames.canonical(nd.op) is not None
                                    or nd.op in opnames.COMPOSITES
                                    or opnames.is_memory_intensive(nd.op)
                                    or nd.op in _MATMULS) and not _stateful(nd.op)


def _stateful(op: str) -> bool:
    from tensorflow.python.framework import op_def_registry
    d = op_def_registry.get(op)
    return d is None or d.is_stateful


_ADDV2_TYPES = frozenset(getattr(types_pb2, "DT_" + t) for t in (
    "BFLOAT16", "HALF", "FLOAT", "DOUBLE", "UINT8", "UINT16", "UINT32", "UINT64", "INT8",
    "INT16", "INT32", "INT64", "COMPLEX64", "COMPLEX128", "STRING"))


def expand_tf_internal_ops(graph_def):
    """``AddN`` -> a chain of ``AddV2`` in TF's order; ``_UnaryOpsComposition`` -> a
    chain of its unary ops.  The last node of a chain keeps the original name (so
    consumers and fetches still resolve) and its control inputs; the others are
    named ``<name>/stitching_expand_<i>``.  Nodes in another form stay as they are."""
    if not any(_expandable(n) for n in graph_def.node):
        return graph_def
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    del out.node[:]
    for nd in graph_def.node:
        out.node.extend(_expand(nd) if _expandable(nd) else [nd])
    return out


def _expandable(nd) -> bool:
    if nd.op == "AddN":
        data = [i for i in nd.input if not i.startswith("^")]
        # AddN also sums variants (a gradient loop body's TensorLists), which AddV2
        # cannot take; those stay AddN, a TF op the planner leaves alone
        return len(data) >= 2 and "T" in nd.attr and nd.attr["T"].type in _ADDV2_TYPES
    if nd.op == "_UnaryOpsComposition":
        names = list(nd.attr["op_names"].list.s) if "op_names" in nd.attr else []
        return bool(names) and all(n.decode() in _UNARY_COMPOSABLE for n in names) \
            and len([i for i in nd.input if not i.startswith("^")]) == 1
    return False


def _expand(nd) -> list:
    data = [i for i in nd.input if not i.startswith("^")]
    ctrl = [i for i in nd.input if i.startswith("^")]
    if nd.op == "AddN":
        steps = _add_n_steps(data)
    else:
        steps = [(n.decode(), [None]) for n in nd.attr["op_names"].list.s]
        steps[0] = (steps[0][0], [data[0]])
    nodes = []
    names = []
    for i, (op, ins) in enumerate(steps):
        last = i == len(steps) - 1
        n = node_def_pb2.NodeDef(name=nd.name if last else f"{nd.name}/stitching_expand_{i}",
                                 op=op, device=nd.device)
        n.attr["T"].CopyFrom(nd.attr["T"])
        # an int refers to an earlier step's node; None to the step just before
        n.input.extend(names[-1] if a is None else names[a] if isinstance(a, int) else a
                       for a in ins)
        if last:
            n.input.extend(ctrl)
        nodes.append(n)
        names.append(n.name)
    return nodes


def _add_n_steps(data):
    """AddV2 steps that sum like TF's CPU AddN kernel (aggregate_ops.h): the first
    n % 8 inputs (8 if none, 9 if one) left to right, then ``out += (a + b + ... +
    h)`` for each next group of 8, each group summed left to right."""
    n = len(data)
    first = {0: 8, 1: 9}.get(n % 8, n % 8) if n > 9 else n
    steps = [("AddV2", [data[0], data[1]])]
    steps += [("AddV2", [None, d]) for d in data[2:first]]
    for k in range(first, n, 8):
        out = len(steps) - 1                       # the running total so far
        group = data[k:k + 8]
        steps.append(("AddV2", [group[0], group[1]]))
        steps += [("AddV2", [None, d]) for d in group[2:]]
        steps.append(("AddV2", [out, None]))
    return steps


def bypass_identity_n(graph_def, keep):
    """Consumers of an ``IdentityN`` output read the IdentityN's input directly.

    ``tf.custom_gradient`` (``tf.nn.silu``, ``tf.nn.swish``, Keras activations built on
    it) routes its forward values through an IdentityN that matters only to the
    gradient; in the forward graph it is a no-op node that would cut a fusion region in
    two (SwiGLU's ``silu(gate) * up`` became a kernel plus a lone TF Mul).  An IdentityN
    with control inputs, or named in ``keep`` (fetches, nodes that must survive), is
    left alone; one nothing refers to afterwards is dropped.  Returns ``graph_def``
    itself when there is nothing to do, else a new GraphDef.

    An IdentityN that carries a custom gradient (``_gradient_op_type``) is bypassed
    only where that gradient is TF's or Keras's own (``_library_gradient``: the
    derivative of the ops a kernel recomputes for a tape outside the function,
    tf/passes/original.py).  A user's (gradient clipping, a straight-through
    estimator, a gradient reversal) is kept: the kernels' backward differentiates
    their original ops, and without the IdentityN a tape outside got the plain
    derivative instead of the custom one.
    """
    bypass = {n.name: n for n in graph_def.node if n.op == "IdentityN" and n.name not in keep
              and not any(i.startswith("^") for i in n.input)
              and (CUSTOM_GRADIENT not in n.attr or _library_gradient(n))}
    if not bypass:
        return graph_def

    def resolve(ref):
        if ref.startswith("^"):
            return ref
        name, _, idx = ref.partition(":")
        for _ in range(64):                        # IdentityN of IdentityN ...
            if name not in bypass:
                break
            ins = bypass[name].input
            k = int(idx or 0)
            if k >= len(ins):
                return ref                          # malformed: leave it to TF's import
            name, _, idx = ins[k].partition(":")
        return name if idx in ("", "0") else f"{name}:{idx}"

    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for nd in out.node:
        if nd.name not in bypass:
            nd.input[:] = [resolve(i) for i in nd.input]
    used = {i.lstrip("^").partition(":")[0] for nd in out.node if nd.name not in bypass
            for i in nd.input}
    dead = [i for i, nd in enumerate(out.node) if nd.name in bypass and nd.name not in used]
    for i in reversed(dead):
        del out.node[i]
    return out


CUSTOM_GRADIENT = "_gradient_op_type"
# Custom gradients defined in these packages are the derivatives of their forward
# values, written for memory or numerical stability (tf.nn.swish's, the Keras
# optimizer's IdentityN over the gradients it applies); one defined anywhere else may
# differ from it on purpose (clipping, a straight-through estimator).
_LIBRARIES = ("tensorflow", "keras", "tf_keras")


def _library_gradient(identity_n) -> bool:
    """Whether a custom-gradient IdentityN's gradient is TF's or Keras's own: the
    functions the registered gradient (tf.custom_gradient's wrapper) closes over all
    come from ``_LIBRARIES``.  True where none is registered in this process (a graph
    read from a file: no tape here can use that gradient)."""
    from tensorflow.python.framework import ops
    try:
        fn = ops._gradient_registry.lookup(identity_n.attr[CUSTOM_GRADIENT].s.decode())
    except LookupError:
        return True
    seen, todo = set(), [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen or not callable(f):
            continue
        seen.add(id(f))
        module = getattr(f, "__module__", None) or ""
        if getattr(f, "__code__", None) is not None and \
                module.partition(".")[0] not in _LIBRARIES:
            return False
        for cell in getattr(f, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:        # an empty cell
                pass
    return True


def _run(ctx):
    ctx.replace(bypass_identity_n(optimize(ctx.graph_def, ctx.roots), ctx.fetched))
    if has_control_flow(ctx.original):
        return ("the graph has functional control flow (tf.cond / tf.while_loop): "
                "Grappler's inlining, constant folding and arithmetic rewrites "
                "were not applied to it (Grappler would lower it to TF1 Switch/Merge "
                "ops, which a TF2 function cannot import), so its regions are "
                "planned as traced")
    return None


PASS = Pass("grappler", _run)
