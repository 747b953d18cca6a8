"""Token-wise blocks split in two along the sequence, so TF runs their products on both cores.

TF's oneDNN ``MatMul`` runs a product on one thread when its operands fit in one core's
L2 (``ExecuteSingleThreadedGemm``, tensorflow/core/kernels/mkl/mkl_matmul_ops_common.h:
``4 (M N + K (M + N)) < L2``).  A Transformer's feed-forward block at batch 1 is such a
product: [128, 256] x [256, 1024] is 1.7 MB, under a 2 MiB L2, and runs at 0.68x XLA's
dot (tools/gemm_probe.py).  The block is token-wise (every op acts on each position of
the sequence alone), so it can run as two halves of the sequence, each half's products
single-threaded, the two halves side by side on TF's inter-op threads:

    X [B, T, D] -> Split(axis 1) -> block(X[:, :T/2]), block(X[:, T/2:]) -> ConcatV2(axis 1)

Measured on whole feed-forward blocks (tools/gemm_probe.py, 2 cores, 2 MiB L2): 1.39x
at M = B T = 128, 1.08x at 256, 1.00x at 1024.  The batch is often unknown when the graph is
rewritten (then the block is split, for batch 1); the split costs a copy of the block's
output (ConcatV2) and two products competing for the cores, which is what makes it
cost ~3.6% at batch 8.

Only where TF runs oneDNN (the device profile's ``tf_onednn``, else the running TF's:
tf/passes/remapper.py) and with the profile's L2: Eigen's contraction (oneDNN off, as on the
AMD EPYC machines here) has no one-thread rule and runs such a product on the whole
pool (measured, [128, 256] x [256, 1024] under load: 2 threads 1.08-1.2x faster than 1).

The block (before the IR is built, on the GraphDef after Grappler): grown forward from
the input ``X`` [?, T, D] (T static and even) of a *seed*, a product against a 2-D
weight whose operands at batch 1 fall under TF's one-thread line and whose work is
large enough for two threads to pay (``T K N >= MIN_MACS``).  Where the batch B is
known (a trace at one batch size) the rows are B T: at batch 8 TF already runs the
products on both threads and the split would only cost its copies (3.6% on the models
suite's encoder, ``tools/transformer_layers.py --whole``).  An op joins when it is
token-wise and all its inputs are block values, parameters (values that broadcast along
the last axis only: rank <= 1 or leading dims 1, not computed from the block), or other
[?, T, ...] tensors computed before the block (split as inputs too):

- element-wise ops and BiasAdd; Mean/Sum/Max/Min over the last axis with keep_dims;
- the Tensordot of a Keras ``Dense``: identity Transpose, Reshape [?, T, K] -> [-1, K]
  (token rows, ``flat``), MatMul of flat rows by a 2-D weight, Reshape back to
  [?, T, N] with a target computed from the block's own Shape.  Traced at a known
  batch B, the targets are constants [B T, K] and [B, T, N]: the halves get their
  own, [B T / 2, K] and [B, T / 2, N]; any other constant target holding T would be
  wrong for a half, and such a Reshape ends the block;
- BatchMatMulV2 [?, T, K] x W[K, N]; Shape of a block value and the integer arithmetic
  on it (its values differ per half, so it is cloned too).

The block ends where a value fans out to two or more products (attention's Q/K/V
projections read the LayerNorm that ends a feed-forward block) and before any op that is
not token-wise.  Its outputs must be [?, T, ...] tensors (joined by ConcatV2); a flat or
shape value read outside, an op with control edges, a path from an output back into the
block, or more than ``MAX_OUTPUTS`` outputs (a training graph, whose backward reads every
activation) reject the block, as does a half whose inferred shape is not the original's
with T halved (checked after the rewrite).  Halves compute the same per-row math;
products may sum in another order (float rounding).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2

from ..passmanager import Pass

MIN_MACS = 1 << 24        # tuned: [128, 256] x [256, 256] (8.4M) runs faster on one thread
MIN_T = 32                # arbitrary: shorter sequences are not worth two ops per op
MAX_OUTPUTS = 2           # arbitrary: a block is one value in, one (or two) out

_ELEMENTWISE = frozenset("""Add AddV2 Sub Mul RealDiv Div Maximum Minimum SquaredDifference
    Neg Abs Square Sqrt Rsqrt Exp Log Log1p Tanh Sigmoid Erf Erfc Relu Relu6 Elu Selu Gelu
    Softplus Softsign LeakyRelu Pow Reciprocal Sign Floor Ceil Cast Identity StopGradient
    BiasAdd SelectV2 Select Greater GreaterEqual Less LessEqual Equal NotEqual LogicalAnd
    LogicalOr LogicalNot IsNan IsFinite ClipByValue""".split())
_REDUCE = frozenset({"Mean", "Sum", "Max", "Min", "Prod"})
_SHAPE_MATH = frozenset({"GatherV2", "Prod", "ConcatV2", "Pack", "StridedSlice", "Cast",
                         "Identity", "Mul", "Add", "AddV2", "Sub"})
_FLOATS = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

TOK, FLAT, SHAPE = "tok", "flat", "shape"


def _static(t) -> list | None:
    return None if t.shape.rank is None else t.shape.as_list()


def _const_value(t):
    if t.op.type != "Const":
        return None
    return tf.make_ndarray(t.op.get_attr("value"))


class _Block:
    def __init__(self, T: int):
        self.T = T
        self.kind: dict = {}       # tensor name -> TOK | FLAT | SHAPE (values in the block)
        self.half_target: dict = {}    # Reshape op name -> its halves' constant target
        self.ops: list = []        # block ops in topological order
        self.inputs: list = []     # [?, T, ...] tensors from outside, split
        self.products = 0          # seed-sized products inside


def _is_tok(t, T) -> bool:
    s = _static(t)
    return s is not None and len(s) >= 3 and s[1] == T and t.dtype in _FLOATS


def _is_param(t) -> bool:
    """A value that broadcasts along the last axis only."""
    s = _static(t)
    return s is not None and (len(s) <= 1 or all(d == 1 for d in s[:-1]))


def _compatible(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b))


def _seed_input(op, l2: int):
    """The [?, T, K] tensor a seed product reads, or None."""
    if op.type == "BatchMatMulV2" and not op.get_attr("adj_x"):
        x, w = op.inputs[0], op.inputs[1]
    elif op.type == "MatMul" and not op.get_attr("transpose_a"):
        x, w = op.inputs[0], op.inputs[1]
        while x.op.type in ("Reshape", "Transpose", "Identity"):
            x = x.op.inputs[0]
    else:
        return None
    ws, xs = _static(w), _static(x)
    # a weight of unknown size (input_signature TensorSpec((None, None))) is no seed
    if ws is None or len(ws) != 2 or None in ws or min(ws) < 1 or xs is None \
            or len(xs) != 3:
        return None
    T = xs[1]
    if T is None or T < MIN_T or T % 2 or x.dtype not in _FLOATS:
        return None
    k, n = ws
    transposed = op.get_attr("adj_y" if op.type == "BatchMatMulV2" else "transpose_b")
    if transposed:
        k, n = n, k
    if xs[2] != k or T * k * n < MIN_MACS or not _one_thread(_rows(xs), k, n, l2):
        return None
    return x


def _rows(xs) -> int:
    """The product's rows M = B T: at batch 1 where the batch is unknown (the latency
    case the split is for), the traced batch where it is known."""
    return xs[1] * (xs[0] if xs[0] is not None and xs[0] > 0 else 1)


def _one_thread(m: int, k: int, n: int, l2: int) -> bool:
    """TF's oneDNN MatMul runs [m, k] x [k, n] on one thread (its operands fit in L2)."""
    return 4 * (m * n + k * (m + n)) < l2


