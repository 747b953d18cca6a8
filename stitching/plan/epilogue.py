"""Convolution epilogues that TF's remapper fuses: work the cost model prices at ~nothing.

Stock TF runs Grappler's remapper over every function it executes, and the remapper folds
a convolution's BiasAdd (and some activations after it) into the convolution's own
kernel: the bias and the activation are applied to each output block while it is still
in cache, for free.  A stitched kernel that takes that BiasAdd costs a launch and a pass
over the convolution's output, and stops the remapper from fusing it.  Our rewritten
graph goes through the same runtime Grappler, so whatever we leave to TF in such a
pattern is fused there exactly as in stock TF.

What the remapper fuses, checked here on TF 2.21 (tensorflow-cpu, x86), by the op types
that run in a tf.function (RunMetadata partition graphs):

  oneDNN on (TF_ENABLE_ONEDNN_OPTS, the default on x86), float32 / bfloat16:
    Conv2D + BiasAdd [+ Relu | Relu6 | Elu | LeakyRelu | x * Sigmoid(x)]
                                                     -> _MklNativeFusedConv2D
    DepthwiseConv2dNative + BiasAdd [+ Relu | Relu6 | Elu]
                                                     -> _MklNativeFusedDepthwiseConv2dNative
  oneDNN off, float32:
    Conv2D + BiasAdd [+ Relu | Relu6 | Elu | LeakyRelu]          -> _FusedConv2D
    (DepthwiseConv2dNative: nothing)
  Never fused into the convolution: Sigmoid, Tanh, GELU (they run as their own ops);
  swish or LeakyRelu after a depthwise convolution (a separate _MklSwish / LeakyRelu);
  float64 (no fusion at all).

The pattern, on the IR (the convolution is an opaque node): a convolution whose only
reader is a BiasAdd over the channel axis (NHWC), then optionally the activation, where
each value but the last has no other reader and is not a function output.  Swish is
x * Sigmoid(x) with both reading the BiasAdd.  An Identity may sit between BiasAdd and
Sigmoid (Grappler folds Keras' ``beta * x`` with beta = 1 into one, anchored to the
constant by a control edge): the remapper does not look through it while that control
edge is there, so the rewrite forwards such an Identity (tf/passes/remapper.py), and only one
whose control inputs are constants is taken.  Keras' swish goes through
``tf.custom_gradient``, whose IdentityN keeps the remapper from fusing it in stock TF;
the IdentityN is bypassed after Grappler (tf/passes/grappler.py), so here it fuses.

``mark`` tags the members with the convolution's name (``attrs["tf_epilogue"]``, a
planner-only attribute); cost.GraphCosts prices a tagged op left to TF at its compute
only (no launch, no memory traffic), so a kernel made of nothing but an epilogue never
pays, while an epilogue can still join a kernel with more work downstream when that
pays.  ``left_to_tf`` says, for the final plan, which tagged ops the remapper really
fuses (a BiasAdd taken into a kernel ends its group; an activation group is fused only
whole) and why, for the report.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir import Graph

ATTR = "tf_epilogue"
SWISH = "swish"                      # x * Sigmoid(x) (as Keras and tf.nn.silu write it)
_ACTS = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu"})


@dataclass(frozen=True)
class Remapper:
    """What TF's remapper fuses into a convolution: conv op -> activations."""
    name: str
    convs: dict
    dtypes: frozenset


# a depthwise convolution is DepthwiseConv2D in the IR (ir/ops.py), the TF op's name
# where the frontend leaves it opaque (a form the kernels do not compute)
ONEDNN = Remapper("onednn", {"Conv2D": _ACTS | {SWISH},
                             "DepthwiseConv2dNative": _ACTS - {"LeakyRelu"},
                             "DepthwiseConv2D": _ACTS - {"LeakyRelu"}},
                  frozenset({"float32", "bfloat16"}))
EIGEN = Remapper("eigen", {"Conv2D": _ACTS}, frozenset({"float32"}))
NONE = Remapper("none", {}, frozenset())


