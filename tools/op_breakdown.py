"""Per-op time breakdown of one model under stock TF, XLA and stitching, side by side.

    python tools/op_breakdown.py --batch 1                 # the models suite's Transformer
    python tools/op_breakdown.py --batch 8 --layers 2 --modes xla,stitched
    python tools/op_breakdown.py --model resnet50 --modes tf,stitched  # any models-suite model

Each mode runs ``--calls`` calls under TF's profiler (``tf.profiler.experimental``);
the trace's host events are summed per op class and divided by the calls:

- TF ops (stock TF, and the TF ops of the stitched graph): the executor's
  ``node:OpType`` events, grouped by op type (``_MklMatMul``, ``GatherV2``, ...);
- XLA: its thunks, grouped by name with the ``.N`` suffix removed (``dot``, ``MatMul``,
  ``multiply_bitcast_fusion``, ``copy_bitcast_fusion``, ...);
- StitchedKernel nodes run inline (not ``IsExpensive``) and leave no event: their time
  comes from the op's own counters (``STITCHING_PROFILE``, runtime.registry.profile),
  one row per kernel kind.

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
import collections
import glob
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np

_XLA_SUFFIX = re.compile(r"\.\d+$")


def group_events(xspace, calls: int) -> dict:
    """op class -> microseconds per call, from a profiler XSpace (see module docstring):
    XLA thunks (events with an ``hlo_op`` stat) by name without their ``.N``, executor
    events ``node:OpType`` by op type; runtime frames are left out."""
    total = collections.defaultdict(float)
    for plane in xspace.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        hlo = {k for k, v in plane.stat_metadata.items() if v.name == "hlo_op"}
        for line in plane.lines:
            for ev in line.events:
                key = op_class(names.get(ev.metadata_id, ""),
                               any(st.metadata_id in hlo for st in ev.stats))
                if key is not None:
                    total[key] += ev.duration_ps / 1e6 / calls
    return dict(total)


def op_class(name: str, xla_thunk: bool) -> str | None:
    """The row an event belongs to, or None for runtime frames."""
    name = name.strip()
    if xla_thunk:
        return None if name.startswith("end: ") else _XLA_SUFFIX.sub("", name)
    if "::" in name or ":" not in name or "__inference" in name:
        return None
    return name.rsplit(":", 1)[1] or None        # executor: "node/name:OpType"


CONTRACTIONS = re.compile(r"Conv|MatMul|Einsum")   # TF's convolutions and GEMMs, plain,
#                      fused (_FusedConv2D, _MklNativeFusedMatMul, ...) or depthwise


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
                fn, input_signature=sig, options=stitching.Options(background_compile=False))}
    unknown = set(wanted) - set(make)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; choose from {sorted(make)}")
    return {m: make[m]() for m in wanted}


def _trace(f, x, calls):
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    logdir = tempfile.mkdtemp(prefix="op_breakdown_")
    try:
        tf.profiler.experimental.start(logdir)
        for _ in range(calls):
            f(x)
        tf.profiler.experimental.stop()
        space = xplane_pb2.XSpace()
        with open(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0], "rb") as fh:
            space.ParseFromString(fh.read())
        return space
    finally:
        shutil.rmtree(logdir, ignore_errors=True)


def _kernel_rows(f, x, calls) -> dict:
    """StitchedKernel time per call, one row per kind of kernel (its distinct op types,
    from the report; the label is ``stitching/kernel_N``, the report's kernel name)."""
    from stitching.runtime import registry
    kinds = {k.name: "StitchedKernel[" + ",".join(sorted({op for _, op in k.ops})) + "]"
             for k in f.report.kernels}
    registry.set_profiling(True)
    registry.profile_reset()
    for _ in range(calls):
        f(x)
    counters = registry.profile()
    registry.set_profiling(False)
    rows = collections.defaultdict(float)
    for label, c in counters.items():
        if c["calls"]:
            rows[kinds.get(label, label)] += c["seconds"] * 1e6 / calls
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
    return modes, x


def op_rows(mode: str, f, x, calls: int) -> dict:
    """One mode's op-class rows, microseconds per call over ``calls`` traced calls
    (stitched kernels from the op's counters)."""
    rows = group_events(_trace(f, x, calls), calls)
    if mode == "stitched":
        rows.update(_kernel_rows(f, x, calls))
    return rows


def breakdown(model_name: str, batch: int, wanted, calls: int, layers: int = 4):
    """(wall ms per mode, {mode: op-class rows}): the module docstring's measurement."""
    modes, x = prepare(model_name, batch, wanted, layers)
    wall = wall_ms(modes, x, max(calls, 10))
    return wall, {m: op_rows(m, f, x, calls) for m, f in modes.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="transformer",
                    help="a models-suite case (tools/bench.py --list)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4, help="Transformer layers (suite: 4)")
    ap.add_argument("--modes", default="tf,xla,stitched")
    ap.add_argument("--calls", type=int, default=20, help="traced calls per mode")
    ap.add_argument("--top", type=int, default=14, help="rows per mode")
    args = ap.parse_args(argv)
    wall, per_mode = breakdown(args.model, args.batch, args.modes.split(","), args.calls,
                               args.layers)
    what = (f"Transformer {args.layers} layers" if args.model == "transformer"
            else args.model)
    print(f"{what}, batch {args.batch}; load average "
          f"{os.getloadavg()[0]:.2f}; wall ms per call (median, interleaved): "
          + ", ".join(f"{m} {v:.3f}" for m, v in wall.items()))
    for m, rows in per_mode.items():
        parts = split(rows)
        total = sum(parts.values())
        print(f"== {m}: {total:.0f} us of op time per call: "
              + ", ".join(f"{k} {v:.0f} us ({v / total:.0%})" for k, v in parts.items())
              + f"; ceiling with contractions left to TF {ceiling(parts):.2f}x")
        for key, us in sorted(rows.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"   {key:34s} {us:9.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
