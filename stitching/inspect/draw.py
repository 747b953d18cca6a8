"""Pictures of a dump: the graph with its stitched regions, and a roofline of kernels.

draw_graph   IR nodes as a layered DAG (inputs at the top), each stitched region's ops
             filled with that kernel's colour and the region labelled by kernel name;
             memory-intensive ops left to TF are grey with a red rim, other TF ops
             (MatMul, Conv...) white.  Layout: Graphviz ``dot`` when it is on PATH (run
             as a program, positions read from ``-Tplain``), else layers by longest path
             from the inputs, a node off it just above its first reader (networkx
             ``multipartite_layout``).  Constants and
             weights (variable handles and their reads) are left out: they feed
             kernels as inputs and only clutter the picture.
roofline     each kernel at (FLOPs per byte, achieved FLOP/s): measured when profiled,
             else the cost model's estimate; against the machine's copy bandwidth
             (the cost model's measured profile) and a FLOP peak (a float32 matmul,
             measured once here).

networkx and matplotlib are imported when called (``pip install stitching[inspect]``).
"""
from __future__ import annotations

import functools
import shutil
import subprocess

_HIDDEN_OPS = frozenset({"Const", "TFConst"})
_LABEL_MAX_NODES = 120        # arbitrary: beyond this op names overlap into noise
_PART_HINT_NODES = 300        # arbitrary: beyond this the title says how to draw a part


def to_networkx(dump):
    """The dump's IR as a networkx DiGraph.  Node attributes: ``op``, ``kernel`` (the
    StitchedKernel it was fused into, or None), ``reason`` (why a memory-intensive op
    was left unfused, or None)."""
    import networkx as nx
    g = nx.DiGraph()
    kernel_of = dump.kernel_of()
    reasons = {u["node"]: u["reason"] for u in dump.unfused}
    for n in dump.ir_nodes:
        if _hidden(n):
            continue
        g.add_node(n["name"], op=n["op"], kernel=kernel_of.get(n["name"]),
                   reason=reasons.get(n["name"]))
    for n in dump.ir_nodes:
        if n["name"] not in g:
            continue
        for ref in n["inputs"]:
            src = ref.split(":")[0]
            if src in g:
                g.add_edge(src, n["name"])
    return g


def _part(g, dump, kernels, scope, around):
    """The subgraph draw_graph draws: ``g`` itself where neither ``kernels`` nor
    ``scope`` is given, else their nodes and everything within ``around`` edges of
    them (either direction).  A name or scope that matches nothing is an error that
    says what there is."""
    if kernels is None and scope is None:
        return g
    if isinstance(around, bool) or not isinstance(around, int) or around < 0:
        raise ValueError(f"around must be a whole number of edges >= 0, got {around!r}")
    seeds = set()
    if kernels is not None:
        wanted = [kernels] if isinstance(kernels, str) else list(kernels)
        by_name = {}
        for k in dump.kernels:
            by_name[k.name] = by_name[k.name.split("/")[-1]] = k
        missing = [w for w in wanted if w not in by_name]
        if missing:
            have = ", ".join(k.name.split("/")[-1] for k in dump.kernels[:8])
            more = f" ... ({len(dump.kernels)} in all)" if len(dump.kernels) > 8 else ""
            raise ValueError(f"no kernel named {', '.join(map(repr, missing))} in this "
                             f"dump; its kernels: {have or 'none'}{more}")
        seeds |= {v for w in wanted for v in by_name[w].nodes if v in g}
    if scope is not None:
        if not isinstance(scope, str) or not scope:
            raise ValueError(f"scope must be a non-empty name prefix, got {scope!r}")
        inside = {v for v in g if v.startswith(scope)}
        if not inside:
            scopes = sorted({"/".join(v.split("/")[:2]) + "/" for v in g if "/" in v})
            have = ", ".join(map(repr, scopes[:6])) + (
                f" ... ({len(scopes)} in all)" if len(scopes) > 6 else "")
            raise ValueError(f"no node's name starts with {scope!r}; the scopes here: "
                             f"{have or 'none (no node name has a /)'}")
        seeds |= inside
    keep, edge = set(seeds), set(seeds)
    for _ in range(around):
        edge = {u for v in edge for u in (*g.predecessors(v), *g.successors(v))} - keep
        keep |= edge
    return g.subgraph(keep).copy()


def _part_words(kernels, scope, around) -> str:
    what = []
    if kernels is not None:
        what.append(kernels if isinstance(kernels, str) else ", ".join(kernels))
    if scope is not None:
        what.append(f"{scope}*")
    return " and ".join(what) + (f" with {around} edge(s) around" if around else "")


def _hidden(n) -> bool:
    if n["op"] in _HIDDEN_OPS:
        return True
    if any(t["dtype"].startswith("opaque:") for t in n["outputs"]):
        return True      # resource handles and other non-tensor values
    # a variable read the frontend lifted as a graph input: a weight
    return n["op"] == "Placeholder" and n["name"].endswith("ReadVariableOp")


