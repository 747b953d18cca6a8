"""Tiny hand-built IR graphs for planner and cost-model tests (TF-free).

    g = G().input("x", [-1, 8]).op("m", "Mean", ["x"], axes=[1], keep_dims=True) \\
           .op("out", "Identity", ["m"]).build("out")

Shared by test_planner.py, test_search.py, test_cost.py and tools/plan_bench.py.
"""
from stitching.ir import Graph, Node, TensorType, ValueRef, infer

F = "float32"


class G:
    """Tiny builder: G().input('x', [-1, 8]).op('m', 'Mean', ['x'], axes=[1], keep_dims=True)"""

    def __init__(self):
        self.g = Graph()

    def input(self, name, shape, dtype=F):
        self.g.add(Node(name, "Placeholder", [], {}, [TensorType(dtype, tuple(shape))]))
        return self

    def opaque(self, name, inputs, shape, dtype=F):
        self.g.add(Node(name, "MatMul", [ValueRef(i) for i in inputs], {},
                        [TensorType(dtype, tuple(shape))]))
        return self

    def op(self, name, op, inputs, **attrs):
        refs = [ValueRef(i) for i in inputs]
        t = infer(op, attrs, [self.g.type_of(r) for r in refs])
        self.g.add(Node(name, op, refs, attrs, [t]))
        return self

    def composite(self, name, op, inputs, **attrs):
        """A composite TF op (Softmax, BiasAdd, ...): the output has the first input's type."""
        refs = [ValueRef(i) for i in inputs]
        self.g.add(Node(name, op, refs, attrs, [self.g.type_of(refs[0])]))
        return self

    def build(self, *outputs):
        self.g.outputs = [ValueRef(o) for o in outputs]
        self.g.verify()
        return self.g


def regions(p):
    return [sorted(r.nodes) for r in p.regions]


def allow_all(spec):
    return None


def layernorm(b, x="x", p=""):
    return (b.op(f"{p}mean", "Mean", [x], axes=[1], keep_dims=True)
             .op(f"{p}d", "Sub", [x, f"{p}mean"]).op(f"{p}sq", "Square", [f"{p}d"])
             .op(f"{p}var", "Mean", [f"{p}sq"], axes=[1], keep_dims=True)
             .op(f"{p}eps", "Const", [], value=1e-5, dtype=F, shape=[])
             .op(f"{p}ve", "Add", [f"{p}var", f"{p}eps"]).op(f"{p}inv", "Rsqrt", [f"{p}ve"])
             .op(f"{p}y", "Mul", [f"{p}d", f"{p}inv"]))


def ln_chain(blocks=150, shape=(-1, 64)):
    """LayerNorm-plus-activation blocks separated by opaque ops (13 nodes per block)."""
    b = G().input("x", list(shape))
    prev = "x"
    for i in range(blocks):
        b.op(f"m{i}", "Mean", [prev], axes=[1], keep_dims=True)
        b.op(f"s{i}", "Sub", [prev, f"m{i}"]).op(f"q{i}", "Square", [f"s{i}"])
        b.op(f"v{i}", "Mean", [f"q{i}"], axes=[1], keep_dims=True)
        b.op(f"r{i}", "Rsqrt", [f"v{i}"]).op(f"y{i}", "Mul", [f"s{i}", f"r{i}"])
        b.op(f"t{i}", "Tanh", [f"y{i}"]).op(f"u{i}", "Exp", [f"t{i}"])
        b.op(f"w{i}", "Add", [f"u{i}", f"y{i}"]).op(f"z{i}", "Relu", [f"w{i}"])
        b.op(f"k{i}", "Sigmoid", [f"z{i}"]).op(f"l{i}", "Mul", [f"k{i}", f"z{i}"])
        b.opaque(f"mm{i}", [f"l{i}"], list(shape))
        prev = f"mm{i}"
    return b.op("out", "Identity", [prev]).build("out")


def encoder(blocks=40, seq=128, hidden=256):
    """Transformer-encoder-like blocks: attention softmax with mask, bias + residual +
    LayerNorm, tanh-GELU feed-forward.  Matmuls are opaque.  ~49 nodes per block."""
    b = G().input("x", [-1, hidden]).input("mask", [-1, seq])
    for name, n in (("g", hidden), ("bt", hidden), ("b1", 4 * hidden), ("b2", hidden)):
        b.input(name, [n])
    for name, v in (("half", 0.5), ("one", 1.0), ("c1", 0.044715), ("c2", 0.7978845608),
                    ("scale", 0.125)):
        b.op(name, "Const", [], value=v, dtype=F, shape=[])
    h = "x"
    for i in range(blocks):
        p = f"b{i}_"
        b.opaque(p + "qk", [h], [-1, seq]).op(p + "sc", "Mul", [p + "qk", "scale"])
        b.op(p + "mk", "Add", [p + "sc", "mask"]).composite(p + "sm", "Softmax", [p + "mk"])
        b.opaque(p + "ctx", [p + "sm", h], [-1, hidden])
        h = _add_norm(b, p + "a_", p + "ctx", h)
        b.opaque(p + "ff1", [h], [-1, 4 * hidden]).op(p + "f1b", "Add", [p + "ff1", "b1"])
        g = _gelu(b, p + "ge_", p + "f1b")
        b.opaque(p + "ff2", [g], [-1, hidden])
        h = _add_norm(b, p + "f_", p + "ff2", h)
    return b.op("out", "Identity", [h]).build("out")


def _add_norm(b, p, y, res):
    b.op(p + "bias", "Add", [y, "b2"]).op(p + "res", "Add", [p + "bias", res])
    layernorm(b, p + "res", p)
    b.op(p + "gm", "Mul", [p + "y", "g"]).op(p + "o", "Add", [p + "gm", "bt"])
    return p + "o"


def _gelu(b, p, x):
    b.op(p + "x2", "Mul", [x, x]).op(p + "x3", "Mul", [p + "x2", x])
    b.op(p + "a", "Mul", [p + "x3", "c1"]).op(p + "s", "Add", [x, p + "a"])
    b.op(p + "t", "Mul", [p + "s", "c2"]).op(p + "th", "Tanh", [p + "t"])
    b.op(p + "u", "Add", [p + "th", "one"]).op(p + "h", "Mul", [p + "u", "half"])
    return b.op(p + "o", "Mul", [x, p + "h"]) and p + "o"


def wide(branches=400, shape=(-1, 256)):
    """Many independent short branches reading one input (siblings for kernel packing)."""
    b = G().input("x", list(shape))
    outs = []
    for i in range(branches):
        b.op(f"e{i}", "Exp", ["x"]).op(f"n{i}", "Mul", [f"e{i}", "x"])
        b.op(f"a{i}", "Abs", [f"n{i}"]).opaque(f"m{i}", [f"a{i}"], list(shape))
        outs.append(f"m{i}")
    return b.build(*outs)
