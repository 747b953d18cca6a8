"""Each 1x1 convolution of a model: TF's Conv2D against the conv1x1 pass's StitchedMatMul,
node by node in the model's own graph (the data tf/passes/conv1x1.py's rule comes from).

    python tools/conv1x1_probe.py --model mobilenet_v2 --batch 8
    python tools/conv1x1_probe.py --model efficientnet_b0 --batch 1 --calls 30

Two stitched functions of the model, traced call by call in one profiler session
(tools/op_breakdown.py, interleaved): ``tf_conv`` with the pass off, ``all1x1`` with the
pass taking every 1x1 convolution it can write, whatever the rule says.  Per convolution:
its shape class, the fastest call of TF's Conv2D node and of the StitchedMatMul that
replaced it (plus its two Reshapes, views), and the ratio.  Then the wall time of each
(median of untraced interleaved calls).  A node's fastest call is its own cost; the
wall time also holds what the output's allocation costs its readers.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mobilenet_v2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args(argv)

    import tensorflow as tf

    import op_breakdown
    import stitching
    from stitching.tf import results
    from stitching.tf.passes import conv1x1

    # a stored result of the model (tf/results.py) would skip the pass and its rule
    results.key = lambda *a, **k: None
    results.probe = lambda *a, **k: None

    dims = {}
    real_dims = conv1x1._dims

    def recorded(ir_graph, conv):
        got = real_dims(ir_graph, conv)
        if not isinstance(got, str):
            dims[conv.name] = got
        return got
    conv1x1._dims = recorded
    conv1x1.decide = lambda *shape: None          # every 1x1 the pass can write

    case = op_breakdown._model(args.model, 4)
    model, shape, inputs = case
    sig = (tf.TensorSpec((None,) + shape, tf.float32),)
    fn = lambda t: model(t, training=False)        # noqa: E731
    opts = stitching.Options(background_compile=False)
    import dataclasses
    modes = {"tf_conv": stitching.function(fn, input_signature=sig, options=dataclasses.replace(
                 opts, conv1x1_gemm=False)),
             "all1x1": stitching.function(fn, input_signature=sig, options=opts)}
    x = tf.constant(inputs(args.batch)[0])
    for f in modes.values():
        for _ in range(3):
            f(x)
    wall = op_breakdown.wall_ms(modes, x, max(args.calls, 10))
    rows = op_breakdown.interleaved_rows(modes, x, args.calls, "min",
                                         nodes="Conv2D|MatMul|Reshape")
    def nodes(mode):
        """node name -> (fastest call, median call) in us; events read
        "stitched/<node>:<op type>"."""
        return {k[2:].rsplit(":", 1)[0].removeprefix("stitched/"): np.array(v)
                for k, v in rows[mode].items() if k.startswith("  ")}
    off, on = nodes("tf_conv"), nodes("all1x1")
    none = np.zeros(2)
    classes = collections.defaultdict(lambda: [np.zeros(2), np.zeros(2), 0])
    print(f"{args.model} batch {args.batch}, load {os.getloadavg()[0]:.2f}; us per node, "
          f"TF's Conv2D vs StitchedMatMul + Reshapes: fastest call (median call)")
    for name, (h, w, cin, cout) in sorted(dims.items(), key=lambda kv: -off.get(kv[0], none)[0]):
        if name not in off:
            continue
        ours = sum(on.get(f"{name}/conv1x1/{s}", none) for s in ("matmul", "pixels", "filter")) \
            + on.get(name, none)
        key = (h, w, cin, cout)
        classes[key][0] = classes[key][0] + off[name]
        classes[key][1] = classes[key][1] + ours
        classes[key][2] += 1
        print(f"  {name:48.48s} {h:3d}x{w:<3d} {cin:4d}->{cout:<4d} {_cells(off[name], ours)}")
    print("by shape class (sum over its convs):")
    for (h, w, cin, cout), (a, b, n) in sorted(classes.items(), key=lambda kv: -kv[1][0][0]):
        print(f"  {h:3d}x{w:<3d} {cin:4d}->{cout:<4d} x{n}: {_cells(a, b)}")
    print(f"wall ms (median): tf_conv {wall['tf_conv']:.2f}, all1x1 {wall['all1x1']:.2f} "
          f"({wall['tf_conv'] / wall['all1x1']:.3f}x); load {os.getloadavg()[0]:.2f}")
    np.testing.assert_allclose(modes["all1x1"](x).numpy(), modes["tf_conv"](x).numpy(),
                               rtol=1e-3, atol=1e-4)
    return 0


def _cells(tf_us, ours_us) -> str:
    """TF's and our (min, median) microseconds and their ratios."""
    ratio = tf_us / np.maximum(ours_us, 1e-9)
    return (f"TF {tf_us[0]:8.1f} ({tf_us[1]:8.1f})  ours {ours_us[0]:8.1f} "
            f"({ours_us[1]:8.1f})  {ratio[0]:5.2f}x ({ratio[1]:5.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
