"""See what stitching did: graph dumps, drawings, TensorBoard.

    Options(dump_dir=...) / $STITCHING_DUMP_DIR / stitching-rewrite --dump-dir
        write one directory per traced function (tf/dump.py; format:
        schema/dump-v1.schema.json)
    load_dump(path)            read one back as objects (load.py)
    list_dumps(root)           the dumps under a root, oldest first
    validate_dump(path)        check it against the JSON schema (needs jsonschema)
    write_profile()            measured time per kernel into this process's dumps
                               (STITCHING_PROFILE=1 or runtime.set_profiling(True))
    draw_graph(dump)           the graph, each stitched region coloured and labelled
    roofline(dump)             kernels against this machine's bandwidth and FLOP peak
    machine_peaks()            that bandwidth (the cost model's copy measurement) and peak
    write_tensorboard(...)     the rewritten graph for TensorBoard's graph view

A stage after ``stitching.tf``: it reads what the TF edge wrote, and reaches
TensorFlow only through it.  Importing it imports neither TensorFlow nor matplotlib.
"""
from __future__ import annotations

from .load import Dump, DumpError, KernelDump, list_dumps, load_dump, validate_dump


def write_profile(dumps=None) -> list:
    """Write the op's profile counters into ``profile.json`` of the dumps this process
    wrote: all of them, or those of ``dumps`` (dump paths, Dump objects, or a stitched
    function: the dumps of its traces).  Returns the files written.  Kernels not run
    since profiling was turned on have no entry (``KernelDump.measured`` is None)."""
    from ..tf import dump
    paths = None if dumps is None else _paths(dumps)
    return dump.write_profiles(paths)


def _paths(obj) -> list:
    if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__"):
        return [obj]
    if isinstance(obj, Dump):
        return [obj.path]
    reports = getattr(obj, "reports", None)
    if reports is not None:             # a StitchedFunction
        return _report_dumps(reports)
    return [p for o in obj for p in _paths(o)]


def _report_dumps(reports) -> list:
    """The dump paths of ``reports`` and of their control-flow functions' reports
    (tf.cond branches, loop bodies: each dumped apart), in order."""
    out = []
    for r in reports:
        if getattr(r, "dump_path", None):
            out.append(r.dump_path)
        out.extend(_report_dumps([b for _, b, _ in getattr(r, "bodies", ()) if b is not None]))
    return out


def __getattr__(name):
    if name in ("draw_graph", "roofline", "machine_peaks", "to_networkx"):
        from . import draw
        return getattr(draw, name)
    if name == "write_tensorboard":
        from .tensorboard import write_tensorboard
        return write_tensorboard
    raise AttributeError(f"module 'stitching.inspect' has no attribute {name!r}")


__all__ = ["Dump", "DumpError", "KernelDump", "list_dumps", "load_dump", "validate_dump",
           "write_profile", "draw_graph", "roofline", "machine_peaks", "to_networkx",
           "write_tensorboard"]
