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
from it without scheduling or generating code, still validating every spec.  Each
shipped ``.so`` carries its own identity (compile/integrity.py): its code name and
the index entries of the specs it serves, so an entry is taken only if the file it
names vouches for it -- a manifest whose index swaps two code names, or a file
replaced by another kernel's, is refused even where every hash was updated to match.

* SavedModel: the files are ``tf.saved_model.Asset``s (copied to ``assets/``) held by a
  resource (``KernelAssets``).  ``tf.saved_model.load`` where stitching is imported
  rebuilds it as its registered class, which installs the files in Python; any other
  loader runs its initializer, the ``StitchedKernelAssets`` op on the assets' current
  paths (``_assets_class`` says why two ways).  The manifest's SHA-256 is recorded in
  ``saved_model.pb`` at rewrite time, as an attribute of that op and as the object's
  record; the manifest records each file's SHA-256.  So a file is used only if it is
  the one the rewrite wrote (the graph is the root of trust, as it is for the specs).
* GraphDef: the same files in a sidecar directory ``<output>.kernels/``, the
  manifest's SHA-256 in the graph (a Const node, ``MANIFEST_NODE``);
  ``install_dir`` (``stitching.install_kernels``) checks the sidecar against the
  graph and makes its files this process's kernels.

``install`` (what a loaded KernelAssets, or the StitchedKernelAssets op's callback,
calls on the loading machine) runs only for a manifest inside a SavedModel's
``assets/`` whose ``saved_model.pb`` records its hash; it copies each checked file
into the kernel cache's ``shipped/`` directory under its content hash, never under a
code name: the compile cache holds only what this machine compiled, and a shipped file
is used only through the index of a manifest verified in this process (shipped.py),
with its content hash checked again at load.  A kernel is then loaded with one dlopen,
without importing Numba.  A manifest built for another toolchain or CPU (``abi``
differs), a missing file, a file that is not a regular file, or whose hash, size or
identity disagrees, or an unwritable cache: a warning (once per reason) and the
kernels compile from their specs as without assets.  Trust: a model that ships kernels
ships native code, like any model with custom ops; load only models you trust
(docs/serving-trust.md).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import warnings
from pathlib import Path

from .. import cachedir

MANIFEST = "stitching_kernels.json"
MAX_MANIFEST = 64 << 20       # arbitrary sanity bound (a manifest is ~1 KB per kernel)
STITCHED_OP = "StitchedKernel"
_warned: set = set()


def stitched_nodes(graph_def):
    """A GraphDef's StitchedKernel nodes, library functions included."""
    for nodes in [graph_def.node] + [f.node_def for f in graph_def.library.function]:
        yield from (n for n in nodes if n.op == STITCHED_OP)


def specs_in(graph_def) -> list:
    """The distinct spec strings of a GraphDef's StitchedKernel nodes, library
    functions included."""
    return list(dict.fromkeys(n.attr["spec"].s.decode("utf-8")
                              for n in stitched_nodes(graph_def)))


def export(specs, out_dir) -> tuple:
    """Write the shared objects serving ``specs`` and their manifest into ``out_dir``.
    Returns (manifest path, [shared object paths], manifest sha256); (None, [], None)
    where there is nothing to ship (no specs, or kernels without shared objects)."""
    from ..compile import kernel as K
    from ..ir import KernelSpec
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from ..compile import integrity, shipped
    files, by_spec, index, served = {}, {}, {}, {}
    for text in specs:
        k = K.compile_kernel(KernelSpec.from_json(text))
        so = _shared_object(k._code)
        if so is None:
            continue
        files[so.name] = so
        by_spec[k.spec.hash] = so.stem
        index[k.spec.hash] = shipped.entry_of(k)
        served.setdefault(so.stem, {})[k.spec.hash] = index[k.spec.hash]
    if not files:
        return None, [], None
    K.interp_address()
    interp = _shared_object(K._INTERP)
    if interp is not None:
        files["interp.so"] = interp
    from ..compile import native
    manifest = {"version": 3, "abi": K.kernel_dir().name, "host": native.host_tag(),
                "toolchain": K.toolchain_versions(),
                "files": {}, "specs": by_spec, "emitter": shipped.emitter_tag(),
                "kernels": index}
    paths = []
    for name, src in sorted(files.items()):
        data = src.read_bytes()
        code = name[:-len(".so")]
        # the file vouches for the index entries it serves (integrity.py identity)
        data = integrity.with_identity(data, {"code": code, "kernels": served.get(code, {})})
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
    """What a loaded KernelAssets calls, and the StitchedKernelAssets op's callback:
    ``payload`` is the manifest sha256 its graph records, then one path a line (the
    manifest first).  Never raises for a bad or foreign asset: it warns and leaves
    those kernels to compile from their specs."""
    want, *paths = payload.split("\n")
    try:
        if not paths:
            return
        reason = _not_a_saved_model(Path(paths[0]), want)
        if reason:
            _skip(f"kernel assets not installed: {reason}")
            return
        install_files(paths, want_manifest_sha=want, within=Path(paths[0]).parent)
    except Exception as e:  # noqa: BLE001 - e.g. no Numba metadata for the cache key:
        _skip(f"the model's kernels could not be installed ({type(e).__name__}: {e})")


