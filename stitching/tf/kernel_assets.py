"""Kernels inside the artifact: a rewritten model ships its compiled shared objects.

Design
------
Loading a rewritten model should not compile (seconds, and Numba) when the machine is
the one the kernels were built for.  So the rewrite (saved_model.py, cli.py) puts the
shared object of every kernel its graph uses, and the shape interpreter they share,
beside the model, with a manifest::

    {"version": 2, "abi": <kernel cache toolchain tag: Numba/llvmlite versions, CPU
     name and features, helper sources (compile/kernel.py)>, "host": <CPU in words>,
     "files": {<name>.so: {"sha256": ..., "size": ...}}, "specs": {<spec hash>: <name>},
     "emitter": <hash of the code generator's sources>,
     "kernels": {<spec hash>: {"code", "program", "errors", "generic"}}}

``kernels`` is the spec-hash index (compile/shipped.py): a load registers each kernel
from it without scheduling or generating code, still validating every spec.

* SavedModel: the files are ``tf.saved_model.Asset``s (copied to ``assets/``) held by a
  resource (``KernelAssets``) whose initializer, run by TF when the model is loaded,
  is the ``StitchedKernelAssets`` op on the assets' current paths.  The manifest's
  SHA-256 is an attribute of that op, i.e. recorded in the graph at rewrite time; the
  manifest records each file's SHA-256.  So a file is used only if it is the one the
  rewrite wrote (the graph is the root of trust, as it is for the specs).
* GraphDef: the same files in a sidecar directory ``<output>.kernels/``, the
  manifest's SHA-256 in the graph (a Const node, ``MANIFEST_NODE``);
  ``install_dir`` (``stitching.install_kernels``) checks the sidecar against the
  graph and makes its files this process's kernels.

``install`` (the op's callback, on the loading machine) copies each checked file into
this process's kernel cache under its code name, where compile_kernel finds it as a
cache hit: the kernel is then loaded with one dlopen, without importing Numba.  A
manifest built for another toolchain or CPU (``abi`` differs), a missing file, a file
or manifest whose hash disagrees, or an unwritable cache: a warning (once per
reason) and the kernels compile from their specs as without assets -- never a
different kernel, because a file is taken only under the code name its checked
content was recorded under, and code names are hashes of the generated code.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

MARKER = "stitching-assets\n"          # op.cc kAssetsMarker
MANIFEST = "stitching_kernels.json"
STITCHED_OP = "StitchedKernel"
_warned: set = set()


def specs_in(graph_def) -> list:
    """The distinct spec strings of a GraphDef's StitchedKernel nodes, library
    functions included."""
    seen = {}
    nodes = list(graph_def.node)
    for f in graph_def.library.function:
        nodes.extend(f.node_def)
    for n in nodes:
        if n.op == STITCHED_OP:
            seen.setdefault(n.attr["spec"].s.decode("utf-8"), None)
    return list(seen)


def export(specs, out_dir) -> tuple:
    """Write the shared objects serving ``specs`` and their manifest into ``out_dir``.
    Returns (manifest path, [shared object paths], manifest sha256); (None, [], None)
    where there is nothing to ship (no specs, or kernels without shared objects)."""
    from ..compile import kernel as K
    from ..ir import KernelSpec
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from ..compile import shipped
    files, by_spec, index = {}, {}, {}
    for text in specs:
        k = K.compile_kernel(KernelSpec.from_json(text))
        so = _shared_object(k._code)
        if so is None:
            continue
        files[so.name] = so
        by_spec[k.spec.hash] = so.stem
        index[k.spec.hash] = shipped.entry_of(k)
    if not files:
        return None, [], None
    K.interp_address()
    interp = _shared_object(K._INTERP)
    if interp is not None:
        files["interp.so"] = interp
    from ..compile import native
    manifest = {"version": 2, "abi": K.kernel_dir().name, "host": native.host_tag(),
                "files": {}, "specs": by_spec, "emitter": shipped.emitter_tag(),
                "kernels": index}
    paths = []
    for name, src in sorted(files.items()):
        data = src.read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                   "size": len(data)}
        (out / name).write_bytes(data)
        paths.append(str(out / name))
    text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (out / MANIFEST).write_bytes(text)
    return str(out / MANIFEST), paths, hashlib.sha256(text).hexdigest()


def _shared_object(code):
    """The .so a kernel's code was loaded from (None: Numba JIT code, no file)."""
    if code is None or getattr(code, "cfunc", None) is not None:
        return None
    so = code.stem.with_suffix(".so")
    return so if so.is_file() else None


