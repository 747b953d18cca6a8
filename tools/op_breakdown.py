"""Per-op time breakdown of one model under stock TF, XLA and stitching, side by side.

    python tools/op_breakdown.py --batch 1                 # the models suite's Transformer
    python tools/op_breakdown.py --batch 8 --layers 2 --modes xla,stitched
    python tools/op_breakdown.py --model resnet50 --modes tf,stitched  # any models-suite model
    python tools/op_breakdown.py --stat min --nodes 'MatMul|dot'  # per-node minima, GEMMs listed
    python tools/op_breakdown.py --interleave --stat min   # modes traced call by call

Each mode runs ``--calls`` calls under TF's profiler (``tf.profiler.experimental``);
the trace's host events are summed per op class and divided by the calls
(``--stat min``: each node's fastest call instead, see ``group_events``):

- TF ops (stock TF, and the TF ops of the stitched graph): the executor's
  ``node:OpType`` events, grouped by op type (``_MklMatMul``, ``GatherV2``, ...);
- XLA: its thunks, grouped by name with the ``.N`` suffix removed (``dot``, ``MatMul``,
  ``multiply_bitcast_fusion``, ``copy_bitcast_fusion``, ...);
- StitchedKernel nodes: their time comes from the op's own counters
  (``STITCHING_PROFILE``, runtime.registry.profile), one row per kernel kind (the
  op's own profiler events, which it emits since it runs inline, are left out);
- the OpenBLAS ops of a graph (``StitchedMatMul``, ``StitchedBatchMatMul``,
  ``StitchedAttention``: two products and the softmax between them) from their events,
  counted as contractions.

The profiler itself adds overhead and, on the shared 2-core machine, ops that run
concurrently on TF's two inter-op threads overlap: the rows show where time goes, the
wall-clock line (median of ``--calls`` untraced calls per mode, interleaved) is the
number to compare.

Each mode's rows are also split (``split``) into contractions (convolutions and matrix
products, TF's however the model is stitched), TF's memory-intensive ops (the report's
definition, stitching.tf.opnames: what a stitched kernel can take over, fused or not
yet), stitched kernels and the rest (variable reads, shape ops).  For stock TF that
gives the ceiling of any fuser that leaves the contractions to TF (Amdahl): if every
memory-intensive op cost nothing, a call would take at least ``1 - share`` of its op
time, so no such fuser can be faster than ``1 / (1 - share)``.  The bound is of op time; a fused graph also saves
the executor's dispatch of each op it removes (outside the op events), which can move
a small model slightly past it.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import os
import re
import sys
import time

import numpy as np

_XLA_SUFFIX = re.compile(r"\.\d+$")


def node_events(xspace, marks: dict | None = None) -> dict:
    """(op class, event name) -> every duration in microseconds, from a profiler XSpace
    (see module docstring): XLA thunks (events with an ``hlo_op`` stat) by name without
    their ``.N``, executor events ``node:OpType`` by op type; runtime frames are left
    out.  The event name is the node's (or thunk's): one entry per call.

    ``marks``: {marker event name: mode} of the calls of an interleaved trace
    (``_trace_interleaved``); then {mode: such a dict}, each event given to the mode
    whose call marker spans its start (events outside every call are dropped)."""
    spans, found = [], []
    for plane in xspace.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        hlo = {k for k, v in plane.stat_metadata.items() if v.name == "hlo_op"}
        for line in plane.lines:
            for ev in line.events:
                name = names.get(ev.metadata_id, "")
                start = line.timestamp_ns * 1000 + ev.offset_ps
                if marks and name in marks:
                    spans.append((start, start + ev.duration_ps, marks[name]))
                    continue
                key = op_class(name, any(st.metadata_id in hlo for st in ev.stats))
                if key is not None:
                    found.append((start, (key, name.strip()), ev.duration_ps / 1e6))
    if not marks:
        out = collections.defaultdict(list)
        for _, key, us in found:
            out[key].append(us)
        return out
    spans.sort()
    starts = [s for s, _, _ in spans]
    per_mode = {m: collections.defaultdict(list) for m in marks.values()}
    for start, key, us in found:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start <= spans[i][1]:
            per_mode[spans[i][2]][key].append(us)
    return per_mode


def group_events(events: dict, calls: int, stat: str = "mean") -> dict:
    """op class -> microseconds per call, from ``node_events`` over ``calls`` calls.

    ``mean``: all of a class's time over ``calls``.  ``min``: each node's fastest call,
    times its events per call: on a machine other processes load, a call that lost
    its core counts in the mean but not in the minimum, so ``min`` is what the op
    itself costs (concurrent ops still slow each other: that stays in both)."""
    if stat not in ("mean", "min"):
        raise ValueError(f"stat must be 'mean' or 'min', not {stat!r}")
    total = collections.defaultdict(float)
    for (key, _), us in events.items():
        total[key] += sum(us) / calls if stat == "mean" else min(us) * len(us) / calls
    return dict(total)


def op_class(name: str, xla_thunk: bool) -> str | None:
    """The row an event belongs to, or None for runtime frames."""
    name = name.strip()
    if xla_thunk:
        return None if name.startswith("end: ") else _XLA_SUFFIX.sub("", name)
    if "::" in name or ":" not in name or "__inference" in name:
        return None
    op = name.rsplit(":", 1)[1] or None         # executor: "node/name:OpType"
    return None if op == "StitchedKernel" else op   # the op's counters: _kernel_rows


CONTRACTIONS = re.compile(r"Conv|MatMul|Einsum|^dot$|^convolution|^StitchedAttention$")
#   TF's convolutions and GEMMs, plain, fused (_FusedConv2D, _MklNativeFusedMatMul, ...)
#   or depthwise, XLA's dot and convolution thunks (XLA's own, or a stitched graph's,
#   tf/passes/xladot.py), and a stitched graph's OpenBLAS products


def split(rows: dict) -> dict:
    """Microseconds per call in contractions, TF's memory-intensive ops, stitched
    kernels and the rest: the op-class rows of one mode (``group_events``) summed by
    class (module docstring)."""
    from stitching.tf import opnames
    out = {"contraction": 0.0, "memory": 0.0, "kernels": 0.0, "other": 0.0}
    for key, us in rows.items():
        cls = ("kernels" if key.startswith("StitchedKernel") else
               "memory" if opnames.is_memory_intensive(key) else
               "contraction" if CONTRACTIONS.search(key) else "other")
        out[cls] += us
    return out


def ceiling(parts: dict) -> float:
    """The Amdahl bound of a fuser that leaves contractions to TF: op time over op time
    without the memory-intensive ops and kernels (module docstring)."""
    total = sum(parts.values())
    rest = parts["contraction"] + parts["other"]
    return total / rest if rest > 0 else float("inf")


def _model(name: str, layers: int):
    """(keras model, per-example input shape, the input at ``batch``): the models suite's
    case ``name``; the Transformer at ``layers`` layers."""
    import keras
    from stitching.testing import models
    if name != "transformer":
        case = models.get(name)
        return case.model, tuple(case.input_shape), case.inputs
    keras.utils.set_random_seed(1)
    cfg = dict(models.TRANSFORMER_CONFIG, num_layers=layers)
    shape = (cfg["seq_len"], cfg["d_model"])
    return models.transformer_encoder(**cfg), shape, lambda b: (
        np.random.default_rng(0).standard_normal((b,) + shape, dtype=np.float32),)


def _modes(fn, sig, wanted):
    import tensorflow as tf

    import stitching
    make = {"tf": lambda: tf.function(fn, input_signature=sig),
            "xla": lambda: tf.function(fn, input_signature=sig, jit_compile=True),
            "stitched": lambda: stitching.function(
                fn, input_signature=sig, options=stitching.Options(background_compile=False)),
            # the products left to TF's GEMM (tf/passes/blas.py off), for an A/B
            "tf_gemm": lambda: stitching.function(
                fn, input_signature=sig,
                options=stitching.Options(background_compile=False, blas_gemm=False)),
            # every 1x1 convolution TF's (tf/passes/conv1x1.py off), for an A/B
            "tf_conv": lambda: stitching.function(
                fn, input_signature=sig,
                options=stitching.Options(background_compile=False, conv1x1_gemm=False))}
    unknown = set(wanted) - set(make)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {sorted(make)}")
    return {m: make[m]() for m in wanted}


def _profile(run):
    """The XSpace of TF's profiler around ``run()``."""
    from stitching.testing.counting import profiler_xspace
    return profiler_xspace(run)


