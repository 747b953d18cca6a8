"""A stitching.function's Python scalar arguments: planned as inputs, not values.

TF traces a Python number argument as a constant, so ``f(x, 1.0)``, ``f(x, 2.0)``,
... is a retrace per value, and each trace is a graph that differs from the last
only in that constant.  tf.function pays the retrace (~8 ms for a softmax); planning
and rewriting the trace again cost as much once more.  So, before the pipeline sees
a trace, each constant that holds one of the Python scalar arguments and only feeds
element-wise arithmetic becomes a Placeholder of the same name (``abstract``):
nothing downstream -- Grappler, the planner, the kernels' specs -- can depend on its
value, and the stitched graph is a template every value shares.  ``Templates`` keeps
a function's templates; a later trace finds one and gets a copy with its own
constants put back (``Abstraction.restore``), so a new value costs the retrace, a
hash of the trace and a copy of the stitched graph (tools/scalar_bench.py).

Which constants: a *candidate* is a float scalar ``Const`` whose every reader uses it
as a plain operand of ``_VALUE_OPERAND_OPS`` (or as the dividend of a division); the
candidates holding an argument's value are abstracted.  Anything that may steer a
decision stays a constant: shape-like and integer constants (reduction axes, reshape
targets), attrs (``leaky_relu``'s alpha), a divisor (``x / c`` lowers to
``x * (1/c)``, codegen/lower/exprs.py) and an exponent (``pow(x, 2)`` becomes
``x * x``).

Control-flow bodies: an argument used inside a loop or a branch is a constant of the
body's function.  It is abstracted within the body's own stitch (a body's graph is a
function's, with its own arguments), and its place in the trace is named by the body's
place among the trace's functions: AutoGraph and tf.while_loop name bodies anew on
each trace (``while_body_40``, then ``while_body_205``), so a template's key leaves
function names out (``_canonical_bytes``), and a trace served by another's template
gets that template's stitched bodies with its own constants, renamed after its own
functions and their new content (``Abstraction.restore``): the runtime keeps a
function by name, so another content must never reuse one.

A value tells an argument's constant from the function's own only by equality:
``f(x, 0.5)`` over a GELU also abstracts GELU's 0.5, ``f(x, 2.0)`` does not.  Both
are correct (an abstracted constant is an input holding its own value), and they
share a template: traces are keyed by their structure with *every* candidate's
value left out, and a template serves a trace whose constants it kept (did not
abstract) hold the same values (``Templates.get``).
"""
from __future__ import annotations

import collections
import hashlib
import threading
from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import graph_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorflow.python.framework import tensor_util

from . import control_flow

_VALUE_OPERAND_OPS = frozenset({"Add", "AddV2", "Sub", "Mul", "Maximum", "Minimum",
                                "SquaredDifference", "BiasAdd"})
_DIVISIONS = frozenset({"RealDiv", "Div"})
_PER_KEY = 4     # arbitrary: templates of one structure (values that equal a constant)
_FLOATS = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_FLOAT,
                     types_pb2.DT_DOUBLE})


@dataclass
class Abstraction:
    """A trace with its argument constants as Placeholders.

    A candidate is named by its node's name in the graph, or by ``(i, name)`` for node
    ``name`` of the i-th function in ``functions`` (a control-flow body, whose name
    changes from one trace to the next while its place in that order does not)."""
    graph_def: object        # what the pipeline plans
    consts: dict             # every candidate -> its Const NodeDef (of the graph traced)
    abstracted: frozenset    # the candidates holding an argument's value (the graph's
    #                          own are Placeholders in graph_def; bodies are abstracted
    #                          when they are stitched, pipeline._stitch_body)
    functions: list          # the library's function names (_function_order)

    def structure(self) -> bytes:
        """The trace with every candidate's value and every function name left out:
        what a template's key hashes (two values of one function give the same
        bytes)."""
        return _structure(self.graph_def, self.consts, self.abstracted, self.functions)

    def values(self, names) -> dict:
        """Candidates ``names`` -> their values, as bytes (NaN equals NaN, -0.0 is
        not 0.0)."""
        return {name: self.consts[name].attr["value"].tensor.SerializeToString(
            deterministic=True) for name in names}

    def restore(self, template_graph_def, abstracted: frozenset, functions=None):
        """A copy of a stitched template whose Placeholders ``abstracted`` are this
        trace's constants (one the passes removed is simply not there).

        ``functions``: the function names of the trace the template was stitched from,
        where that is another trace: its library functions become this trace's (its
        own functions this trace's; its stitched bodies with this trace's constants,
        renamed), and every node calling one calls the new name."""
        out = graph_pb2.GraphDef()
        out.CopyFrom(template_graph_def)
        for node in out.node:
            if node.name in abstracted and node.op == "Placeholder":
                node.CopyFrom(self.consts[node.name])
        if functions is not None and functions:
            _rename_functions(out, self._restore_functions(out, abstracted, functions))
        return out

    def _restore_functions(self, out, abstracted, then) -> dict:
        """``out``'s library (a template's, its functions named as in trace ``then``)
        made this trace's, in place; returns {old name: new name}."""
        mine = {f.signature.name: f for f in self.graph_def.library.function}
        renamed = {}
        for f in out.library.function:
            name = f.signature.name
            for i, (was, now) in enumerate(zip(then, self.functions)):
                if name == was:                   # as traced: this trace's own
                    f.CopyFrom(mine[now])
                    renamed[was] = now
                    break
                if name.startswith(was + control_flow.STITCHED):
                    renamed[name] = self._stitched_body(f, i, abstracted, now)
                    break
        return renamed

    def _stitched_body(self, fdef, i, abstracted, now) -> str:
        """A stitched copy of the i-th function (``fdef``, in place) with this trace's
        constants, named after this trace's function and a hash of its content (the
        runtime keeps a function by name: another content needs another name)."""
        scope = control_flow.BODY_SCOPE + "/"
        for node in fdef.node_def:
            key = (i, node.name[len(scope):])
            if node.op == "Const" and node.name.startswith(scope) and key in abstracted:
                node.attr["value"].CopyFrom(self.consts[key].attr["value"])
        fdef.signature.name = ""
        digest = hashlib.sha256(fdef.SerializeToString(deterministic=True)).hexdigest()
        fdef.signature.name = f"{now}{control_flow.STITCHED}{digest[:16]}"
        return fdef.signature.name


