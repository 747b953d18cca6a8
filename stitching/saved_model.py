"""SavedModels: rewrite every serving signature, and load rewritten ones.

A rewritten SavedModel holds StitchedKernel nodes whose ``spec`` attributes are
the kernels; a process that imports stitching compiles them on first use (or
finds them in the on-disk kernel cache) through the runtime's compiler hook.  It
also ships the kernels' shared objects for the machine it was rewritten on as assets
(kernel_assets.py), which a process on the same CPU and toolchain uses instead.
"""
from __future__ import annotations

import inspect

import tensorflow as tf

from .options import Options
from .tf.function import StitchedFunction


def rewrite_saved_model(src: str, dst: str, options: Options | None = None,
                        signature_keys=None, embed_kernels: bool = True) -> dict:
    """Rewrite the signatures of the SavedModel ``src`` into a new SavedModel at ``dst``
    (what ``stitching-rewrite src/ dst/`` does).  Signatures not selected, the
    variables and the assets are kept; the loaded model's root is the original root
    object (its functions, like a Keras export's ``serve``, and variables where they
    were).

    Args:
        src: The SavedModel directory to read.
        dst: The directory to write (must not be ``src``).
        options: A ``stitching.Options``; default ``Options(fallback=True)``, so each
            kernel node keeps its original ops for machines that cannot build it.
        signature_keys: The signatures to rewrite (default: all).
        embed_kernels: Ship this machine's compiled kernels in the model's assets,
            so loading it here, or on a machine of the same CPU and toolchain,
            compiles nothing.

    Returns:
        ``{signature key: Report}``; signatures that share one function share one
        report.

    Raises:
        ValueError: no signatures, an unknown signature key, or a model this tool
            rewrote already.
    """
    from .compile.parallel import shipping
    from .tf import ensure_runtime
    ensure_runtime()
    with shipping():        # the model ships its kernels: tier-2 code only
        return _rewrite_saved_model(src, dst, options, signature_keys, embed_kernels)


def _rewrite_saved_model(src, dst, options, signature_keys, embed_kernels) -> dict:
    _refuse_rewritten(src)
    _warn_keras2(src)
    model = tf.saved_model.load(src)
    keys = signature_keys or list(model.signatures.keys())
    if not keys:
        raise ValueError(f"{src}: SavedModel has no signatures to rewrite")
    new_sigs, reports, done = {}, {}, {}
    for key in keys:
        if key not in model.signatures:
            raise ValueError(f"{src}: no signature {key!r} (has {sorted(model.signatures)})")
        cf = model.signatures[key]
        same = done.setdefault(_identity(cf), key)
        if same != key:     # e.g. Keras export's 'serve' and 'serving_default'
            new_sigs[key], reports[key] = new_sigs[same], reports[same]
            continue
        # the call's keywords are TF's Python-identifier form of the SignatureDef's input
        # keys; the specs keep the keys themselves ("my-input.0"), which the rewritten
        # SignatureDef then has as the original did (a TF Serving client sends them)
        inputs = sorted(cf.structured_input_signature[1].items())
        sig = [tf.TensorSpec(t.shape, t.dtype, name=t.name or n) for n, t in inputs]
        names = [n for n, _ in inputs]

        sf = StitchedFunction(_signature_caller(cf, names, key), input_signature=sig,
                              options=options or Options(fallback=True))
        new_sigs[key] = sf.get_concrete_function()
        reports[key] = sf.report
    for key in model.signatures.keys():       # the ones not selected stay as they were
        new_sigs.setdefault(key, model.signatures[key])
    _share_stitched_functions(model, new_sigs, [k for k in keys if done.get(_identity(
        model.signatures[k])) == k])
    # The original root object is the new root: its API (a Keras export's ``serve``,
    # ``variables``, its other functions and attributes) stays where users call it.
    import tempfile
    with tempfile.TemporaryDirectory(prefix="stitching-kernels-") as staging:
        if embed_kernels:
            _embed_kernels(model, new_sigs.values(), staging)
        tf.saved_model.save(model, dst, signatures=new_sigs)
    return reports


