"""SavedModels: rewrite every serving signature, and load rewritten ones.

A rewritten SavedModel holds StitchedKernel nodes whose ``spec`` attributes are
the kernels; a process that imports stitching compiles them on first use (or
finds them in the on-disk kernel cache) through the runtime's compiler hook.  It
also ships the kernels' shared objects for the machine it was rewritten on as assets
(kernel_assets.py), which a process on the same CPU and toolchain uses instead.
"""
from __future__ import annotations

import tensorflow as tf

from ..options import Options
from .function import StitchedFunction


def rewrite_saved_model(src: str, dst: str, options: Options | None = None,
                        signature_keys=None, embed_kernels: bool = True) -> dict:
    """Rewrite the signatures of ``src`` (``signature_keys``, default all) into a new
    SavedModel at ``dst``; the others, the variables and the assets are kept.

    ``embed_kernels``: ship the kernels' shared objects for this machine in the
    model's assets (kernel_assets.py), so loading it here, or on a machine of the same
    CPU and toolchain, compiles nothing.  Returns {signature key: Report}.
    """
    from . import ensure_runtime
    ensure_runtime()
    model = tf.saved_model.load(src)
    keys = signature_keys or list(model.signatures.keys())
    if not keys:
        raise ValueError(f"{src}: SavedModel has no signatures to rewrite")
    _refuse_rewritten(src, model)
    new_sigs, reports, done = {}, {}, {}
    for key in keys:
        if key not in model.signatures:
            raise ValueError(f"{src}: no signature {key!r} (has {sorted(model.signatures)})")
        cf = model.signatures[key]
        same = done.setdefault(_identity(cf), key)
        if same != key:     # e.g. Keras export's 'serve' and 'serving_default'
            new_sigs[key], reports[key] = new_sigs[same], reports[same]
            continue
        sig = [tf.TensorSpec(t.shape, t.dtype, name=n) for n, t in
               sorted(cf.structured_input_signature[1].items())]
        names = [s.name for s in sig]

        def call(*args, _cf=cf, _names=names):
            return _cf(**dict(zip(_names, args)))
        call.__name__ = key           # names the report and the dump directory

        sf = StitchedFunction(call, input_signature=sig,
                              options=options or Options(fallback=True))
        new_sigs[key] = sf.get_concrete_function()
        reports[key] = sf.report
    for key in model.signatures.keys():       # the ones not selected stay as they were
        new_sigs.setdefault(key, model.signatures[key])
    module = tf.Module()
    module.model = model            # keeps variables tracked
    import tempfile
    with tempfile.TemporaryDirectory(prefix="stitching-kernels-") as staging:
        if embed_kernels:
            _embed_kernels(module, new_sigs.values(), staging)
        tf.saved_model.save(module, dst, signatures=new_sigs)
    return reports


def _identity(cf) -> tuple:
    """Signatures with the same inputs and outputs that call the same function are one
    program (Keras' export writes 'serve' and 'serving_default' so): rewritten once,
    saved once, instead of planned, compiled and stored twice."""
    calls = sorted(n.attr["f"].func.name for n in cf.graph.as_graph_def().node
                   if n.op in ("StatefulPartitionedCall", "PartitionedCall"))
    outs = sorted((k, t.dtype.name, str(t.shape)) for k, t in
                  (cf.structured_outputs or {}).items()) \
        if isinstance(cf.structured_outputs, dict) else repr(cf.structured_outputs)
    return (tuple(calls), repr(cf.structured_input_signature), repr(outs)) if calls \
        else (id(cf),)


def _refuse_rewritten(src, model) -> None:
    """A model rewritten already is refused: rewriting it again would fuse nothing new
    and could only double-wrap its kernels."""
    from .kernel_assets import specs_in
    for key, cf in model.signatures.items():
        if specs_in(cf.graph.as_graph_def()):
            raise ValueError(f"{src}: signature {key!r} holds StitchedKernel nodes: this "
                             f"SavedModel was rewritten by stitching already (rewrite the "
                             f"original instead)")


def _embed_kernels(module, concrete_functions, staging) -> None:
    from .kernel_assets import export, kernel_assets_resource, specs_in
    specs = []
    for cf in concrete_functions:
        specs += [s for s in specs_in(cf.graph.as_graph_def()) if s not in specs]
    manifest, paths, sha = export(specs, staging)
    if manifest is not None:
        module.stitching_kernels = kernel_assets_resource(manifest, paths, sha)


def load_saved_model(path: str, **kwargs):
    """``tf.saved_model.load`` after making sure StitchedKernel can run here."""
    from . import ensure_runtime
    ensure_runtime()
    return tf.saved_model.load(path, **kwargs)
