#!/usr/bin/env python
"""What a new input shape costs: first-call time per new batch size, side by side.

    python tools/retrace_bench.py [--batches 8,9,10,11,12,40]

A small Keras block (Dense + LayerNorm + GELU + residual, d=256) called with one batch
size after another, each size new to the function; every mode in a fresh process, the
kernel cache warm (an untimed process fills it first), so a row shows tracing,
planning and lookup, not Numba.  Modes: ``tf.function``, ``tf.function(
reduce_retracing=True)`` and ``stitching.function`` (relaxes shapes after the second
size by default).  Times are milliseconds of the first call at each size.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
import numpy as np
import tensorflow as tf
import keras
import stitching
mode, batches = sys.argv[1], [int(b) for b in sys.argv[2].split(",")]
inp = keras.Input((256,))
h = keras.layers.Dense(256)(inp)
h = keras.layers.LayerNormalization()(h)
h = keras.layers.Activation("gelu")(h)
model = keras.Model(inp, keras.layers.Add()([h, inp]))
fn = {"tf": lambda f: tf.function(f),
      "tf_reduce_retracing": lambda f: tf.function(f, reduce_retracing=True),
      "stitching": lambda f: stitching.function(
          f, options=stitching.Options(background_compile=False))}[mode](lambda x: model(x))
out = []
for b in batches:
    x = tf.constant(np.random.rand(b, 256).astype(np.float32))
    t = time.perf_counter()
    fn(x).numpy()
    out.append(round((time.perf_counter() - t) * 1e3, 1))
print(json.dumps(out))
"""


def run(mode, batches):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", STITCHING_NO_HINTS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # cwd: ``python -c`` puts it first on sys.path, before PYTHONPATH, so a run from
    # another checkout would import that checkout's stitching
    r = subprocess.run([sys.executable, "-c", CHILD, mode, batches], env=env,
                       capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="8,9,10,11,12,40")
    args = ap.parse_args(argv)
    run("stitching", args.batches)                       # fills the kernel cache
    batches = args.batches.split(",")
    print("| mode | " + " | ".join(f"batch {b} ms" for b in batches) + " |")
    print("|---|" + "---:|" * len(batches))
    for mode in ("tf", "tf_reduce_retracing", "stitching"):
        print(f"| {mode} | " + " | ".join(str(t) for t in run(mode, args.batches)) + " |")


if __name__ == "__main__":
    main()
