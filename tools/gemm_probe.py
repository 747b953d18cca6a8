"""TF's GEMM against XLA's and OpenBLAS's at the Transformer's sizes.

    python tools/gemm_probe.py                       # table on stdout
    python tools/gemm_probe.py --markdown BENCHMARKS.md

Stitching leaves matrix products to TF's kernels (it only rewrites their layout,
tf/passes/gemm.py and tf/passes/einsum.py).  At batch 1 the models suite's Transformer encoder spends
most of its time in the feed-forward products [M, 256] x [256, 1024] and
[M, 1024] x [1024, 256] with M = 128 (the sequence), and there TF's product is slower
than XLA's dot.  The cause is in TF, not in the fused kernels: TF's oneDNN ``MatMul``
runs a product on one thread when its operands fit in one core's L2,
``4 (M N + K (M + N)) < L2`` (``ExecuteSingleThreadedGemm``,
tensorflow/core/kernels/mkl/mkl_matmul_ops_common.h), which on a 2 MiB L2 holds for
the feed-forward products up to M = 204.

This probe times, per product, a chain of 16 alternating products (256 -> 1024 -> 256)
in one ``tf.function`` with the batch unknown, as:

- ``MatMul``: what TF runs (and what the stitched graph runs);
- ``BatchMatMulV2``: the same product as [1, M, K] x [K, N], which TF runs on all
  threads whatever its size;
- ``tf.cond``: chooses between the two at run time from M (the choice a rewrite
  would need, since the batch is unknown when the graph is rewritten);
- XLA's dot (``jit_compile=True``);
- ``StitchedMatMul``, our OpenBLAS op (runtime/gemm.cc; tf/passes/blas.py puts it in
  place of each product where TF's GEMM is Eigen's), where the ``scipy-openblas32``
  wheel is installed.

A second table times whole feed-forward blocks (``relu(x W1 + b1) W2 + b2 + x``, four
in a chain) as TF runs them, as XLA does, with both products as ``BatchMatMulV2``, and
split by rows into two halves that TF runs concurrently (``Split`` on the rows aliases
the input; each half's products fall under the one-thread line, so the two halves use
both cores; a ``ConcatV2`` joins them): the graph-level way around the one-thread line,
and what it costs at batch 8; and with ``StitchedMatMul`` taking the bias, as the
blas pass writes them.

The markdown section is per machine class (``gemm`` on the Intel AVX-512 class, with
oneDNN, where this probe started; ``gemm@amd_avx2`` on the AMD EPYC, oneDNN off;
``gemm@amd_avx512`` on the AMD EPYC with AVX-512, oneDNN on).

Each cell is the fastest of ``--rounds`` medians of ``--calls`` calls; modes are
interleaved per round.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

K, N = 256, 1024                      # the models suite's Transformer: d_model, ff
CHAIN = 8                             # pairs of products per call
MODES = ("matmul", "bmm", "cond", "xla", "blas")


def _blas_ops():
    """Our OpenBLAS product ops, or None without the wheel (the column is left out)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from stitching.runtime import blas
    return None if blas.unavailable() else blas.load()


def l2_bytes() -> int:
    """One core's L2 as Linux reports it (what TF's heuristic reads through Eigen)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from stitching.plan import profiles
    return profiles._cache_sizes().get("l2", 0)


def single_threaded(m: int, k: int, n: int, l2: int) -> bool:
    """TF's oneDNN MatMul runs this product on one thread (ExecuteSingleThreadedGemm)."""
    return 4 * (m * n + k * (m + n)) < l2


