"""Symbolic dims: dims known only at run time that the graph proves equal.

The IR writes every run-time dim as -1, so two of them say nothing about each other.
Packing two independent chains into one kernel (grouped-query attention's K and V
head transposes, both [batch, heads, seq, dim]) shares a loop axis between their
outputs, and the kernel then checks at run time that the dims are equal: sound only
where the graph guarantees it, else a kernel would refuse inputs TF runs.

Algorithm: one forward sweep in topological order gives every dim of every value a
*monomial*, ``coef * s1 * s2 * ...`` over symbols that stand for positive integers
fixed at run time (a static dim is a monomial with no symbol).  Equal monomials are
equal dims whatever the symbols' values::

    x [B, 128, 256]                     B: a graph input's run-time dim, a fresh symbol
    Reshape(x, [-1, 256]) [128*B, 256]   a -1 entry: the element count over the rest
    MatMul(., w[256, 64]) [128*B, 64]    rows from the left operand
    Reshape(., [-1, 128, 2, 32])         (128*B*64) / (128*2*32) = B
    Transpose(., perm)                   the same monomials, permuted

Rules, each sound by the op's definition (TF computes the same at run time):
  - element-wise (broadcasting): an output dim is the operands' dim where every
    operand that is not a static 1 there has the same monomial;
  - a Tile broadcasting to run-time dims of a second input (``like``), and a SliceTo
    cutting to them (a Slice's, not a StridedSlice's, which clamps): those dims;
  - reductions keep the dims they do not reduce; Transpose permutes;
  - Reshape: a -1 entry of its target (``facts``: the constant target TF runs,
    tf/passes/shapes.py folds Keras's run-time targets to these), or the one dim of
    the IR shape known only at run time, is the input's element count over the
    other entries; every static entry is itself;
  - MatMul / BatchMatMul: rows from the left operand, columns from the right (their
    transpose and adjoint flags in ``facts``), batch dims broadcast as element-wise;
  - any other op, or a rule that does not apply: a fresh symbol per run-time dim
    (never equal to anything else: what the IR said before).
This is the same symbolic reasoning TF's own shape inference does with its unknown-dim
handles, which do not survive into Python.  The result is a planning fact: the region
extractor (plan/region.py) writes the proven groups into a spec's ``same_dims``.
"""
from __future__ import annotations

from fractions import Fraction

from .composites import COMPOSITE_OPS
from .graph import ValueRef
from .ops import Kind, kind_of

_SHAPE_KEEPING = ("Softmax", "LogSoftmax", "BiasAdd", "FusedBatchNorm",
                  "FusedBatchNormTraining")
_MATMULS = {"MatMul": ("transpose_a", "transpose_b"), "BatchMatMul": ("adj_x", "adj_y"),
            "BatchMatMulV2": ("adj_x", "adj_y"), "BatchMatMulV3": ("adj_x", "adj_y")}


def _static(n: int) -> tuple:
    return (Fraction(n), ())


def _product(dims) -> tuple:
    coef, syms = Fraction(1), []
    for c, s in dims:
        coef *= c
        syms.extend(s)
    return (coef, tuple(sorted(syms)))