def find(graph: Graph, remapper: Remapper) -> list:
    """[(conv, [BiasAdd], [activation members])] for each fusible epilogue."""
    if not remapper.convs:
        return []
    cons = graph.consumers()
    fetched = {r.node for r in graph.outputs}
    out = []
    for conv in graph:
        acts = remapper.convs.get(conv.op)
        if acts is None or conv.name in fetched or len(cons[conv.name]) != 1:
            continue
        b = graph[cons[conv.name][0]]
        if not _is_bias(graph, b, conv.name, remapper):
            continue
        out.append((conv.name, [b.name], _activation(graph, b, cons, fetched, acts)))
    return out


def _is_bias(graph, b, conv: str, remapper) -> bool:
    return (b.op == "BiasAdd" and b.attrs.get("data_format", "NHWC") == "NHWC"
            and len(b.inputs) == 2 and b.inputs[0].node == conv and b.inputs[0].index == 0
            and b.inputs[1].node != conv
            and graph.type_of(b.inputs[0]).dtype in remapper.dtypes)


def _activation(graph, b, cons, fetched, acts) -> list:
    """The activation after BiasAdd ``b`` that the remapper takes, as its node names."""
    if b.name in fetched:
        return []
    readers = cons[b.name]
    if len(readers) == 1 and graph[readers[0]].op in acts:
        return readers
    if SWISH in acts and len(readers) == 2:
        return _swish(graph, b.name, readers, cons, fetched)
    return []


def _swish(graph, b: str, readers, cons, fetched) -> list:
    """[Identity..., Sigmoid, Mul] when ``b``'s two readers compute b * Sigmoid(b)."""
    by_op = {graph[r].op: graph[r] for r in readers}
    mul = by_op.get("Mul")
    first = by_op.get("Sigmoid") or by_op.get("Identity")
    if mul is None or first is None:
        return []
    chain, node = [], first
    while node.op == "Identity" and len(chain) < 4:   # b -> Identity -> ... -> Sigmoid
        nxt = cons[node.name]
        if node.name in fetched or len(nxt) != 1 or any(
                graph[c].op != "Const" for c in node.control_inputs):
            return []
        chain.append(node.name)
        node = graph[nxt[0]]
    if node.op != "Sigmoid" or node.name in fetched or cons[node.name] != [mul.name]:
        return []
    if sorted((r.node, r.index) for r in mul.inputs) != sorted([(b, 0), (node.name, 0)]):
        return []
    return chain + [node.name, mul.name]


# Products and convolutions whose bfloat16 BiasAdd oneDNN adds inside the op.
ROUNDING_PRODUCTS = frozenset({"MatMul", "Conv2D", "DepthwiseConv2dNative",
                               "DepthwiseConv2D"})
ROUNDING = ("bfloat16: TF's remapper adds the bias inside the product (oneDNN), to its "
            "float32 accumulator, and rounds once; a kernel would add it to the product "
            "already rounded to bfloat16 (less accurate: up to hundreds of ulps where the "
            "bias cancels the product)")


def pin_rounding(graph: Graph, remapper: Remapper) -> int:
    """Where TF runs oneDNN, the BiasAdd right after a bfloat16 product or convolution
    stays TF's (``unfusible``, with the reason): oneDNN's fused op adds the bias before
    its one rounding to bfloat16, and any kernel taking the BiasAdd would read the
    product rounded first.  A Keras Dense layer under ``mixed_bfloat16``: max 251 ulps
    stitched against stock's 0.5 (float32 products round to float32 either way, and
    float16 ones are not fused on the CPU).  Returns how many it pinned."""
    if remapper is not ONEDNN:
        return 0
    cons = graph.consumers()
    fetched = {r.node for r in graph.outputs}
    pinned = 0
    for p in graph:
        if p.op not in ROUNDING_PRODUCTS or p.name in fetched or len(cons[p.name]) != 1:
            continue
        b = graph[cons[p.name][0]]
        if (b.op == "BiasAdd" and b.inputs and b.inputs[0].node == p.name
                and b.inputs[0].index == 0
                and graph.type_of(b.inputs[0]).dtype == "bfloat16"):
            b.attrs.setdefault("unfusible", ROUNDING)
            pinned += 1
            if p.op == "MatMul" and b.name not in fetched:
                for n in _gelu_exact(graph, b.name, cons, fetched):
                    graph[n].attrs.setdefault("unfusible", GELU_ROUNDING)
    return pinned


