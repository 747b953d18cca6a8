"""``stitching-rewrite``: rewrite a frozen GraphDef (.pb/.pbtxt) or a SavedModel offline.

    stitching-rewrite model.pb out.pb --outputs logits
    stitching-rewrite saved_model_dir/ out_dir/ [--signature serving_default]

Prints the report (what was fused, into how many kernels, what was not and why);
``--report report.json`` writes it as data too.  ``--help`` is plain text (``HELP``
below); flags for the user-facing Options are a table (``_OPTION_FLAGS``).  The output ships this machine's
compiled kernels (a SavedModel's assets; ``<out>.kernels/`` beside a GraphDef, for
``stitching.install_kernels``) unless ``--no-kernels``.  On failure: exit status 1
and one line naming the reason.
"""
from __future__ import annotations

import argparse
import contextlib
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

    Args:
        graph_def: A ``tf.compat.v1.GraphDef`` (frozen: variables as constants).
        outputs: The node or tensor names to keep computing (default: the nodes
            nothing reads).
        options: A ``stitching.Options``; default ``Options(fallback=True)``.
        name: The name the report and dumps use.

    Returns:
        ``(rewritten GraphDef, Report)``.

    Raises:
        ValueError: unknown ops, dangling inputs, a missing output or an already
            rewritten graph (graph_file.check_graph_def), naming the node.
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
    from .compile.parallel import shipping
    with shipping():        # the graph's sidecar ships its kernels: tier-2 code only
        res = stitch_graph_def(graph_def, fetches, options=options or _default_options(),
                               name=name)
    return res.graph_def, res.report


def rewrite_graph_def_file(src, dst, outputs=None, options=None, embed_kernels=True):
    import shutil
    if os.path.isdir(dst):
        raise IsADirectoryError(f"{dst}: is a directory (a GraphDef is written to a file)")
    graph_def, report = rewrite_graph_def(_read_graph_def(src), outputs, options,
                                          name=os.path.basename(src))
    side = dst + ".kernels"
    shutil.rmtree(side, ignore_errors=True)   # an earlier run's: stale, shipped or not
    try:
        if embed_kernels:   # first: the graph records the sidecar manifest's hash
            _write_sidecar(graph_def, dst)
        if dst.endswith(".pbtxt"):
            from google.protobuf import text_format
            open(dst, "w").write(text_format.MessageToString(graph_def))
        else:
            open(dst, "wb").write(graph_def.SerializeToString())
    except BaseException:
        shutil.rmtree(side, ignore_errors=True)   # no kernels beside a graph not written
        raise
    return {"graph": report}


def _write_sidecar(graph_def, dst) -> None:
    """The kernels' shared objects beside a GraphDef: ``<dst>.kernels/`` (load them
    with ``stitching.install_kernels``; kernel_assets.py).  The manifest's SHA-256
    goes into ``graph_def`` (in place), as a SavedModel's goes into its graph."""
    from .tf.kernel_assets import export, record_manifest, specs_in
    side = dst + ".kernels"
    specs = specs_in(graph_def)
    if specs:
        _, _, sha = export(specs, side)
        if sha is not None:
            record_manifest(graph_def, sha)


