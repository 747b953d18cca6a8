"""Small contractions inside a kernel: where SmallMatMul and its side values run.

A squeeze-excite block gates x [N, H, W, C] by sigmoid(W2 . swish(W1 . mean(x) + b1)
+ b2): two matrix products on one [C] vector per image.  In the domain (domain.py,
step 4) the products' contracted dims are *side* classes, not axes: the kernel is the
element-wise x * gate over [N, H*W, C], and the gate is a per-image value (it does not
carry the row axis H*W), computed once per row group in the hoisted prologue
(Schedule.hoisted).  Before that prologue's loop over the last axis, each side class
gets a loop of its own over its static size::

    per row group (one image):
      side group K:  acc[K] = mean . W1            (SmallMatMul, a loop nest over Cin x K)
                     for j < K: s[j] = swish(acc[j] + b1[j])      (side nodes, scratch)
      main prologue: acc[C] = s . W2               (the last SmallMatMul, over K x C)
                     for j < C: gate[j] = sigmoid(acc[j] + b2[j]) (Schedule.hoisted)
      element loop:  out = x * gate[j]

``groups`` returns the side groups in the order they run, each with its nodes; a
product's vector must come from an earlier group (or be a kernel input), and nothing a
side group computes may depend on a value of the main prologue.  Legal only in
element-wise kernels.  Where a product varies along the row axis (a kernel over
[N, M] that ends in the product: the squeeze's own swish, left without the multiply it
gates) every value is computed in the prologue, once per row (rank 1: once per call;
Schedule.products_per_row).  The CUDA backend has no such prologue, so plans for a
CUDA profile keep SmallMatMul out (plan/legality.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ir.ops import OPS, Kind
from .domain import Refusal
from .passes import KernelKind


@dataclass(frozen=True)
class SideGroup:
    cls: int            # the side class (domain.py step 4)
    size: int           # its static size: the group's loop trip count
    nodes: tuple        # side nodes computed in the group's loop, SSA order
    products: tuple     # of those, the SmallMatMuls (computed by a loop nest before)
    scalars: tuple      # nodes carrying nothing the group's loop reads (constants)


def is_contraction(node) -> bool:
    return OPS[node.op].kind == Kind.CONTRACTION


def groups(spec, dom, kind, live) -> tuple:
    """The side groups of a kernel with SmallMatMuls, in run order; () without any.
    Raises Refusal where the kernel cannot evaluate them."""
    products = [k for k in live if is_contraction(spec.nodes[k])]
    if not products:
        return ()
    R = dom.rank
    if kind != KernelKind.ELEMENTWISE:
        raise Refusal(f"a SmallMatMul in a {kind.value} kernel: products run once per "
                      "row group in element-wise kernels only (a squeeze-excite gate and "
                      "the multiply it scales)")
    outputs = set(spec.outputs)
    side = {k for k in live if k in dom.side}
    for k in sorted(side) + [r for r in dom.side if r < 0]:
        if R - 1 in dom.carries[k]:
            raise Refusal(f"{_name(spec, k)} runs along the kernel's last axis and a "
                          "contracted one: not fused")
    for k in sorted(side):
        if k in outputs:
            raise Refusal(f"{_name(spec, k)} (a value between two products) leaves the "
                          "kernel: it lives in the kernel's prologue only")
    order: list = []
    members: dict = {}
    for k in sorted(side):
        c = dom.side[k]
        if c not in members:
            order.append(c)
            members[c] = []
        members[c].append(k)
    pos = {c: i for i, c in enumerate(order)}
    out = []
    for c in order:
        scalars = set()
        for k in members[c]:
            n = spec.nodes[k]
            args = n.args[:1] if is_contraction(n) else n.args
            for a in args:
                if a < 0 or a in side and (pos[dom.side[a]] < pos[c] or
                                           not is_contraction(n) and dom.side[a] == c):
                    continue
                if a not in side and not dom.carries[a] and a not in dom.side:
                    scalars |= _scalar_closure(spec, dom, a)
                    continue
                raise Refusal(f"{_name(spec, k)} reads {_name(spec, a)} in an order the "
                              "kernel's prologue cannot evaluate (each product's vector "
                              "must be complete before the product)")
        prods = tuple(k for k in members[c] if is_contraction(spec.nodes[k]))
        out.append(SideGroup(c, dom.classes[c].size, tuple(members[c]), prods,
                             tuple(sorted(scalars))))
    for k in products:
        if k not in side and R - 1 not in dom.carries[k]:
            raise Refusal(f"{_name(spec, k)} does not run along the kernel's last axis")
    return tuple(out)


def _scalar_closure(spec, dom, k) -> set:
    """``k`` and the nodes it reads, all carrying no axis (constants, scalar math)."""
    out, todo = set(), [k]
    while todo:
        a = todo.pop()
        if a < 0 or a in out:
            continue
        if dom.carries[a] or a in dom.side or is_contraction(spec.nodes[a]):
            raise Refusal(f"{_name(spec, a)} is read by a product's side values but "
                          "varies: not fused")
        out.add(a)
        todo.extend(spec.nodes[a].args)
    return out


def _name(spec, k) -> str:
    if k < 0:
        return f"input {-k - 1}"
    n = spec.nodes[k]
    return f"node {k} ({n.op} {list(n.type.shape)})"
