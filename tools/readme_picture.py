"""Make docs/inspect_graph_dump.png (the picture in docs/inspecting.md) from the public inspection API.

    python tools/readme_picture.py [out.png]

A small Keras Transformer block, stitched with a dump, profiled for 50 calls; the
picture is the dump's graph (draw_graph), its kernels on the roofline, and estimated vs
measured time per kernel -- what notebooks/inspect_graph_dump.ipynb shows.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import stitching  # noqa: E402
from stitching import inspect as si  # noqa: E402
from stitching import runtime  # noqa: E402
from stitching.testing.models import transformer_encoder  # noqa: E402


def main(out="docs/inspect_graph_dump.png"):
    model = transformer_encoder(num_layers=1, d_model=64, heads=4, ff=256, seq_len=32)

    def block(x):
        return model(x, training=False)

    f = stitching.function(block, options=stitching.Options(dump_dir=tempfile.mkdtemp()))
    x = tf.random.normal([8, 32, 64])
    f(x)            # stock TF answers the first call while the kernels compile
    f.wait()        # so the profile below times the kernels (tier 2), not stock TF
    f(x)
    runtime.set_profiling(True)
    for _ in range(50):
        f(x)
    runtime.set_profiling(False)
    si.write_profile(f)
    d = stitching.load_dump(f.report.dump_path)
    d.function = "Keras Transformer block"
    fig = plt.figure(figsize=(11, 7.5))
    gs = fig.add_gridspec(2, 2, width_ratios=[1.15, 1])
    si.draw_graph(d, ax=fig.add_subplot(gs[:, 0]))
    si.roofline(d, ax=fig.add_subplot(gs[0, 1]))
    ax = fig.add_subplot(gs[1, 1])
    rows = d.kernel_rows()
    i = np.arange(len(rows))
    ax.barh(i - 0.2, [r["estimated_us"] for r in rows], 0.4, color="lightsteelblue",
            label="estimated (cost model)")
    ax.barh(i + 0.2, [r["measured_us"] or 0 for r in rows], 0.4, color="tab:orange",
            label="measured (STITCHING_PROFILE=1)")
    ax.set_yticks(i, [f"{r['kernel'].split('/')[-1]} ({r['ops']} ops)" for r in rows],
                  fontsize=8)
    ax.set_xlabel("µs per call")
    ax.set_title("per kernel: estimated vs measured", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=72)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
