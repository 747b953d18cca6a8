#!/usr/bin/env python
"""What the pipeline makes of a fixed set of graphs, written to a directory, so two
revisions can be compared byte for byte.

    python tools/pipeline_diff.py dump OUT                  # the stitching on sys.path
    python tools/pipeline_diff.py dump OUT --rev d69d31b    # that commit (git archive)
    python tools/pipeline_diff.py compare OUT_A OUT_B       # exit 1 on any difference
    python tools/pipeline_diff.py dump OUT --only models/transformer,plan/encoder

Graphs (``--only`` takes these names, or a suite name):

    plan/<name>       tools/plan_bench.py's IR graphs (tests/irbuild.py, TF-free):
                      planned (search planner, the schedule stage's legality), each
                      region's kernels generated
    models/<name>     the models suite (stitching/testing/models.py; tools/bench.py
                      --suite models), traced as tools/bench_lib does (unknown batch)
    patterns/<name>   the patterns suite, small size (batch dims are unknown anyway)
    train/<name>      the train suite's steps (forward, tape, optimizer; control outputs)
    autotune/<name>   a model again under Options(autotune=True) (the marking pass)
    verify/<name>     a model again under Options(verify=True) (the debug verifiers)
    seqsplit/<name>   a model at batch 1 with the L2 pinned to 2 MiB, where the
                      sequence split fires (it reads the machine's L2)

Per graph, under OUT/<graph>/:

    input.sha256      the GraphDef handed to the driver (both sides must trace the same)
    graph.pbtxt       the rewritten GraphDef (text format, deterministic)
    report.txt        Report.summary(), explain() and to_dict(), timings zeroed
    kernels/<hash>.{cpu.py,cpu.prog,cuda.cu,cuda.prog}
                      per distinct kernel spec: the CPU source of its compile target
                      and its shape program, the CUDA source and shape program
    MANIFEST          sha256 of every file; ``compare`` diffs the manifests, then the files

A ``--rev`` dump runs this script in a fresh process with PYTHONPATH set to that
commit's tree (its own ``tests/irbuild.py`` too), with a fresh STITCHING_CACHE_DIR, so
no plan or kernel stored by one side is read by the other.  Only APIs both sides have
are used: ``tf.pipeline.stitch_graph_def``, ``tf.frontend.resource_shapes``, the
schedule and codegen stages.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SUITES = ("plan", "models", "patterns", "train", "autotune", "verify", "seqsplit")
AUTOTUNE_MODELS = ("transformer", "mobilenet_v2")
VERIFY_MODELS = ("transformer", "efficientnet_b0")
SEQSPLIT_L2 = 2 << 20           # tests/test_seqsplit.py's L2


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _kernel_files(spec) -> dict:
    """{suffix: text}: what code generation makes of one spec, CPU and CUDA."""
    from stitching.codegen.cpu import emit as cpu_emit
    from stitching.codegen.cuda import emitter as cuda_emitter
    from stitching.codegen.lower.specialize import compile_target
    from stitching.schedule import build_schedule
    target = compile_target(spec)                     # what compile_kernel builds
    cpu = cpu_emit(build_schedule(target))
    cuda = cuda_emitter.emit(build_schedule(spec))    # what compile/cuda.py builds
    return {"cpu.py": cpu.text, "cpu.prog": repr(tuple(cpu.program)) + "\n",
            "cuda.cu": cuda.text, "cuda.prog": repr(tuple(cuda.program)) + "\n"}


def _dump_kernels(out: str, specs) -> None:
    seen = set()
    for spec in specs:
        if spec.hash in seen:
            continue
        seen.add(spec.hash)
        try:
            files = _kernel_files(spec)
        except Exception as e:  # noqa: BLE001 -- a refusal is an artefact too
            files = {"error": f"{type(e).__name__}: {e}\n"}
        for suffix, text in files.items():
            _write(os.path.join(out, "kernels", f"{spec.hash}.{suffix}"), text)


# Per-pass timings (the pass manager's) and wall times are not behaviour.
_TIMING_KEYS = ("compile_seconds", "pass_seconds")


def _report_text(rep) -> str:
    for key in _TIMING_KEYS:
        if hasattr(rep, key):
            setattr(rep, key, type(getattr(rep, key))())
    d = rep.to_dict()
    for key in _TIMING_KEYS:
        d.pop(key, None)
    return "\n".join([rep.summary(), "", rep.explain(), "",
                      json.dumps(d, indent=1, sort_keys=True, default=str), ""])


def _stitch_one(out: str, fn, specs, options) -> None:
    """Trace ``fn`` as stitching.function does and run the driver on its graph."""
    import tensorflow as tf
    from google.protobuf import text_format
    from stitching.tf import frontend, pipeline
    cf = tf.function(fn).get_concrete_function(*specs)
    gdef = cf.graph.as_graph_def()
    fetches = [t.name for t in cf.outputs]
    keep = [op.name for op in cf.graph.control_outputs]
    _write(os.path.join(out, "input.sha256"), hashlib.sha256(
        gdef.SerializeToString(deterministic=True)).hexdigest() + "\n")
    result = pipeline.stitch_graph_def(gdef, fetches, keep, options,
                                       name=getattr(fn, "__name__", "fn"),
                                       resources=frontend.resource_shapes(cf.graph))
    _write(os.path.join(out, "graph.pbtxt"), text_format.MessageToString(result.graph_def))
    _write(os.path.join(out, "report.txt"), _report_text(result.report))
    _dump_kernels(out, [k.spec for k in result.kernels])


def _plan_graph(out: str, name: str) -> None:
    sys.path.insert(0, os.path.join(os.environ.get("PIPELINE_DIFF_TREE", REPO), "tests"))
    import irbuild
    import stitching.schedule  # noqa: F401 -- gives the cost model its schedules
    from stitching.plan import get_planner
    from stitching.tf.pipeline import legal
    sizes = {"ln_chain": 154, "encoder": 49, "wide": 500}     # tools/plan_bench.py's
    g = getattr(irbuild, name)(sizes[name])
    plan = get_planner("search")(g, legal=legal, min_ops=2)
    lines = [f"{i}: {r.spec.hash} {' '.join(r.nodes)}" for i, r in enumerate(plan.regions)]
    lines += [f"unfused {n} {op}: {why}" for n, op, why in plan.unfused]
    _write(os.path.join(out, "report.txt"), "\n".join(lines) + "\n")
    _dump_kernels(out, [r.spec for r in plan.regions])


def _graphs(only) -> list:
    """[(graph name, callable(out))] in a fixed order."""
    from stitching.options import Options
    out = [(f"plan/{n}", lambda d, n=n: _plan_graph(d, n))
           for n in ("ln_chain", "encoder", "wide")]

    def model(name, options):
        def run(d):
            from stitching.testing import models as M
            case = M.get(name)
            _stitch_one(d, case.make_fn(), case.input_signature(), options)
        return run

    def seqsplit(name):
        def run(d):
            import tensorflow as tf
            from stitching.plan import profiles
            from stitching.testing import models as M
            case = M.get(name)
            real = profiles._cache_sizes

            def pinned():
                # only for the split's own reading (tf/passes/seqsplit.py, or the driver before
                # the pass manager): the cost model's profile keeps the machine's caches,
                # or it is measured afresh (noisy) instead of read from its calibration
                caller = sys._getframe(1).f_globals.get("__name__", "")
                sizes = real()
                return dict(sizes, l2=SEQSPLIT_L2) if caller.endswith(
                    ("seqsplit", "pipeline")) else sizes
            profiles._cache_sizes = pinned
            # since the machine models (plan/profiles.py MACHINES) the split reads the
            # device profile's L2 and oneDNN fact: pin a model that splits
            pin = "intel-avx512" if hasattr(profiles, "MACHINES") else None
            old_env = os.environ.get("STITCHING_DEVICE_PROFILE")
            if pin:
                os.environ["STITCHING_DEVICE_PROFILE"] = pin
            try:
                spec = tf.TensorSpec((1,) + tuple(case.input_shape), tf.float32)
                _stitch_one(d, case.make_fn(), [spec], Options())
            finally:
                profiles._cache_sizes = real
                if pin and old_env is None:
                    os.environ.pop("STITCHING_DEVICE_PROFILE", None)
                elif pin:
                    os.environ["STITCHING_DEVICE_PROFILE"] = old_env
        return run

    def pattern(name):
        def run(d):
            from stitching.testing import patterns as P
            p = P.get(name)
            _stitch_one(d, p.fn, p.input_signature("small"), Options())
        return run

    def train(name):
        def run(d):
            import tensorflow as tf
            from stitching.testing import train as T
            step = T.make_step(name)
            specs = [tf.TensorSpec(t.shape, t.dtype) for t in (step.x, step.y)]
            _stitch_one(d, step.fn, specs, Options())
        return run

    from stitching.testing import models as M
    from stitching.testing import patterns as P
    from stitching.testing import train as T
    out += [(f"models/{m.name}", model(m.name, Options())) for m in M.all_models()]
    out += [(f"patterns/{p.name}", pattern(p.name)) for p in P.all_patterns()]
    out += [(f"train/{n}", train(n)) for n in T.CASES]
    out += [(f"autotune/{n}", model(n, Options(autotune=True))) for n in AUTOTUNE_MODELS]
    out += [(f"verify/{n}", model(n, Options(verify=True))) for n in VERIFY_MODELS]
    out += [("seqsplit/transformer", seqsplit("transformer"))]
    if only:
        out = [(g, f) for g, f in out if g in only or g.split("/")[0] in only]
    return out


def _manifest(root: str) -> dict:
    files = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            if rel == "MANIFEST":
                continue
            with open(p, "rb") as f:
                files[rel] = hashlib.sha256(f.read()).hexdigest()
    return dict(sorted(files.items()))


def dump_here(out: str, only) -> None:
    if os.environ.get("PIPELINE_DIFF_CACHE_SET"):       # dump_rev made one
        return _dump(out, only)
    # a fresh cache, so no plan or kernel stored by an earlier run is read
    with tempfile.TemporaryDirectory(prefix="pipeline_diff_") as cache:
        os.environ["STITCHING_CACHE_DIR"] = cache
        return _dump(out, only)


def _dump(out: str, only) -> None:
    os.makedirs(out, exist_ok=True)
    for name, run in _graphs(only):
        print(f"pipeline_diff: {name}", file=sys.stderr, flush=True)
        d = os.path.join(out, name)
        try:
            run(d)
        except Exception as e:  # noqa: BLE001 -- a failure is compared like any artefact
            _write(os.path.join(d, "error.txt"), f"{type(e).__name__}: {e}\n")
            print(f"pipeline_diff: {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
    _write(os.path.join(out, "MANIFEST"),
           "".join(f"{h}  {p}\n" for p, h in _manifest(out).items()))


def dump_rev(out: str, rev: str, only) -> int:
    """This script over commit ``rev``'s tree, in a fresh process and cache."""
    out = os.path.abspath(out)
    with tempfile.TemporaryDirectory(prefix="pipeline_diff_") as tmp:
        tree, cache = os.path.join(tmp, "tree"), os.path.join(tmp, "cache")
        os.makedirs(tree)
        archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        env = dict(os.environ, PYTHONPATH=tree, STITCHING_CACHE_DIR=cache,
                   PIPELINE_DIFF_TREE=tree, PIPELINE_DIFF_CACHE_SET="1")
        cmd = [sys.executable, os.path.abspath(__file__), "dump", out]
        if only:
            cmd += ["--only", ",".join(sorted(only))]
        return subprocess.run(cmd, env=env, cwd=tmp).returncode