KERAS2_NOTE = (
    "{src} is a Keras 2 (tf_keras) SavedModel (model.save(..., save_format='tf')): only "
    "its signatures are rewritten. Serve the output through "
    "tf.saved_model.load(dst).signatures['serving_default']: the loaded object's own "
    "__call__ and its layers' functions keep their stock graphs, and the Keras metadata "
    "(keras_metadata.pb) is not carried over, so tf_keras.models.load_model(dst) gives "
    "a plain restored object, not a Keras model (model.export(path) of a stitched model, "
    "docs/training.md, writes a stitched 'serve' endpoint instead)")


def _warn_keras2(src) -> None:
    """A Keras 2 SavedModel is most often loaded back with ``tf_keras.models.load_model``
    or called as ``loaded(x)``: neither runs the rewritten signatures (an audit's tf_keras
    model: ``loaded(x)`` ran stock TF silently, load_model returned an object without
    ``predict``).  Say so where the rewrite happens."""
    import os
    import warnings
    if os.path.exists(os.path.join(src, "keras_metadata.pb")):
        warnings.warn(KERAS2_NOTE.format(src=src), stacklevel=3)


def _signature_caller(cf, names, key):
    """A Python function calling the signature ``cf`` by its input ``names``, with
    those names as its parameters (so the stitched trace keeps them) and ``key`` as
    its name (the report's and the dump directory's)."""
    def call(*args):
        return cf(**dict(zip(names, args)))
    call.__name__ = call.__qualname__ = key
    if all(n.isidentifier() for n in names):
        call.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    return call


# ---- the original object's own functions -------------------------------------------
#
# The rewritten model keeps the original object as its root: its variables, and the
# functions users call on it (a Keras export's ``loaded.serve``).  Kept as
# they were, those functions and the object's own signatures hold a second, unstitched
# copy of the whole graph, which tf.saved_model.load converts to a Python FuncGraph
# like every library function: measured, that copy was a third of the rewritten
# Transformer's load (566 of ~2,200 library nodes) and pushed it into a full garbage
# collection (~0.2 s).  So a function that only calls what a rewritten signature calls
# is replaced by one that calls the stitched signature (same inputs, same outputs,
# mapped through the signature's own wrapper graph), and the object's signature map by
# the stitched signatures: one graph, stitched, serves all of them.  A function that
# does anything else is kept as it was.

def _share_stitched_functions(model, new_sigs, rewritten_keys) -> None:
    from tensorflow.python.eager.polymorphic_function import polymorphic_function
    from tensorflow.python.saved_model import signature_serialization as ss
    calls = {}                      # original callee -> (signature key, in map, out map)
    for key in rewritten_keys:
        m = _call_mapping(model.signatures[key])
        if m is not None:
            calls.setdefault(m[0], (key, m[1], m[2]))
    children = model._trackable_children(save_type="savedmodel")  # noqa: SLF001
    for name, child in children.items():
        if not isinstance(child, polymorphic_function.Function) or name == "signatures":
            continue
        cfs = child._list_all_concrete_functions_for_serialization()  # noqa: SLF001
        hit = calls.get(tf.compat.as_str(cfs[0].name)) if len(cfs) == 1 else None
        redirect = hit and _redirect(cfs[0], new_sigs[hit[0]], hit[1], hit[2])
        if redirect is not None:
            setattr(model, name, redirect)
    if "signatures" in children:
        wrapped, _, _ = ss.canonicalize_signatures(
            {k: new_sigs[k] for k in model.signatures.keys()})
        model.signatures = ss.create_signature_map(wrapped)


def _call_mapping(sig_cf):
    """(callee function name, {call input position: signature input key},
    {signature output key: call output index}) for a signature that is one function
    call (Keras export's and tf.saved_model.save's wrappers), else None."""
    ops = sig_cf.graph.get_operations()
    call = [op for op in ops if op.type in ("StatefulPartitionedCall", "PartitionedCall")]
    if len(call) != 1 or not isinstance(sig_cf.structured_outputs, dict):
        return None
    call = call[0]
    keys = list(sig_cf._arg_keywords)           # noqa: SLF001 - aligned with .inputs
    inputs = {t.ref(): k for t, k in zip(sig_cf.inputs, keys)}
    in_map = {i: inputs[_through_identity(t).ref()] for i, t in enumerate(call.inputs)
              if _through_identity(t).ref() in inputs}
    out_map = {}
    for key, t in zip(sorted(sig_cf.structured_outputs), sig_cf.outputs):
        t = _through_identity(t)
        if t.op is not call:
            return None
        out_map[key] = t.value_index
    return tf.compat.as_str(call.get_attr("f").name), in_map, out_map


