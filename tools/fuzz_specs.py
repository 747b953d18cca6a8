"""Mutation fuzzer over StitchedKernel specs and node attributes (issue 44).

    python tools/fuzz_specs.py [--trials 300] [--seed 44] [--timeout 60] [--json]

Takes the rewritten softmax graph (stitching.testing.models, rewritten by the CLI),
mutates its one StitchedKernel node -- the spec as JSON (values, deleted keys and list
items, swapped ops, nudged numbers), the spec as text (truncated, a byte flipped, a
NUL byte, deep nesting, padding past the size limit), the spec's version and the
node's attributes (spec_hash cleared, removed or wrong, Tin/Tout, output_shapes, label,
_stitching_forward, the fallback kept or dropped) -- and runs each mutant once,
classifying what happened:

    error_names_node   a TF or Python error naming the node          (fine)
    correct            ran; equal to the mutated spec's float64 meaning (fine)
    fallback_warned    a valid spec ran its original subgraph, warned (fine)
    error_unnamed      an error that does not name the node          (a bug)
    accepted_invalid   ran a mutant invalid by construction (a version other than
                       the integer 1, spec_hash cleared/removed/wrong, NUL bytes,
                       deep nesting, cut text, unknown keys)           (a bug)
    fallback_invalid   an invalid spec ran its original subgraph      (a bug)
    fallback_silent    ran its original subgraph with no warning     (a bug)
    wrong              ran and gave another answer                   (a bug)
    crash              the process died (a signal)                   (a bug)
    hang               no answer within --timeout seconds            (a bug)

Trials run in a child process, which is restarted after a crash or a hang, so one bad
mutant costs one trial.  Seeded: the same seed gives the same mutants.  Prints the
counts by outcome (and, with --json, one JSON line), with an example of each bug.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE = "stitching/kernel_0"
BUGS = ("error_unnamed", "accepted_invalid", "fallback_invalid", "fallback_silent", "wrong",
        "crash", "hang")
STARTUP_SECONDS = 180      # the child imports TF and rewrites nothing: ~10 s, on a busy machine more

CHILD = textwrap.dedent(r'''
    import copy, hashlib, json, random, sys, warnings
    import numpy as np, tensorflow as tf
    import stitching
    from stitching import runtime
    from stitching.codegen.cuda import ref as cuda_ref
    from stitching.ir import KernelSpec

    path, seed, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    NODE = "stitching/kernel_0"
    gd0 = tf.compat.v1.GraphDef.FromString(open(path, "rb").read())
    (k,) = [i for i, n in enumerate(gd0.node) if n.op == "StitchedKernel"]
    base = json.loads(gd0.node[k].attr["spec"].s)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    VALUES = [0, 1, -1, 2, 16, 3.5, -0.0, 1e30, 1 << 62, -(1 << 62), True, False, None,
              "", "x", "Exp", "Sub", "float64", "int32", "__import__('os')", [], [1], {}]
    KINDS = [["Exp", "Tanh", "Neg", "Abs", "Sigmoid", "Square", "Relu", "Identity"],
             ["Add", "Sub", "Mul", "Maximum", "Minimum", "AddV2"],
             ["Max", "Min", "Sum", "Mean"]]

    def paths(o, p=()):
        yield p
        if isinstance(o, dict):
            for kk, v in o.items():
                yield from paths(v, p + (kk,))
        elif isinstance(o, list):
            for i, v in enumerate(o):
                yield from paths(v, p + (i,))

    def structural(rng, d):
        if rng.random() < 0.4:                      # often still valid: another function
            n = rng.choice(d["nodes"])
            for kind in KINDS:
                if n["op"] in kind:
                    n["op"] = rng.choice(kind)
            if n["op"] == "Const":
                n["attrs"]["value"] = rng.choice([0.0, -1.5, 7.0, 1e-3, 1e30, -0.0])
            if rng.random() < 0.3:
                d["schedule"] = rng.choice([{}, {"rows_per_task": rng.randint(1, 9)},
                                            {"scratch": 0}, {"col_block": 3}, {"split_rows": 1}])
            return json.dumps(d)
        for _ in range(rng.choice([1, 1, 2, 3])):
            p = rng.choice([q for q in paths(d) if q])
            parent = d
            for kk in p[:-1]:
                parent = parent[kk]
            r = rng.random()
            if r < 0.15 and isinstance(parent, list) and len(parent) > 1:
                del parent[p[-1]]
            elif r < 0.25 and isinstance(parent, dict):
                del parent[p[-1]]
            elif r < 0.55 and isinstance(parent[p[-1]], (int, float)) \
                    and not isinstance(parent[p[-1]], bool):
                parent[p[-1]] = parent[p[-1]] + rng.choice([-2, -1, 1, 2])
            else:
                parent[p[-1]] = rng.choice(VALUES)
        return json.dumps(d)

    def textual(rng, d):
        """(text, whether it is invalid by construction)"""
        t = json.dumps(d).encode()
        r = rng.randrange(7)
        if r == 1:                                  # a flipped bit may leave it valid
            i = rng.randrange(len(t))
            return t[:i] + bytes([t[i] ^ (1 << rng.randrange(8))]) + t[i + 1:], False
        return textual_invalid(rng, t, r), True

    def textual_invalid(rng, t, r):
        if r == 0:
            return t[:rng.randrange(len(t))]
        if r == 2:
            return t + b"\0" + rng.choice([b"", b"junk", t])
        if r == 3:
            i = rng.randrange(len(t))
            return t[:i] + b"\0" + t[i:]
        if r == 4:
            n = rng.choice([50, 1000, 100000])
            return t[:-1] + b', "x": ' + b"[" * n + b"]" * n + b"}"
        if r == 5:
            return t[:-1] + b', "pad": "' + b"x" * rng.choice([1 << 10, 2 << 20]) + b'"}'
        return rng.choice([b"stitching-assets\n" + b"0" * 64 + b"\n/tmp/x.json", b"",
                           b"\xff\xfe", b"null", b"[]", b"1"])

    def version(rng, d):
        d["version"] = rng.choice([True, 1.0, "1", 2, 0, None, [1]])
        return json.dumps(d)

    def attributes(rng, node):
        """Whether the mutant is invalid by construction (the spec_hash ones)."""
        r = rng.randrange(7)
        if r == 0:
            node.attr["spec_hash"].s = b""
        elif r == 1:
            del node.attr["spec_hash"]
        elif r == 2:
            node.attr["spec_hash"].s = b"0" * 24
        elif r == 3:
            node.attr["Tout"].list.type[:] = [rng.choice([tf.int32, tf.float64, tf.bool]).as_datatype_enum]
        elif r == 4:
            shp = node.attr["output_shapes"].list.shape[0]
            if rng.random() < 0.5 and shp.dim:
                del shp.dim[-1]
            else:
                shp.dim.add().size = rng.choice([1, 7, -1])
        elif r == 5:
            node.attr["_stitching_forward"].list.i[:] = [rng.randint(-2, 3) for _ in range(rng.choice([1, 2, 4]))]
        else:
            node.attr["label"].s = rng.choice([b"", b"\0", b"x" * 10000, b"%s%n"])
        return r <= 2

    warned_once = False
    for trial in range(start, stop):
        rng = random.Random(seed * 1000003 + trial)
        gd = tf.compat.v1.GraphDef()
        gd.CopyFrom(gd0)
        node = gd.node[k]
        kind = rng.choice(["structural", "structural", "textual", "version", "attribute"])
        text, invalid = json.dumps(base).encode(), False
        if kind == "structural":
            text = structural(rng, copy.deepcopy(base)).encode()
        elif kind == "textual":
            text, invalid = textual(rng, copy.deepcopy(base))
        elif kind == "version":                     # every choice is not the integer 1
            text, invalid = version(rng, copy.deepcopy(base)).encode(), True
        node.attr["spec"].s = text
        node.attr["spec_hash"].s = hashlib.sha256(text).hexdigest()[:24].encode()
        if kind == "attribute":
            invalid = attributes(rng, node)
        if rng.random() < 0.5:
            node.attr.pop("fallback", None)
        print("START", trial, kind, flush=True)
        before = runtime.stats()["fallbacks"]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                run = tf.compat.v1.wrap_function(
                    lambda a: tf.compat.v1.import_graph_def(gd, {"x:0": a}, ["y:0"], name=""),
                    [tf.TensorSpec([None, 16], tf.float32)])
                got = run(tf.constant(x))[0].numpy()
                err = None
            except Exception as e:  # noqa: BLE001 - classified
                err = e
        if err is not None:
            msg = str(err) + repr(err)
            outcome = "error_names_node" if NODE in msg else "error_unnamed"
            detail = msg[-300:]
        else:
            fell = runtime.stats()["fallbacks"] > before
            try:
                spec = None if invalid else KernelSpec.from_json(text)
                ref = None if invalid else cuda_ref.evaluate(spec, [x])[0]
            except Exception:  # noqa: BLE001 - not a valid spec: only the fallback may answer
                spec = ref = None
            if invalid and not fell:
                outcome, detail = "accepted_invalid", "ran a spec invalid by construction"
            elif fell:
                # (one Python warning per process for kernels that cannot be built)
                warned_once = warned_once or any("stitching" in str(w.message) for w in seen)
                outcome = "fallback_invalid" if spec is None else \
                    "fallback_warned" if warned_once else "fallback_silent"
                detail = "fallback on " + ("a valid" if spec is not None else "an invalid") + " spec"
            elif ref is not None and got.shape == ref.shape and np.allclose(
                    got, ref.astype(np.float64), rtol=2e-5, atol=2e-6, equal_nan=True):
                outcome, detail = "correct", ""
            else:
                outcome, detail = "wrong", f"shape {got.shape}"
        print("DONE", trial, outcome, json.dumps({"kind": kind, "spec": text[:300].decode("utf-8", "replace"),
                                                  "detail": detail}), flush=True)
''')


def _child(path, seed, start, stop):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.Popen([sys.executable, "-c", CHILD, path, str(seed), str(start), str(stop)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def _lines(p, timeout):
    """Lines of p's stdout; None when none came within ``timeout()`` seconds."""
    while True:
        ready, _, _ = select.select([p.stdout], [], [], timeout())
        if not ready:
            yield None
            return
        line = p.stdout.readline()
        if not line:
            return
        yield line


