"""``stitching-rewrite``: rewrite a frozen GraphDef (.pb/.pbtxt) or a SavedModel offline.

    stitching-rewrite model.pb out.pb --outputs logits
    stitching-rewrite saved_model_dir/ out_dir/ [--signature serving_default]

Prints the report (what was fused, into how many kernels, what was not and why);
``--report report.json`` writes it as data too.  The output ships this machine's
compiled kernels (a SavedModel's assets; ``<out>.kernels/`` beside a GraphDef, for
``stitching.install_kernels``) unless ``--no-kernels``.  On failure: exit status 1
and one line naming the reason.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _read_graph_def(path):
    from .tf.graph_file import read_graph_def
    return read_graph_def(path)


def _default_outputs(gd):
    consumed = {i.lstrip("^").split(":")[0] for n in gd.node for i in n.input}
    return [n.name for n in gd.node if n.name not in consumed
            and n.op not in ("NoOp", "Const", "Placeholder", "Assert")]


def rewrite_graph_def(graph_def, outputs=None, options=None, name="graph"):
    """Rewrite a frozen GraphDef in memory (``stitching.rewrite_graph_def``).

    ``outputs``: the node or tensor names to keep computing (default: the nodes nothing
    reads); checked like a graph file's (graph_file.check_graph_def: unknown ops,
    dangling inputs, missing outputs, an already rewritten graph each raise ValueError
    naming the node).  Returns ``(rewritten GraphDef, Report)``.
    """
    from .tf import ensure_runtime
    from .tf.graph_file import check_graph_def
    from .tf.pipeline import stitch_graph_def
    ensure_runtime()
    outs = list(outputs) if outputs else _default_outputs(graph_def)
    if not outs:
        raise ValueError(f"{name}: no outputs given and none could be inferred")
    known = {n.name for n in graph_def.node}
    for o in outs:
        if o.split(":")[0] not in known:
            raise ValueError(f"{name}: output {o!r} names no node in the graph")
    fetches = [o if ":" in o else o + ":0" for o in outs]
    check_graph_def(graph_def, name, fetches)
    res = stitch_graph_def(graph_def, fetches, options=options or _options(), name=name)
    return res.graph_def, res.report


def rewrite_graph_def_file(src, dst, outputs=None, options=None, embed_kernels=True):
    graph_def, report = rewrite_graph_def(_read_graph_def(src), outputs, options,
                                          name=os.path.basename(src))
    if embed_kernels:       # first: the graph records the sidecar manifest's hash
        _write_sidecar(graph_def, dst)
    if dst.endswith(".pbtxt"):
        from google.protobuf import text_format
        open(dst, "w").write(text_format.MessageToString(graph_def))
    else:
        open(dst, "wb").write(graph_def.SerializeToString())
    return {"graph": report}


def _write_sidecar(graph_def, dst) -> None:
    """The kernels' shared objects beside a GraphDef: ``<dst>.kernels/`` (load them
    with ``stitching.install_kernels``; kernel_assets.py).  The manifest's SHA-256
    goes into ``graph_def`` (in place), as a SavedModel's goes into its graph."""
    import shutil

    from .tf.kernel_assets import export, record_manifest, specs_in
    side = dst + ".kernels"
    shutil.rmtree(side, ignore_errors=True)
    specs = specs_in(graph_def)
    if specs:
        _, _, sha = export(specs, side)
        if sha is not None:
            record_manifest(graph_def, sha)


def _options(dump_dir=None, autotune=None):
    from .options import Options
    # a shipped graph keeps its original segments (fallback)
    if autotune is None:
        return Options(fallback=True, dump_dir=dump_dir)
    return Options(fallback=True, dump_dir=dump_dir, autotune=True, autotune_margin=autotune)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="stitching-rewrite", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="GraphDef file (.pb, .pbtxt) or SavedModel directory")
    ap.add_argument("dst", help="output file or directory")
    ap.add_argument("--outputs", help="comma-separated output node names (GraphDef only)")
    ap.add_argument("--signature", action="append", help="SavedModel signature key(s)")
    ap.add_argument("--report", "--json", dest="json",
                    help="write the report(s) as JSON here")
    ap.add_argument("--dump-dir", help="write a graph dump per rewritten graph here "
                    "(stitching.inspect.load_dump reads it)")
    ap.add_argument("--no-kernels", action="store_true",
                    help="do not ship this machine's compiled kernels with the output "
                         "(SavedModel assets, or <output>.kernels/ beside a GraphDef)")
    ap.add_argument("--autotune", nargs="?", type=float, const=1.3, metavar="MARGIN",
                    help="kernels predicted faster than their ops by less than MARGIN "
                         "(default 1.3) are timed against them on their first calls where "
                         "the model runs, and the faster serves (Options(autotune=True))")
    args = ap.parse_args(argv)
    embed = not args.no_kernels
    try:
        if os.path.isdir(args.src):
            from .saved_model import rewrite_saved_model
            reports = rewrite_saved_model(args.src, args.dst, signature_keys=args.signature,
                                          options=_options(args.dump_dir, args.autotune),
                                          embed_kernels=embed)
        elif os.path.isfile(args.src):
            outs = args.outputs.split(",") if args.outputs else None
            reports = rewrite_graph_def_file(args.src, args.dst, outs,
                                             options=_options(args.dump_dir, args.autotune),
                                             embed_kernels=embed)
        else:
            raise FileNotFoundError(f"{args.src}: no such file or directory")
    except Exception as e:  # noqa: BLE001 — a CLI reports, it does not dump a traceback
        reason = " ".join(str(e).split())[:800]    # one line (TF's errors have several)
        print(f"stitching-rewrite: error: {type(e).__name__}: {reason}", file=sys.stderr)
        return 1
    for key, rep in reports.items():
        print(f"[{key}]\n{rep.summary()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: r.to_dict() for k, r in reports.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