def _trace(f, x, calls):
    return _profile(lambda: [f(x) for _ in range(calls)])


def _interleaved(modes, x, calls):
    """(run, marks): ``run()`` makes ``calls`` rounds, each calling every mode once in
    turn (the order rotating), each call under a profiler marker named for its mode
    (no ':' in it, so op_class takes it for a runtime frame); ``marks`` maps the marker
    names to the modes (node_events).  Traced as one session, every mode meets the same
    load, which on a shared machine moves more between two sequential traces than
    between the modes."""
    import tensorflow as tf
    marks = {f"op_breakdown call {m}": m for m in modes}
    order = list(modes)

    def run():
        for i in range(calls):
            for m in order[i % len(order):] + order[:i % len(order)]:
                with tf.profiler.experimental.Trace(f"op_breakdown call {m}"):
                    modes[m](x)
    return run, marks


def _kernel_rows(f, run, calls, stat: str = "mean") -> dict:
    """StitchedKernel time per call of ``f`` while ``run()`` runs ``calls`` of them, one
    row per kind of kernel (its distinct op types, from the report; the label is
    ``stitching/kernel_N``, the report's kernel name); ``stat`` as group_events's (the
    op's counters keep each label's fastest call)."""
    from stitching.runtime import registry
    kinds = {k.name: "StitchedKernel[" + ",".join(sorted({op for _, op in k.ops})) + "]"
             for k in f.report.kernels}
    registry.set_profiling(True)
    registry.profile_reset()
    run()
    counters = registry.profile()
    registry.set_profiling(False)
    rows = collections.defaultdict(float)
    for label, c in counters.items():
        if c["calls"]:
            total = c["seconds"] if stat == "mean" else c["min_seconds"] * c["calls"]
            rows[kinds.get(label, label)] += total * 1e6 / calls
    return dict(rows)


