"""A variable's update as its new value: the optimizer's math and its writes in one kernel.

Keras writes an optimizer as reads, element-wise math and in-place updates of each
variable (Adam, per variable: ``m.assign_add((g - m) * (1 - b1))``, the same for ``v``,
then ``var.assign_sub(lr * m / (sqrt(v) + eps))``, reading m and v again).  TF runs each
update as ``AssignAdd/AssignSubVariableOp(var, delta)``: after the kernel that wrote
the delta, one more op that locks the variable and adds the delta into its buffer (it
reads the variable and the delta and writes the variable: three passes over a
variable's worth of memory, and a node of its own).  And the reads of m and v after
their updates go through the variables, so the kernel computing var's delta waits for
those updates and reads their results back from memory.

Two rewrites, per variable, where the graph orders every write of the variable against
each other access of it (what ``tf.function``'s automatic control dependencies do):

1. ``AssignAdd/SubVariableOp(var, d)`` becomes ``AssignVariableOp(var, value + d)``
   (``- d``), ``validate_shape=True``, where ``value`` is the variable's value at that
   point: a read of it ordered after the last write, or what that write assigned, or a
   new ``ReadVariableOp`` with the update's control inputs.  The addition is an
   element-wise op the planner fuses with the math that computed ``d``.
2. Store-to-load forwarding: a ``ReadVariableOp`` ordered after a write and before the
   next reads what the write assigned (or, before any write, what an earlier read
   returned), so its readers read that tensor, and the read goes (its control edges
   move to its own control inputs) unless the function must run it (a control output
   of ``tf.function``'s: then it stays, read by nothing).  A read after a write is
   forwarded only where none of the function's outputs depends on it: a tape outside
   the function differentiates the outputs through the kernels' original ops, and
   through the written value the gradient would reach what computed the update,
   where TF's read passes it to the variable.  An optimizer's reads of m and v feed
   only further updates.

Both only where the value comes from an op a kernel can compute (``d``, or what an
``AssignVariableOp`` assigned): where TF computes it (a matrix product assigned as
is), the update stays TF's, which adds in place, and a read stays a read, not a
second reader of a value ``AssignVariableOp`` would then have to copy.

So Adam's update of one variable is one element-wise region: g, m, v and var in; m, v
and var out.  ``AssignVariableOp`` adopts its input's buffer when it is that tensor's
last reader (TF's ``forward_input``: no copy), so an update costs the kernel's passes
and a pointer swap.  The values are the same: ``var - d`` is the subtraction
AssignSubVariableOp does, in the variable's dtype, and a read after a write returns
what the write assigned.

Where it does not apply, nothing changes: a variable one of whose accesses is not a
plain read or write (a gather, a call, an Identity of the handle: the handle escapes),
whose accesses the graph does not order (a TF1 graph without control dependencies),
that lives on another job's device (a parameter server: AssignAdd's atomic add is what
lets workers update a variable at once, which a read, compute and assign would not),
or whose update's shape is not the variable's, known at trace time (AssignAdd refuses
another shape; an element-wise add would broadcast).

Opt-in (``Options(variable_updates=True)``): the new values are new buffers, so while a
kernel runs a variable's old and new values are both alive, where TF's AssignAdd adds
a delta into the old buffer.  On the train suite's steps (2-core AMD EPYC Zen 5) the
MLP step ran 7% faster and the Transformer's 1-2%, for a peak 0.5-0.7 MiB above stock
TF's (the suite's bar is at most TF's; a model whose variables dominate its memory
would pay up to its variables' and moments' size again).  A kernel writing the new
values into the variables' buffers under their locks (docs/internals/architecture.md,
"Variable updates") would make it free; that is not built.
"""
from __future__ import annotations

from tensorflow.core.framework import attr_value_pb2

from .. import opnames
from ..passmanager import Pass

READ = "ReadVariableOp"
UPDATES = {"AssignAddVariableOp": "AddV2", "AssignSubVariableOp": "Sub"}
ASSIGN = "AssignVariableOp"
WRITES = (ASSIGN, *UPDATES)