# tf.nn.gelu(x) (approximate=False, Keras's "gelu") as TF writes it after Grappler's
# arithmetic optimizer: 0.5 * x * erfc(-x * 1/sqrt(2)).  TF's remapper (oneDNN) fuses it
# with a MatMul and its BiasAdd into one _MklNativeFusedMatMul (fused_ops BiasAdd,
# GeluExact), rounding once to bfloat16; a kernel reading the BiasAdd's rounded output
# computed it at 0.51 ulp mean against stock's 0.27 (a bfloat16 Dense with GELU).  So
# where the BiasAdd stays TF's, so does the GELU: the remapper fuses the three, as in
# stock TF (it needs the arithmetic optimizer's own pass over those nodes, which
# tf/passes/grappler.py leaves to it).
GELU_ROUNDING = ("bfloat16: TF's remapper fuses this GELU with the product and its bias "
                 "(oneDNN's _MklNativeFusedMatMul) and rounds once; a kernel would read "
                 "the product rounded to bfloat16 first (less accurate)")
_HALF, _SQRT_HALF = 0.5, 0.7071067811865476


def _scalar_const(graph, ref, value) -> bool:
    n = graph[ref.node]
    return (n.op == "Const" and n.attrs.get("shape") in ([], None)
            and isinstance(n.attrs.get("value"), float)
            and abs(n.attrs["value"] - value) <= 1e-2)   # the remapper's own tolerance


def _gelu_exact(graph, b: str, cons, fetched) -> list:
    """The nodes of ``0.5 * b * erfc(-b * 1/sqrt(2))`` reading BiasAdd ``b``, each read
    only inside it and none fetched but the last, or []."""
    def only(name, op):            # name's one reader, of type op (not fetched)
        r = cons[name]
        if len(r) != 1 or name in fetched or graph[r[0]].op != op:
            return None
        return graph[r[0]]

    def other(node, name):         # the input of a two-input node that is not `name`
        refs = [r for r in node.inputs if r.node != name]
        return refs[0] if len(node.inputs) == 2 and len(refs) == 1 else None

    readers = [graph[r] for r in cons[b]]
    half = [n for n in readers if n.op == "Mul"]
    neg = [n for n in readers if n.op == "Neg"]
    if len(readers) != 2 or len(half) != 1 or len(neg) != 1:
        return []
    half, neg = half[0], neg[0]
    c = other(half, b)
    if c is None or not _scalar_const(graph, c, _HALF):
        return []
    scaled = only(neg.name, "Mul")
    c = scaled and other(scaled, neg.name)
    if c is None or not _scalar_const(graph, c, _SQRT_HALF):
        return []
    erfc = only(scaled.name, "Erfc")
    out = erfc and only(erfc.name, "Mul")
    if out is None or only(half.name, "Mul") is not out or \
            sorted(r.node for r in out.inputs) != sorted([half.name, erfc.name]):
        return []
    return [half.name, neg.name, scaled.name, erfc.name, out.name]


def mark(graph: Graph, remapper: Remapper) -> int:
    """Tag every epilogue member with its convolution; returns how many epilogues."""
    found = find(graph, remapper)
    for conv, bias, acts in found:
        for n in bias + acts:
            graph[n].attrs[ATTR] = conv
    return len(found)


def left_to_tf(graph: Graph, fused: set) -> dict:
    """node -> reason, for the tagged ops the final plan leaves to TF's remapper: the
    BiasAdd when it is in no kernel, its activation only when none of it is."""
    groups: dict = {}
    for n in graph:
        conv = n.attrs.get(ATTR)
        if conv is not None:
            groups.setdefault(conv, []).append(n)
    out = {}
    for conv, members in groups.items():
        bias = [m.name for m in members if m.op == "BiasAdd"]
        rest = [m.name for m in members if m.op != "BiasAdd"]
        if not bias or fused.intersection(bias):
            continue
        left = bias + ([] if fused.intersection(rest) else rest)
        ops = " + ".join([graph[conv].op] + _ops(graph, left))
        # no node names in the reason: the report groups ops by reason (ResNet50's 53
        # BiasAdds are one line), and names each op beside it
        why = (f"TF's remapper fuses it into the convolution's epilogue ({ops}: "
               f"one TF op with the convolution before it)")
        out.update((n, why) for n in left)
    return out


def _ops(graph, names) -> list:
    ops = [graph[n].op for n in names if graph[n].op != "Identity"]
    return ops[:1] + ([SWISH] if "Sigmoid" in ops else ops[1:])
