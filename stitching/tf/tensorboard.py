"""A dump's rewritten graph for TensorBoard's graph view (``stitching.write_tensorboard``,
in stitching/inspect, resolves what to write; this is the TensorFlow side).

TensorBoard groups nodes by name scope, so each StitchedKernel becomes a scope named
after the kernel node (``stitching/kernel_3``) holding

    StitchedKernel       the real node (its inputs, attrs, consumers as in the graph)
    <fused op>...        each TF op fused into it, with its op type and the edges
                         among them ("/" in their names becomes "." so they sit
                         directly in the group, not in nested scopes)

Every other node is the rewritten GraphDef's own.  The graph written is for viewing
only: the fused ops are display nodes (TensorBoard never runs it).  When the dump has
a profile, each kernel's calls, mean time and achieved bandwidth are written as
scalars (``stitching/<kernel>/mean_us`` ...).  One run directory per dump, named by
its id, under ``logdir``.
"""
from __future__ import annotations

import os

KERNEL_NODE = "StitchedKernel"


def write_runs(dumps, logdir) -> list:
    """One TensorBoard run per dump (``stitching.inspect.Dump``-like objects: kernels,
    ir_nodes, graph_after(), id); returns the run directories."""
    import tensorflow as tf
    runs = []
    for d in dumps:
        run = os.path.join(os.fspath(logdir), d.id)
        writer = tf.summary.create_file_writer(run)
        with writer.as_default():
            tf.summary.graph(display_graph(d))
            for k in d.kernels:
                _scalars(tf, k)
        writer.flush()
        writer.close()
        runs.append(run)
    return runs


def group_of(kernel_name: str) -> str:
    """The name scope a kernel's nodes sit in."""
    return kernel_name


def flat(name: str) -> str:
    return name.replace("/", ".")


def display_graph(dump):
    """The rewritten GraphDef with each kernel expanded into a named group."""
    from tensorflow.core.framework import graph_pb2
    after = dump.graph_after()
    kernels = {k.name: k for k in dump.kernels}
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(after.versions)
    for nd in after.node:
        new = out.node.add()
        new.CopyFrom(nd)
        if nd.name in kernels:
            new.name = f"{group_of(nd.name)}/{KERNEL_NODE}"
        del new.input[:]
        new.input.extend(_rename(i, kernels) for i in nd.input)
    _add_fused_ops(out, dump, kernels, {nd.name for nd in after.node})
    return out


def _rename(inp: str, kernels: dict) -> str:
    ctrl = inp.startswith("^")
    name, _, idx = inp.lstrip("^").partition(":")
    if name in kernels:
        name = f"{group_of(name)}/{KERNEL_NODE}"
    return ("^" if ctrl else "") + name + (f":{idx}" if idx else "")


def _add_fused_ops(out, dump, kernels, present):
    ir = {n["name"]: n for n in dump.ir_nodes}
    home = {m: k.name for k in dump.kernels for m in k.nodes}
    exported = {}       # IR ref fused away -> the kernel output carrying it
    for k in dump.kernels:
        for i, o in enumerate(k.outputs):
            exported[o["ref"]] = f"{group_of(k.name)}/{KERNEL_NODE}" + (f":{i}" if i else "")
    for k in dump.kernels:
        for m, op in k.ops:
            nd = out.node.add(name=f"{group_of(k.name)}/{flat(m)}", op=op)
            nd.attr["_stitched_kernel"].s = k.name.encode()
            for ref in (ir.get(m) or {}).get("inputs", []):
                src, _, idx = ref.partition(":")
                suffix = f":{idx}" if idx and idx != "0" else ""
                if home.get(src) == k.name:
                    nd.input.append(f"{group_of(k.name)}/{flat(src)}{suffix}")
                elif src in home:
                    nd.input.append(exported.get(ref) or exported.get(src)
                                    or f"{group_of(home[src])}/{flat(src)}{suffix}")
                elif src in present:
                    nd.input.append(src + suffix)


def _scalars(tf, k):
    m = k.measured
    if not m or not m.get("calls"):
        return
    tag = f"stitching/{k.name.split('/')[-1]}"
    mean_s = m["seconds"] / m["calls"]
    _scalar(tf, f"{tag}/calls", float(m["calls"]))
    _scalar(tf, f"{tag}/mean_us", mean_s * 1e6)
    if m.get("min_seconds"):
        _scalar(tf, f"{tag}/fastest_us", m["min_seconds"] * 1e6)
    if k.estimated_us is not None:
        _scalar(tf, f"{tag}/estimated_us", float(k.estimated_us))
    if m["seconds"] > 0:
        _scalar(tf, f"{tag}/GB_per_s", m["bytes"] / m["seconds"] / 1e9)


def _scalar(tf, tag, value):
    """What ``tf.summary.scalar`` writes (a float32 scalar tagged for TensorBoard's
    scalars plugin), without needing the tensorboard package to write it."""
    from tensorflow.core.framework import summary_pb2
    meta = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
    tf.summary.write(tag, tf.constant(value, tf.float32), step=0, metadata=meta)


