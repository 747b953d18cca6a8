"""SavedModels: rewrite every serving signature, and load rewritten ones.

A rewritten SavedModel holds StitchedKernel nodes whose ``spec`` attributes are
the kernels; a process that imports stitching compiles them on first use (or
finds them in the on-disk kernel cache) through the runtime's compiler hook.
"""
from __future__ import annotations

import tensorflow as tf

from ..options import Options
from .function import StitchedFunction


def rewrite_saved_model(src: str, dst: str, options: Options | None = None,
                        signature_keys=None) -> dict:
    """Rewrite the signatures of ``src`` into a new SavedModel at ``dst``.

    Returns {signature key: Report}.
    """
    from . import ensure_runtime
    ensure_runtime()
    model = tf.saved_model.load(src)
    keys = signature_keys or list(model.signatures.keys())
    if not keys:
        raise ValueError(f"{src}: SavedModel has no signatures to rewrite")
    new_sigs, reports = {}, {}
    for key in keys:
        if key not in model.signatures:
            raise ValueError(f"{src}: no signature {key!r} (has {sorted(model.signatures)})")
        cf = model.signatures[key]
        sig = [tf.TensorSpec(t.shape, t.dtype, name=n) for n, t in
               sorted(cf.structured_input_signature[1].items())]
        names = [s.name for s in sig]

        def call(*args, _cf=cf, _names=names):
            return _cf(**dict(zip(_names, args)))
        call.__name__ = key           # names the report and the dump directory

        sf = StitchedFunction(call, input_signature=sig, options=options)
        new_sigs[key] = sf.get_concrete_function()
        reports[key] = sf.report
    module = tf.Module()
    module.model = model            # keeps variables tracked
    tf.saved_model.save(module, dst, signatures=new_sigs)
    return reports


def load_saved_model(path: str, **kwargs):
    """``tf.saved_model.load`` after making sure StitchedKernel can run here."""
    from . import ensure_runtime
    ensure_runtime()
    return tf.saved_model.load(path, **kwargs)
