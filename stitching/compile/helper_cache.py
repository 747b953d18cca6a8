"""The compiled code of the math helpers kernels call, kept on disk between processes.

Every generated kernel calls small Numba functions (fastmath.py's ``exp_f32``,
``tanh_f32``, ..., cpu/rt.py's ``maximum``; ``fastmath.HELPERS`` lists them).  Numba
compiles each once per process, the first time a kernel's typing reaches it: 0.05-0.2
s apiece (``exp_f32`` with its callees ~0.2 s), paid again by every compile worker.
Numba's own on-disk cache keeps a compiled function as object code plus the LLVM
bitcode other libraries link in, so a kernel that calls a helper loaded from it still
inlines it and vectorizes the same (tests/test_codegen_cpu.py checks the machine
code); loading one takes ~2 ms.

Where: ``<kernel dir>/helpers`` -- the kernel cache's directory for this toolchain,
whose tag hashes fastmath.py, intrinsics.py and cpu/rt.py (kernel._toolchain_tag),
so an edit to any helper, or to an intrinsic one of them uses, lands in a new
directory instead of loading stale code (Numba's own staleness check sees only the
helper's own file).  Like the shape interpreter, the helpers are an install-time
product: ``python -m stitching.runtime.build`` compiles them into the default cache
(``prebuild``), and a process whose ``STITCHING_CACHE_DIR`` holds none yet loads
those, read-only; a helper missing there is compiled, and saved to its own cache.

Numba's cache files hold pickles of its own compile results: they are trusted like
the kernel shared objects beside them (this process or the install step wrote them),
and nothing read from a graph ever goes into one.  Like those objects, each data file
is sealed to what it holds (``_SealedFile``): one helper's code under another's name
(files copied between caches by hand) is a miss, not a wrong kernel.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import stat
import threading
from pathlib import Path

from numba import types
from numba.core.caching import (CompileResultCacheImpl, FunctionCache,
                                IndexDataCacheFile, _CacheLocator)

from .. import cachedir
from ..codegen.cpu import rt as cpu_rt, fastmath  # cpu_rt: its helpers join fastmath.HELPERS on import

_lock = threading.Lock()
_dir: Path | None = None        # where the helpers' cache is, once enabled
_read_only = False
_tried = False                  # enable() ran (it decides once per process)


class _Locator(_CacheLocator):
    def __init__(self, py_func):
        self._lineno = py_func.__code__.co_firstlineno

    def get_cache_path(self):
        return str(_dir)

    def get_source_stamp(self):
        return _dir.parent.name         # the toolchain tag: the directory's name

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        self = cls(py_func)
        try:
            if not _read_only:
                self.ensure_cache_path()
        except OSError:
            return None                 # not writable: Numba then declines to cache
        return self


class _Impl(CompileResultCacheImpl):
    _locator_classes = [_Locator]


class _SealedFile(IndexDataCacheFile):
    """Numba's index and data files, each data file sealed to the helper it holds: a
    header with the sha256 of the index's name (the helper), the data file's name and
    the payload.  Numba trusts its files' names: ``exp_f32``'s data file copied over
    ``sigmoid_f32``'s loaded as the sigmoid, the kernels built on it gave wrong
    numbers and were cached as good ones.  A file that does not carry its own seal
    is a miss (compiled again and saved)."""

    def _seal(self, name: str, payload: bytes) -> bytes:
        h = hashlib.sha256(self._index_name.encode() + b"\0" + name.encode() + b"\0")
        h.update(payload)
        return _SEAL + h.hexdigest().encode() + b"\n"

    def _save_data(self, name, data):
        payload = self._dump(data)
        with self._open_for_write(self._data_path(name)) as f:
            f.write(self._seal(name, payload) + payload)

    def _load_data(self, name):
        with open(self._data_path(name), "rb") as f:
            data = f.read()
        head, _, payload = data.partition(b"\n")
        if head + b"\n" != self._seal(name, payload):
            raise _Unsealed(f"{self._data_path(name)} is not the helper's own compiled code")
        return pickle.loads(payload)   # noqa: S301 - sealed by this cache (module note)


class _Unsealed(Exception):
    pass


_SEAL = b"stitching-helper-v1 "


class _Cache(FunctionCache):
    _impl_class = _Impl

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = _SealedFile(self._cache_path, self._impl.filename_base,
                                       self._impl.locator.get_source_stamp())

    # A cache that cannot be read or written (removed, full, truncated by a crash)
    # costs a compile, never the kernel: a miss, and an unsaved helper.
    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception:  # noqa: BLE001 - any unreadable entry is a miss
            return None

    def save_overload(self, sig, data):
        if _read_only:                  # the installed cache is the install step's
            return
        try:
            super().save_overload(sig, data)
        except OSError:
            pass


def enable(path: Path, read_only: bool = False) -> bool:
    """Cache every helper's compiled code in ``path`` (decided once per process;
    later calls only report that decision).  Returns False where the directory
    cannot be used (then helpers are compiled in each process, as without this
    module)."""
    global _dir, _read_only, _tried
    with _lock:
        if _tried:
            return _dir is not None
        _tried = True
        _dir, _read_only = Path(path), read_only
        if not _only_files(_dir):
            _dir = None                 # Numba would open a FIFO there and wait forever
            return False
        try:
            caches = [_Cache(d.py_func) for d in fastmath.HELPERS]
        except RuntimeError:            # no usable locator: the directory is not writable
            _dir = None
            return False
        for d, c in zip(fastmath.HELPERS, caches):
            d._cache = c
        return True


def _only_files(d: Path) -> bool:
    """Whether every entry of the cache directory ``d`` is a regular file (Numba opens
    its cache files without such checks, compile/integrity.py's rule for every file
    stitching reads itself): entries that are not are removed where the directory is
    ours to write; a read-only one holding any is not used."""
    try:
        entries = list(os.scandir(d))
    except OSError:
        return True                     # absent (created on first save) or unreadable
    for e in entries:
        if not stat.S_ISREG(e.stat(follow_symlinks=False).st_mode):
            if _read_only:
                return False
            try:
                cachedir.clear_for_file(e.path)
            except OSError:
                return False
    return True


def enabled_dir() -> Path | None:
    return _dir


def decided() -> bool:
    """enable() has run in this process (whether or not the cache could be used)."""
    return _tried


def _all(d, ty) -> tuple:
    """The signature of helper ``d`` with every argument of type ``ty``."""
    return (ty,) * d.py_func.__code__.co_argcount


def prebuild() -> int:
    """Compile (or load) the helpers for the signatures kernels use most: each
    ``*_f32``/``*_f64`` helper with all arguments of that type, ``maximum``/``minimum``
    of two float32 or float64.  The big helpers (inlined at Numba-IR level, so never
    cached themselves) are typed the same way, which compiles and caches the helpers
    they call with the signatures kernels reach them with: without it each compile
    worker compiled erfc_f32's ``_erfc_pos(float32)`` anew (~0.2 s; every exact-GELU
    kernel).  Returns how many signatures were compiled or loaded."""
    todo = []
    for d in fastmath.HELPERS + fastmath.BIG_HELPERS:
        for suffix, ty in (("_f32", types.float32), ("_f64", types.float64)):
            if d.py_func.__name__.endswith(suffix):
                todo.append((d, _all(d, ty)))
    for d in (cpu_rt.maximum, cpu_rt.minimum):
        todo += [(d, _all(d, ty)) for ty in (types.float32, types.float64)]
    for d, sig in todo:
        d.compile(sig)
    return len(todo)


def preload() -> int:
    """Load the float32 helpers whose cache files exist (a compile worker's warm-up:
    ~15 ms in all where they were prebuilt), so no kernel pays for them.  Returns how
    many were loaded."""
    if _dir is None:
        return 0
    n = 0
    for d in fastmath.HELPERS:          # enable() gave each its _Cache
        if d.py_func.__name__.endswith("_f32"):
            if (_dir / f"{d._cache._impl.filename_base}.nbi").exists():
                d.compile(_all(d, types.float32))
                n += 1
    return n