def abstract(graph_def, values, functions: bool = True) -> Abstraction | None:
    """``graph_def`` with the candidates holding one of ``values`` (the Python numbers
    among a trace's arguments) Placeholders; None where none does.  ``functions``:
    also the candidates of the control-flow bodies in its library (the value of an
    argument used inside a loop is a constant of the loop's body)."""
    if not values:
        return None
    consts = _candidates(graph_def.node)
    order = _function_order(graph_def) if functions else []
    if order:
        library = {f.signature.name: f for f in graph_def.library.function}
        bodies = set(control_flow.called_functions(graph_def))
        for i, name in enumerate(order):
            if name in bodies:
                consts.update(((i, c), n) for c, n in
                              _candidates(library[name].node_def).items())
    abstracted = frozenset(k for k, n in consts.items() if _holds(n, values))
    if not abstracted:
        return None
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    _to_placeholders(out, abstracted)
    return Abstraction(out, consts, abstracted, order)


def _candidates(nodes) -> dict:
    """Name -> NodeDef of the candidates among ``nodes`` (a graph's or a function's)."""
    nodes = list(nodes)
    uses = _uses(nodes)
    return {n.name: n for n in nodes
            if _float_scalar_const(n) and _value_operand(uses.get(n.name))}


def _structure(graph_def, consts, abstracted, order) -> bytes:
    """``graph_def`` (an abstraction's: ``abstracted`` are Placeholders) serialized
    with every candidate's value and every library function's name (``order``) left
    out; ``graph_def`` is left as it was."""
    if order:                  # a library: a copy of its own, its functions renamed
        canon = graph_pb2.GraphDef()
        canon.CopyFrom(graph_def)
        _to_placeholders(canon, consts)
        library = {f.signature.name: f for f in canon.library.function}
        nodes = {}
        for k in consts:
            if not isinstance(k, str):
                fname = order[k[0]]
                if fname not in nodes:
                    nodes[fname] = {n.name: n for n in library[fname].node_def}
                tensor = nodes[fname][k[1]].attr["value"].tensor
                tensor.CopyFrom(tensor_pb2.TensorProto(dtype=tensor.dtype))
        return _canonical_bytes(canon, order)
    _to_placeholders(graph_def, consts)    # in place, then back: one copy fewer
    blob = graph_def.SerializeToString(deterministic=True)
    for node in graph_def.node:
        if node.name in consts and node.name not in abstracted and \
                node.op == "Placeholder":
            node.CopyFrom(consts[node.name])
    return blob


def _canonical_bytes(graph_def, order) -> bytes:
    """``graph_def`` (a throwaway copy) serialized with its functions in ``order``,
    each named by its place there: also inside the names TF derives from a function's
    (its arguments', ``while_while_cond_22___redundant_placeholder0``)."""
    tokens = {name: "\0%d" % i for i, name in enumerate(order)}
    longest_first = sorted(order, key=len, reverse=True)

    def sub(text):
        for name in longest_first:
            if name in text:
                text = text.replace(name, tokens[name])
        return text

    _rename_functions(graph_def, tokens)
    library = {f.signature.name: f for f in graph_def.library.function}
    parts = []
    for name in order:
        f = library[name]
        f.signature.name = tokens[name]
        for arg in list(f.signature.input_arg) + list(f.signature.output_arg):
            arg.name = sub(arg.name)
        f.signature.control_output[:] = [sub(c) for c in f.signature.control_output]
        for n in f.node_def:
            n.input[:] = [sub(i) for i in n.input]
        for table in (f.ret, f.control_ret):
            items = [(sub(k), sub(v)) for k, v in table.items()]
            table.clear()
            table.update(items)
        parts.append(f.SerializeToString(deterministic=True))
    parts += sorted(g.SerializeToString(deterministic=True)
                    for g in graph_def.library.gradient)
    graph_def.ClearField("library")
    return graph_def.SerializeToString(deterministic=True) + b"".join(parts)