def fuzz(trials: int, seed: int, timeout: float, graph: str) -> dict:
    counts = {k: 0 for k in ("error_names_node", "correct", "fallback_warned") + BUGS}
    examples, by_kind = {}, {}
    trial = 0
    while trial < trials:
        p = _child(graph, seed, trial, trials)
        current, started = None, []
        for line in _lines(p, lambda: timeout if started else STARTUP_SECONDS):
            if line is None:                                   # no answer in time
                p.kill()
                break
            parts = line.split(" ", 3)
            if parts[0] == "START":
                current = int(parts[1])
                started.append(current)
            elif parts[0] == "DONE":
                outcome, info = parts[2], json.loads(parts[3])
                counts[outcome] += 1
                by_kind.setdefault(info["kind"], {}).setdefault(outcome, 0)
                by_kind[info["kind"]][outcome] += 1
                if outcome in BUGS:
                    examples.setdefault(outcome, info)
                trial, current = int(parts[1]) + 1, None
        p.wait()
        if current is not None:                                # died or hung mid-trial
            outcome = "hang" if p.returncode in (-9, None) else "crash"
            counts[outcome] += 1
            examples.setdefault(outcome, {"trial": current, "returncode": p.returncode})
            trial = current + 1
        elif trial < trials and p.returncode != 0:             # died before any trial
            raise RuntimeError(f"the fuzz child failed to start (exit {p.returncode})")
    return {"seed": seed, "trials": trials, "counts": counts, "by_kind": by_kind,
            "bugs": sum(counts[b] for b in BUGS), "examples": examples}