def _functions(l2: int):
    import tensorflow as tf
    rng = np.random.default_rng(0)
    w1 = tf.Variable(rng.standard_normal((K, N), dtype=np.float32) * 0.05)
    w2 = tf.Variable(rng.standard_normal((N, K), dtype=np.float32) * 0.05)

    def mm(x, w):
        return tf.matmul(x, w)

    def bmm(x, w):
        return tf.squeeze(tf.matmul(tf.expand_dims(x, 0), w), 0)

    def cond(x, w):
        k, n = w.shape
        # BatchMatMulV2 where TF would run MatMul on one thread (M below the L2 line)
        hi = (l2 // 4 - k * n) // (k + n)
        return tf.cond(tf.shape(x)[0] < hi, lambda: bmm(x, w), lambda: mm(x, w))

    def chain(f):
        def run(x):
            for _ in range(CHAIN):
                x = f(f(x, w1), w2)
            return x
        return run

    sig = [tf.TensorSpec([None, K], tf.float32)]
    out = {m: tf.function(chain(f), input_signature=sig)
           for m, f in (("matmul", mm), ("bmm", bmm), ("cond", cond))}
    out["xla"] = tf.function(chain(mm), input_signature=sig, jit_compile=True)
    ops = _blas_ops()
    if ops is not None:
        out["blas"] = tf.function(chain(lambda x, w: ops.stitched_mat_mul(a=x, b=w, bias=[])),
                                  input_signature=sig)
    return out


BLOCKS = 4                            # feed-forward blocks per call


def _block_functions():
    import tensorflow as tf
    rng = np.random.default_rng(2)
    w1 = [tf.Variable(rng.standard_normal((K, N), dtype=np.float32) * 0.05)
          for _ in range(BLOCKS)]
    w2 = [tf.Variable(rng.standard_normal((N, K), dtype=np.float32) * 0.05)
          for _ in range(BLOCKS)]
    b1 = [tf.Variable(np.zeros(N, np.float32)) for _ in range(BLOCKS)]
    b2 = [tf.Variable(np.zeros(K, np.float32)) for _ in range(BLOCKS)]

    def block(x, i, mm=tf.matmul):
        h = tf.nn.relu(tf.nn.bias_add(mm(x, w1[i]), b1[i]))
        return tf.nn.bias_add(mm(h, w2[i]), b2[i]) + x

    def bmm(x, w):
        return tf.squeeze(tf.matmul(tf.expand_dims(x, 0), w), 0)

    def plain(x):
        for i in range(BLOCKS):
            x = block(x, i)
        return x

    def as_bmm(x):
        for i in range(BLOCKS):
            x = block(x, i, bmm)
        return x

    def split(x):
        for i in range(BLOCKS):
            top, bottom = tf.split(x, 2, axis=0)
            x = tf.concat([block(top, i), block(bottom, i)], 0)
        return x

    sig = [tf.TensorSpec([None, K], tf.float32)]
    out = {m: tf.function(f, input_signature=sig)
           for m, f in (("matmul", plain), ("bmm", as_bmm), ("split", split))}
    out["xla"] = tf.function(plain, input_signature=sig, jit_compile=True)
    ops = _blas_ops()
    if ops is not None:
        def blas(x):            # the bias in the product, as tf/passes/blas.py writes it
            for i in range(BLOCKS):
                h = tf.nn.relu(ops.stitched_mat_mul(a=x, b=w1[i], bias=[b1[i]]))
                x = ops.stitched_mat_mul(a=h, b=w2[i], bias=[b2[i]]) + x
            return x
        out["blas"] = tf.function(blas, input_signature=sig)
    return out


def _time(fns, m: int, calls: int, rounds: int, per_call: int) -> dict:
    """Microseconds per ``per_call``-th of a call, each mode's fastest round median."""
    import tensorflow as tf
    x = tf.constant(np.random.default_rng(1).standard_normal((m, K), dtype=np.float32))
    best = {k: float("inf") for k in fns}
    for f in fns.values():
        for _ in range(3):
            f(x)
    for _ in range(rounds):
        for name, f in fns.items():
            ts = []
            for _ in range(calls):
                t = time.perf_counter()
                f(x)
                ts.append(time.perf_counter() - t)
            best[name] = min(best[name], float(np.median(ts)) / per_call * 1e6)
    return best


def measure(sizes, calls: int, rounds: int) -> tuple[list[dict], list[dict]]:
    """(per-product rows, per-block rows) for each M in ``sizes``."""
    l2 = l2_bytes()
    fns, blocks = _functions(l2), _block_functions()
    products = [dict(m=m, single=single_threaded(m, K, N, l2),
                     **_time(fns, m, calls, rounds, 2 * CHAIN)) for m in sizes]
    per_block = [dict(m=m, **_time(blocks, m, calls, rounds, BLOCKS)) for m in sizes]
    return products, per_block


def _blas_cells(r) -> list:
    """The OpenBLAS op's columns, where it ran."""
    if "blas" not in r:
        return []
    return [f"{r['blas']:.0f}", f"{r['matmul'] / r['blas']:.2f}x"]


_BLAS_HEAD = ["OpenBLAS op us", "OpenBLAS vs MatMul"]


def table(rows, single: bool = True) -> tuple[list, list]:
    blas = "blas" in rows[0]
    head = (["M"] + (["TF MatMul threads"] if single else []) +
            ["MatMul us", "BatchMatMulV2 us", "tf.cond us", "XLA dot us", "MatMul vs XLA"]
            + (_BLAS_HEAD if blas else []))
    body = [[str(r["m"])] + (["1 (operands < L2)" if r["single"] else "all"] if single else [])
            + [f"{r['matmul']:.0f}", f"{r['bmm']:.0f}", f"{r['cond']:.0f}",
               f"{r['xla']:.0f}", f"{r['xla'] / r['matmul']:.2f}x"] + _blas_cells(r)
            for r in rows]
    return head, body


def block_table(rows) -> tuple[list, list]:
    blas = "blas" in rows[0]
    head = ["M", "MatMul us", "BatchMatMulV2 us", "row halves us", "XLA us",
            "row halves vs MatMul"] + (_BLAS_HEAD if blas else [])
    body = [[str(r["m"]), f"{r['matmul']:.0f}", f"{r['bmm']:.0f}", f"{r['split']:.0f}",
             f"{r['xla']:.0f}", f"{r['matmul'] / r['split']:.2f}x"] + _blas_cells(r)
            for r in rows]
    return head, body


def _markdown(rows, blocks, meta: str, key: str = "gemm", onednn: bool = True) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_lib.output import render_markdown
    if not onednn:
        return "\n".join([
            f"<!-- suite:{key} -->",
            "## gemm (the amd-avx2 machine: TF's Eigen GEMM vs XLA's and OpenBLAS's)", "",
            meta, "",
            f"Per product of a chain [M, {K}] x [{K}, {N}] x [{N}, {K}] ... (16 products "
            "in one function, batch unknown); `tools/gemm_probe.py` says what each column "
            "runs (the TF-threads column is oneDNN's rule, not Eigen's: left out).",
            "", render_markdown(*table(rows, single=False)), "",
            f"Per feed-forward block relu(x W1 + b1) W2 + b2 + x ({BLOCKS} in one "
            "function; the OpenBLAS op takes the biases):",
            "", render_markdown(*block_table(blocks)), "",
            f"<!-- /suite:{key} -->"])
    home = key == "gemm"          # the Intel class, where the notes below were measured
    title = ("## gemm (TF's matrix product vs XLA's, Transformer sizes)" if home else
             f"## gemm (the {key.split('@')[1].replace('_', '-')} machine: TF's oneDNN "
             "GEMM vs XLA's and OpenBLAS's)")
    return "\n".join([
        f"<!-- suite:{key} -->", title, "",
        meta, "",
        f"Per product of a chain [M, {K}] x [{K}, {N}] x [{N}, {K}] ... (16 products in "
        "one function, batch unknown); `tools/gemm_probe.py` says what each column runs.",
        "", render_markdown(*table(rows)), "",
        f"Per feed-forward block relu(x W1 + b1) W2 + b2 + x ({BLOCKS} in one function):",
        "", render_markdown(*block_table(blocks)), "",
        *(["- At batch 1 (M = 128) TF's MatMul runs on one thread and loses to XLA's dot; "
            "BatchMatMulV2 runs on both but loses from M = 256 on; tf.cond pays its "
            "dispatch on every product; two row halves run side by side win at M = 128 "
            "and are even at M = 1024 (tf/passes/seqsplit.py does this in the graph). This was "
            "the Transformer's batch-1 gap to XLA (docs/limits.md, Matrix products)."]
          if home else []),
        f"<!-- /suite:{key} -->"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,128,192,256,512,1024", help="values of M")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--markdown", metavar="PATH")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows, blocks = measure(sizes, args.calls, args.rounds)
    for head, body in (table(rows), block_table(blocks)):
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
        for line in [head] + body:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        print()
    if args.markdown:
        import tensorflow as tf
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_lib.machine import machine_line
        from bench_lib.output import replace_sections, section_key
        from stitching.plan import profiles
        from stitching.tf.passes import remapper
        onednn = remapper.onednn_enabled()
        cls = profiles.cpu_facts()["cpu_class"]
        # a table of one machine never replaces another's
        key = section_key("gemm", {"cpu_class": cls, "tf_onednn": onednn})
        meta = (f"Measured {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} on "
                f"{machine_line()} ({os.cpu_count()} cores, L2 {l2_bytes() >> 10} KiB "
                f"per core), TensorFlow {tf.__version__}; load average "
                f"{os.getloadavg()[0]:.2f} at the end; command `python tools/gemm_probe.py "
                f"--sizes {args.sizes} --calls {args.calls} --rounds {args.rounds}`.")
        replace_sections(args.markdown, {key: _markdown(rows, blocks, meta, key, onednn)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