class _Sweep:
    def __init__(self, graph, facts):
        self.graph = graph
        self.facts = facts
        self.dims: dict = {}         # ValueRef -> list of monomials, or None (rank)
        self.next = 0

    def fresh(self) -> tuple:
        self.next += 1
        return (Fraction(1), (self.next,))

    def of(self, ref):
        return self.dims.get(ref)

    def known(self, shape, derived):
        """The IR's static dims, the derived monomial (or a fresh one) elsewhere."""
        return [_static(d) if d >= 0 else m if m is not None else self.fresh()
                for d, m in zip(shape, derived)]

    def run(self) -> dict:
        for node in self.graph:
            for i, t in enumerate(node.outputs):
                ref = ValueRef(node.name, i)
                if t.shape is None:
                    self.dims[ref] = None
                    continue
                got = self.rule(node, i, t.shape) if i == 0 or node.op == "Split" else None
                if got is None or len(got) != len(t.shape):
                    got = [None] * len(t.shape)
                self.dims[ref] = self.known(t.shape, got)
        return {ref: tuple(None if not m[1] else m for m in d)
                for ref, d in self.dims.items() if d is not None and any(m[1] for m in d)}

    # -- rules: a list of monomials (None where not derived), or None ------------------
    def rule(self, node, i, shape):
        ins = [self.of(r) for r in node.inputs]
        kind = COMPOSITE_OPS[node.op][0] if node.op in COMPOSITE_OPS else kind_of(node.op)
        if node.op in _SHAPE_KEEPING:     # x's shape (a bias may run along dim 1, NCHW)
            return list(ins[0]) if ins and ins[0] is not None and \
                len(ins[0]) == len(shape) else None
        if node.op == "Tile" and "like" in node.attrs and len(ins) == 2 and None not in ins:
            # a broadcast to run-time dims of its second input (ir/composites.py)
            x, src = ins
            lead = len(shape) - len(x)
            return [src[k] if k >= 0 else x[i - lead] if i >= lead else None
                    for i, k in enumerate(node.attrs["like"])]
        if node.op == "SliceTo" and len(ins) == 2 and ins[1] is not None and \
                not node.attrs.get("clamps"):
            # a slice whose run-time counts are dims of its second input (a StridedSlice
            # clamps its end, so its counts are not those dims: fresh symbols)
            return [ins[1][k] if k >= 0 else None for k in node.attrs["like"]]
        if kind == Kind.ELEMENTWISE:
            return _broadcast(ins, len(shape))
        if kind == Kind.REDUCTION and "axes" in node.attrs and ins and ins[0] is not None:
            axes = node.attrs["axes"]
            keep = node.attrs.get("keep_dims", False)
            return [None if a in axes else m for a, m in enumerate(ins[0])
                    if keep or a not in axes]
        if node.op == "Transpose" and "perm" in node.attrs and ins and ins[0] is not None:
            return [ins[0][p] for p in node.attrs["perm"]]
        if node.op == "Reshape" and ins and ins[0] is not None:
            return self.reshape(node, ins[0], shape)
        if node.op == "Split" and "axis" in node.attrs and ins and ins[0] is not None:
            axis = node.attrs["axis"]
            return [None if a == axis else m for a, m in enumerate(ins[0])]
        if node.op in _MATMULS and len(ins) == 2 and None not in ins:
            return self.matmul(node, ins, len(shape))
        return None

    def reshape(self, node, x, shape):
        target = list(self.facts.get(node.name, {}).get("target") or shape)
        if len(target) != len(shape) or sum(1 for d in target if d < 0) > 1:
            return None
        count = _product(x)
        rest = 1
        for d in target:
            rest *= d if d >= 0 else 1
        if rest == 0:
            return None
        return [(count[0] / rest, count[1]) if d < 0 else _static(d) for d in target]

    def matmul(self, node, ins, rank):
        a, b = ins
        if len(a) < 2 or len(b) < 2:
            return None
        ta, tb = (bool(self.facts.get(node.name, {}).get(f)) for f in _MATMULS[node.op])
        rows = a[-1] if ta else a[-2]
        cols = b[-2] if tb else b[-1]
        batch = _broadcast([a[:-2], b[:-2]], rank - 2)
        return batch + [rows, cols]


def _broadcast(ins, rank):
    out = []
    for i in range(rank):
        seen = set()
        for d in ins:
            if d is None:
                return None
            j = i - (rank - len(d))
            if j >= 0 and d[j] != _static(1):
                seen.add(d[j])
        out.append(seen.pop() if len(seen) == 1 else None)
    return out


def analyze(graph, facts=None) -> dict:
    """ValueRef -> per dim the monomial of a run-time dim (None where static), for the
    values that have one; ``facts``: node name -> {"target": a Reshape's constant
    target, or the MatMul/BatchMatMul flag names (transpose_a, adj_x ...): bool}."""
    return _Sweep(graph, facts or {}).run()