def _layers(g):
    """Each node's layer: its longest path from the inputs, then (for a node off
    that path) moved down to just above its first reader.  A BatchNorm's weight-side
    math (rsqrt of the variance, times gamma) reads only weights: by the first rule
    alone a conv net's dozens of them all sat on the top rows, far from the kernels
    that use them, with their labels piled up there."""
    import networkx as nx
    order = list(nx.topological_sort(g))
    depth = {}
    for v in order:
        depth[v] = max((depth[u] + 1 for u in g.predecessors(v)), default=0)
    for v in reversed(order):
        readers = [depth[s] for s in g.successors(v)]
        if readers and min(readers) - 1 > depth[v]:
            depth[v] = min(readers) - 1
    return depth


LAYOUTS = ("auto", "dot", "layers")


def _layout(g, engine):
    if engine not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {engine!r}")
    if engine == "dot" and not shutil.which("dot"):
        raise ValueError("layout='dot' needs Graphviz's dot program on PATH (e.g. apt "
                         "install graphviz); layout='auto' falls back to 'layers'")
    if engine in ("auto", "dot") and shutil.which("dot"):
        try:
            return _dot_layout(g)
        except (OSError, subprocess.SubprocessError, ValueError):
            if engine == "dot":
                raise
    import networkx as nx
    depth = _layers(g)
    nx.set_node_attributes(g, depth, "layer")
    pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal")
    return {v: (x, -y) for v, (x, y) in pos.items()}


def _dot_layout(g):
    """Node positions from Graphviz (``dot -Tplain``); node names are passed as quoted
    ids through an index, never as code."""
    names = list(g.nodes)
    idx = {v: i for i, v in enumerate(names)}
    lines = ["digraph G {", "rankdir=TB;"]
    lines += [f"n{i};" for i in range(len(names))]
    lines += [f"n{idx[u]} -> n{idx[v]};" for u, v in g.edges]
    lines.append("}")
    out = subprocess.run(["dot", "-Tplain"], input="\n".join(lines), capture_output=True,
                         text=True, timeout=120, check=True).stdout
    pos = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] == "node":
            pos[names[int(parts[1][1:])]] = (float(parts[2]), float(parts[3]))
    if len(pos) != len(names):
        raise ValueError("dot left nodes out")
    return pos


def kernel_colors(dump) -> dict:
    """kernel name -> an RGBA colour: matplotlib's tab20 up to 20 kernels; beyond, hues
    a golden-ratio turn apart (tab20 cycled gave kernel_3 and kernel_23 of a large
    model one colour, often side by side)."""
    import colorsys

    import matplotlib
    ks = dump.kernels
    if len(ks) <= 20:
        cmap = matplotlib.colormaps["tab20"]
        return {k.name: cmap(i) for i, k in enumerate(ks)}
    return {k.name: (*colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.75 - 0.3 * (i % 2),
                                          0.9 - 0.25 * (i % 3 == 2)), 1.0)
            for i, k in enumerate(ks)}