def _ref(name: str) -> str:
    """A data input's tensor, ``node`` and ``node:0`` alike."""
    return name[:-2] if name.endswith(":0") else name


def _node(name: str) -> str:
    return name.lstrip("^").split(":")[0]


def _accesses(graph_def) -> dict:
    """handle tensor -> the nodes reading or writing it through input 0, for handles
    every data reader of which is such a node (a handle gathered from, passed to a
    call or copied by an Identity escapes: not listed)."""
    readers: dict[str, list] = {}
    for nd in graph_def.node:
        for k, i in enumerate(nd.input):
            if i.startswith("^"):
                continue
            readers.setdefault(_ref(i), []).append((nd, k))
    out = {}
    for handle, users in readers.items():
        if all(nd.op in (READ, *WRITES) and k == 0 for nd, k in users):
            out[handle] = [nd for nd, _ in users]
    return out


def _ancestors(graph_def, tracked: list) -> dict | None:
    """For each node of ``tracked`` (names), the set of ``tracked`` nodes it depends on,
    through data and control edges, as a bit mask over ``tracked``'s indices; None
    when the graph has a cycle (a TF1 loop: left alone)."""
    bit = {name: 1 << i for i, name in enumerate(tracked)}
    nodes = {nd.name: nd for nd in graph_def.node}
    pending = {nd.name: len({_node(i) for i in nd.input if _node(i) in nodes})
               for nd in graph_def.node}
    users: dict[str, list] = {}
    for nd in graph_def.node:
        for src in {_node(i) for i in nd.input if _node(i) in nodes}:
            users.setdefault(src, []).append(nd.name)
    mask = dict.fromkeys(nodes, 0)
    ready = [n for n, k in pending.items() if k == 0]
    seen = 0
    while ready:
        name = ready.pop()
        seen += 1
        carried = mask[name] | bit.get(name, 0)
        for u in users.get(name, ()):
            mask[u] |= carried
            pending[u] -= 1
            if pending[u] == 0:
                ready.append(u)
    if seen != len(nodes):
        return None
    return {name: mask[name] for name in tracked}


def _feeding(nodes: dict, fetches) -> set:
    """The nodes a fetched tensor depends on through data edges.  A read after a write
    is forwarded only where no output depends on it: a tape outside the function
    differentiates the outputs through the kernels' original ops, and an output
    computed from the written value would take a gradient through the update, where
    TF's read passes the gradient to the variable instead.  ``nodes``: name -> node."""
    seen, todo = set(), [_node(f) for f in fetches]
    while todo:
        name = todo.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        todo.extend(_node(i) for i in nodes[name].input if not i.startswith("^"))
    return seen


def _remote(nd) -> bool:
    """Placed on another job's device (a parameter server's variable)."""
    dev = nd.device.lower()
    return "/job:" in dev and "/job:localhost" not in dev


def _ordered(accesses, anc, index) -> list | None:
    """The accesses of one variable in the order the graph runs them, or None where a
    write is not ordered against another access.  Reads between two writes keep their
    relative order where the graph gives one (an unordered pair: either first)."""
    writes = [nd for nd in accesses if nd.op in WRITES]
    for w in writes:
        for a in accesses:
            if a is w:
                continue
            if not (anc[w.name] >> index[a.name] & 1 or anc[a.name] >> index[w.name] & 1):
                return None
    # a topological order of the accesses: by how many of them each depends on
    mine = sum(1 << index[nd.name] for nd in accesses)
    return sorted(accesses, key=lambda nd: bin(anc[nd.name] & mine).count("1"))


def _static_shape(t):
    """A tf.Tensor's shape as a tuple of ints, or None unless fully known."""
    shape = t.shape
    if shape.rank is None or any(d is None for d in shape.as_list()):
        return None
    return tuple(shape.as_list())


