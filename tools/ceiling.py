#!/usr/bin/env python
"""How fast can stitching make each model at best?  The models suite's Amdahl ceiling.

    python tools/ceiling.py                                  # every model, batches 1 and 8
    python tools/ceiling.py --models resnet50 --batches 1 --markdown BENCHMARKS.md

Stitching fuses memory-intensive ops and leaves convolutions and matrix products to
TF.  For each models-suite case this runs stock TF and the stitched function under
TF's profiler (tools/op_breakdown.py: op time per call by op type, stitched kernels
from the op's own counters) and splits each mode's op time into contractions,
memory-intensive ops and the rest (op_breakdown.split).  The ceiling is stock TF's op
time over its op time without the memory-intensive ops: what a fuser that leaves the
contractions to TF would reach if its kernels took no time at all.  The stitched
columns say how much of the memory-intensive time is gone, and whether TF's own
contractions ran as fast in the stitched graph as in stock TF (a ratio over 1 is time
lost outside our kernels: load on the machine, or interference).

Times are op time (summed over TF's threads), each class's median over calls traced
one at a time, the two modes' calls interleaved; on a busy machine they still move
with the load (at load 4-9 one model's ceiling moved by 10-40% between runs),
the shares and the ceiling, ratios within one mode, less than the times.  The
wall-clock columns are the interleaved medians of op_breakdown (fewer calls than the
models suite, whose numbers are the ones to quote for speed).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import op_breakdown  # noqa: E402  (tools/ on the path first)

MODELS = "resnet50,mobilenet_v2,efficientnet_b0,transformer,llama_decoder,gpt2_decoder,vit_encoder"
BAR = 1.4        # issue 37's bar: the models at least 1.4x stock TF (geomean)


def measure(model: str, batch: int, calls: int) -> dict:
    """One row: wall ms per mode, and each mode's op time split by class, the median
    over ``calls`` calls traced one at a time, the modes' calls interleaved (a call the
    load slowed down, as it does on a shared machine, moves a median little and a sum
    a lot, and a drifting load falls on both modes alike)."""
    modes, x = op_breakdown.prepare(model, batch, ["tf", "stitched"])
    wall = op_breakdown.wall_ms(modes, x, max(calls, 10))
    per_call = {m: [] for m in modes}
    for i in range(calls):
        for m in list(modes)[i % 2:] + list(modes)[:i % 2]:
            per_call[m].append(op_breakdown.split(op_breakdown.op_rows(m, modes[m], x, 1)))
    parts = {m: {k: statistics.median(p[k] for p in calls_) for k in calls_[0]}
             for m, calls_ in per_call.items()}
    return {"case": model, "batch": batch, "wall": wall, "tf": parts["tf"],
            "st": parts["stitched"], "ceiling": op_breakdown.ceiling(parts["tf"])}


def table(rows) -> tuple[list, list]:
    head = ["case", "batch", "TF ms", "stitched ms", "st vs TF", "TF op time: contractions",
            "memory-intensive", "ceiling", "memory-intensive time removed",
            "stitched op time: kernels", "TF memory ops left", "contractions st / TF"]
    body = []
    for r in rows:
        tf_total, st_total = sum(r["tf"].values()), sum(r["st"].values())
        st_memory = r["st"]["memory"] + r["st"]["kernels"]
        body.append([
            r["case"], str(r["batch"]), f"{r['wall']['tf']:.4g}", f"{r['wall']['stitched']:.4g}",
            f"{r['wall']['tf'] / r['wall']['stitched']:.2f}x",
            f"{r['tf']['contraction'] / tf_total:.0%}", f"{r['tf']['memory'] / tf_total:.0%}",
            f"{r['ceiling']:.2f}x", f"{1 - st_memory / r['tf']['memory']:.0%}",
            f"{r['st']['kernels'] / st_total:.0%}", f"{r['st']['memory'] / st_total:.0%}",
            f"{r['st']['contraction'] / r['tf']['contraction']:.2f}"])
    return head, body


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def verdicts(rows) -> list[str]:
    ceil = geomean(r["ceiling"] for r in rows)
    speed = geomean(r["wall"]["tf"] / r["wall"]["stitched"] for r in rows)
    under = [f"{r['case']}/b{r['batch']} {r['ceiling']:.2f}x" for r in rows
             if r["ceiling"] < BAR]
    return [f"- ceiling geomean {ceil:.2f}x over {len(rows)} rows; stitched vs TF in "
            f"this run (wall) {speed:.2f}x",
            f"- rows whose ceiling is under the {BAR}x bar: "
            + (", ".join(under) if under else "none")]


def _markdown(rows, meta: str, key: str, command: str) -> str:
    from bench_lib.output import render_markdown
    return "\n".join([
        f"<!-- suite:{key} -->",
        "## ceiling (what fusing memory-intensive ops can gain, per model)", "",
        meta + f" Command `{command}`.", "",
        "Stock TF's op time per call (TF's profiler, summed over its threads) split into "
        "contractions (convolutions, matrix products: TF's in every mode) and "
        "memory-intensive ops; ceiling = op time / op time without the memory-intensive "
        "ops, the speed-up a fuser that leaves contractions to TF would reach if its "
        "kernels took no time (Amdahl). 'Memory-intensive time removed': stitched "
        "kernels plus the memory ops left to TF, against stock TF's memory ops; then "
        "the stitched graph's op time in its kernels and in the memory ops it leaves "
        "to TF. "
        "'Contractions st / TF': TF's own convolutions and products in the stitched "
        "graph against stock TF (1: unchanged). A row can beat its ceiling: stitching's "
        "layout passes also speed up TF's products (the Transformer's), and each op it "
        "removes saves TF's dispatch too. `tools/ceiling.py` says how.", "",
        render_markdown(*table(rows)), "", *verdicts(rows), f"<!-- /suite:{key} -->"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--calls", type=int, default=10, help="traced calls per mode")
    ap.add_argument("--markdown", metavar="PATH", help="write the section into PATH")
    args = ap.parse_args(argv)
    load0, started = os.getloadavg()[0], time.gmtime()
    rows = []
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            rows.append(measure(model, batch, args.calls))
            r = rows[-1]
            print(f"{model} b{batch}: TF {r['wall']['tf']:.2f} ms, stitched "
                  f"{r['wall']['stitched']:.2f} ms; TF op time "
                  + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in r["tf"].items() if v)
                  + f"; ceiling {r['ceiling']:.2f}x; load {os.getloadavg()[0]:.2f}",
                  flush=True)
    print("\n".join(verdicts(rows)))
    if args.markdown:
        import tensorflow as tf

        from bench_lib.machine import machine_line
        from bench_lib.output import replace_sections, section_key
        from stitching.plan import profiles
        from stitching.tf.passes import remapper
        # a table of one machine never replaces another's (oneDNN on or off included)
        key = section_key("ceiling", {"cpu_class": profiles.cpu_facts()["cpu_class"],
                                      "tf_onednn": remapper.onednn_enabled()})
        busy = max(load0, os.getloadavg()[0]) > os.cpu_count()
        meta = (f"Measured {time.strftime('%Y-%m-%d %H:%M:%S UTC', started)} on "
                f"{machine_line()} ({os.cpu_count()} cores); TensorFlow "
                f"{tf.__version__}; load average {load0:.2f} at start, "
                f"{os.getloadavg()[0]:.2f} at end; {args.calls} traced calls per mode."
                + (" The machine was busy with other work (load above its cores): the "
                   "times are inflated and move from run to run; the shares, the "
                   "ceilings and 'st vs TF' are ratios within one run (between runs at "
                   "load 4-9 a model's ceiling moved by 10-40%)." if busy else ""))
        command = ("python tools/ceiling.py " + " ".join(argv if argv is not None
                                                           else sys.argv[1:]))
        replace_sections(args.markdown, {key: _markdown(rows, meta, key, command.strip())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
