"""Export the pattern suite as serialized KernelSpecs, for GPU machines without TensorFlow.

    python tools/gpu_patterns/export.py          # rewrites tools/gpu_patterns/*.json

Each pattern of ``stitching.testing.patterns`` is traced at each size's signature (batch
dim unknown, the other dims as that size has them), run through the same frontend +
planner as ``stitching.function`` (``stitching.tf.pipeline.stitch_graph_def``), and
every planned region's spec is written to ``<pattern>.json``::

    {"name": ..., "description": ..., "source": ..., "expected_kernels": 1,
     "args": ["x"], "input_kinds": ["float"],                      # the pattern's arguments
     "shapes": {"small": [[8, 1024]], "large": [[8192, 1024]]},
     "kernels": {"small": [{"spec": <KernelSpec.to_dict()>,
                            "inputs": ["x", "mul_1/ReadVariableOp/resource", ...]}],
                 "large": [...]}}

``inputs`` names the graph value behind each spec input (a pattern argument, or the
variable / constant / op output it reads), so tools/gpu_bench.py knows which inputs are
activations and which are weights.  Needs TensorFlow; run it here, commit the JSON.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _input_names(result, graph_def) -> list:
    """Per kernel, per spec input: the pattern argument or variable it comes from."""
    from stitching.tf.passes import rewrite   # noqa: F401  (the rewritten graph has the wiring)
    nodes = {n.name: n for n in result.graph_def.node}
    args = {}
    for n in graph_def.node:
        if n.op == "Placeholder":
            args[n.name] = n.name
    out = []
    for n in result.graph_def.node:
        if n.op != "StitchedKernel":
            continue
        names = []
        for inp in n.input:
            if inp.startswith("^"):
                continue
            src = inp.split(":")[0]
            names.append(_origin(nodes, src))
        out.append((n.name, names))
    return out


def _origin(nodes, name, depth=0) -> str:
    """Follow Identity / ReadVariableOp back to a Placeholder or a Const."""
    n = nodes.get(name)
    if n is None or depth > 8:
        return name
    if n.op in ("Identity", "ReadVariableOp") and n.input:
        return _origin(nodes, n.input[0].split(":")[0], depth + 1)
    return n.name


def _kernels(pattern, size) -> list:
    import tensorflow as tf
    from stitching.options import Options
    from stitching.tf import frontend, pipeline
    cf = tf.function(pattern.fn).get_concrete_function(*pattern.input_signature(size))
    gdef = cf.graph.as_graph_def()
    res = pipeline.stitch_graph_def(
        gdef, [t.name for t in cf.outputs], [op.name for op in cf.graph.control_outputs],
        Options(), name=pattern.name, resources=frontend.resource_shapes(cf.graph))
    return [{"spec": k.spec.to_dict(), "inputs": names}
            for k, (_node, names) in zip(res.kernels, _input_names(res, gdef))]


def export(pattern) -> dict:
    import inspect
    return {"name": pattern.name, "description": pattern.description,
            "source": pattern.source, "expected_kernels": pattern.expected_kernels,
            "args": list(inspect.signature(pattern.fn).parameters),
            "input_kinds": list(pattern.input_kinds),
            "shapes": {s: [list(x) for x in pattern.shapes[s]] for s in pattern.shapes},
            "kernels": {s: _kernels(pattern, s) for s in pattern.shapes}}


def main() -> int:
    from stitching.testing.patterns import all_patterns
    for p in all_patterns():
        d = export(p)
        path = HERE / f"{p.name}.json"
        path.write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")
        print(f"{p.name}: {len(d['kernels']['small'])} kernel(s) -> {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
