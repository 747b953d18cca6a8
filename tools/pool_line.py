#!/usr/bin/env python
"""Where should the op's output pool start?  TF's allocator against the pool, measured.

    python tools/pool_line.py                      # all patterns at 1, 4, 16, 64 MiB
    python tools/pool_line.py --only softmax_tf bn_swish --rounds 5

The StitchedKernel op takes outputs of at least STITCHING_OUTPUT_POOL_MIN_MB (default 32)
from its own pool of recycled buffers and smaller ones from TF's allocator
(runtime/op.cc, "Output pool").  The pool's whole point is page faults: glibc serves
allocations above its mmap threshold (which adapts up to 32 MiB) with fresh pages, so
a 64 MiB output costs ~16k faults per call; below it malloc recycles warm memory and a
pool only adds a colder buffer.  This tool decides the line from measurements instead
of that argument: the pattern suite (``bench.py --suite patterns --modes tf,stitching``)
runs at each size in fresh processes under two settings,

* ``tf``:   STITCHING_OUTPUT_POOL_MB=0 (every output from TF's allocator),
* ``pool``: STITCHING_OUTPUT_POOL_MIN_MB=1 (every output of 1 MiB or more pooled),

alternating the two for ``--rounds`` rounds.  Processes differ in noise, so each
process's stitched time is divided by the stock-TF time measured beside it in the same
process; the table compares those ratios (median over rounds) per size, and says from
which size the pool wins by more than the noise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {"tf": {"STITCHING_OUTPUT_POOL_MB": "0"},
            "pool": {"STITCHING_OUTPUT_POOL_MIN_MB": "1"}}


def _run(setting, sizes, only, repeats) -> dict:
    """{(pattern, size): stitched time / TF time} from one bench.py process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, os.path.join(HERE, "bench.py"), "--suite", "patterns",
               "--modes", "tf,stitching", "--sizes", ",".join(sizes),
               "--repeats", str(repeats), "--json", out]
        if only:
            cmd += ["--only", *only]
        env = {k: v for k, v in os.environ.items() if not k.startswith("STITCHING_OUTPUT_POOL")}
        subprocess.run(cmd, env={**env, **SETTINGS[setting]}, check=True,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            rows = json.load(f)["results"]["patterns"]
    ratios = {}
    for r in rows:
        t = {m: (r["modes"].get(m) or {}).get("time") for m in ("tf", "stitching")}
        if t["tf"] and t["stitching"]:
            ratios[(r["name"], r["size"])] = t["stitching"]["median_s"] / t["tf"]["median_s"]
    return ratios


def table(runs, sizes) -> list:
    """Lines: per size, the geomean over patterns of (stitched/TF under TF's allocator)
    / (stitched/TF under the pool), medians over rounds: > 1 where the pool is faster."""
    lines = [f"{'size':>5}  {'pool vs TF allocator (geomean of stitched/TF ratios)':>52}  rows"]
    for size in sizes:
        gains = []
        for key in sorted({k for r in runs["tf"] for k in r if k[1] == size}):
            tf_r = [r[key] for r in runs["tf"] if key in r]
            pool_r = [r[key] for r in runs["pool"] if key in r]
            if tf_r and pool_r:
                gains.append(statistics.median(tf_r) / statistics.median(pool_r))
        if gains:
            g = statistics.geometric_mean(gains)
            lines.append(f"{size:>5}  {g:>51.3f}x  {len(gains)} (worst {min(gains):.2f}x, "
                         f"best {max(gains):.2f}x)")
        else:
            lines.append(f"{size:>5}  {'no rows measured at this size':>52}")
    lines.append("\n> 1: the pool is faster at that size (outputs recycled warm beat TF's "
                 "allocator); the line belongs where this crosses 1 beyond the rounds' spread.")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1m,4m,16m,64m")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="PATH", help="write the per-round ratios here")
    ap.add_argument("--from-json", metavar="PATH", help="print the table of a --json file")
    args = ap.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        runs = {s: [{tuple(k.rsplit("/", 1)): v for k, v in r.items()} for r in rs]
                for s, rs in saved.items()}
        print("\n".join(table(runs, sizes)))
        return 0
    runs = {s: [] for s in SETTINGS}
    for i in range(args.rounds):
        for setting in (SETTINGS if i % 2 == 0 else reversed(list(SETTINGS))):
            print(f"round {i + 1}/{args.rounds}: {setting}", flush=True)
            runs[setting].append(_run(setting, sizes, args.only, args.repeats))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({s: [{f"{k[0]}/{k[1]}": v for k, v in r.items()} for r in rs]
                       for s, rs in runs.items()}, f, indent=1)
    print("\n".join(table(runs, sizes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