def rewritten_graph(d: str) -> str:
    from stitching.testing.models import frozen_softmax_graph_def
    from stitching.tf import cli
    src, out = os.path.join(d, "g.pb"), os.path.join(d, "out.pb")
    with open(src, "wb") as f:
        f.write(frozen_softmax_graph_def().SerializeToString())
    with contextlib.redirect_stdout(io.StringIO()):          # its report
        rc = cli.main([src, out, "--outputs", "y", "--no-kernels"])
    if rc != 0:
        raise RuntimeError("rewriting the softmax graph failed")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds one trial may take before it counts as a hang")
    ap.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-specs-") as d:
        os.environ.setdefault("STITCHING_CACHE_DIR", os.path.join(d, "cache"))
        t0 = time.monotonic()
        res = fuzz(args.trials, args.seed, args.timeout, rewritten_graph(d))
        res["seconds"] = round(time.monotonic() - t0, 1)
    print(f"{res['trials']} trials, seed {res['seed']}, {res['seconds']} s")
    for k, v in res["counts"].items():
        print(f"  {k:18s} {v:5d}{'   <- bug' if k in BUGS and v else ''}")
    for k, info in res["examples"].items():
        print(f"  e.g. {k}: {json.dumps(info)[:400]}")
    if args.json:
        print(json.dumps(res))
    return 1 if res["bugs"] else 0


if __name__ == "__main__":
    sys.exit(main())