def compare(a: str, b: str, context: int = 3, limit: int = 40) -> int:
    ma, mb = _manifest(a), _manifest(b)
    only_a, only_b = sorted(ma.keys() - mb.keys()), sorted(mb.keys() - ma.keys())
    differ = sorted(p for p in ma.keys() & mb.keys() if ma[p] != mb[p])
    for p in only_a:
        print(f"only in {a}: {p}")
    for p in only_b:
        print(f"only in {b}: {p}")
    for p in differ:
        print(f"differs: {p}")
        with open(os.path.join(a, p)) as fa, open(os.path.join(b, p)) as fb:
            diff = list(difflib.unified_diff(fa.readlines(), fb.readlines(), a, b, n=context))
        sys.stdout.writelines(diff[:limit])
    graphs = {os.path.dirname(p.split("/kernels/")[0]) for p in ma}
    kernels = sum(1 for p in ma if "/kernels/" in p)
    same = not (only_a or only_b or differ)
    print(f"{len(graphs)} graphs, {len(ma)} files ({kernels} kernel files): "
          + ("identical" if same else
             f"{len(differ)} differ, {len(only_a) + len(only_b)} on one side only"))
    return 0 if same else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write the artefacts to OUT")
    d.add_argument("out")
    d.add_argument("--rev", help="a git revision of this repository (default: the "
                                 "stitching on sys.path)")
    d.add_argument("--only", default="", help="comma-separated graph or suite names")
    c = sub.add_parser("compare", help="diff two dumps; exit 1 if they differ")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.a, args.b)
    only = {s for s in args.only.split(",") if s}
    bad = [s for s in only if s.split("/")[0] not in SUITES]
    if bad:
        ap.error(f"unknown graphs {bad}: names start with one of {SUITES}")
    if args.rev:
        return dump_rev(args.out, args.rev, only)
    os.environ.setdefault("PIPELINE_DIFF_TREE", REPO)
    dump_here(args.out, only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