# Options a user sets from the command line: (flag, Options field, argparse keywords).
# background_compile (stitching.function's first calls) and stitch_backward (a tape
# around the loaded model) do not apply to an offline rewrite.
_OPTION_FLAGS = [
    ("--planner", "planner", dict(choices=["search", "greedy", "baseline"],
                                  help="how regions are chosen (default: search)")),
    ("--min-ops", "min_ops", dict(type=int, metavar="N",
                                  help="smallest region made a kernel, in ops (default 2)")),
    ("--no-gemm", "gemm", dict(action="store_false", default=None,
                               help="keep BatchMatMul against a 2-D weight as it is")),
    ("--no-einsum", "einsum", dict(action="store_false", default=None,
                                   help="keep two-operand Einsum ops as they are")),
    ("--no-pad-fold", "pad_fold", dict(action="store_false", default=None,
                                       help="keep a zero Pad before a convolution "
                                            "as its own op")),
    ("--no-depthwise", "depthwise", dict(action="store_false", default=None,
                                         help="leave depthwise convolutions to TF")),
    ("--no-seq-split", "seq_split", dict(action="store_false", default=None,
                                         help="keep token-wise blocks whole (for "
                                              "large-batch throughput)")),
    ("--xla-gemm", "xla_gemm", dict(action="store_true", default=None,
                                    help="where TF's GEMM is Eigen's, run the matrix "
                                         "products as XLA dots (less accurate; each new "
                                         "shape compiles them)")),
    ("--no-blas-gemm", "blas_gemm", dict(action="store_false", default=None,
                                         help="where TF's GEMM is Eigen's, leave the "
                                              "matrix products to it instead of OpenBLAS")),
    ("--no-conv1x1-gemm", "conv1x1_gemm", dict(action="store_false", default=None,
                                               help="leave large 1x1 convolutions to TF "
                                                    "instead of OpenBLAS")),
    ("--variable-updates", "variable_updates",
     dict(action="store_true", default=None,
          help="compute each variable's AssignAdd/AssignSub update as its new value in "
               "the kernel before it (faster optimizer steps, a higher peak memory)")),
    ("--transposed-gemm", "transposed_gemm",
     dict(action="store_true", default=None,
          help="where TF's oneDNN MatMul is slow on a transposed weight (amd-avx512), "
               "run such products as BatchMatMulV2 (faster, one more output-sized "
               "buffer while each runs)")),
    ("--no-fused-attention", "fused_attention",
     dict(action="store_false", default=None,
          help="keep each attention's products and softmax kernel as three ops "
               "instead of one StitchedAttention")),
    ("--unroll-loops", "unroll_loops", dict(
        type=int, metavar="N",
        help="unroll each while loop whose trip count is a constant of the graph, up "
             "to N iterations (default 64; 0 keeps every loop)")),
    ("--no-fallback", "fallback", dict(action="store_false", default=None,
                                       help="do not keep each region's original ops in "
                                            "the output (smaller; a kernel that cannot "
                                            "be built is then an error)")),
    ("--verify", "verify", dict(action="store_true", default=None,
                                help="run the IR, plan and spec verifiers between stages")),
    ("--dump-dir", "dump_dir", dict(metavar="DIR", help="write a graph dump per rewritten "
                                    "graph here (stitching.load_dump reads it)")),
    ("--exclude", "exclude", dict(
        action="append", metavar="PATTERN",
        help="keep these ops TF's: an op type (Softmax) or a node-name pattern "
             "('model/block3*'); repeat for several")),
    ("--autotune", "autotune_margin", dict(
        nargs="?", type=float, metavar="MARGIN",
        help="kernels predicted faster than their ops by less than MARGIN (default 1.3) "
             "are timed against them on their first calls where the model runs, and "
             "the faster serves (--autotune=MARGIN or --autotune MARGIN)")),
]


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _flag_margins(argv: list) -> list:
    """``--autotune`` takes an optional MARGIN; argparse would read the next word as it
    whatever it is (``--autotune in.pb out.pb`` failed on 'in.pb'). A word after it that
    is not a number is left to be a path: the flag is then given its default margin."""
    out = list(argv)
    for i, word in enumerate(out):
        if word == "--":
            break
        if word == "--autotune" and (i + 1 == len(out) or not _is_number(out[i + 1])):
            out[i] = "--autotune=" + str(_default_options().autotune_margin)
    return out

HELP = """\
Rewrite a frozen GraphDef (.pb, .pbtxt) or a SavedModel directory: the memory-intensive
ops are fused into generated kernels that run as a TensorFlow op.

Prints the report: what was fused, into how many kernels, what was not and why.
The output ships this machine's compiled kernels (in a SavedModel's assets, or in
OUTPUT.kernels/ beside a GraphDef) unless --no-kernels.  A process that runs the
output must import stitching first.  On failure: exit status 1 and one line naming
the reason.
"""

EXAMPLES = """\
examples:
  stitching-rewrite model.pb fast.pb --outputs logits
  stitching-rewrite saved_model/ fast_model/ --signature serving_default
  stitching-rewrite saved_model/ fast_model/ --report report.json --dump-dir dumps
"""


def _default_options():
    from .options import Options
    return Options(fallback=True)   # a shipped graph keeps its original segments


def _options(ap, args):
    """The Options the flags ask for; a value Options refuses is a usage error (exit 2)
    naming the flag."""
    from .options import Options
    kw = {"fallback": True}
    flags = {}
    for flag, field, _ in _OPTION_FLAGS:
        value = getattr(args, field)
        if value is not None:
            kw[field] = value
            flags[field] = flag
    if args.autotune_margin is not None:
        kw["autotune"] = True
    try:
        return Options(**kw)
    except (TypeError, ValueError) as e:
        msg = str(e)
        for field, flag in flags.items():
            msg = msg.replace(f"Options.{field}", flag)
        ap.error(msg)


def _version() -> str:
    from importlib import metadata
    # the package is imported already (this module is inside it); reading the
    # attribute keeps the import graph running down the pipeline (test_layering)
    __version__ = sys.modules["stitching"].__version__
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return f"stitching {__version__} (TensorFlow {metadata.version(dist)})"
        except metadata.PackageNotFoundError:
            continue
    return f"stitching {__version__} (TensorFlow not installed)"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="stitching-rewrite", description=HELP, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="GraphDef file (.pb, .pbtxt) or SavedModel directory")
    ap.add_argument("dst", help="output file (GraphDef) or directory (SavedModel)")
    ap.add_argument("--version", action="version", version=_version())
    ap.add_argument("--outputs", help="GraphDef only: comma-separated output node names "
                    "(default: the nodes nothing reads)")
    ap.add_argument("--signature", action="append", metavar="KEY",
                    help="SavedModel only: a signature to rewrite (repeat for several; "
                         "default: all); the others are kept as they are")
    ap.add_argument("--report", "--json", dest="json", metavar="FILE",
                    help="also write the report(s) as JSON here")
    ap.add_argument("--no-kernels", action="store_true",
                    help="do not ship this machine's compiled kernels with the output")
    ap.add_argument("--overwrite", action="store_true",
                    help="allow the output to replace the input")
    opts = ap.add_argument_group("options (stitching.Options)")
    for flag, field, kw in _OPTION_FLAGS:
        opts.add_argument(flag, dest=field, **kw)
    return ap