def wall_ms(modes, x, calls) -> dict:
    times = {m: [] for m in modes}
    for i in range(calls):
        for m in list(modes)[i % len(modes):] + list(modes)[:i % len(modes)]:
            t = time.perf_counter()
            modes[m](x)
            times[m].append(time.perf_counter() - t)
    return {m: float(np.median(v)) * 1e3 for m, v in times.items()}


def prepare(model_name: str, batch: int, wanted, layers: int = 4):
    """({mode: function}, input) of one models-suite case at ``batch``, each mode
    traced and warm (modes ``wanted``: tf, xla, stitched)."""
    import tensorflow as tf
    try:
        model, shape, inputs = _model(model_name, layers)
    except KeyError as e:
        raise SystemExit(e.args[0]) from None
    sig = (tf.TensorSpec((None,) + shape, tf.float32),)
    modes = _modes(lambda t: model(t, training=False), sig, wanted)
    x = tf.constant(inputs(batch)[0])
    for f in modes.values():
        for _ in range(3):
            f(x)
    # the stitched modes' tier-2 code in place of tier 1 (and of the original ops a
    # region with a transcendental runs until then), as the models suite times it
    from bench_lib.modes import wait_for_final_code
    wait_for_final_code()
    for f in modes.values():
        f(x)
    return modes, x


def rows_of(events: dict, calls: int, stat: str = "mean", nodes=None) -> dict:
    """One mode's op-class rows from its ``node_events`` (``group_events``'s ``stat``).
    ``nodes``: a regex; when given, the rows also hold ``"  " + name`` (min and median
    microseconds) per node whose class matches."""
    rows = group_events(events, calls, stat)
    if nodes:
        rows.update({"  " + name: (min(us), float(np.median(us)))
                     for (key, name), us in events.items() if re.search(nodes, key)})
    return rows


def op_rows(mode: str, f, x, calls: int, stat: str = "mean", nodes=None) -> dict:
    """One mode's rows (``rows_of``) over ``calls`` traced calls; stitched kernels from
    the op's counters over as many more calls."""
    rows = rows_of(node_events(_trace(f, x, calls)), calls, stat, nodes)
    if mode == "stitched":
        rows.update(_kernel_rows(f, lambda: [f(x) for _ in range(calls)], calls, stat))
    return rows