def draw_graph(dump, ax=None, layout: str = "auto", labels: bool | None = None,
               kernels=None, scope: str | None = None, around: int = 1):
    """Draw the dump's graph with each stitched region coloured and labelled; returns
    the matplotlib Axes.  ``layout``: "auto" (Graphviz when installed), "dot" or
    "layers"; ``labels``: op names on nodes (default: drawings up to 120 nodes).

    A large model's graph (EfficientNetB0: ~900 nodes drawn) is unreadable whole:
    draw a part.  ``kernels``: a kernel's name or a list of them ("kernel_13" or
    "stitching/kernel_13"); ``scope``: the nodes whose name starts with it (a layer:
    ``"model/block2a_"``); ``around``: how many edges out from those the drawing reaches
    (1: what feeds them and what reads them).  Colours are the whole dump's, so a
    kernel has the same colour in every part."""
    import matplotlib.pyplot as plt
    import networkx as nx
    from matplotlib.patches import Patch
    whole = to_networkx(dump)
    g = _part(whole, dump, kernels, scope, around)
    pos = _layout(g, layout)
    colors = kernel_colors(dump)
    if ax is None:
        n = max(1, len(g))
        _, ax = plt.subplots(figsize=(min(20, 4 + n ** 0.5 * 0.6), min(30, 4 + n ** 0.5 * 1.1)))
    fill, rim = [], []
    for v, d in g.nodes(data=True):
        if d["kernel"]:
            fill.append(colors[d["kernel"]])
            rim.append("black")
        elif d["reason"]:
            fill.append("lightgrey")
            rim.append("red")
        else:
            fill.append("white")
            rim.append("dimgrey")
    nx.draw_networkx_edges(g, pos, ax=ax, arrows=True, arrowsize=6, width=0.6,
                           edge_color="grey", node_size=120)
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=fill, edgecolors=rim, linewidths=0.8,
                           node_size=120)
    if labels if labels is not None else len(g) <= _LABEL_MAX_NODES:
        nx.draw_networkx_labels(g, pos, {v: d["op"] for v, d in g.nodes(data=True)},
                                ax=ax, font_size=6)
    for k in dump.kernels:
        pts = [pos[v] for v in k.nodes if v in pos]
        if not pts:
            continue
        # beside the region's middle node: a member far off (a weight's Reshape drawn
        # among the inputs) must not drag the label away from the rest
        x, y = sorted(pts, key=lambda p: p[1])[len(pts) // 2]
        ax.annotate(k.name.split("/")[-1], (x, y), xytext=(14, 0), textcoords="offset points",
                    fontsize=8, fontweight="bold", color=colors[k.name], va="center",
                    bbox=dict(boxstyle="round,pad=0.2", fc="white", ec=colors[k.name]))
    legend = [Patch(fc="lightgrey", ec="red", label="memory-intensive, left to TF"),
              Patch(fc="white", ec="dimgrey", label="other TF op")]
    ax.legend(handles=legend, loc="upper left", fontsize=7)
    title = (f"{dump.function}: {len(dump.kernels)} stitched kernel(s), "
             f"{dump.summary.get('fused_ops')}/{dump.summary.get('memory_intensive_ops')} "
             f"memory-intensive ops fused")
    if g is not whole:
        title += f"\nthe part drawn: {_part_words(kernels, scope, around)}, {len(g)} nodes"
    elif len(g) > _PART_HINT_NODES:
        title += f"\n{len(g)} nodes: draw_graph(..., kernels=...) or scope=... draws a part"
    ax.set_title(title, fontsize=9)
    ax.set_axis_off()
    return ax


@functools.lru_cache(maxsize=None)
def machine_peaks() -> dict:
    """{"bandwidth", "cache_bandwidth": bytes/s, "flops": FLOP/s, "source": ...}: the
    copy and on-chip bandwidths of the cost model's measured CPU profile (threaded copy
    benchmarks, cached under ~/.cache/stitching) and the best of a few float32 matmuls
    (~0.1 s, measured once per process) as the FLOP ceiling."""
    import time

    import numpy as np

    from ..plan import profiles
    prof = profiles.measured_cpu()
    n = 768
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    best = float("inf")
    for _ in range(8):     # best of several: the machine may be shared
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return {"bandwidth": float(prof.bandwidth), "flops": 2 * n ** 3 / best,
            "cache_bandwidth": float(prof.cache_bandwidth),
            "source": f"bandwidth: device profile {prof.name!r}; flops: {n}x{n} float32 matmul"}


def roofline_points(dump) -> list:
    """Per kernel: (name, FLOPs per byte, FLOP/s, "measured" | "estimated").  A
    measured rate is the fastest call's (the mean moves with other processes'
    load), or the mean's where the profile has no fastest call."""
    pts = []
    for k in dump.kernels:
        e = k.estimate
        flops, nbytes = e.get("flops") or 0, e.get("bytes_fused") or 0
        if not flops or not nbytes:
            continue
        intensity = flops / nbytes
        m = k.measured
        if m and m.get("calls") and m.get("seconds") and m.get("bytes"):
            seconds = m.get("min_seconds") or m["seconds"] / m["calls"]
            pts.append((k.name, intensity, intensity * m["bytes"] / m["calls"] / seconds,
                        "measured"))
        elif e.get("fused_us"):
            pts.append((k.name, intensity, flops / (e["fused_us"] * 1e-6), "estimated"))
    return pts


def roofline(dump, peaks: dict | None = None, ax=None):
    """Roofline chart of the dump's kernels; returns the Axes.  ``peaks``: as
    ``machine_peaks()`` returns (measured when not given)."""
    import matplotlib.pyplot as plt
    import numpy as np
    peaks = peaks or machine_peaks()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    pts = roofline_points(dump)
    lo = min([p[1] for p in pts] + [0.01]) / 4
    hi = max([p[1] for p in pts] + [peaks["flops"] / peaks["bandwidth"]]) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 100)
    ax.loglog(x, np.minimum(peaks["bandwidth"] * x, peaks["flops"]), "k-", lw=1.2,
              label=f"roof: {peaks['bandwidth'] / 1e9:.1f} GB/s, "
                    f"{peaks['flops'] / 1e9:.0f} GFLOP/s")
    if peaks.get("cache_bandwidth"):
        # small kernels run from cache, above the DRAM roof: show the roof they meet
        ax.loglog(x, np.minimum(peaks["cache_bandwidth"] * x, peaks["flops"]), "k--",
                  lw=0.8, label=f"cache roof: {peaks['cache_bandwidth'] / 1e9:.0f} GB/s")
    colors = kernel_colors(dump)
    for name, ai, rate, how in pts:
        ax.loglog([ai], [rate], "o" if how == "measured" else "^", color=colors[name],
                  mec="black", ms=7)
        ax.annotate(name.split("/")[-1], (ai, rate), xytext=(4, 3), textcoords="offset points",
                    fontsize=7)
    ax.plot([], [], "ko", label="measured")
    ax.plot([], [], "k^", label="estimated (cost model)")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"{dump.function}: kernels against this machine's roofline", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return ax