def _paths(args) -> tuple:
    """(whether the output is the input, the input's real path, the output's)."""
    same = os.path.exists(args.dst) and os.path.samefile(args.src, args.dst)
    return same, os.path.realpath(args.src), os.path.realpath(args.dst)


def _check_kinds(ap, args) -> None:
    """Options that do not apply to the input's kind are errors, not ignored."""
    if os.path.isdir(args.src) and args.outputs:
        ap.error("--outputs applies to a GraphDef file; a SavedModel's outputs are its "
                 "signatures' (choose them with --signature)")
    if os.path.isfile(args.src) and args.signature:
        ap.error("--signature applies to a SavedModel directory; a GraphDef's outputs "
                 "are chosen with --outputs")
    same, src, dst = _paths(args)
    inside = os.path.isdir(src) and os.path.commonpath([src, dst]) in (src, dst)
    if (same or inside) and not args.overwrite:
        ap.error(f"the output {args.dst} would overwrite the input {args.src}; choose "
                 f"another output, or pass --overwrite")
    if os.path.isdir(args.src) and not same and os.path.isdir(args.dst) and \
            os.listdir(args.dst) and not args.overwrite:
        # a SavedModel saved into it would keep the files it does not write (another
        # model's kernel assets among them)
        ap.error(f"the output {args.dst} is a directory that is not empty; choose "
                 f"another output, or pass --overwrite to replace it")


def main(argv=None) -> int:
    """Run ``stitching-rewrite`` (see ``--help``); returns the exit status."""
    ap = _parser()
    args = ap.parse_args(_flag_margins(sys.argv[1:] if argv is None else argv))
    if os.path.exists(args.src):
        _check_kinds(ap, args)
    embed = not args.no_kernels
    options = _options(ap, args)
    if args.json:        # before the rewrite: a report it cannot write fails nothing late
        where = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(where):
            ap.error(f"--report {args.json}: " + ("a directory" if os.path.isdir(args.json)
                                                  else f"no directory {where}"))
    try:
        with _output(args) as dst:
            if os.path.isdir(args.src):
                from .saved_model import rewrite_saved_model
                reports = rewrite_saved_model(args.src, dst, signature_keys=args.signature,
                                              options=options, embed_kernels=embed)
            elif os.path.isfile(args.src):
                outs = [o.strip() for o in args.outputs.split(",") if o.strip()] \
                    if args.outputs else None
                reports = rewrite_graph_def_file(args.src, dst, outs, options=options,
                                                 embed_kernels=embed)
            else:
                raise FileNotFoundError(f"{args.src}: no such file or directory")
    except Exception as e:  # noqa: BLE001 — a CLI reports, it does not dump a traceback
        reason = " ".join(str(e).split())[:800]    # one line (TF's errors have several)
        print(f"stitching-rewrite: error: {type(e).__name__}: {reason}", file=sys.stderr)
        return 1
    for keys, rep in _distinct(reports):
        print(f"[{', '.join(keys)}]\n{rep.summary()}")
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({k: r.to_dict() for k, r in reports.items()}, f, indent=2)
        except OSError as e:
            print(f"stitching-rewrite: error: --report {args.json}: {e.strerror or e} (the "
                  f"model was written)", file=sys.stderr)
            return 1
    return 0


def _distinct(reports: dict) -> list:
    """[(keys, report)]: signatures that share one rewritten function (a Keras export's
    ``serve`` and ``serving_default``) share one report, printed once."""
    groups: dict[int, tuple] = {}
    for key, rep in reports.items():
        groups.setdefault(id(rep), ([], rep))[0].append(key)
    return list(groups.values())


@contextlib.contextmanager
def _output(args):
    """The path to write to: ``dst`` itself, or, when it is the input or an existing
    SavedModel directory (--overwrite), a sibling moved over it once the rewrite
    succeeded (the rewrite reads the input while it writes; an old model's files must
    not stay beside the new one's)."""
    same, src, dst = _paths(args)
    # another SavedModel's directory, replaced whole (never one that holds the input)
    replace = os.path.isdir(src) and os.path.isdir(dst) and args.overwrite and \
        os.path.commonpath([src, dst]) != dst
    if not (same or replace):
        yield args.dst
        return
    import shutil
    import tempfile
    dst = args.dst.rstrip(os.sep)
    tmp = tempfile.mkdtemp(prefix=".stitching-rewrite-", dir=os.path.dirname(dst) or ".")
    try:
        staged = os.path.join(tmp, os.path.basename(dst))
        yield staged
        if os.path.isdir(dst):
            shutil.rmtree(dst)
        os.replace(staged, dst)
        if os.path.isdir(staged + ".kernels"):          # a GraphDef's shipped kernels
            shutil.rmtree(dst + ".kernels", ignore_errors=True)
            os.replace(staged + ".kernels", dst + ".kernels")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
