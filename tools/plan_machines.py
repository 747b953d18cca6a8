#!/usr/bin/env python
"""Plans under several device profiles, side by side: how many kernels each plans, and
whether the plans are the same.  Planning only (no compile, no timing), so it runs on a
busy machine and says nothing about this machine's speed.

    python tools/plan_machines.py                    # models and patterns, every machine model
    python tools/plan_machines.py --models efficientnet_b0 --batch 8
    python tools/plan_machines.py --profiles intel-avx512,amd-avx2,amd-avx512,cpu
    python tools/plan_machines.py --measure 5 --load 2             # 5 profiles measured while
                                # 2 busy processes run, 5 measured quietly, plans compared

Profiles: named machine models (plan/profiles.py MACHINES), ``cpu`` (this machine's
measured profile as the pipeline would plan with it), or profile files.  ``--measure N``
adds N fresh measurements of this machine taken under ``--load`` busy processes and N
taken without, each as the pipeline would plan with it (provisional ones with their
class's numbers, ``profiles.settled``), and reports whether every one plans the same
kernels as the first quiet one: the stability the measured profile has to have.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO]
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def model_graph(name: str, batch: int):
    """(graph_def, fetches, resources) of a models-suite case's inference function."""
    import tensorflow as tf

    from stitching.testing import models
    from stitching.tf import frontend
    case = models.get(name)
    sig = [tf.TensorSpec((batch or None,) + tuple(case.input_shape), tf.float32)]
    cf = tf.function(case.make_fn(), input_signature=sig).get_concrete_function()
    return (cf.graph.as_graph_def(), [t.name for t in cf.outputs],
            frontend.resource_shapes(cf.graph))


def pattern_graph(name: str, size: str):
    """(graph_def, fetches, resources) of a pattern-suite case at ``size``."""
    import tensorflow as tf

    from stitching.testing import patterns
    from stitching.tf import frontend
    pat = patterns.get(name)
    cf = tf.function(pat.make_fn(), input_signature=pat.input_signature(size)) \
        .get_concrete_function()
    return (cf.graph.as_graph_def(), [t.name for t in cf.outputs],
            frontend.resource_shapes(cf.graph))


NO_WORK = ("Identity", "Snapshot", "StopGradient")   # forwarded values: a kernel taking
#              one or not is the same kernel (the cost model scores them at ~0, so noise
#              in the profile flips such ties)


def plan_with(graph, profile, tmp):
    """The kernels the search planner deploys for ``graph`` under ``profile``, as
    sorted tuples of the members that do work: the pipeline's passes before planning
    and its planner, with ``profile`` pinned as the pipeline's device profile (a file in
    ``tmp``), so every decision that reads the machine reads this one."""
    from stitching import Options
    from stitching.plan import get_planner, profiles
    from stitching.tf import passmanager, pipeline
    path = os.path.join(tmp, f"{profile.name}-{id(profile)}.json")
    profiles.save_file(profile, path)
    old = os.environ.get("STITCHING_DEVICE_PROFILE")
    os.environ["STITCHING_DEVICE_PROFILE"] = path
    try:
        graph_def, fetches, resources = graph
        ctx = passmanager.Context(graph_def, fetches, (), Options(), resources)
        passmanager.run(pipeline.BEFORE_PLANNING, ctx)
        plan = get_planner("search")(ctx.ir, legal=pipeline.legal, min_ops=2)
    finally:
        if old is None:
            del os.environ["STITCHING_DEVICE_PROFILE"]
        else:
            os.environ["STITCHING_DEVICE_PROFILE"] = old
    ir = ctx.ir
    return sorted(tuple(sorted(n for n in r.nodes if ir[n].op not in NO_WORK))
                  for r in plan.regions)


def _busy(stop):
    x = 0
    while not stop.is_set():
        for i in range(100000):
            x += i * i


def measured(n: int, load: int) -> list:
    """``n`` fresh measurements of this machine with ``load`` busy processes running,
    each as the pipeline plans with it."""
    from stitching.plan import profiles
    stop = multiprocessing.Event()
    procs = [multiprocessing.Process(target=_busy, args=(stop,), daemon=True)
             for _ in range(load)]
    for p in procs:
        p.start()
    try:
        out = [profiles.calibrated(profiles.settled(profiles.measure_cpu()))
               for _ in range(n)]
    finally:
        stop.set()
        for p in procs:
            p.join()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="resnet50,mobilenet_v2,efficientnet_b0,transformer")
    ap.add_argument("--batch", type=int, default=0, help="0: unknown (the models suite)")
    ap.add_argument("--patterns", default="all",
                    help="pattern-suite cases (comma-separated, 'all' or 'none'), at "
                         "--sizes")
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--profiles", default=None,
                    help="comma-separated (default: every named machine model)")
    ap.add_argument("--measure", type=int, default=0,
                    help="also N measurements of this machine under load and N quiet")
    ap.add_argument("--load", type=int, default=2, help="busy processes for --measure")
    args = ap.parse_args(argv)
    import stitching.schedule  # noqa: F401  (the cost model's scheduler hook)
    from stitching.plan import profiles
    named = []
    wanted = args.profiles if args.profiles is not None else ",".join(profiles.MACHINES)
    for spec in filter(None, wanted.split(",")):
        prof = (profiles.calibrated(profiles.settled(profiles.get("cpu"))) if spec == "cpu"
                else profiles.get(spec) if spec in profiles.names()
                else profiles.load_file(spec))
        named.append((spec, prof))
    if args.measure:
        named += [(f"loaded{i}", p) for i, p in enumerate(measured(args.measure, args.load))]
        named += [(f"quiet{i}", p) for i, p in enumerate(measured(args.measure, 0))]
    for label, p in named:
        state = f"provisional: {p.why_provisional}" if p.provisional else "final"
        print(f"# {label}: {p.source} [{state}]", flush=True)
    worst = 0
    from stitching.testing import patterns
    tmp = tempfile.mkdtemp(prefix="plan-machines-")
    cases = [(f"{m} b{args.batch}", lambda m=m: model_graph(m, args.batch))
             for m in filter(None, args.models.split(",")) if m != "none"]
    pats = ([p.name for p in patterns.all_patterns()] if args.patterns == "all" else
            [] if args.patterns == "none" else args.patterns.split(","))
    cases += [(f"{p} {size}", lambda p=p, size=size: pattern_graph(p, size))
              for p in pats for size in args.sizes.split(",")]
    for name, build in cases:
        graph = build()
        plans = {label: plan_with(graph, p, tmp) for label, p in named}
        ref_label = next((k for k in plans if k.startswith("quiet")), next(iter(plans)))
        ref = plans[ref_label]
        row = "  ".join(f"{k}={len(v)}{'' if v == ref else '*'}" for k, v in plans.items())
        differ = [k for k, v in plans.items() if v != ref]
        worst = max(worst, len(differ))
        print(f"{name}: kernels {row}   (* differs from {ref_label})", flush=True)
    return 1 if args.measure and worst else 0


if __name__ == "__main__":
    sys.exit(main())