def breakdown(model_name: str, batch: int, wanted, calls: int, layers: int = 4,
              stat: str = "mean", nodes=None, interleave: bool = False):
    """(wall ms per mode, {mode: op-class rows}): the module docstring's measurement;
    ``interleave``: the modes traced in one session, call by call (``_interleaved``)."""
    modes, x = prepare(model_name, batch, wanted, layers)
    wall = wall_ms(modes, x, max(calls, 10))
    if not interleave:
        return wall, {m: op_rows(m, f, x, calls, stat, nodes) for m, f in modes.items()}
    return wall, interleaved_rows(modes, x, calls, stat, nodes)


def interleaved_rows(modes, x, calls: int, stat: str = "mean", nodes=None,
                     stitched=None) -> dict:
    """{mode: op-class rows} of ``modes`` ({mode: function of ``x``}) traced in one
    profiler session, call by call (``_interleaved``); the ``stitched`` mode's kernels
    from the op's counters during the same calls, named from ``stitched``'s report
    (default: the stitched mode's function itself)."""
    run, marks = _interleaved(modes, x, calls)
    traced = []

    def trace():
        traced.append(_profile(run))
    if "stitched" in modes:     # the kernels' counters count during the same calls
        kernels = _kernel_rows(stitched or modes["stitched"], trace, calls, stat)
    else:
        trace()
        kernels = {}
    per_mode = node_events(traced[0], marks)
    out = {m: rows_of(per_mode[m], calls, stat, nodes) for m in modes}
    out.get("stitched", {}).update(kernels)
    return out


def print_rows(per_mode: dict, stat: str, top: int) -> None:
    """Each mode's op time split (``split``, ``ceiling``), its ``top`` op classes and
    the nodes ``rows_of`` listed."""
    for m, all_rows in per_mode.items():
        rows = {k: v for k, v in all_rows.items() if not k.startswith("  ")}
        parts = split(rows)
        total = sum(parts.values())
        print(f"== {m} ({stat}): {total:.0f} us of op time per call: "
              + ", ".join(f"{k} {v:.0f} us ({v / total:.0%})" for k, v in parts.items())
              + f"; ceiling with contractions left to TF {ceiling(parts):.2f}x")
        for key, us in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
            print(f"   {key:34s} {us:9.1f} us")
        for key, (low, mid) in sorted(((k, v) for k, v in all_rows.items()
                                       if k.startswith("  ")), key=lambda kv: -kv[1][1]):
            print(f"   {key:70.70s} min {low:8.1f} median {mid:8.1f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="transformer",
                    help="a models-suite case (tools/bench.py --list)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4, help="Transformer layers (suite: 4)")
    ap.add_argument("--modes", default="tf,xla,stitched",
                    help="any of tf,xla,stitched,tf_gemm (stitched with the matrix "
                         "products left to TF: Options(blas_gemm=False)),tf_conv (every "
                         "1x1 convolution TF's: Options(conv1x1_gemm=False))")
    ap.add_argument("--calls", type=int, default=20, help="traced calls per mode")
    ap.add_argument("--top", type=int, default=14, help="rows per mode")
    ap.add_argument("--stat", choices=("mean", "min"), default="mean",
                    help="per op class: mean time, or each node's fastest call "
                         "(steadier on a loaded machine)")
    ap.add_argument("--nodes", metavar="REGEX",
                    help="also list each node of the op classes matching REGEX "
                         "(min / median us per call), e.g. 'MatMul|dot'")
    ap.add_argument("--interleave", action="store_true",
                    help="trace the modes in one profiler session, call by call, so "
                         "they meet the same load (default: one session per mode)")
    args = ap.parse_args(argv)
    wall, per_mode = breakdown(args.model, args.batch, args.modes.split(","), args.calls,
                               args.layers, args.stat, args.nodes, args.interleave)
    what = (f"Transformer {args.layers} layers" if args.model == "transformer"
            else args.model)
    print(f"{what}, batch {args.batch}; load average "
          f"{os.getloadavg()[0]:.2f}; wall ms per call (median, interleaved): "
          + ", ".join(f"{m} {v:.3f}" for m, v in wall.items()))
    print_rows(per_mode, args.stat, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
