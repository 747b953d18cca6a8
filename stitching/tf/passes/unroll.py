"""Loops with a trip count known when the graph is planned, unrolled into straight-line ops.

A Keras RNN layer (``LSTM``, ``GRU``, ``SimpleRNN`` with ``unroll=False``, the default)
runs its cell in a ``tf.while_loop`` over the time steps.  TF's executor then pays for
the loop itself on every step: each loop variable's Enter/Merge/Switch/NextIteration,
the condition, the counters, the body's Identity nodes -- 3.2 µs a step for an empty
loop of one variable, ~0.3 µs for each more (7 for an LSTM) on the amd-avx512 machine -- and
the cell's math is split from the matrix products it reads by the body's boundary.
Stitched, each body became two kernels (tf/control_flow.py), and the loop control still
cost most of the step: the rnn_encoder model ran ~10 µs per step where XLA, which
compiles the loop, ran 1.5 µs.

Where the number of iterations is a constant of the graph, this pass replaces the
``While``/``StatelessWhile`` node by that many copies of its body, each reading the one
before, and an ``IdentityN`` under the loop's name that gives the last copy's values
(so the loop's consumers, data and control, are unchanged).  What the body computes
from loop invariants alone (the weights' reads, constants) is copied once, before the
steps (``_invariant``).  The planner then sees one
graph: the counters fold to constants (Grappler runs on a graph without control
flow), and each step's cell math is one kernel between TF's matrix products.  Keras
writes the same graph with ``unroll=True``; this is that, for models that did not ask.

A loop is unrolled only where that cannot change what the graph computes:

- the trip count is exact: the condition is a function of loop variables that start
  as constants (``Const``, and integer arithmetic on constants: Keras's maximum
  iterations is a ``Max`` over a constant) and that the body updates by integer
  arithmetic on themselves and constants; evaluated here step by step, in NumPy, with
  TF's integer semantics (int32 / int64 wrap), over a whitelist of ops;
- the body calls no function (no nested loop or cond) and has no stateful op but
  ``ReadVariableOp`` (a variable assigned in the loop, a random op, a print keep it);
- the loop's outputs feed no other loop (a training step's gradient loop reads the
  forward loop's accumulators; the pair is left as TF traced it);
- the trip count is at most ``Options.unroll_loops`` (default 64; 0 unrolls nothing)
  and the copies add at most ``MAX_NODES`` nodes to the graph: planning time grows with
  the graph (the rnn_encoder model: 4 loops of 50 steps, its synchronous first call
  1.9 -> ~5 s), the kernels do not (every step's cell is the same code).

Every loop left as it is gets a note saying why, in the report.
"""
from __future__ import annotations

import numpy as np
from tensorflow.core.framework import attr_value_pb2, node_def_pb2
from tensorflow.python.framework import function_def_to_graph, op_def_registry

MAX_NODES = 8000    # arbitrary: the copies one graph may gain (~5000 for rnn_encoder)
WHILE_OPS = ("While", "StatelessWhile")
CALL_OPS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "Case",
                      "StatelessCase", "PartitionedCall", "StatefulPartitionedCall"})
ALLOWED_STATEFUL = frozenset({"ReadVariableOp"})
SUFFIX = "unroll"


class _NotStatic(Exception):
    """The trip count cannot be known here; the message says why."""


class _TooLong(Exception):
    """The trip count passes the limit."""


# ---- a small interpreter for the loop's control: integer and boolean scalars ------------

def _int_op(fn):
    return lambda a, b: fn(np.asarray(a), np.asarray(b))


_BINARY = {
    "Add": _int_op(np.add), "AddV2": _int_op(np.add), "Sub": _int_op(np.subtract),
    "Mul": _int_op(np.multiply), "Maximum": _int_op(np.maximum),
    "Minimum": _int_op(np.minimum),
    "Less": _int_op(np.less), "LessEqual": _int_op(np.less_equal),
    "Greater": _int_op(np.greater), "GreaterEqual": _int_op(np.greater_equal),
    "Equal": _int_op(np.equal), "NotEqual": _int_op(np.not_equal),
    "LogicalAnd": _int_op(np.logical_and), "LogicalOr": _int_op(np.logical_or),
}
_REDUCE = {"Max": np.max, "Min": np.min, "Sum": np.sum, "Prod": np.prod,
           "All": np.all, "Any": np.any}
_INT_TYPES = (np.int32, np.int64, np.bool_)


def _const_value(node):
    from tensorflow.python.framework import tensor_util
    value = tensor_util.MakeNdarray(node.attr["value"].tensor)
    if value.dtype.type not in _INT_TYPES or value.size > 1024:
        raise _NotStatic(f"{node.name}: a {value.dtype} constant")
    return value


