"""The fused attention op against TF's products at the models' attention shapes.

    python tools/attention_probe.py                          # table on stdout
    python tools/attention_probe.py --runs 4 --markdown BENCHMARKS.md

What tf/passes/blas.py's choice rests on where TF's GEMM is oneDNN's: does
``StitchedAttention`` (runtime/attention.cc: OpenBLAS products around a row softmax,
the scores of a block of query rows kept in cache, the key blocks a causal mask
removes skipped), where the passes make it, beat what the stitched graph runs
otherwise, TF's two batch products around the stitched softmax kernel?  Per shape
[B, H, T, D] (q, k, v alike), unmasked and with a causal additive mask (the Llama
decoder's: -1e9 above the diagonal), each in
one ``tf.function`` with the batch unknown:

- ``tf``: stock TF, ``matmul(softmax(q k^T * c [+ mask]), v)``;
- ``unfused``: the same through ``stitching.function`` with
  ``Options(fused_attention=False)``: TF's products (oneDNN's or, where TF runs Eigen,
  OpenBLAS's) around one stitched softmax kernel;
- ``forced``: the same with ``STITCHING_ATTENTION_AUTOTUNE=0`` while it is stitched:
  where the passes fuse the attention, the ``StitchedAttention`` op always (the rule
  before the op timed itself);
- ``default``: ``stitching.function`` with its default options: where the blas and
  attention passes fuse the attention (column 'fused'), one ``StitchedAttention``,
  which where TF's GEMM is oneDNN's times itself against the unfused way on its
  first calls and keeps the faster (tf/passes/attention.py; the decision is kept in
  the autotune cache, so the later runs read the first run's).

Each run is a fresh process (this machine's timings move between processes, docs/
machines.md); a cell is the median over ``--runs`` runs of each run's median of
``--calls`` interleaved calls, and 'default vs unfused' the median of the runs' ratios,
with their range.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SHAPES = ((1, 4, 128, 64), (8, 4, 128, 64), (8, 8, 128, 32), (32, 4, 128, 64))
MODES = ("tf", "unfused", "forced", "default")


def _one_run(calls: int) -> list[dict]:
    """Time every (shape, mask) case in this process; one dict per case."""
    import numpy as np
    import tensorflow as tf
    import stitching
    from stitching import options as st_options
    rng = np.random.default_rng(0)
    rows = []
    for causal in (False, True):
        for b, h, t, d in SHAPES:
            q, k, v = (tf.constant(rng.standard_normal((b, h, t, d)).astype(np.float32))
                       for _ in range(3))
            mask = tf.constant(np.triu(np.full((t, t), -1e9, np.float32), 1))
            scale = float(np.float32(1.0 / np.sqrt(d)))

            def attend(q, k, v):
                s = tf.matmul(q, k, transpose_b=True) * scale
                return tf.matmul(tf.nn.softmax(s + mask if causal else s), v)

            sig = [tf.TensorSpec((None, h, t, d), tf.float32)] * 3
            fns = {"tf": tf.function(attend, input_signature=sig),
                   "unfused": stitching.function(
                       attend, input_signature=sig,
                       options=stitching.Options(fused_attention=False,
                                                 background_compile=False)),
                   "forced": stitching.function(
                       attend, input_signature=sig,
                       options=stitching.Options(background_compile=False)),
                   "default": stitching.function(
                       attend, input_signature=sig,
                       options=stitching.Options(background_compile=False))}
            outs = {}
            for m, f in fns.items():        # the first call stitches
                os.environ[st_options.ATTENTION_AUTOTUNE_ENV] = "0" if m == "forced" else "1"
                outs[m] = f(q, k, v).numpy()
            os.environ.pop(st_options.ATTENTION_AUTOTUNE_ENV)
            err = max(float(np.max(np.abs(outs[m] - outs["tf"]))) for m in MODES[1:])
            times = {m: [] for m in MODES}
            for _ in range(calls):
                for m in MODES:
                    start = time.perf_counter()
                    fns[m](q, k, v)
                    times[m].append(time.perf_counter() - start)
            graph = fns["default"].get_concrete_function(*sig).graph.as_graph_def()
            fused = any(nd.op == "StitchedAttention" for nd in graph.node)
            rows.append({"shape": [b, h, t, d], "causal": causal, "max_abs_diff": err,
                         "fused": fused,
                         **{m: statistics.median(x) * 1e3 for m, x in times.items()}})
    return rows


def measure(runs: int, calls: int) -> list[dict]:
    """``runs`` fresh processes of ``_one_run``; per case the medians over runs."""
    per_run = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, __file__, "--_one", str(calls)],
                             capture_output=True, text=True, check=True)
        per_run.append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for i, first in enumerate(per_run[0]):
        cases = [r[i] for r in per_run]
        ratios = sorted(c["unfused"] / c["default"] for c in cases)
        rows.append({"shape": first["shape"], "causal": first["causal"],
                     "fused": first["fused"],
                     "max_abs_diff": max(c["max_abs_diff"] for c in cases),
                     **{m: statistics.median(c[m] for c in cases) for m in MODES},
                     "ratio": statistics.median(ratios), "lo": ratios[0], "hi": ratios[-1]})
    return rows


def table(rows) -> tuple[list, list]:
    head = ["[B, H, T, D]", "mask", "fused", "TF ms", "unfused ms", "forced ms",
            "default ms", "default vs unfused", "range over runs", "default vs forced",
            "default vs TF", "max |diff|"]
    body = [["x".join(map(str, r["shape"])), "causal" if r["causal"] else "none",
             "yes" if r["fused"] else "no",
             f"{r['tf']:.3f}", f"{r['unfused']:.3f}", f"{r['forced']:.3f}",
             f"{r['default']:.3f}", f"{r['ratio']:.2f}x", f"{r['lo']:.2f}-{r['hi']:.2f}x",
             f"{r['forced'] / r['default']:.2f}x",
             f"{r['tf'] / r['default']:.2f}x", f"{r['max_abs_diff']:.1e}"] for r in rows]
    return head, body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="fresh processes")
    ap.add_argument("--calls", type=int, default=40, help="interleaved calls per run")
    ap.add_argument("--markdown", metavar="PATH")
    ap.add_argument("--_one", type=int, metavar="CALLS", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._one:
        print(json.dumps(_one_run(args._one)))
        return 0
    rows = measure(args.runs, args.calls)
    from bench_lib.output import render_text
    print(render_text(*table(rows)))
    if args.markdown:
        from bench_lib.output import write_probe_section
        write_probe_section(
            args.markdown, "attention", "the fused attention op against TF's products",
            f"python tools/attention_probe.py --runs {args.runs} --calls {args.calls}",
            [table(rows)], "`tools/attention_probe.py` says what each column runs; cells "
            "are medians over the runs (fresh processes).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
