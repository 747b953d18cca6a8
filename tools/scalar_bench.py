#!/usr/bin/env python
"""What a new Python scalar costs: ``f(x, 1.0)``, ``f(x, 1.5)``, ... side by side.

    python tools/scalar_bench.py [--values 16] [--repeats 3] [--json]
    python tools/scalar_bench.py --markdown BENCHMARKS.md   # its section there
    python tools/scalar_bench.py --paired    # both modes in one process, alternating

TF traces a Python number as a constant, so each new value is a retrace, under
``tf.function`` and ``stitching.function`` alike (issue 38, item 4: a new value may
cost at most tf.function's retrace plus a few milliseconds).  Each mode runs in a
fresh process with an empty kernel cache (a new ``STITCHING_CACHE_DIR``): the first
call traces (and, stitched, compiles); every later call brings a value the function
has not seen.  A row gives the first call and the median of the later ones, in
milliseconds of wall time and of the process's CPU time (which other processes on a
shared machine disturb less), for each function below; ``--repeats`` runs each process that many
times (the two modes alternating) and takes the median of the medians.  The functions:

* ``softmax_axpy``: ``softmax(x * scale) * scale + x`` on [64, 256] (the issue's case);
* ``mlp_block``: a Dense layer, LayerNorm and GELU with ``h * alpha + beta`` on
  [32, 256] (two scalars, a product in the graph);
* ``softmax_loop``: ``softmax_axpy`` three times in an AutoGraph ``for`` over
  ``tf.range`` (the value is a constant of the loop's body, which AutoGraph names anew
  on every trace).

The bar (issue 38, item 4): a new value costs at most tf.function's retrace plus
``MARGIN_MS``, "a few milliseconds" as this tool reads it, in CPU time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time
import numpy as np
import tensorflow as tf
import stitching
mode, case, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(0)
if case == "softmax_axpy":
    x = tf.constant(rng.standard_normal((64, 256)), tf.float32)
    def body(x, scale):
        return tf.nn.softmax(x * scale) * scale + x
    args = lambda v: (x, v)
elif case == "softmax_loop":
    x = tf.constant(rng.standard_normal((64, 256)), tf.float32)
    def body(x, scale):
        for _ in tf.range(3):
            x = tf.nn.softmax(x * scale) * scale + x
        return x
    args = lambda v: (x, v)
else:
    x = tf.constant(rng.standard_normal((32, 256)), tf.float32)
    w = tf.Variable(rng.standard_normal((256, 256)).astype(np.float32) / 16)
    def body(x, alpha, beta):
        h = tf.matmul(x, w)
        m, v = tf.nn.moments(h, axes=[-1], keepdims=True)
        h = tf.nn.gelu((h - m) * tf.math.rsqrt(v + 1e-5))
        return h * alpha + beta
    args = lambda v: (x, v, 0.5 - v)
modes = ("tf", "stitching") if mode == "paired" else (mode,)
fs = {m: tf.function(body) if m == "tf" else stitching.function(body) for m in modes}
out = {m: {"times": [], "cpu": [], "max_abs_diff": 0.0} for m in modes}
for i in range(n):
    v = 1.0 + 0.5 * i
    for m in (modes if i % 2 else modes[::-1]):   # paired: alternating which goes first
        c, t = time.process_time(), time.perf_counter()
        got = fs[m](*args(v)).numpy()
        out[m]["times"].append((time.perf_counter() - t) * 1e3)
        out[m]["cpu"].append((time.process_time() - c) * 1e3)
        want = body(*args(v)).numpy()
        out[m]["max_abs_diff"] = max(out[m]["max_abs_diff"],
                                     float(np.max(np.abs(got - want))))
print(json.dumps(out if mode == "paired" else out[mode]))
"""

CASES = ("softmax_axpy", "mlp_block", "softmax_loop")
MARGIN_MS = 5.0