# ---- loading -------------------------------------------------------------------------

def install(payload: str) -> None:
    """The StitchedKernelAssets op's callback: ``MARKER`` + manifest sha256, then one
    path a line (the manifest first).  Never raises for a bad or foreign asset: it
    warns and leaves those kernels to compile from their specs."""
    lines = payload[len(MARKER):].split("\n")
    try:
        install_files(lines[1:], want_manifest_sha=lines[0])
    except Exception as e:  # noqa: BLE001 - e.g. no Numba metadata for the cache key:
        _skip(f"the model's kernels could not be installed ({type(e).__name__}: {e})")


def install_dir(path, graph=None) -> int:
    """Install the kernels shipped beside a rewritten GraphDef (``<graph>.kernels/``),
    so running it compiles nothing (``stitching.install_kernels``).

    Args:
        path: The sidecar directory.
        graph: The GraphDef (or its file) the kernels belong to; default ``path``
            without ``.kernels``.

    Returns:
        How many files were installed; 0 with a warning when the directory does not
        match the graph (the kernels then compile from the specs in the graph).

    The rewrite recorded the sidecar manifest's SHA-256 in the graph (a Const node,
    ``MANIFEST_NODE``), as a SavedModel records its own in the StitchedKernelAssets
    op: ``graph`` (a GraphDef, or its file; default: ``path`` without ``.kernels``)
    says which manifest it was written with, and a sidecar that is not that one (a
    swapped or edited directory) is not used (warning; the kernels compile from their
    specs).  Returns how many files were installed."""
    d = Path(path)
    try:
        want = recorded_manifest(_graph_for(d, graph))
    except (OSError, ValueError) as e:
        return _skip(f"the graph of the kernels in {d} cannot be read ({e}); pass it as "
                     f"install_kernels(dir, graph=...)")
    if want is None:
        return _skip(f"the graph of the kernels in {d} records no kernel manifest hash "
                     f"(rewrite it again, or pass its graph as install_kernels(dir, graph=...))")
    files = [str(d / MANIFEST)] + [str(p) for p in sorted(d.glob("*.so"))]
    return install_files(files, want_manifest_sha=want)


MANIFEST_NODE = "stitching_kernels_manifest_sha256"


def record_manifest(graph_def, sha: str) -> None:
    """Put the sidecar manifest's SHA-256 into ``graph_def`` (a Const string node that
    no output reads, so importing or pruning the graph is unchanged)."""
    for n in list(graph_def.node):
        if n.name == MANIFEST_NODE:
            graph_def.node.remove(n)
    n = graph_def.node.add(name=MANIFEST_NODE, op="Const")
    n.attr["dtype"].type = 7                         # DT_STRING
    n.attr["value"].tensor.dtype = 7
    n.attr["value"].tensor.string_val.append(sha.encode())


def recorded_manifest(graph_def):
    """The manifest SHA-256 ``record_manifest`` put into ``graph_def``, or None."""
    for n in graph_def.node:
        if n.name == MANIFEST_NODE and n.op == "Const":
            vals = n.attr["value"].tensor.string_val
            if len(vals) == 1:
                return vals[0].decode("ascii", "replace")
    return None