def _through_identity(t):
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    return t


def _redirect(cf0, stitched, in_map, out_map):
    """A tf.function with ``cf0``'s inputs and outputs that runs ``stitched`` (the
    rewritten signature, positional in sorted input-name order), or None where the
    mapping does not cover ``cf0`` exactly."""
    args, kwargs = cf0.structured_input_signature
    specs = tf.nest.flatten(args)
    n_out = len(tf.nest.flatten(cf0.structured_outputs, expand_composites=True))
    if kwargs or not all(isinstance(s, tf.TensorSpec) for s in specs) or \
            sorted(in_map) != list(range(len(specs))) or \
            sorted(out_map.values()) != list(range(n_out)):
        return None
    names = sorted(set(in_map.values()))
    if len(names) != len(specs):
        return None
    by_index = {j: key for key, j in out_map.items()}

    def redirect(*xs):
        flat = tf.nest.flatten(xs)
        feed = {in_map[i]: x for i, x in enumerate(flat)}
        res = stitched(*[feed[n] for n in names])
        return tf.nest.pack_sequence_as(cf0.structured_outputs,
                                        [res[by_index[j]] for j in range(n_out)],
                                        expand_composites=True)
    # the original's parameter names, so a call by keyword (loaded.serve(x=...)) works
    function_type = getattr(cf0, "function_type", None)
    params = list(function_type.parameters) if function_type is not None else []
    if len(params) == len(args) and all(p.isidentifier() for p in params):
        redirect.__signature__ = inspect.Signature(
            [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])
    fn = tf.function(redirect, input_signature=list(args))
    fn.get_concrete_function()
    return fn


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


def _refuse_rewritten(src) -> None:
    """A model rewritten already is refused (rewriting it again would fuse nothing new
    and could only double-wrap its kernels), from its ``saved_model.pb`` (or
    ``.pbtxt``) before it is loaded: loading it would first install its kernels (and
    print their warnings) only to be refused.  A file that does not parse is left to
    ``tf.saved_model.load``."""
    import os

    from google.protobuf import message, text_format
    from tensorflow.core.protobuf import saved_model_pb2
    from .tf.kernel_assets import stitched_nodes
    sm = saved_model_pb2.SavedModel()
    try:
        if os.path.exists(os.path.join(src, "saved_model.pb")):
            with open(os.path.join(src, "saved_model.pb"), "rb") as f:
                sm.ParseFromString(f.read())
        else:
            with open(os.path.join(src, "saved_model.pbtxt"), encoding="utf-8") as f:
                text_format.Parse(f.read(), sm)
    except (OSError, UnicodeDecodeError, message.DecodeError, text_format.ParseError):
        return
    node = next((n for mg in sm.meta_graphs for n in stitched_nodes(mg.graph_def)), None)
    if node is not None:
        raise ValueError(f"{src}: node {node.name!r} is a StitchedKernel: this SavedModel "
                         f"was rewritten by stitching already (rewrite the original "
                         f"instead)")


def _embed_kernels(module, concrete_functions, staging) -> None:
    from .tf.kernel_assets import export, kernel_assets_resource, specs_in
    specs = []
    for cf in concrete_functions:
        specs += [s for s in specs_in(cf.graph.as_graph_def()) if s not in specs]
    manifest, paths, sha = export(specs, staging)
    if manifest is not None:
        module.stitching_kernels = kernel_assets_resource(manifest, paths, sha)


def load_saved_model(path: str, **kwargs):
    """``tf.saved_model.load(path, **kwargs)`` after registering the StitchedKernel op
    (building its library if needed).  ``import stitching`` before
    ``tf.saved_model.load`` does the same.

    Raises:
        stitching.runtime.BuildError: the op library cannot be built here.
    """
    from .tf import ensure_runtime
    ensure_runtime()
    return tf.saved_model.load(path, **kwargs)