def run(mode: str, case: str, n: int) -> dict:
    """One fresh process, its own empty kernel cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", STITCHING_NO_HINTS="1",
                   STITCHING_CACHE_DIR=cache,
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        # a file, not ``python -c``: AutoGraph converts a loop only where it can read
        # the function's source; the script's directory (first on sys.path) holds
        # nothing importable
        script = os.path.join(cache, "scalar_child.py")
        with open(script, "w") as f:
            f.write(CHILD)
        r = subprocess.run([sys.executable, script, mode, case, str(n)], env=env,
                           capture_output=True, text=True, cwd=REPO)
    if r.returncode:
        raise RuntimeError(f"{mode} {case} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure(case: str, n: int, repeats: int, paired: bool = False) -> dict:
    """Per mode: first call and the median new-value call (medians over repeats),
    and the largest difference from eager TF over every value.  ``paired``: both
    modes in one process, their calls alternating (a loaded machine disturbs both
    alike); else each mode in its own process, the processes interleaved."""
    row, runs_of = {}, {"tf": [], "stitching": []}
    for _ in range(repeats):    # interleaved: a shared machine's load drifts
        if paired:
            both = run("paired", case, n)
            for mode in runs_of:
                runs_of[mode].append(both[mode])
            continue
        for mode in runs_of:
            runs_of[mode].append(run(mode, case, n))
    for mode, runs in runs_of.items():
        row[mode] = {
            "first_ms": statistics.median(r["times"][0] for r in runs),
            "new_value_ms": statistics.median(statistics.median(r["times"][1:])
                                              for r in runs),
            "new_value_cpu_ms": statistics.median(statistics.median(r["cpu"][1:])
                                                  for r in runs),
            "max_abs_diff": max(r["max_abs_diff"] for r in runs)}
    row["over_tf_ms"] = row["stitching"]["new_value_ms"] - row["tf"]["new_value_ms"]
    row["over_tf_cpu_ms"] = (row["stitching"]["new_value_cpu_ms"]
                             - row["tf"]["new_value_cpu_ms"])
    return row


def table(rows: dict) -> list[str]:
    lines = ["| function | first call ms: tf.function / stitching | new value ms: tf.function"
             " / stitching (over) | new value CPU ms: tf.function / stitching (over) |"
             " max abs diff vs TF |", "|---|---:|---:|---:|---:|"]
    for case, r in rows.items():
        t, s = r["tf"], r["stitching"]
        lines.append(
            f"| {case} | {t['first_ms']:.1f} / {s['first_ms']:.1f} | "
            f"{t['new_value_ms']:.1f} / {s['new_value_ms']:.1f} ({r['over_tf_ms']:+.1f}) | "
            f"{t['new_value_cpu_ms']:.1f} / {s['new_value_cpu_ms']:.1f} "
            f"({r['over_tf_cpu_ms']:+.1f}) | {s['max_abs_diff']:.2g} |")
    return lines


def section(rows: dict, args, loads) -> str:
    """BENCHMARKS.md's section for this run (tools/bench_lib/output.py's format)."""
    import time
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_lib import machine
    worst = max(r["over_tf_cpu_ms"] for r in rows.values())
    paired = getattr(args, "paired", False)
    verdict = "PASS" if worst <= MARGIN_MS else "FAIL"
    return "\n".join([
        "<!-- suite:python_scalars -->",
        "## python_scalars (a new Python scalar: f(x, 1.0), f(x, 1.5), ...)",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())} on "
        f"{machine.machine_line()} ({machine.cores()} cores); stitching "
        f"`{machine.git_rev()}`; load average {loads[0]:.2f} at start, {loads[1]:.2f} at "
        f"end; command `python tools/scalar_bench.py --values {args.values} --repeats "
        f"{args.repeats}{' --paired' if paired else ''} --markdown BENCHMARKS.md`. "
        + ("Both modes run in one fresh process per repeat, their calls alternating "
           "(--paired: a loaded machine slows both alike), with an empty kernel cache; "
           if paired else "Each mode runs in a fresh process with an empty kernel "
           "cache; ")
        + "its first call traces (stitched: and compiles), each "
        f"later one brings a value not seen before ({args.values - 1} of them); a cell is "
        f"the median of the new-value calls, the median over {args.repeats} processes. "
        "CPU time is the process's (other processes on this shared machine disturb it "
        "less than wall time); max abs diff: every value's stitched result against "
        "eager TF.",
        "",
        *table(rows),
        "",
        f"- **{verdict}** a new value costs at most tf.function's retrace + "
        f"{MARGIN_MS:.0f} ms of CPU time: worst {worst:+.1f} ms.",
        "<!-- /suite:python_scalars -->"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=16, help="calls per process, each "
                    "with a new value (default 16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", choices=CASES, action="append",
                    help="one function (repeatable; default all)")
    ap.add_argument("--paired", action="store_true", help="tf.function and "
                    "stitching.function in one process, alternating (for a loaded "
                    "machine; the first call of each then shares a process)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", metavar="PATH", help="replace (or add) this run's "
                    "section of a BENCHMARKS.md")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = {c: measure(c, args.values, args.repeats, args.paired)
            for c in args.case or CASES}
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"load average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
          f"{args.values} values per process, median of {args.repeats} processes")
    print("\n".join(table(rows)))
    if args.markdown:
        from bench_lib import output
        text = section(rows, args, (load0, os.getloadavg()[0]))
        output.replace_sections(args.markdown, {"python_scalars": text})


if __name__ == "__main__":
    main()
