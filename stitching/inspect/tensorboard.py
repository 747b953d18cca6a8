"""``stitching.write_tensorboard``: which dumps to write; tf/tensorboard.py writes them
(each StitchedKernel a named group expanding into its fused ops, the profile as
scalars)."""
from __future__ import annotations

import os

from .load import Dump, DumpError, list_dumps, load_dump


def write_tensorboard(fn_or_dump, logdir) -> list:
    """Write a stitched graph for TensorBoard's graph view (``tensorboard --logdir
    logdir``): each StitchedKernel a group that expands into the ops it fused, and
    the measured profile as scalars when one was collected.

    Args:
        fn_or_dump: A ``Dump``, a dump path (one dump or a dump root), a list of
            those, or a ``stitching.function`` (its traces' dumps; one traced without
            ``dump_dir`` is dumped again into ``logdir/dumps``).
        logdir: The TensorBoard log directory.

    Returns:
        The run directories written, one per dump.

    Raises:
        stitching.inspect.DumpError: a path that holds no dump.
    """
    from ..tf.tensorboard import write_runs
    return write_runs(_dumps(fn_or_dump, logdir), logdir)


def _dumps(obj, logdir) -> list:
    if isinstance(obj, Dump):
        return [obj]
    if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__"):
        return [load_dump(p) for p in list_dumps(obj)]
    if hasattr(obj, "reports") and hasattr(obj, "options"):      # a stitching.function
        from . import _report_dumps
        return [load_dump(p) for p in _report_dumps(obj.reports)] or _dump_again(obj, logdir)
    if isinstance(obj, (list, tuple)):
        return [d for o in obj for d in _dumps(o, logdir)]
    raise TypeError(f"write_tensorboard expects a dump, a dump path or a "
                    f"stitching.function, got {type(obj).__name__}")


def _dump_again(fn, logdir) -> list:
    """Trace ``fn`` again with dumping on, for each input signature it was called with
    (kernels come from the caches: nothing is compiled again)."""
    import dataclasses

    from ..tf.function import StitchedFunction
    sigs = [cf.structured_input_signature for cf in fn._list_all_concrete_functions()]
    if not sigs:
        raise DumpError("this stitching.function has not been traced yet: call it once, "
                        "or give it Options(dump_dir=...)")
    root = os.path.join(os.fspath(logdir), "dumps")
    opts = dataclasses.replace(fn.options, dump_dir=root, background_compile=False)
    again = StitchedFunction(fn.python_function, options=opts)
    for args, kwargs in sigs:
        again.get_concrete_function(*args, **kwargs)
    return [load_dump(r.dump_path) for r in again.reports if r.dump_path]