def _graph_for(d: Path, graph):
    if graph is None:
        if d.name.endswith(".kernels"):
            graph = d.with_name(d.name[:-len(".kernels")])
        else:
            raise ValueError("the directory is not named <graph file>.kernels")
    if isinstance(graph, (str, os.PathLike)):
        from .graph_file import read_graph_def
        return read_graph_def(str(graph))
    return graph


def install_files(paths, want_manifest_sha) -> int:
    if not paths:
        return 0
    try:
        data = Path(paths[0]).read_bytes()
    except OSError as e:
        return _skip(f"the model's kernel manifest cannot be read ({e})")
    if hashlib.sha256(data).hexdigest() != want_manifest_sha:   # the graph's record
        return _skip(f"the model's kernel manifest {paths[0]} does not match the hash "
                     f"recorded in its graph")
    try:
        manifest = json.loads(data)
        files, abi = dict(manifest["files"]), str(manifest["abi"])
    except (ValueError, KeyError, TypeError) as e:
        return _skip(f"the model's kernel manifest is malformed ({e})")
    from ..compile import kernel as K
    here = K.kernel_dir()
    if abi != here.name:
        return _skip(f"the model's kernels were built for another CPU or toolchain "
                     f"({manifest.get('host', '?')}); this machine's differs")
    by_name = {os.path.basename(p): p for p in paths[1:]}
    installed = [name for name, rec in sorted(files.items())
                 if _install_one(name, rec, by_name.get(name), here)]
    from ..compile import shipped
    shipped.add(manifest.get("kernels"), manifest.get("emitter"),
                {n[:-len(".so")] for n in installed})
    return len(installed)


def _install_one(name, rec, path, here: Path) -> int:
    from ..compile import native
    from ..compile import integrity
    if not _safe_name(name):
        return _skip(f"the model's kernel manifest names a file {name[:60]!r}")
    if path is None:
        return _skip(f"the model's kernel file {name} is missing")
    dest = here / name
    if dest.is_file() and integrity.check(dest) is None:
        return 1
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return _skip(f"the model's kernel file {name} is missing")
    except OSError as e:
        return _skip(f"the model's kernel file {name} cannot be read ({e})")
    if hashlib.sha256(data).hexdigest() != rec.get("sha256") or \
            len(data) != rec.get("size"):
        return _skip(f"the model's kernel file {path} does not match the hash recorded "
                     f"at rewrite time")
    try:
        here.mkdir(parents=True, exist_ok=True)
        integrity.seal(dest, data)
        native.atomic_write(dest, data)
    except OSError as e:
        return _skip(f"the kernel cache cannot be written ({e})")
    return 1


def _safe_name(name) -> bool:
    """A plain file name of the kind export() writes (no directories, no dot files)."""
    return isinstance(name, str) and name.endswith(".so") and "/" not in name \
        and "\\" not in name and not name.startswith(".") and len(name) < 100


def _skip(reason: str) -> int:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"stitching: {reason}; those kernels compile from their specs",
                      RuntimeWarning, stacklevel=3)
    return 0


# ---- the SavedModel resource ---------------------------------------------------------

def kernel_assets_resource(manifest_path, paths, manifest_sha):
    """A tracked resource whose initializer installs the shipped kernels at load."""
    import tensorflow as tf

    from .. import runtime

    class KernelAssets(tf.saved_model.experimental.TrackableResource):
        def __init__(self):
            super().__init__()
            self.files = [tf.saved_model.Asset(p) for p in [manifest_path, *paths]]
            for i, a in enumerate(self.files):   # a resource tracks nothing by itself
                self._track_trackable(a, name=f"file_{i}")

        def _create_resource(self):
            # a handle only: the state lives in the process's kernel cache
            return tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[],
                                          shared_name=f"stitching_kernels_{manifest_sha}")

        def _initialize(self):
            return runtime.load().stitched_kernel_assets(
                paths=tf.stack([a.asset_path for a in self.files]),
                manifest_sha256=manifest_sha)

    return KernelAssets()
