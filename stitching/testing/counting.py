"""Counting kernels the way the papers do: memory-intensive ops in a TF graph, and
memory-intensive kernels in XLA's optimized HLO.

TF side: every memory-intensive op in the traced graph is one kernel launch in stock TF
(Grappler's remapper fuses a few pairs, e.g. MatMul+BiasAdd, but we count the graph the
user wrote, as FusionStitching's Table 2 does).  Function-call nodes
(PartitionedCall / StatefulPartitionedCall, and any node whose op is a library
function) are inlined by walking their bodies in the graph's function library.

XLA side: in optimized HLO every ``fusion`` instruction in a non-fused computation is one
kernel; so is every other top-level instruction that does work (``reduce``, ``copy``,
``transpose``...).  A fusion that contains a ``dot`` or ``convolution`` is a compute
kernel (XLA fused the bias/activation into the GEMM); the rest are memory-intensive.
Verified on XLA:CPU in TF 2.21: a hand-written LayerNorm over [64, 1024] is five
fusions (a YNNPACK ``kCustom`` mean, a ``kLoop`` squared difference, a wrapped
``reduce-window`` partial sum, a ``kLoop`` rsqrt, a ``kLoop`` normalize); tf.nn.softmax
is four.
"""
from __future__ import annotations

import collections
import re

from stitching.tf.opnames import is_memory_intensive

_CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def _graph_def_of(obj):
    """GraphDef from a GraphDef, a tf.Graph, or a ConcreteFunction."""
    if hasattr(obj, "graph") and hasattr(obj.graph, "as_graph_def"):
        return obj.graph.as_graph_def()
    if hasattr(obj, "as_graph_def"):
        return obj.as_graph_def()
    return obj


def tf_op_histogram(obj) -> collections.Counter:
    """Op type -> count over the graph, with library function bodies inlined
    (a function called twice counts twice)."""
    gd = _graph_def_of(obj)
    library = {f.signature.name: f for f in gd.library.function}
    counts: collections.Counter = collections.Counter()

    def walk(nodes, depth):
        if depth > 32:
            raise RecursionError("function library nesting deeper than 32")
        for node in nodes:
            callee = None
            if node.op in _CALL_OPS and "f" in node.attr:
                callee = node.attr["f"].func.name
            elif node.op in library:
                callee = node.op
            if callee is not None and callee in library:
                walk(library[callee].node_def, depth + 1)
            else:
                counts[node.op] += 1

    walk(gd.node, 0)
    return counts


def count_memory_intensive_ops(obj) -> int:
    """Memory-intensive TF ops (per stitching.tf.opnames) in the inlined graph."""
    return sum(n for op, n in tf_op_histogram(obj).items() if is_memory_intensive(op))


# ---- XLA HLO

# Top-level HLO instructions that launch nothing.
_HLO_FREE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
    "partition-id", "replica-id", "while", "conditional", "call", "opt-barrier",
    "add-dependency", "domain",
})
# Instructions that make a kernel compute-bound (GEMM / conv / library calls).
_HLO_COMPUTE = frozenset({
    "dot", "convolution", "custom-call", "fft", "triangular-solve", "cholesky",
})

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def _opcode(rhs: str) -> str:
    """Opcode of an instruction's right-hand side ``shape opcode(operands), attrs``."""
    i = 0
    if rhs.startswith("("):          # tuple shape: skip balanced parens
        depth = 0
        for i, ch in enumerate(rhs):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        i += 1
    else:
        while i < len(rhs) and not rhs[i].isspace():
            i += 1
    m = re.match(r"\s*([\w\-]+)\(", rhs[i:])
    return m.group(1) if m else ""


def parse_hlo(text: str) -> dict:
    """{computation name: [(instr name, opcode, rhs)]} and the entry's name."""
    comps: dict = {}
    entry = None
    current = None
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if m:
            comps[current].append((m.group(1), _opcode(m.group(2)), m.group(2)))
    return {"computations": comps, "entry": entry}


def count_xla_kernels(hlo_text: str) -> dict:
    """Kernels in optimized HLO text.

    Returns ``fusions`` (all fusion instructions), ``memory_fusions`` (fusions with no
    dot/convolution/custom-call inside), ``compute_fusions``, ``unfused_memory``
    (top-level instructions doing memory-intensive work outside any fusion),
    ``unfused_compute``, and ``memory_kernels`` = memory_fusions + unfused_memory: the
    number to compare with TF's memory-intensive ops and stitched kernels.
    """
    parsed = parse_hlo(hlo_text)
    comps = parsed["computations"]
    fused = set()
    for instrs in comps.values():
        for _, op, rhs in instrs:
            if op == "fusion":
                fused.update(_CALLS.findall(rhs))
    # Reducers and other to_apply computations only hold scalar ops; they are called
    # from inside kernels, never launched.
    applied = set()
    for instrs in comps.values():
        for _, _, rhs in instrs:
            applied.update(re.findall(r"to_apply=%?([\w.\-]+)", rhs))

    def contains_compute(name, seen=()):
        for _, op, rhs in comps.get(name, ()):
            if op in _HLO_COMPUTE:
                return True
            for callee in _CALLS.findall(rhs):
                if callee not in seen and contains_compute(callee, seen + (name,)):
                    return True
        return False

    out = dict(fusions=0, memory_fusions=0, compute_fusions=0,
               unfused_memory=0, unfused_compute=0)
    for name, instrs in comps.items():
        if name in fused or name in applied:
            continue
        for _, op, rhs in instrs:
            if op == "fusion":
                out["fusions"] += 1
                callees = _CALLS.findall(rhs)
                if any(contains_compute(c) for c in callees):
                    out["compute_fusions"] += 1
                else:
                    out["memory_fusions"] += 1
            elif op in _HLO_FREE or not op:
                continue
            elif op in _HLO_COMPUTE:
                out["unfused_compute"] += 1
            else:
                out["unfused_memory"] += 1
    out["memory_kernels"] = out["memory_fusions"] + out["unfused_memory"]
    return out



def profiler_xspace(run):
    """The XSpace (TF's profiler's record: planes of threads and their events) of
    ``run()``, traced at the profiler's default level (what TensorBoard's Profile tab
    shows)."""
    import glob
    import shutil
    import tempfile

    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    logdir = tempfile.mkdtemp(prefix="stitching_profiled_")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            run()
        finally:
            tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        with open(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0], "rb") as fh:
            space.ParseFromString(fh.read())
        return space
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def profiled_ops(run) -> collections.Counter:
    """Op type -> events of TF's profiler while ``run()`` runs (``profiler_xspace``):
    the executor's ``node:OpType`` events, and those ops emit for themselves."""
    found = collections.Counter()
    for plane in profiler_xspace(run).planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                name = names.get(ev.metadata_id, "")
                if ":" in name and "::" not in name:
                    found[name.rsplit(":", 1)[1]] += 1
    return found
