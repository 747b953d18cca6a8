"""Kernels registered from a shipped spec-hash index: no schedule, no code generation.

Design
------
Registering a kernel the usual way (kernel.py: ``compile_kernel``) rebuilds its
schedule and generated source just to find the name its machine code is cached under
(~9 ms per distinct spec, measured: specialize 3.3, emit 2.3, schedule 1.9, validate
1.7), and imports codegen and schedule (~50 ms) on the first one.  A model that ships
its kernels (tf/kernel_assets.py) knew all of that when it was rewritten, so its
manifest carries an index::

    "emitter": <hash of the sources that turn a spec into code and shape program>,
    "kernels": {<spec hash>: {"code": <code name>, "program": [int...],
                              "errors": [str...], "generic": bool}}

and a load registers each kernel from it: the node's spec is still parsed and
validated (untrusted input), its hash computed here and looked up; the entry gives
the code to dlopen (checked against its recorded SHA-256 like any cache entry), the
shape program, the error messages, and whether the code is the shape-generic twin's
(then the op checks the spec's static dims).  Ranks, dtypes and the launch hint come
from the validated spec itself.

Trust: entries are added only from a manifest whose own SHA-256 matched the one
recorded in the graph (``add``'s caller checks it), only for code files that were
installed after their hash was checked, only where the file itself vouches for the
entry (its identity lists this spec hash with this very entry: a rearranged index is
refused), and only when the emitter hash equals this process's (a different stitching
would generate other code or programs for the same spec: then the spec compiles).
Shipped files live apart from the compile cache, under their content hash
(``<kernel dir>/shipped/<sha256>.so``), and are loaded only through this index, the
content hash checked again at load: one model's files never answer for a spec
through the compile cache.  An entry never overrides the spec: a spec whose hash is
not indexed compiles as usual.
"""
from __future__ import annotations

import re
import threading
import warnings
from pathlib import Path

from .. import cachedir

_lock = threading.Lock()
_index: dict = {}            # spec hash -> entry (validated, see well_formed_entry) + its "sha256"
_CODE_NAME = re.compile(r"k_[0-9a-f]{24}\Z")
# the sources a spec's code, shape program and errors are generated from
_SOURCES = ("ir", "schedule", "codegen", "plan", "compile/kernel.py")
# ... less the CUDA backend's, which no CPU kernel is generated from (a GPU-only change
# made every shipped model's CPU kernels compile again from their specs)
_NOT_SOURCES = ("codegen/cuda/",)
MAX_PROGRAM = 1 << 16        # arbitrary sanity bounds on a shipped entry
MAX_ERRORS = 4096


def emitter_tag() -> str:
    """Hash of the package sources that generate kernels (read once per process)."""
    return cachedir.sources_digest(_SOURCES, _NOT_SOURCES)[:24]


def entry_of(kernel) -> dict:
    """The index entry of a compiled kernel (kernel.CompiledKernel), at rewrite time."""
    return {"code": kernel.code_name,
            "program": [int(v) for v in kernel.shape_program],
            "errors": [str(e) for e in kernel.errors],
            "generic": kernel.generic is not None}


def add(entries, emitter: str, installed: dict) -> tuple:
    """Index ``entries`` ({spec hash: entry}) whose code is among ``installed`` ({code
    name: (content sha256, the file's identity)}, checked and stored by the caller)
    and whose file vouches for them.  Returns (how many were taken, [spec hashes
    refused because their file does not vouch for them]); none taken if ``emitter``
    is not this process's ``emitter_tag()``."""
    if "interp" in installed:
        from . import kernel
        kernel.offer_interp(stem(installed["interp"][0]))
    if emitter != emitter_tag() or not isinstance(entries, dict):
        return 0, []
    taken, refused = {}, []
    for key, e in entries.items():
        e = well_formed_entry(key, e)
        if e is None or e["code"] not in installed:
            continue
        sha, ident = installed[e["code"]]
        vouched = (ident or {}).get("kernels")
        if not isinstance(vouched, dict) or vouched.get(key) != entries[key]:
            refused.append(key)
            continue
        taken[key] = dict(e, sha256=sha)
    with _lock:
        _index.update(taken)
    return len(taken), refused


def well_formed_entry(key, e):
    """A well-formed entry for spec hash ``key``, or None (a manifest is checked, and a
    stored result (tf/results.py) is ours, but both are still parsed with care)."""
    try:
        ok = (isinstance(key, str) and re.fullmatch(r"[0-9a-f]{24}", key)
              and isinstance(e, dict) and _CODE_NAME.match(e["code"])
              and isinstance(e["generic"], bool)
              and 0 < len(e["program"]) <= MAX_PROGRAM
              and all(type(v) is int and -(1 << 63) <= v < (1 << 63) for v in e["program"])
              and len(e["errors"]) <= MAX_ERRORS
              and all(isinstance(m, str) for m in e["errors"]))
    except (KeyError, TypeError):
        return None
    return dict(e) if ok else None


def lookup(spec):
    """A registrable kernel for the validated ``spec`` from the index, or None."""
    e = _index.get(spec.hash)
    if e is None:
        return None
    from . import kernel, native
    try:
        body = native.load(stem(e["sha256"]), kernel.BODY_SYMBOL, code=e["code"],
                           sha256=e["sha256"])
    except native.NativeError as err:    # removed or damaged since: compile it instead
        warnings.warn(f"stitching: a shipped kernel is not used ({err}); the kernel "
                      f"compiles from its spec", RuntimeWarning, stacklevel=2)
        return None
    return ShippedKernel(spec, e, body, kernel.interp_address())


def store() -> Path:
    """Where shipped kernel files are kept, under their content hash."""
    from . import kernel
    return kernel.kernel_dir() / "shipped"


def private_store() -> Path:
    """Where they go where ``store()`` cannot be written (a read-only cache: a serving
    container's image): a directory of this process's own, removed at exit.  Without
    it every shipped kernel compiled from its spec in every process (Numba imported,
    5.7-7.1 s against 2.7 s to load and serve)."""
    global _private
    with _lock:
        if _private is None:
            from .. import cachedir
            _private = cachedir.private_dir("shipped")
        return _private


_private: Path | None = None


def stem(sha256: str) -> Path:
    """The path (without ``.so``) of the shipped file with content hash ``sha256``:
    in the cache's store, else in this process's private one where it went there."""
    cached = store() / sha256
    if _private is not None and not cached.with_suffix(".so").exists():
        return _private / sha256
    return cached


class ShippedKernel:
    """What runtime.register needs (its duck type), from the spec and an index entry."""

    def __init__(self, spec, entry, body_address, shape_address):
        self.spec = spec
        self.code_name = entry["code"]
        self.body_address, self.shape_address = body_address, shape_address
        self.shape_program = list(entry["program"])
        self.errors = list(entry["errors"])
        self.in_ranks = [len(t.shape) for t in spec.inputs]
        self.out_ranks = [len(t.shape) for t in spec.output_types]
        self.in_dtypes = [t.dtype for t in spec.inputs]
        self.out_dtypes = [t.dtype for t in spec.output_types]
        from .kernel import launch_hint
        self.launch = launch_hint(spec)
        self.in_static_dims = [d for t in spec.inputs for d in t.shape] \
            if entry["generic"] else None

    def __repr__(self):
        return f"<ShippedKernel {self.spec.hash} {self.code_name}>"


def clear() -> None:
    """Forget the index (tests)."""
    with _lock:
        _index.clear()