class _Evaluator:
    """Values of integer/boolean tensors of one graph (``nodes``: name -> NodeDef),
    ``leaves``: tensor name -> value given from outside (a function's arguments)."""

    def __init__(self, nodes, leaves):
        self.nodes, self.leaves, self.memo = nodes, leaves, {}

    def __call__(self, ref: str):
        ref = _tensor_ref(ref)
        if ref in self.leaves:
            return self.leaves[ref]
        if ref not in self.memo:
            self.memo[ref] = self._eval(ref)
        return self.memo[ref]

    def _eval(self, ref: str):
        name, idx = ref.rsplit(":", 1)
        node = self.nodes.get(name)
        if node is None or idx != "0":
            raise _NotStatic(f"{ref} is not a value this pass can evaluate")
        data = [i for i in node.input if not i.startswith("^")]
        if node.op == "Const":
            return _const_value(node)
        if node.op in ("Identity", "StopGradient", "Snapshot"):
            return self(data[0])
        if node.op in _BINARY:
            out = _BINARY[node.op](self(data[0]), self(data[1]))
            want = np.asarray(self(data[0])).dtype
            return out if out.dtype == np.bool_ else out.astype(want)
        if node.op in _REDUCE:
            x, axes = np.asarray(self(data[0])), np.asarray(self(data[1]))
            axes = tuple(int(a) % max(x.ndim, 1) for a in axes.reshape(-1))
            if not axes:                # TF reduces over no axis: x itself
                return x
            keep = node.attr["keep_dims"].b
            return np.asarray(_REDUCE[node.op](x, axis=axes, keepdims=keep)).astype(x.dtype)
        if node.op == "Range":
            start, limit, delta = (int(self(d)) for d in data)
            if delta == 0 or abs((limit - start) // delta) > 1 << 16:
                raise _NotStatic(f"{name}: a Range this pass does not evaluate")
            return np.arange(start, limit, delta, dtype=np.asarray(self(data[0])).dtype)
        if node.op == "Cast":
            to = node.attr["DstT"].type
            np_to = {3: np.int32, 9: np.int64, 10: np.bool_}.get(to)
            if np_to is None:
                raise _NotStatic(f"{name}: a Cast to a non-integer type")
            return np.asarray(self(data[0])).astype(np_to)
        raise _NotStatic(f"{name} ({node.op}) is not integer arithmetic on constants")


def _results(fdef, flat) -> list:
    """The tensors a function returns, in its outputs' order, named as in the GraphDef
    ``function_def_to_graph_def`` made of it (``flat``: its name map)."""
    return [flat[fdef.ret[a.name]] for a in fdef.signature.output_arg]


def _trip_count(loop, graph_nodes, cond_gd, cond_flat, cond_fdef, body_gd, body_flat,
                body_fdef, limit: int) -> int:
    """How many times ``loop``'s body runs; raises _NotStatic."""
    n_vars = len(cond_fdef.signature.input_arg)
    cond_args = [f"{a.name}:0" for a in cond_fdef.signature.input_arg]
    body_args = [f"{a.name}:0" for a in body_fdef.signature.input_arg]
    cond_out = _results(cond_fdef, cond_flat)[0]
    cond_nodes = {n.name: n for n in cond_gd.node}
    body_nodes = {n.name: n for n in body_gd.node}
    body_outs = _results(body_fdef, body_flat)
    # the loop variables the condition reads, and those their updates read in turn
    used = _args_read(cond_out, cond_nodes, cond_args)
    while True:
        more = set().union(*(_args_read(body_outs[k], body_nodes, body_args) for k in used))
        if more <= used:
            break
        used |= more
    inputs = [i for i in loop.input if not i.startswith("^")]
    if len(inputs) != n_vars:
        raise _NotStatic("its inputs do not match its condition's arguments")
    main = _Evaluator(graph_nodes, {})
    values = {k: main(inputs[k]) for k in sorted(used)}
    trips = 0
    while True:
        ev = _Evaluator(cond_nodes, {cond_args[k]: values[k] for k in values})
        go = np.asarray(ev(cond_out))
        if go.shape != () or go.dtype != np.bool_:
            raise _NotStatic("its condition is not a boolean scalar")
        if not bool(go):
            return trips
        trips += 1
        if trips > limit:
            raise _TooLong(f"it runs more than {limit} times (Options.unroll_loops)")
        ev = _Evaluator(body_nodes, {body_args[k]: values[k] for k in values})
        values = {k: ev(body_outs[k]) for k in values}


def _args_read(ref, nodes, args) -> set:
    """Indices of the arguments (``args``: their tensor names) ``ref`` depends on."""
    stack, seen, found = [ref], set(), set()
    while stack:
        r = _tensor_ref(stack.pop())
        if r in seen:
            continue
        seen.add(r)
        if r in args:
            found.add(args.index(r))
            continue
        node = nodes.get(r.rsplit(":", 1)[0])
        if node is None:
            raise _NotStatic(f"{r} is not in its function")
        stack.extend(i for i in node.input if not i.startswith("^"))
    return found


# ---- the rewrite ---------------------------------------------------------------------------

def _is_stateful(op: str) -> bool:
    d = op_def_registry.get(op)
    return d is None or d.is_stateful


def _body_refusal(fdef, library) -> str | None:
    for n in fdef.node_def:
        if n.op in CALL_OPS or n.op in library:
            return f"its body calls a function ({n.op} {n.name})"
        if any(v.HasField("func") for v in n.attr.values()):
            return f"its body calls a function ({n.op} {n.name})"
        if _is_stateful(n.op) and n.op not in ALLOWED_STATEFUL:
            return f"its body has a stateful op ({n.op} {n.name})"
    return None


def _invariant(body_gd, body, body_flat) -> set:
    """The body's nodes that compute the same value in every iteration: those whose
    inputs (data and control) are all loop arguments the body passes through unchanged
    (a Keras RNN's weights: resource handles) or other such nodes, and that are not
    stateful but for ``ReadVariableOp`` (no op of the body writes a variable:
    ``_body_refusal``).  Their constants, the weights' reads and what the body computes
    from them alone are copied once, not once per step: the rnn_encoder model's 200
    steps read its 12 variables 600 times a call, in 600 ops of TF's executor."""
    args = [a.name for a in body.signature.input_arg]
    outs = _results(body, body_flat)
    inv = {a for a, o in zip(args, outs) if o.split(":")[0] == a}
    arg_set = set(args)
    nodes = [n for n in body_gd.node if n.name not in arg_set]
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if n.name in inv or (_is_stateful(n.op) and n.op not in ALLOWED_STATEFUL):
                continue
            if all(i.lstrip("^").split(":")[0] in inv for i in n.input):
                inv.add(n.name)
                changed = True
    return inv - arg_set


def _copy(graph_nodes_out, body_gd, prefix, arg_tensors, arg_names, first_controls,
          only=None, hoisted=frozenset(), hoisted_prefix=""):
    """Append ``body_gd``'s nodes (but its argument Placeholders) under ``prefix``,
    the arguments replaced by ``arg_tensors``: those named in ``only`` if given, else
    all but the ``hoisted`` ones, which the copy reads under ``hoisted_prefix``."""
    args = dict(zip(arg_names, arg_tensors))
    for n in body_gd.node:
        if n.name in args or (n.name not in only if only is not None
                              else n.name in hoisted):
            continue
        m = node_def_pb2.NodeDef()
        m.CopyFrom(n)
        m.name = _copy_name(prefix, n.name)
        if "_class" in m.attr:          # colocation with a body node: named otherwise now
            del m.attr["_class"]
        del m.input[:]
        for i in n.input:
            ctrl = i.startswith("^")
            base = i[1:] if ctrl else i
            name, _, idx = base.partition(":")
            if name in args:
                t = args[name]
                if ctrl:
                    src = t[1:] if t.startswith("^") else t.split(":")[0]
                    m.input.append("^" + src)
                else:
                    m.input.append(t)
            else:
                where = hoisted_prefix if name in hoisted else prefix
                m.input.append(("^" if ctrl else "") + _copy_name(where, name)
                               + (f":{idx}" if idx and not ctrl else ""))
        for c in first_controls:
            m.input.append(c)
        graph_nodes_out.append(m)


def _copy_name(prefix: str, name: str) -> str:
    """A body node's name in the copy ``prefix`` (``<loop>/unroll_<t>``): TF names a
    loop's body nodes under the loop's own scope (``lstm/while/lstm_cell/MatMul``),
    which the copy's name replaces (``lstm/while/unroll_3/lstm_cell/MatMul``)."""
    scope = prefix.rsplit("/", 1)[0] + "/"
    return prefix + "/" + (name[len(scope):] if name.startswith(scope) else name)


def _result(ref: str, prefix: str, args: dict, hoisted=frozenset(),
            hoisted_prefix="") -> str:
    """A body result's tensor in the copy under ``prefix``: an argument passed
    through is the value that copy read; a hoisted node's, its one copy."""
    name = ref.split(":")[0]
    if name in args:
        return args[name]
    return _copy_name(hoisted_prefix if name in hoisted else prefix, _tensor_ref(ref))


def _tensor_ref(name: str) -> str:
    return name if ":" in name else name + ":0"


def unroll_loops(graph_def, limit: int) -> list[str]:
    """Unroll every eligible loop of ``graph_def`` (in place); returns the report's
    notes: one per loop unrolled and per loop kept, with why."""
    loops = [n for n in graph_def.node if n.op in WHILE_OPS]
    if not loops or limit <= 0:
        return []
    library = {f.signature.name: f for f in graph_def.library.function}
    nodes = {n.name: n for n in graph_def.node}
    read_by_loop = set()
    for n in graph_def.node:
        if n.op in CALL_OPS:
            read_by_loop.update(i.lstrip("^").split(":")[0] for i in n.input)
    notes, done, added = [], {}, 0
    for loop in loops:
        why = None
        cond = library.get(loop.attr["cond"].func.name)
        body = library.get(loop.attr["body"].func.name)
        if cond is None or body is None:
            why = "its condition or body is not in the graph's library"
        elif loop.name in read_by_loop:
            why = "another loop or call reads its results (a gradient loop)"
        else:
            why = _body_refusal(body, library) or _body_refusal(cond, library)
        if why is None:
            try:
                cond_gd, cond_flat = function_def_to_graph.function_def_to_graph_def(cond)
                body_gd, body_flat = function_def_to_graph.function_def_to_graph_def(body)
                trips = _trip_count(loop, nodes, cond_gd, cond_flat, cond, body_gd,
                                    body_flat, body, limit)
            except _NotStatic as e:
                why = f"its trip count is not a constant here: {e}"
            except _TooLong as e:
                why = str(e)
            except Exception as e:  # noqa: BLE001 — a FunctionDef TF cannot convert
                why = f"its functions could not be read ({type(e).__name__}: {e})"
        if why is None:
            # the nodes the copies add: the hoisted ones once, the rest once per step
            hoisted = _invariant(body_gd, body, body_flat) if trips else frozenset()
            step = max(1, len(body.node_def) - len(hoisted))
            size = len(hoisted) + trips * step
            if added + size > MAX_NODES:
                why = (f"{trips} copies of the {step} nodes of its body that each step "
                       f"repeats would pass the {MAX_NODES}-node budget for unrolled "
                       "loops")
        if why is not None:
            notes.append(f"loop {loop.name} kept as a loop: {why}")
            continue
        added += size
        done[loop.name] = (loop, body_gd, body_flat, body, trips, hoisted)
    if not done:
        return notes
    out = []
    for n in graph_def.node:
        if n.name not in done:
            out.append(n)
            continue
        loop, body_gd, body_flat, body, trips, hoisted = done[n.name]
        arg_names = [a.name for a in body.signature.input_arg]
        current = [i for i in loop.input if not i.startswith("^")]
        controls = [i for i in loop.input if i.startswith("^")]
        results = _results(body, body_flat)
        inv_prefix = f"{loop.name}/{SUFFIX}_invariant"
        _copy(out, body_gd, inv_prefix, current, arg_names, controls, only=hoisted)
        for t in range(trips):
            prefix = f"{loop.name}/{SUFFIX}_{t}"
            _copy(out, body_gd, prefix, current, arg_names, controls if t == 0 else (),
                  hoisted=hoisted, hoisted_prefix=inv_prefix)
            previous = dict(zip(arg_names, current))
            current = [_result(r, prefix, previous, hoisted, inv_prefix) for r in results]
        result = node_def_pb2.NodeDef(name=loop.name, op="IdentityN")
        result.input.extend(current + (controls if trips == 0 else []))
        result.attr["T"].CopyFrom(attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(type=loop.attr["T"].list.type)))
        if "_output_shapes" in loop.attr:
            result.attr["_output_shapes"].CopyFrom(loop.attr["_output_shapes"])
        out.append(result)
        notes.append(f"loop {loop.name} unrolled: {trips} iteration(s) of its "
                     f"{len(body.node_def)}-node body")
    del graph_def.node[:]
    graph_def.node.extend(out)
    _drop_unused_functions(graph_def, {loop.attr[a].func.name
                                       for loop, *_ in done.values()
                                       for a in ("cond", "body")})
    return notes


def _drop_unused_functions(graph_def, names) -> None:
    """Remove the unrolled loops' functions that nothing else calls."""
    called = set()
    for n in list(graph_def.node) + [nd for f in graph_def.library.function
                                     for nd in f.node_def]:
        for v in n.attr.values():
            if v.HasField("func"):
                called.add(v.func.name)
        called.add(n.op)
    keep = [f for f in graph_def.library.function
            if f.signature.name not in names or f.signature.name in called]
    if len(keep) != len(graph_def.library.function):
        del graph_def.library.function[:]
        graph_def.library.function.extend(keep)