def _products_reading(t) -> int:
    return sum(c.type in ("MatMul", "BatchMatMulV2", "BatchMatMul", "Einsum")
               for c in t.consumers())


def _grow(x, T: int, after: set, l2: int) -> _Block | None:
    """The token-wise block read from ``x`` (see the module docstring), or None.
    ``after``: the ops computed from ``x``; an input from one of them that is not a
    block value is not ready (it may become one later in the walk) or never will be."""
    b = _Block(T)
    b.kind[x.name] = TOK
    b.inputs.append(x)
    frontier = [x]
    seen_ops = set()
    while frontier:
        t = frontier.pop()
        if t is not x and _products_reading(t) >= 2:
            continue                                  # fans out to products: the end
        for op in t.consumers():
            if op.name in seen_ops:
                continue
            if any(i.name not in b.kind and i.op.name in after for i in op.inputs):
                continue                              # an input not ready yet: revisit
            kind, new_inputs = _classify(op, b)
            if kind is None:
                continue
            seen_ops.add(op.name)
            for i in new_inputs:
                b.kind[i.name] = TOK
                b.inputs.append(i)
            b.ops.append(op)
            if op.type in ("MatMul", "BatchMatMulV2") and _is_seed(op, l2):
                b.products += 1
            b.kind[op.outputs[0].name] = kind
            frontier.append(op.outputs[0])
    return b if b.products else None