class _Rewrite:
    """The rewrites of one graph (a copy the pass owns), variable by variable."""

    def __init__(self, graph_def, tf_graph, resources, pinned, excluded, anc, index,
                 fetches):
        self.g = graph_def
        self.anc, self.index = anc, index
        self.nodes = {nd.name: nd for nd in graph_def.node}
        self.to_outputs = _feeding(self.nodes, fetches)
        self.tf_graph = tf_graph
        self.resources = resources or {}
        self.pinned = pinned
        self.excluded = excluded
        self.taken = {nd.name for nd in graph_def.node}
        self.redirect: dict[str, str] = {}     # read tensor -> the tensor it reads
        self.dropped: dict[str, list] = {}     # read node -> its control inputs
        self.updates = 0
        self.variables = set()

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def var_shape(self, handle: str, accesses):
        """The variable's static shape: from the live graph's resource data, else
        TF's inferred shape of one of its reads."""
        got = self.resources.get(_node(handle))
        if got is not None and all(d is not None for d in got[1]):
            return tuple(got[1])
        for nd in accesses:
            if nd.op == READ:
                try:
                    return _static_shape(self.tf_graph.get_operation_by_name(nd.name).outputs[0])
                except KeyError:
                    return None
        return None

    def delta_shape(self, nd):
        try:
            op = self.tf_graph.get_operation_by_name(nd.name)
        except KeyError:
            return None
        return _static_shape(op.inputs[1])

    def variable(self, handle: str, order: list, shape) -> None:
        cur = None          # the tensor holding the variable's value here, if known
        read = None         # the read node cur is, if it is one
        for nd in order:
            if nd.op == READ:
                if cur is None:
                    cur, read = nd.name, nd.name
                elif nd.name not in self.excluded and (
                        self.before(read, nd.name) if read is not None
                        else nd.name not in self.to_outputs):
                    # after a write: its value (an input of the write, which this read
                    # follows); after a read: that read, where the graph runs it first
                    self.redirect[nd.name] = cur
                    self.dropped[nd.name] = [i for i in nd.input if i.startswith("^")]
                continue
            read = None
            if nd.op == ASSIGN:
                cur = _ref(nd.input[1]) if self.fusible(nd.input[1]) else None
                continue
            if shape is None or nd.name in self.excluded or self.delta_shape(nd) != shape \
                    or not self.fusible(nd.input[1]):
                cur = None          # left as TF's update: a later read reads it
                continue
            cur = self.update(nd, handle, cur)

    def fusible(self, tensor: str) -> bool:
        """Whether ``tensor`` comes from an op a kernel can compute."""
        nd = self.nodes.get(_node(tensor))
        return nd is not None and opnames.is_memory_intensive(nd.op) \
            and nd.op not in opnames.UNSUPPORTED_MEMORY_INTENSIVE \
            and nd.name not in self.excluded

    def before(self, a: str, b: str) -> bool:
        """Whether node ``a`` is an ancestor of node ``b`` (both accesses)."""
        return bool(self.anc[b] >> self.index[a] & 1)

    def update(self, nd, handle: str, base: str | None) -> str:
        """``nd`` (an AssignAdd/Sub) becomes AssignVariableOp(handle, base +- delta);
        returns the new value's tensor."""
        data = [i for i in nd.input if not i.startswith("^")]
        control = [i for i in nd.input if i.startswith("^")]
        dtype = nd.attr["dtype"]
        if base is None:
            read = self.g.node.add(name=self.fresh(f"{nd.name}/stitching_read"), op=READ,
                                   device=nd.device)
            read.input.extend([handle] + control)
            read.attr["dtype"].CopyFrom(dtype)
            base = read.name
        value = self.g.node.add(name=self.fresh(f"{nd.name}/stitching_value"),
                                op=UPDATES[nd.op], device=nd.device)
        value.input.extend([base, data[1]])
        value.attr["T"].CopyFrom(dtype)
        nd.op = ASSIGN
        del nd.input[:]
        nd.input.extend([handle, value.name] + control)
        keep = {k: v for k, v in nd.attr.items() if k.startswith("_")}
        nd.attr.clear()
        for k, v in keep.items():
            nd.attr[k].CopyFrom(v)
        nd.attr["dtype"].CopyFrom(dtype)
        nd.attr["validate_shape"].CopyFrom(attr_value_pb2.AttrValue(b=True))
        self.updates += 1
        return value.name

    def finish(self) -> None:
        """Readers of a forwarded read read its value; the read goes, and a control
        edge from it becomes edges from its own control inputs."""
        def resolve(t):
            seen = set()
            while t in self.redirect and t not in seen:
                seen.add(t)
                t = self.redirect[t]
            return t
        gone = {r for r in self.redirect if r not in self.pinned}
        for nd in self.g.node:
            if nd.name in gone:
                continue
            new, changed = [], False
            for i in nd.input:
                if i.startswith("^") and i[1:] in gone:
                    new.extend(self._controls(i[1:]))
                    changed = True
                elif not i.startswith("^") and _ref(i) in self.redirect:
                    new.append(resolve(_ref(i)))
                    changed = True
                else:
                    new.append(i)
            if changed:
                data = [i for i in new if not i.startswith("^")]
                ctrl = list(dict.fromkeys(i for i in new if i.startswith("^")
                                          and i[1:] != nd.name
                                          and i[1:] not in {_node(d) for d in data}))
                del nd.input[:]
                nd.input.extend(data + ctrl)
        for nd in [nd for nd in self.g.node if nd.name in gone]:
            self.g.node.remove(nd)

    def _controls(self, name, seen=None) -> list:
        """The control inputs standing in for a dropped read (its own, through reads
        dropped before it)."""
        seen = seen if seen is not None else set()
        out = []
        for c in self.dropped.get(name, []):
            if c[1:] in self.dropped and c[1:] not in seen:
                seen.add(c[1:])
                out.extend(self._controls(c[1:], seen))
            else:
                out.append(c)
        return out