def _function_order(graph_def) -> list:
    """The library's function names in the order the graph's nodes reach them (depth
    first, each node's attrs by name), then those it does not reach, by name: the same
    order for two traces of one structure, whatever names their functions have."""
    library = {f.signature.name: f for f in graph_def.library.function}
    if not library:
        return []
    order, seen = [], set()

    def visit(nodes):
        for n in nodes:
            for key in sorted(n.attr):
                v = n.attr[key]
                if v.HasField("func"):
                    names = [v.func.name]
                elif v.HasField("list"):
                    names = [f.name for f in v.list.func]
                else:
                    continue
                for name in names:
                    if name in library and name not in seen:
                        seen.add(name)
                        order.append(name)
                        visit(library[name].node_def)

    visit(graph_def.node)
    return order + sorted(set(library) - seen)


def _rename_functions(graph_def, renamed) -> None:
    """Every reference to a function of ``graph_def`` (its nodes', its functions'
    nodes', gradients) renamed by ``renamed``, in place."""
    renamed = {a: b for a, b in renamed.items() if a != b}
    if not renamed:
        return
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    for n in nodes:
        for v in n.attr.values():
            if v.HasField("func"):
                v.func.name = renamed.get(v.func.name, v.func.name)
            elif v.HasField("list"):
                for fn in v.list.func:
                    fn.name = renamed.get(fn.name, fn.name)
    for g in graph_def.library.gradient:
        g.function_name = renamed.get(g.function_name, g.function_name)
        g.gradient_func = renamed.get(g.gradient_func, g.gradient_func)


def _to_placeholders(graph_def, names) -> None:
    for node in graph_def.node:
        if node.name in names and node.op == "Const":
            dtype = node.attr["dtype"].type
            node.op = "Placeholder"
            node.ClearField("attr")
            node.attr["dtype"].type = dtype
            node.attr["shape"].shape.CopyFrom(tensor_shape_pb2.TensorShapeProto())


def _uses(nodes) -> dict:
    """Node name -> [(reader NodeDef, input position)]; a control edge is position
    None (its value is not read, but a constant so ordered is not a plain operand).
    A function's inputs (``node:output:index``) name their node as a graph's do."""
    uses = collections.defaultdict(list)
    for node in nodes:
        for i, inp in enumerate(node.input):
            if inp.startswith("^"):
                uses[inp[1:]].append((node, None))
            else:
                uses[inp.partition(":")[0]].append((node, i))
    return uses


def _float_scalar_const(node) -> bool:
    if node.op != "Const" or node.input or node.attr["dtype"].type not in _FLOATS:
        return False
    shape = node.attr["value"].tensor.tensor_shape
    return not shape.dim and not shape.unknown_rank


def _holds(node, values) -> bool:
    """Whether the constant is one of ``values``, as its dtype holds them."""
    value = tensor_util.MakeNdarray(node.attr["value"].tensor)
    with np.errstate(over="ignore", invalid="ignore"):   # 70000.0 as float16: inf, as TF
        return any(value == np.asarray(v, value.dtype) for v in values)


def _value_operand(uses) -> bool:
    return bool(uses) and all(
        i is not None and (node.op in _VALUE_OPERAND_OPS or
                           (node.op in _DIVISIONS and i == 0))
        for node, i in uses)


class Templates:
    """A function's stitched templates, by structure (the most recent ``size``)."""

    def __init__(self, size: int = 16):   # arbitrary: a template is one GraphDef
        self._size = size
        self._lock = threading.Lock()
        self._by_key: collections.OrderedDict = collections.OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    @staticmethod
    def key(abstraction: Abstraction, context: str) -> str:
        """``context``: what else the stitched graph depends on (fetches, options,
        the device profile), as text."""
        h = hashlib.sha256(abstraction.structure())
        h.update(context.encode())
        return h.hexdigest()

    def get(self, key, abstraction: Abstraction):
        """(stitched result, the candidates it abstracted, the function names of its
        trace) of a template that serves ``abstraction``: one whose kept constants
        hold this trace's values; or None."""
        with self._lock:
            entries = list(self._by_key.get(key, ()))
        for kept, abstracted, functions, result in entries:
            if abstraction.values(kept) == kept:
                with self._lock:
                    if key in self._by_key:
                        self._by_key.move_to_end(key)
                return result, abstracted, functions
        return None

    def put(self, key, abstraction: Abstraction, result) -> None:
        kept = abstraction.values(set(abstraction.consts) - abstraction.abstracted)
        with self._lock:
            entries = self._by_key.setdefault(key, [])
            entries.append((kept, abstraction.abstracted, abstraction.functions, result))
            del entries[:-_PER_KEY]
            self._by_key.move_to_end(key)
            while len(self._by_key) > self._size:
                self._by_key.popitem(last=False)