def _is_seed(op, l2: int) -> bool:
    """A block product as large as a seed (its rows at batch 1 are the sequence)."""
    ws = _static(op.inputs[1])
    if ws is None or len(ws) != 2:
        return False
    k, n = ws
    if op.get_attr("adj_y" if op.type == "BatchMatMulV2" else "transpose_b"):
        k, n = n, k
    x = op.inputs[0]
    while x.op.type in ("Reshape", "Transpose", "Identity") and len(_static(x) or []) != 3:
        x = x.op.inputs[0]
    xs = _static(x)
    T = xs[1] if xs is not None and len(xs) == 3 else None
    return T is not None and T * k * n >= MIN_MACS and _one_thread(_rows(xs), k, n, l2)


def _classify(op, b: _Block):
    """(kind of ``op``'s output as a block member, [?, T, ...] inputs from outside to
    split), or (None, []) when ``op`` ends the block.  Inputs not in the block are
    computed before it (the caller checked)."""
    none = (None, [])
    if any(c.type != "Const" for c in op.control_inputs) or op._control_outputs \
            or len(op.outputs) != 1:
        return none             # (Grappler anchors an Identity to a constant: kept)
    kinds = [b.kind.get(i.name) for i in op.inputs]
    block_kinds = {k for k in kinds if k is not None}
    out, ty = op.outputs[0], op.type
    if block_kinds == {SHAPE}:
        ok = ty in _SHAPE_MATH and out.dtype in (tf.int32, tf.int64) and all(
            k is not None or i.op.type == "Const" for k, i in zip(kinds, op.inputs))
        return (SHAPE, []) if ok else none
    if ty == "Shape":
        return (SHAPE, []) if kinds[0] == TOK else none
    if ty == "Reshape":
        kind, half = _reshape_kind(op, kinds, b.T)
        if half is not None:
            b.half_target[op.name] = half
        return kind, []
    if SHAPE in block_kinds:
        return none
    if ty in _ELEMENTWISE:
        if len(block_kinds) != 1:
            return none
        kind = next(iter(block_kinds))
        new = []
        for k, i in zip(kinds, op.inputs):
            if k is not None or _is_param(i):
                continue
            if kind == TOK and _is_tok(i, b.T) and _compatible(_static(i), _static(out)):
                new.append(i)                          # e.g. a residual from before
                continue
            return none
        return kind, new
    if ty in _REDUCE:
        axes = _const_value(op.inputs[1])
        rank = len(_static(op.inputs[0]) or [])
        if axes is None or not rank or not op.get_attr("keep_dims") or kinds[0] is None:
            return none
        axes = sorted(int(a) % rank for a in np.atleast_1d(axes))
        return (kinds[0], []) if axes == [rank - 1] else none
    if ty == "Transpose":
        perm = _const_value(op.inputs[1])
        if kinds[0] is None or perm is None or list(perm) != list(range(len(perm))):
            return none
        return kinds[0], []
    w = _static(op.inputs[1]) if len(op.inputs) > 1 else None
    if ty == "MatMul" and kinds == [FLAT, None] and not op.get_attr("transpose_a") \
            and w is not None and len(w) == 2:
        return FLAT, []
    if ty == "BatchMatMulV2" and kinds == [TOK, None] and not op.get_attr("adj_x") \
            and w is not None and len(w) == 2:
        return TOK, []
    return none


