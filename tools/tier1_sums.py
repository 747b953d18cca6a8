"""Tier-1 row sums: the speed of a tier-1 LayerNorm and mean kernel with the row's
float32 partial sums folded every ``--chunks`` elements (codegen/cpu/emitter.py,
TIER1_CHUNK; BENCHMARKS.md, "Tier-1 row sums in 16-element partials").

    python tools/tier1_sums.py [--cols 1024] [--rows 2048] [--chunks 1024 16]

Each chunk length gets its own tier-1 build (a directory of its own, an empty
kernel cache); calls are interleaved, the median of 15 per kernel is printed.
"""
import argparse
import os
import tempfile
import time

os.environ["STITCHING_CACHE_DIR"] = tempfile.mkdtemp(prefix="tier1-sums-")

import numpy as np  # noqa: E402

from stitching.codegen.cpu import emitter  # noqa: E402
from stitching.compile import kernel  # noqa: E402
from stitching.ir.builder import SpecBuilder  # noqa: E402


def layernorm(n):
    b = SpecBuilder()
    x, g = b.input("float32", (-1, n)), b.input("float32", (n,))
    c = b.Sub(x, b.Mean(x, axes=[1], keep_dims=True))
    v = b.Mean(b.Square(c), axes=[1], keep_dims=True)
    return b.build([b.Add(b.Mul(c, b.Rsqrt(b.Add(v, b.const(1e-5)))), g)])


def mean(n):
    b = SpecBuilder()
    return b.build([b.Mean(b.input("float32", (-1, n)), axes=[1], keep_dims=False)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 16])
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.random((a.rows, a.cols), dtype=np.float32)
    for name, make, args in (("layernorm", layernorm, (x, x[0])), ("mean", mean, (x,))):
        built = {}
        for chunk in a.chunks:
            emitter.TIER1_CHUNK = chunk
            kernel.clear_memory_cache()
            kernel.set_tier1_dir(tempfile.mkdtemp(prefix="tier1-"))
            built[chunk] = kernel.compile_kernel(make(a.cols), tier=1)
        times = {c: [] for c in built}
        for _ in range(15):
            for c, k in built.items():
                t = time.perf_counter()
                k(*args)
                times[c].append(time.perf_counter() - t)
        ms = {c: np.median(v) * 1e3 for c, v in times.items()}
        print(f"{name} [{a.rows}x{a.cols}] " + "  ".join(f"chunk {c}: {m:.3f} ms"
                                                     for c, m in ms.items()))


if __name__ == "__main__":
    main()
