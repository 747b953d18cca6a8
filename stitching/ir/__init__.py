"""TF-free IR: graph, op table, kernel specs.  Importing this never imports TensorFlow."""
from .graph import Graph, GraphError, Node, TensorType, ValueRef, UNKNOWN, broadcast_shapes
from .ops import OPS, Kind, OpDef, kind_of, infer
from .spec import KernelSpec, SpecError, SpecNode, validate

__all__ = ["Graph", "GraphError", "Node", "TensorType", "ValueRef", "UNKNOWN",
           "broadcast_shapes", "OPS", "Kind", "OpDef", "kind_of", "infer",
           "KernelSpec", "SpecError", "SpecNode", "validate"]