def _asset_name(name: str) -> str:
    """A file's name as its rewrite wrote it: tf.saved_model.save copies assets of one
    name from two objects (two stitched functions of one module, each with its
    manifest and kernels) as ``name``, ``name_1``, ``name_2``...; the manifest's own
    hashes say which file is which."""
    stem, sep, n = name.rpartition("_")
    return stem if sep and n.isdigit() and stem.endswith((".json", ".so")) \
        else name


def _not_a_saved_model(manifest: Path, want: str) -> str | None:
    """None if ``manifest`` is the kernel manifest of a SavedModel on disk whose
    graph records ``want`` (the StitchedKernelAssets op of that model, as its
    initializer runs it), else why not.  The op is a registered op any graph can
    hold: from a plain GraphDef, pointing at files of its own, it installs nothing."""
    if _asset_name(manifest.name) != MANIFEST or manifest.parent.name != "assets":
        return f"{str(manifest)[:200]} is not a SavedModel's assets/{MANIFEST}"
    if len(want) != 64 or any(c not in "0123456789abcdef" for c in want):
        return "the recorded manifest hash is malformed"
    for name in ("saved_model.pb", "saved_model.pbtxt"):
        if _file_holds(manifest.parent.parent / name, want.encode()):
            return None
    return (f"{manifest.parent.parent} is not a SavedModel whose graph records this "
            f"manifest's hash")


def _file_holds(path: Path, needle: bytes) -> bool:
    """Whether the regular file ``path`` contains ``needle`` (mapped, not read: a
    saved_model.pb may hold hundreds of MB of constants)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return False
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
            return m.find(needle) >= 0
    except (OSError, ValueError):
        return False
    finally:
        os.close(fd)


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
    op, so a sidecar that is not the one the graph was written with (a swapped or
    edited directory) is not used."""
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
    return install_files(files, want_manifest_sha=want, within=d)


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