def _reshape_kind(op, kinds, T: int):
    """(kind, the halves' constant target or None): token rows [?, T, K] <-> [-1, K], by
    a target computed from the block's own Shape (right for a half too), a constant
    [-1, K], or, traced at a known batch B, the constants [B T, K] and [B, T, ...]
    (halved for the halves).  (None, None) ends the block."""
    none = (None, None)
    out, x = _static(op.outputs[0]), _static(op.inputs[0])
    if kinds[0] not in (TOK, FLAT) or out is None or x is None:
        return none
    if kinds[1] is None:
        target = _const_value(op.inputs[1])
        if target is None or target.ndim != 1:
            return none
        target = [int(v) for v in target]
        if kinds[0] == TOK:
            if target == [-1, x[-1]]:
                return FLAT, None
            if None not in x and target == [int(np.prod(x[:-1])), x[-1]]:
                return FLAT, [target[0] // 2, x[-1]]
            return none
        if len(target) >= 3 and target == out and target[1] == T \
                and target[-1] == x[-1] and min(target) > 0:
            return TOK, [target[0], T // 2, *target[2:]]
        return none
    if kinds[1] != SHAPE:
        return none
    # TF's shape inference may not see through the target's arithmetic: an unknown
    # row width is accepted here (halves_match checks the halves after the rewrite)
    if kinds[0] == TOK and len(out) == 2 and out[1] in (None, x[-1]):
        return FLAT, None
    if kinds[0] == FLAT and len(out) >= 3 and out[1] in (None, T) \
            and out[-1] in (None, x[-1]):
        return TOK, None
    return none


def _outputs(b: _Block, fetched: set) -> list | None:
    """Block values read outside it (all [?, T, ...]), or None when the block cannot be cut."""
    members = {op.name for op in b.ops}
    outs = []
    for op in b.ops:
        t = op.outputs[0]
        outside = [c for c in t.consumers() if c.name not in members] \
            or op.name in fetched or op._control_outputs
        if not outside:
            continue
        if b.kind[t.name] != TOK:
            return None
        outs.append(t)
    return outs if 0 < len(outs) <= MAX_OUTPUTS else None


def _reenters(b: _Block, outs: list) -> bool:
    """True if a path leaves the block at an output and comes back into it."""
    members = {op.name for op in b.ops}
    entry = {i.op.name for op in b.ops for i in op.inputs if i.op.name not in members}
    stack = [c for t in outs for c in t.consumers() if c.name not in members]
    seen = set()
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in entry:
            return True
        stack.extend(c for o in op.outputs for c in o.consumers() if c.name not in members)
    return False


def _descendants(tf_graph, roots) -> set:
    out, stack = set(), list(roots)
    while stack:
        op = stack.pop()
        for o in op.outputs:
            for c in o.consumers():
                if c.name not in out:
                    out.add(c.name)
                    stack.append(c)
    return out


def find(tf_graph, fetched: set, l2: int, excluded=frozenset()) -> list:
    """The blocks to split: (block, outputs) in topological order, disjoint.  A block
    holding a node of ``excluded`` (Options(exclude): left as it is) is not split: its
    halves would replace the node by two copies."""
    taken: set = set()
    blocks = []
    for op in tf_graph.get_operations():
        if op.name in taken:
            continue
        x = _seed_input(op, l2)
        if x is None:
            continue
        b = _grow(x, _static(x)[1], _descendants(tf_graph, [x.op]), l2)
        if b is None or any(o.name in taken or o.name in excluded for o in b.ops):
            continue
        outs = _outputs(b, fetched)
        if outs is None or _reenters(b, outs):
            continue
        taken.update(o.name for o in b.ops)
        blocks.append((b, outs))
    return blocks


def _tensor(name: str) -> str:
    """A NodeDef input string as a tensor name ``op:k``."""
    return name if ":" in name else f"{name}:0"


def rewrite(graph_def, blocks) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` with each block run as two halves of the sequence."""
    by_name = {nd.name: nd for nd in graph_def.node}
    drop, replace, add = set(), {}, []
    taken = set(by_name)

    def fresh(base: str) -> str:
        n = base
        while n in taken:
            n += "_"
        taken.add(n)
        return n

    def const(base, value, dev):
        c = node_def_pb2.NodeDef(name=fresh(base), op="Const", device=dev)
        c.attr["dtype"].type = tf.int32.as_datatype_enum
        c.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.asarray(value, np.int32)))
        add.append(c)
        return c.name

    def reshape(base, value, target, dtype, dev):
        r = node_def_pb2.NodeDef(name=base, op="Reshape", input=[value, target], device=dev)
        r.attr["T"].type = dtype.as_datatype_enum
        r.attr["Tshape"].type = tf.int32.as_datatype_enum
        return r

    for b, outs in blocks:
        anchor = b.ops[0]
        dev = by_name[anchor.name].device
        # Token-wise: any two halves of the tokens will do, the same for every input
        # and output.  With the trailing dims static, [B, T, ...] is viewed as
        # [2B, T/2, ...] and cut on axis 0, which TF's Split does without a copy;
        # else it is cut on axis 1 (a copy).
        rests = [_static(t)[2:] for t in b.inputs + outs]
        flat = all(None not in r for r in rests)
        axis = const(f"{anchor.name}/seqsplit/axis", 0 if flat else 1, dev)
        halves = {}                                   # tensor -> (half 0, half 1)
        for t, rest in zip(b.inputs, rests):
            src = t.name
            if flat:
                view = reshape(fresh(f"{t.op.name}/seqsplit/view"), t.name,
                               const(f"{t.op.name}/seqsplit/halves", [-1, b.T // 2] + rest,
                                     dev), t.dtype, dev)
                add.append(view)
                src = view.name
            sp = node_def_pb2.NodeDef(name=fresh(f"{t.op.name}/seqsplit/in"), op="Split",
                                      input=[axis, src], device=dev)
            sp.attr["T"].type = t.dtype.as_datatype_enum
            sp.attr["num_split"].i = 2
            add.append(sp)
            halves[t.name] = (f"{sp.name}:0", f"{sp.name}:1")
        names = {op.name: (fresh(f"{op.name}/seqsplit_0"), fresh(f"{op.name}/seqsplit_1"))
                 for op in b.ops}
        for op in b.ops:
            halves[op.outputs[0].name] = names[op.name]
        for op in b.ops:
            nd = by_name[op.name]
            half_target = b.half_target.get(op.name)
            if half_target is not None:
                half_target = const(f"{op.name}/seqsplit/target", half_target, nd.device)
            for h in (0, 1):
                c = node_def_pb2.NodeDef()
                c.CopyFrom(nd)
                c.name = names[op.name][h]
                del c.input[:]
                c.input.extend(halves[_tensor(i)][h] if _tensor(i) in halves else i
                               for i in nd.input)
                if half_target is not None:
                    c.input[1] = half_target
                    c.attr["Tshape"].type = tf.int32.as_datatype_enum
                add.append(c)
        for t, rest in zip(outs, rests[len(b.inputs):]):
            nd = by_name[t.op.name]
            cat = node_def_pb2.NodeDef(name=fresh(f"{nd.name}/seqsplit/join") if flat
                                       else nd.name, op="ConcatV2", device=nd.device,
                                       input=[*names[t.op.name], axis])
            cat.attr["T"].type = t.dtype.as_datatype_enum
            cat.attr["N"].i = 2
            cat.attr["Tidx"].type = tf.int32.as_datatype_enum
            if flat:        # back to [B, T, ...] under the original name
                add.append(cat)
                replace[nd.name] = reshape(nd.name, cat.name, const(
                    f"{nd.name}/seqsplit/whole", [-1, b.T] + rest, nd.device), t.dtype,
                    nd.device)
            else:
                replace[nd.name] = cat
        drop.update(op.name for op in b.ops)
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for nd in graph_def.node:
        if nd.name in replace:
            out.node.append(replace[nd.name])
        elif nd.name not in drop:
            out.node.append(nd)
    out.node.extend(add)
    return out


def halves_match(blocks, new_graph) -> str | None:
    """None if every half's inferred shape is its original's with the sequence halved
    (token values) or the same row width (flat values); else the first mismatch."""
    for b, _ in blocks:
        for op in b.ops:
            kind = b.kind[op.outputs[0].name]
            if kind == SHAPE:
                continue
            want = _static(op.outputs[0])
            for h in (0, 1):
                got = _static(new_graph.get_operation_by_name(
                    f"{op.name}/seqsplit_{h}").outputs[0])
                if kind == TOK:     # (TF may not infer T through Tensordot's Reshape)
                    ok = got is not None and len(got) == len(want) and all(
                        g == (w // 2 if i == 1 and w is not None else w)
                        for i, (g, w) in enumerate(zip(got, want)))
                else:
                    ok = got is not None and len(got) == 2 and got[1] == want[1]
                if not ok:
                    return f"{op.name}: a half is {got}, the block's value {want}"
    return None


def _run(ctx):
    """Token-wise blocks split along the sequence where TF would run their products on
    one thread at batch 1; the halves checked on the new graph's shapes."""
    from ...plan import profiles
    from . import remapper
    prof = profiles.default()
    if prof.backend != "cpu" or not remapper.onednn(prof):
        return None          # the one-thread rule is oneDNN's (the module's docstring)
    l2 = prof.caches.get("l2", 0)
    if not ctx.has_op("BatchMatMulV2", "MatMul"):      # the seeds (_seed_input)
        return None
    blocks = find(ctx.tf_graph, ctx.fetched, l2, ctx.excluded)
    if not blocks:
        return None
    new = rewrite(ctx.graph_def, blocks)
    new_graph = ctx.shapes_of(new)
    bad = halves_match(blocks, new_graph)
    if bad is not None:
        return f"token-wise blocks left whole: {bad} (tf/passes/seqsplit.py)"
    ctx.replace(new, new_graph)
    ops = sum(len(b.ops) for b, _ in blocks)
    return (f"{len(blocks)} token-wise block(s) ({ops} TF ops) run as two halves of the "
            f"sequence: at batch 1 TF runs their products on one thread (operands under "
            f"L2, {l2 >> 10} KiB), the halves use both cores (tf/passes/seqsplit.py; "
            f"Options(seq_split=False) keeps them whole)")


PASS = Pass("seqsplit", _run, option="seq_split")
