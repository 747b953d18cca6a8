"""A training-mode FusedBatchNormV3's reserve_space_3, as its CPU gradient reads it, is
a constant: the gradient reads a scalar zero instead.

TF's CPU FusedBatchNormV3 writes a scalar 0 as reserve_space_3 (fused_batch_norm_op.cc:
``allocate_output(5, {})``, the value ``U()``; only cuDNN keeps a workspace there), and
the CPU FusedBatchNormGradV3 never reads that input.  Every training step through a
BatchNormalization (tf_keras' fused one, or tf_keras' LayerNormalization with its default
epsilon) has that edge from the forward to its gradient.  Left in place it would be a
kernel output of the fused forward (ir/composites.py, FusedBatchNormTraining) of no
shape a kernel's parallel axes span; read from a constant, the forward's kernel writes
only its statistics and y.  Placed on a GPU, either node keeps the edge (cuDNN's
reserve space is data there).
"""
from __future__ import annotations

from tensorflow.core.framework import node_def_pb2, tensor_pb2, types_pb2

from ..passmanager import Pass

FORWARD, GRADIENT = "FusedBatchNormV3", "FusedBatchNormGradV3"


def _on_cpu(nd) -> bool:
    return "GPU" not in nd.device.upper()


def _training_forwards(graph_def, excluded) -> set:
    return {nd.name for nd in graph_def.node
            if nd.op == FORWARD and nd.attr["is_training"].b and _on_cpu(nd)
            and nd.name not in excluded}


def rewire(graph_def, excluded=frozenset()):
    """A copy of ``graph_def`` whose CPU gradients read a zero as reserve_space_3 where
    a training-mode forward wrote it, or None where there is none.  A gradient that
    ``excluded`` (Options(exclude)) names is rewired too: it stays TF's op, and the
    input it ignores changes nothing it computes; an excluded forward is left as is."""
    forwards = _training_forwards(graph_def, excluded)
    todo = [i for i, nd in enumerate(graph_def.node)
            if nd.op == GRADIENT and len(nd.input) > 5 and _on_cpu(nd)
            and nd.input[5].split(":")[0] in forwards
            and nd.input[5].endswith(":5")]
    if not todo:
        return None
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    taken = {nd.name for nd in out.node}
    for i in todo:
        grad = out.node[i]
        name, k = f"{grad.name}/reserve_space_3_cpu", 1
        while name in taken:
            name, k = f"{grad.name}/reserve_space_3_cpu_{k}", k + 1
        taken.add(name)
        out.node.append(_zero(name, grad.attr["U"].type, grad.device))
        grad.input[5] = name
    return out


def _zero(name, dtype, device):
    nd = node_def_pb2.NodeDef(name=name, op="Const", device=device)
    nd.attr["dtype"].type = dtype
    value = tensor_pb2.TensorProto(dtype=dtype)
    value.tensor_shape.SetInParent()          # a scalar, as TF's CPU kernel writes
    if dtype == types_pb2.DT_FLOAT:
        value.float_val.append(0.0)
    nd.attr["value"].tensor.CopyFrom(value)
    return nd


def _run(ctx):
    if not ctx.has_op(GRADIENT):
        return None
    new = rewire(ctx.graph_def, ctx.excluded)
    if new is not None:
        ctx.replace(new)


PASS = Pass("bn_reserve", _run)
