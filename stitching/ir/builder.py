"""SpecBuilder: build a validated ``KernelSpec`` by hand (tests, planner, tools).

    b = SpecBuilder()
    x = b.input("float32", (-1, 768))
    g = b.input("float32", (768,))
    m = b.Mean(x, axes=[1], keep_dims=True)      # any op-table name works as a method
    d = b.Sub(x, m)
    y = b.Mul(d, g)
    spec = b.build([y], rows_per_task=4)

References are the spec's own encoding (``k >= 0`` node, ``-(j + 1)`` input), so a
built spec reads exactly like its JSON.  Each ``op`` call infers the output type
with the op table (``ops.infer``) and fails immediately, naming the op, when the
arguments do not fit; ``build`` runs the full ``validate``.
"""
from __future__ import annotations

from .graph import TensorType
from .ops import OPS, Kind, infer
from .spec import KernelSpec, SpecError, SpecNode, validate


class SpecBuilder:
    def __init__(self):
        self.inputs: list[TensorType] = []
        self.nodes: list[SpecNode] = []

    def input(self, dtype: str, shape) -> int:
        self.inputs.append(TensorType(dtype, tuple(shape)))
        return -len(self.inputs)

    def type_of(self, ref: int) -> TensorType:
        return self.inputs[-ref - 1] if ref < 0 else self.nodes[ref].type

    def op(self, name: str, *args: int, out_shape=None, **attrs) -> int:
        """Append one node; ``out_shape`` may pin unknown dims of the inferred shape."""
        d = OPS.get(name)
        if d is None:
            raise SpecError(f"op {name!r} is not in the op table")
        if d.kind == Kind.REDUCTION:
            attrs.setdefault("keep_dims", False)
        try:
            attrs = d.validate_attrs(attrs)
            t = infer(name, attrs, [self.type_of(a) for a in args])
        except ValueError as e:
            msg = str(e)
            raise SpecError(msg if msg.startswith(name) else f"{name}: {msg}") from None
        if out_shape is not None:
            t = TensorType(t.dtype, tuple(out_shape))
        self.nodes.append(SpecNode(name, tuple(args), attrs, t))
        return len(self.nodes) - 1

    def const(self, value, dtype: str = "float32", shape=()) -> int:
        return self.op("Const", value=value, dtype=dtype, shape=list(shape))

    def build(self, outputs, same_dims=(), **schedule) -> KernelSpec:
        return validate(KernelSpec(tuple(self.inputs), tuple(self.nodes),
                                   tuple(outputs), dict(schedule), tuple(same_dims)))

    def __getattr__(self, name):
        if name in OPS:
            return lambda *args, **attrs: self.op(name, *args, **attrs)
        raise AttributeError(name)