def rewrite(graph_def, tf_graph, resources=None, pinned=frozenset(),
            excluded=frozenset(), fetches=()):
    """A rewritten copy of ``graph_def`` and the counts (updates, reads forwarded,
    variables), or None when nothing applies.  ``fetches``: the function's outputs
    (tensor names)."""
    found = {h: acc for h, acc in _accesses(graph_def).items()
             if any(nd.op in UPDATES for nd in acc) or sum(nd.op == READ for nd in acc) > 1}
    if not found:
        return None
    tracked = list(dict.fromkeys(nd.name for acc in found.values() for nd in acc))
    anc = _ancestors(graph_def, tracked)
    if anc is None:
        return None
    index = {name: i for i, name in enumerate(tracked)}
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    rw = _Rewrite(out, tf_graph, resources, pinned, excluded, anc, index, fetches)
    for handle, acc in found.items():
        if any(_remote(nd) for nd in acc) or any(nd.name in excluded for nd in acc
                                                 if nd.op in WRITES):
            continue
        order = _ordered(acc, anc, index)
        if order is None or len({nd.attr["dtype"].type for nd in acc}) != 1:
            continue
        before = (rw.updates, len(rw.redirect))
        rw.variable(handle, [rw.nodes[nd.name] for nd in order], rw.var_shape(handle, acc))
        if (rw.updates, len(rw.redirect)) != before:
            rw.variables.add(handle)
    if not rw.updates and not rw.redirect:
        return None
    rw.finish()
    return out, rw.updates, len(rw.redirect), len(rw.variables)


def _run(ctx):
    if not ctx.has_op(*UPDATES) and not ctx.has_op(READ):
        return None
    got = rewrite(ctx.graph_def, ctx.tf_graph, ctx.resources, ctx.pinned, ctx.excluded,
                  ctx.fetches)
    if got is None:
        return None
    graph_def, updates, forwarded, variables = got
    ctx.replace(graph_def)
    return (f"{variables} variable(s): {updates} AssignAdd/AssignSub update(s) "
            f"computed as the new value (AssignVariableOp), {forwarded} read(s) "
            f"forwarded from the value written or read before them "
            f"(tf/passes/variables.py, Options(variable_updates=True))")


PASS = Pass("variables", _run, option="variable_updates")
