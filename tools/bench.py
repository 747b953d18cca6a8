#!/usr/bin/env python
"""Benchmark harness: stock tf.function vs XLA vs stitching, side by side in one run.

    python tools/bench.py --suite patterns --sizes small --repeats 5
    python tools/bench.py --suite all --json bench_out/all.json --png bench_out/all.png \\
        --markdown BENCHMARKS.md

Suites: ``patterns`` (stitching.testing.patterns, large = bandwidth-bound and small =
latency-bound), ``models`` (keras.applications CNNs + a Keras Transformer encoder),
``compile`` (first call in fresh processes: TF, XLA, stitching with an empty and then a
filled STITCHING_CACHE_DIR), ``short`` (whole short Keras jobs -- fit, evaluate, 100
predicts -- in fresh processes, cold and warm: bench_lib/short.py), ``serving``, ``train`` (one custom training step per model:
stitching.testing.train; kernels and coverage per phase, peak memory in fresh
processes; bench_lib/train.py says how).  A mode that fails (stitching not importable, a trace
error...) is shown as FAILED with its error's first line; the run goes on.

TF's intra-op thread count is left at its default for every mode (one thread per core).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for p in (REPO, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="patterns",
                    choices=["patterns", "models", "compile", "short", "serving", "train",
                             "all"])
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed repeats per mode (default: 10 patterns, 5 models)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed calls after the first (default: 2 patterns, 1 models)")
    ap.add_argument("--min-time", type=float, default=0.02,
                    help="patterns: seconds per timed repeat; fast calls are looped")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="pattern or model names (see --list)")
    ap.add_argument("--sizes", default="large,small", help="patterns: any of large,small "
                    "and 1m,4m,16m,64m (the largest input's MiB)")
    ap.add_argument("--batches", default=None,
                    help="models: comma-separated batch sizes (default: each model's)")
    ap.add_argument("--batch", type=int, default=1, help="compile suite: batch size")
    ap.add_argument("--compile-rounds", type=int, default=3,
                    help="compile suite: rounds of fresh processes; each cell is the "
                         "round with the median first call (default 3)")
    ap.add_argument("--short-rounds", type=int, default=3,
                    help="short suite: rounds of fresh processes per job and mode, "
                         "interleaved (cell: median round)")
    ap.add_argument("--serve-rounds", type=int, default=3,
                    help="serving suite: fresh processes per mode (cell: median round)")
    ap.add_argument("--serve-calls", type=int, default=50,
                    help="serving suite: timed calls per batch size for p50/p99")
    ap.add_argument("--steps", type=int, default=10,
                    help="train suite: steps per peak-memory measurement")
    ap.add_argument("--memory-runs", type=int, default=5,
                    help="train suite: fresh processes per mode for peak memory "
                         "(median; 0: not measured)")
    ap.add_argument("--modes", default="tf,xla,stitching",
                    help="subset of tf,xla,stitching (tf is the reference for checks), "
                         "and tf_gemm: stitching with Options(blas_gemm=False), "
                         "no_attn: stitching with Options(fused_attention=False), "
                         "tf_conv: stitching with Options(conv1x1_gemm=False)")
    ap.add_argument("--ablation", action="store_true",
                    help="add mode 'baseline' (stitching with the XLA-like baseline "
                         "planner) beside the full planner, with an ablation table")
    ap.add_argument("--planner", default=None, metavar="baseline|full|...",
                    help="ablation: passed as stitching.Options(planner=...) when "
                         "stitching.Options has that field (the value is checked there)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--png", metavar="PATH")
    ap.add_argument("--markdown", metavar="PATH",
                    help="regenerate this file's sections for the suites run")
    ap.add_argument("--list", action="store_true", help="list patterns and models")
    ap.add_argument("--from-json", metavar="PATH",
                    help="re-render the report/--markdown/--png from a --json file, no runs")
    ap.add_argument("--no-isolate", action="store_true",
                    help="run patterns/models in this process (default: a worker process, "
                         "so a crash in native code shows as a failed row)")
    ap.add_argument("--row-timeout", type=float, default=900,
                    help="seconds without progress before a worker is declared hung")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_train_memory", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_short", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_serve-dir", dest="_serve_dir", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from bench_lib import suites

    if args._worker:
        from bench_lib import isolate
        isolate.worker_main(args._worker)
        return 0
    if args._train_memory:
        from bench_lib import train
        train.memory_child(args._train_memory, args.steps, args.planner)
        return 0
    if args._serve:
        from bench_lib import serving
        serving.child(args._serve, args.only[0], args._serve_dir, args.serve_calls)
        return 0
    if args._short:
        from bench_lib import short
        short.child(args._short)
        return 0
    if args._child:
        suites.compile_child(args._child, args.only[0], args.batch, args.planner)
        return 0
    if args.list:
        from stitching.testing import all_models, all_patterns
        for p in all_patterns():
            print(f"pattern  {p.name:24s} {p.description}")
        for m in all_models():
            print(f"model    {m.name:24s} {m.description}")
        return 0

    from bench_lib import machine, output
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        return _emit(args, saved["results"], saved["meta"], write_json=False)
    mode_list = tuple(m for m in args.modes.split(",") if m)
    if args.ablation and "baseline" not in mode_list:
        mode_list += ("baseline",)
    bad = set(mode_list) - {"tf", "xla", "stitching", "baseline", "tf_gemm", "no_attn",
                            "tf_conv"}
    if bad:
        raise SystemExit(f"unknown modes: {sorted(bad)}")
    run = ["patterns", "models", "compile"] if args.suite == "all" else [args.suite]
    _check_only(args.only, run)

    meta = machine.machine_info()
    meta["command"] = "python tools/bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta["notes"] = []
    meta["planner"] = args.planner or "default"
    threads = meta["cores"]
    if "patterns" in run:
        print("[bench] measuring copy bandwidth", file=sys.stderr, flush=True)
        meta["copy_bandwidth"] = machine.copy_bandwidth(threads)
    _stitching_note(meta, mode_list)

    results = {}
    t0 = time.time()
    common = dict(mode_list=mode_list, planner=args.planner, repeats=args.repeats,
                  warmup=args.warmup)

    def rows_of(suite, keys, **kw):
        if args.no_isolate:
            return suites.run_rows(suite, keys, **common, **kw)
        from bench_lib import isolate
        return isolate.run_isolated(suite, keys, row_timeout=args.row_timeout, **common, **kw)

    if "patterns" in run:
        sizes = [s for s in args.sizes.split(",") if s]
        results["patterns"] = rows_of(
            "patterns", suites.case_keys("patterns", only=args.only, sizes=sizes),
            min_time=args.min_time)
        if "small" in sizes:
            meta["call_overhead_s"] = suites.call_overhead(mode_list, args.planner)
        # Again after the suite: on a shared machine the first figure may have been
        # taken during someone else's burst; the higher of the two is the reference.
        again = machine.copy_bandwidth(threads)
        cb = meta["copy_bandwidth"]
        cb["gbs_before"], cb["gbs_after"] = cb["gbs"], again["gbs"]
        # and after each large row (suites.run_rows): the best at any point of the run
        during = [r["copy_gbs"] for r in results["patterns"] if r.get("copy_gbs")]
        cb["gbs_during"] = during
        cb["gbs"] = max([cb["gbs"], again["gbs"]] + during)
        cb["method"] += (", measured before and after the suite and after each large "
                         "row, highest kept")
    if "models" in run:
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
        results["models"] = rows_of(
            "models", suites.case_keys("models", only=args.only, batches=batches))
    if "compile" in run:
        results["compile"] = suites.run_compile(only=args.only, batch=args.batch,
                                                planner=args.planner, mode_list=mode_list,
                                                rounds=args.compile_rounds)
        pre = next((r.get("op_library_prebuild") for r in results["compile"]
                    if r.get("op_library_prebuild")), None)
        if pre:
            meta["notes"].append(
                "compile: install step (`python -m stitching.runtime.build`: the "
                "StitchedKernel op library, the shape interpreter, the compiled math helpers) "
                "run into the default cache before the cold runs, untimed: "
                + ("ok" if pre.get("ok") else f"FAILED ({pre.get('error')})"))
    if "short" in run:
        from bench_lib import short
        results["short"] = short.run_short(only=args.only, rounds=args.short_rounds)
    if "serving" in run:
        from bench_lib import serving
        results["serving"] = serving.run_serving(only=args.only, rounds=args.serve_rounds,
                                                 calls=args.serve_calls)
    if "train" in run:
        results["train"] = rows_of(
            "train", suites.case_keys("train", only=args.only),
            train_opts={"memory_runs": args.memory_runs, "memory_steps": args.steps})
    meta["elapsed_s"] = round(time.time() - t0, 1)
    meta["load_avg_end"] = machine.load_avg()

    return _emit(args, results, meta)


def _emit(args, results, meta, write_json=True):
    from bench_lib import output
    output.print_report(results, meta)
    if args.json and write_json:
        _ensure_dir(args.json)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    if args.png:
        _ensure_dir(args.png)
        output.write_png(args.png, results)
    if args.markdown:
        output.write_markdown(args.markdown, results, meta)
    print(f"\n[bench] done in {meta.get('elapsed_s')} s", file=sys.stderr)
    # Wrong answers make the exit status non-zero (targets missed do not: they are
    # goals, not errors).
    return 1 if output.mismatch_lines([r for v in results.values() if v for r in v]) else 0


def _stitching_note(meta, mode_list):
    """Say up front if stitching cannot even be imported (rows will show it too)."""
    if "stitching" not in mode_list:
        return
    try:
        import stitching
        stitching.function  # noqa: B018  (lazy attribute: imports the TF frontend)
    except Exception as e:
        from bench_lib.modes import first_line
        meta["notes"].append(f"stitching unavailable: {first_line(e)}")


def _check_only(only, run):
    if not only:
        return
    from stitching.testing import MODELS, PATTERNS
    from stitching.testing import train as T
    known = set()
    if "train" in run:
        known |= set(T.CASES) | set(T.EXTRA)
    if "patterns" in run:
        known |= set(PATTERNS)
    if "models" in run or "compile" in run or "serving" in run:
        known |= set(MODELS)
    if "compile" in run:        # its training rows (bench_lib/suites.py)
        known |= {"train:" + n for n in T.CASES}
    if "short" in run:
        from bench_lib.short import JOBS
        known |= set(JOBS)
    unknown = [n for n in only if n not in known]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; known: {sorted(known)}")


def _ensure_dir(path):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


if __name__ == "__main__":
    sys.exit(main())