def install_files(paths, want_manifest_sha, within) -> int:
    """Install the files of a manifest (``paths[0]``, its SHA-256 ``want_manifest_sha``
    as the graph records it) from the directory ``within``."""
    if not paths:
        return 0
    try:
        data = cachedir.read_file(paths[0], MAX_MANIFEST, within=within)
    except OSError as e:
        return _skip(f"the model's kernel manifest cannot be read ({e})")
    if hashlib.sha256(data).hexdigest() != want_manifest_sha:   # the graph's record
        return _skip(f"the model's kernel manifest {paths[0]} does not match the hash "
                     f"recorded in its graph")
    try:
        manifest = json.loads(data)
        files, abi = dict(manifest["files"]), str(manifest["abi"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        return _skip(f"the model's kernel manifest is malformed ({e})")
    from ..compile import kernel as K
    here = K.kernel_dir()
    if abi != here.name:
        return _skip(f"the model's kernels were built for another CPU or toolchain "
                     f"({_built_elsewhere(manifest)})")
    by_name = {}
    for p in paths[1:]:                  # a name TF wrote as is wins over a renamed copy
        name = os.path.basename(p)
        written = _asset_name(name)
        if name == written or written not in by_name:
            by_name[written] = p
    installed = {}             # code name -> (content sha256, the file's identity)
    for name, rec in sorted(files.items()):
        got = _install_one(name, rec, by_name.get(name), here / "shipped", within)
        if got:
            installed[name[:-len(".so")]] = got
    from ..compile import shipped
    entries, emitter = manifest.get("kernels"), manifest.get("emitter")
    taken, refused = shipped.add(entries, emitter, installed)
    if isinstance(entries, dict) and entries and emitter != shipped.emitter_tag():
        _skip(f"the model's kernels were generated by another version of stitching "
              f"(code generator {str(emitter)[:12]}, this one's "
              f"{shipped.emitter_tag()[:12]}): rewrite the model with this version to "
              f"ship kernels it loads")
    elif isinstance(entries, dict):       # (an entry whose file was refused: warned)
        malformed = sum(shipped.well_formed_entry(k, e) is None for k, e in entries.items())
        if malformed:
            _skip(f"{malformed} of the model's kernel index entries are malformed")
    for key in refused[:3]:
        _skip(f"the model's kernel index entry for spec {key} is not vouched for by the "
              f"kernel file it names (an edited or rearranged model)")
    return len(installed)


def _install_one(name, rec, path, store: Path, within):
    """(content sha256, identity) of the checked asset ``name``, now in ``store``
    under its content hash; None (warned) if it is not the file recorded."""
    from ..compile import integrity
    if not _safe_name(name) or not isinstance(rec, dict):
        return _skip(f"the model's kernel manifest names a file {str(name)[:60]!r}") or None
    if path is None:
        return _skip(f"the model's kernel file {name} is missing") or None
    sha, size = rec.get("sha256"), rec.get("size")
    if not isinstance(sha, str) or len(sha) != 64 or type(size) is not int or size < 0:
        return _skip(f"the model's kernel manifest records {name} malformed") or None
    try:
        data = cachedir.read_file(path, integrity.MAX_OBJECT, size=size, within=within)
    except FileNotFoundError:
        return _skip(f"the model's kernel file {name} is missing") or None
    except OSError as e:
        return _skip(f"the model's kernel file {name} cannot be read, or is not the "
                     f"file recorded at rewrite time ({e})") or None
    if hashlib.sha256(data).hexdigest() != sha:
        return _skip(f"the model's kernel file {path} does not match the hash recorded "
                     f"at rewrite time") or None
    code = name[:-len(".so")]
    reason = integrity.elf_problem(data) or integrity.identity_problem(data, code)
    if reason:
        return _skip(f"the model's kernel file {name} is refused: {reason}") or None
    from ..compile import shipped
    if integrity.check(store / f"{sha}.so", code=code, sha256=sha) is not None:
        try:
            _store_file(store, sha, data)
        except OSError as e:       # a read-only cache: this process's own directory
            _warn_private(store, e)
            try:
                _store_file(shipped.private_store(), sha, data)
            except OSError as e2:
                return _skip(f"the kernel cache cannot be written ({e}), nor a "
                             f"temporary directory ({e2})") or None
    return sha, integrity.split_identity(data)[1]


def _store_file(store: Path, sha: str, data: bytes) -> None:
    from ..compile import integrity
    store.mkdir(parents=True, exist_ok=True)
    integrity.seal(store / f"{sha}.so", data)
    cachedir.write_atomic(store / f"{sha}.so", data)


def _warn_private(store, e) -> None:
    _warn_once(f"the model's kernels cannot be stored in the kernel cache {store} "
               f"({e.strerror or e}); this process loads them from a temporary "
               f"directory of its own")


def _safe_name(name) -> bool:
    """A plain file name of the kind export() writes (no directories, no dot files)."""
    return isinstance(name, str) and name.endswith(".so") and "/" not in name \
        and "\\" not in name and not name.startswith(".") and len(name) < 100


def _built_elsewhere(manifest) -> str:
    """What differs between where a model's kernels were built (its manifest's CPU
    and toolchain) and this process: the CPU's name, the features told apart, the
    Numba settings, the versions; not the whole feature list (~1.5 KB)."""
    from ..compile import kernel as K
    from ..compile import native
    theirs, ours = str(manifest.get("host", "")).split("|"), native.host_tag().split("|")
    said = []
    if theirs[:2] != ours[:2]:
        said.append(f"CPU {theirs[1] if len(theirs) > 1 else '?'}, this one {ours[1]}")
    elif theirs[2:3] != ours[2:3]:
        def signs(t):
            return {f[1:]: f[0] for f in t[2].split(",") if f[:1] in "+-"} \
                if len(t) > 2 else {}
        a, b = signs(theirs), signs(ours)
        apart = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
        said.append("CPU features " + ", ".join(
            f"{a.get(f, '?')}{f} there, {b.get(f, '?')}{f} here" for f in apart[:4])
            + (f" and {len(apart) - 4} more" if len(apart) > 4 else ""))
    if theirs[3:] != ours[3:]:
        said.append("NUMBA_ENABLE_AVX/NUMBA_OPT " + repr("|".join(theirs[3:]))
                    + " there, " + repr("|".join(ours[3:])) + " here")
    tc, mine = manifest.get("toolchain"), K.toolchain_versions()
    if isinstance(tc, dict):
        said += [f"{k} {str(tc.get(k))[:32]} there, {v} here" for k, v in mine.items()
                 if str(tc.get(k)) != v]
    elif not said:
        said.append("the model does not record its Numba and llvmlite versions")
    return "; ".join(said) or "stitching's native runtime sources differ"


def _skip(reason: str) -> int:
    _warn_once(f"{reason}; those kernels compile here from their specs (or come from "
               f"this machine's compile cache, where it holds them)")
    return 0


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        warnings.warn(f"stitching: {text}", RuntimeWarning, stacklevel=4)


# ---- the SavedModel resource ---------------------------------------------------------

# The name a saved KernelAssets records (SavedObject.registered_name) and the class TF's
# loader then builds it with, where stitching is imported (register_loader).
_PACKAGE, _NAME = "stitching", "KernelAssets"
_CLASS = None


def kernel_assets_resource(manifest_path, paths, manifest_sha):
    """A tracked resource whose initializer installs the shipped kernels at load."""
    import tensorflow as tf
    files = [tf.saved_model.Asset(p) for p in [manifest_path, *paths]]
    return _assets_class()(files, manifest_sha)


def register_loader() -> None:
    """Let ``tf.saved_model.load`` rebuild a saved KernelAssets as this class (called
    once TF is imported: tf/__init__.py ensure_runtime)."""
    _assets_class()


def _assets_class():
    """The KernelAssets resource class, defined (and registered with TF's SavedModel
    loader) on first use, so importing this module needs no TensorFlow.

    Two ways a load installs the kernels:

    * stitching imported (``tf.saved_model.load`` in Python): TF's loader rebuilds the
      object as this class (its registered name) and calls ``_initialize`` eagerly,
      which installs the files in Python.  The restored initializer function is never
      traced nor run: that was ~20 ms of a Transformer's 0.37 s load and first call
      (BENCHMARKS.md ``serving``).
    * otherwise (a loader that runs the SavedModel's init op instead of rebuilding
      its Python objects: TF1's ``tf.compat.v1.saved_model.loader.load``, the C API in
      a process that loaded the op library): the init op runs the initializer
      function saved with the model, the ``StitchedKernelAssets`` op on the assets'
      paths, as before.

    Either way the manifest's SHA-256 comes from ``saved_model.pb`` (an attribute of
    the op, or this object's serialized record), and ``install`` checks it there."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    import tensorflow as tf
    from google.protobuf import wrappers_pb2

    from .. import runtime

    class KernelAssets(tf.saved_model.experimental.TrackableResource):
        def __init__(self, files=(), manifest_sha="", loaded=False):
            super().__init__()
            self._sha, self._loaded, self._files = manifest_sha, loaded, {}
            for i, a in enumerate(files):
                self._add_trackable_child(f"file_{i}", a)

        def _add_trackable_child(self, name, value):
            # the loader hands back the children: the assets (file_0 the manifest),
            # and the saved resource functions, which this class makes anew
            if name.startswith("file_") and name[5:].isdigit() \
                    and isinstance(value, tf.saved_model.Asset):
                self._track_trackable(value, name=name, overwrite=True)
                self._files[int(name[5:])] = value

        def _assets(self):
            return [self._files[i] for i in sorted(self._files)]

        def _create_resource(self):
            # a handle only: the state lives in the process's kernel cache
            return tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[],
                                          shared_name=f"stitching_kernels_{self._sha}")

        def _initialize(self):
            if self._loaded and tf.executing_eagerly():      # TF's loader, in Python
                if self._sha is not None:                    # None: a malformed record
                    paths = [a.asset_path.numpy().decode("utf-8", "replace")
                             for a in self._assets()]
                    install("\n".join([self._sha, *paths]))
                return None
            return runtime.load().stitched_kernel_assets(
                paths=tf.stack([a.asset_path for a in self._assets()]),
                manifest_sha256=self._sha or "")

        def _serialize_to_proto(self, object_proto=None, **kwargs):
            return wrappers_pb2.StringValue(value=self._sha or "")

        @classmethod
        def _deserialize_from_proto(cls, proto=None, **kwargs):
            record = wrappers_pb2.StringValue()
            if proto is None or not proto.Unpack(record):
                _skip("the model's kernel assets record is malformed")
                return cls(manifest_sha=None, loaded=True)      # installs nothing
            return cls(manifest_sha=record.value, loaded=True)

    try:
        from tensorflow.python.saved_model import registration
        registration.register_serializable(package=_PACKAGE, name=_NAME)(KernelAssets)
    except (ImportError, AttributeError, ValueError) as e:
        # an unregistered class saves as a plain resource: loads run its initializer
        # function (the second way above), slower but the same kernels
        _warn_once(f"TF's SavedModel registration is not available ({e}); a rewritten "
                   f"model's kernels install through their initializer function")
    _CLASS = KernelAssets
    return _CLASS
