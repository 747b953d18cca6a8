"""Build (once) and locate the StitchedKernel op library.

Design
------
``op.cc`` is compiled with the system C++ compiler against the installed TensorFlow's
headers, so the library must match that TensorFlow exactly.  The output is cached under
``$STITCHING_CACHE_DIR/ops`` (default ``~/.cache/stitching/ops``) with a file name that
hashes everything the binary depends on: TF version, the source text, the compiler
command and flags, and the machine.  Changing any of them builds a new file next to
the old one instead of loading a stale binary.

Two processes may start at the same moment (pytest-xdist, several workers): an
exclusive ``flock`` on a per-key lock file serializes the build, the compiler writes
to a private temporary name, and ``os.replace`` publishes it atomically, so a reader
never sees a half-written ``.so``.

A library already built in the *default* cache (``~/.cache/stitching/ops``, where CI's
prebuild puts it) is reused when ``$STITCHING_CACHE_DIR`` points elsewhere (the test
suite gives every session a fresh kernel cache): the file name is a hash of every input
of the build, so a file with the right name is the right binary wherever it lies.

Prebuild (the install step, CI):  ``stitching-build [--force]`` or
``python -m stitching.runtime.build``.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import cachedir
from ..compile.native import compiler
from ..compile import integrity

SOURCE = Path(__file__).with_name("op.cc")
LIB_PREFIX = "stitching_ops"
# Warnings from TF's own headers that say nothing about our code.
QUIET = ["-Wno-deprecated-declarations", "-Wno-interference-size"]
STDERR_TAIL = 4000


class BuildError(RuntimeError):
    """The op library could not be built (message carries the compiler's stderr tail)."""


def cache_dir() -> Path:
    """Where this process builds the op library."""
    return cachedir.root() / "ops"


def _prebuilt(path: Path) -> Path | None:
    """The same library (same hashed name) in the default cache, if it is there."""
    other = cachedir.default_root() / "ops" / path.name
    return other if other != path and other.is_file() else None


def _tf_flags() -> tuple[list, list, str]:
    import tensorflow as tf  # local: importing this module must stay cheap
    return (list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags()),
            tf.__version__)


def _files(source) -> tuple:
    """A library's source files: ``source`` is one path or a sequence of them."""
    return (source,) if isinstance(source, Path) else tuple(source)


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"/]+)"', re.M)


def _headers(sources: tuple) -> list:
    """The headers beside the sources that they include by quoted name (blas_util.h):
    part of what a library is built from, so part of its hash."""
    found = []
    for src in sources:
        for name in _LOCAL_INCLUDE.findall(src.read_bytes()):
            h = src.with_name(name.decode())
            if h.is_file() and h not in found:
                found.append(h)
    return found


def command(source, output: Path, extra: tuple = ()) -> list:
    """The full compiler command line for building ``source`` (one file or several,
    compiled into one library) into ``output``; ``extra``: flags of a library it links
    (runtime/blas.py: OpenBLAS's)."""
    cflags, lflags, _ = _tf_flags()
    return ([*shlex.split(compiler()), "-shared", "-fPIC", "-O2", *QUIET,
             *map(str, _files(source)), "-o", str(output)] + cflags + lflags + list(extra))


def library_path(source=SOURCE, prefix: str = LIB_PREFIX, extra: tuple = ()) -> Path:
    """Where the library for the current TF/source/flags lives (built or not)."""
    cflags, lflags, tf_version = _tf_flags()
    h = hashlib.sha256()
    for part in (tf_version, platform.machine(), compiler(), " ".join(QUIET),
                 " ".join(cflags), " ".join(lflags)) + tuple(extra):
        h.update(part.encode() + b"\0")
    sources = _files(source)
    for f in list(sources) + _headers(sources):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return cache_dir() / f"{prefix}-tf{tf_version}-{h.hexdigest()[:16]}.so"


def build(force: bool = False, source=SOURCE, prefix: str = LIB_PREFIX,
          extra: tuple = ()) -> Path:
    """Return the path of the op library (by default the StitchedKernel one; another
    ``source`` with its ``prefix`` and link flags ``extra``), compiling it first if it
    is not cached."""
    path = library_path(source, prefix, extra)
    if not force:
        if _whole(path):
            return path
        prebuilt = _prebuilt(path)
        if prebuilt is not None and _whole(prebuilt):
            return prebuilt
    if not _writable(path.parent):
        return _build_private(path, source, extra)
    def waiting():
        # another process is building it (a minute of g++): say so, not sit silent
        print(f"stitching: waiting for another process building {path.name} into "
              f"{path.parent}", file=sys.stderr, flush=True)
    with cachedir.locked(path.with_suffix(".lock"), waiting):
        if _whole(path) and not force:    # another process built it meanwhile
            return path
        # a minute of g++ on a small machine: say what it is (a serving process whose
        # image skipped the install step otherwise sits silent through it)
        print(f"stitching: building {path.name} with {compiler()} into {path.parent} "
              f"(once per TensorFlow and stitching version; `stitching-build` does this "
              f"at install)", file=sys.stderr, flush=True)
        _compile_to(path, source, extra)
    built_here.add(path)
    return path


def _writable(directory: Path) -> bool:
    """Whether a library can be built into ``directory`` (made if missing)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


_PRIVATE: dict = {}      # library path in the cache -> its build in a private directory


def _build_private(path: Path, source, extra: tuple) -> Path:
    """``path``'s library built into a directory of this process's own, where the
    cache cannot be written and does not hold it (an image whose read-only cache holds
    an older release's library): the op registers and models load, at the price of
    the compiler at each start, which the line printed says how to avoid."""
    built = _PRIVATE.get(path)
    if built is None:
        d = cachedir.private_dir("ops")
        print(f"stitching: the cache {path.parent} cannot be written and has no "
              f"{path.name} (this TensorFlow's and stitching's build): building it with "
              f"{compiler()} into {d}, for this process only; run `stitching-build` where "
              f"the cache can be written (when the image is built) so that processes "
              f"load it instead", file=sys.stderr, flush=True)
        built = d / path.name
        _compile_to(built, source, extra)
        _PRIVATE[path] = built
        built_here.add(built)
    return built


# The libraries this process compiled (main() says "built" for these: importing the
# package may have built the op library before main() looked).
built_here: set = set()


def _built_here(path: Path) -> bool:
    """Whether this process compiled ``path``.  Run as ``python -m``, this module is
    ``__main__`` and the package's import hook built through its other copy,
    ``stitching.runtime.build``: both copies' records count."""
    imported = sys.modules.get(__spec__.name if __spec__ else __name__)
    return path in built_here or path in getattr(imported, "built_here", ())


# The OpenBLAS ops (gemm.cc and attention.cc, sharing blas_util.h; loaded by blas.py): a second library, linked
# against the OpenBLAS of the scipy-openblas32 wheel (the NumPy/SciPy project's build,
# with prefixed symbols such as scipy_cblas_sgemm, so it never clashes with another
# BLAS in the process); the wheel's folder is its run path.
BLAS_SOURCES = (SOURCE.with_name("gemm.cc"), SOURCE.with_name("attention.cc"))
BLAS_PREFIX = "stitching_blas"
BLAS_WHEEL = "scipy-openblas32"


def blas_flags() -> tuple:
    """Compiler flags that find the wheel's header and library (ImportError without
    the wheel); its version is among them, so a new wheel builds a new library."""
    include_dir, lib_dir, library, version = _openblas_wheel()
    return (f"-I{include_dir}", f"-L{lib_dir}", f"-l{library}",
            f"-Wl,-rpath,{lib_dir}", f"-DSTITCHING_OPENBLAS={version}")


def _openblas_wheel() -> tuple:
    """(include dir, library dir, link name, version) of the scipy-openblas32 wheel, as
    its own functions give them, found without importing it where its ``.dist-info``
    sits beside it: its ``__init__`` reads its version through ``importlib.metadata``,
    4 ms of every ``import stitching`` (BENCHMARKS.md ``serving``, the load bar).
    ImportError without the wheel."""
    import importlib.util
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.origin:
        raise ImportError("No module named 'scipy_openblas32'")
    here = Path(spec.origin).resolve().parent
    stem = "scipy_openblas32-"
    try:
        libs = [n for n in os.listdir(here / "lib") if n.startswith("libscipy_openblas")]
        infos = [e.name[len(stem):-len(".dist-info")] for e in os.scandir(here.parent)
                 if e.name.startswith(stem) and e.name.endswith(".dist-info")]
    except OSError:
        libs, infos = [], []
    if sys.platform != "win32" and libs and len(infos) == 1:
        return (str(here / "include"), str(here / "lib"),
                os.path.splitext(libs[0])[0][3:], infos[0])
    import scipy_openblas32 as sob      # another layout: ask the wheel
    return sob.get_include_dir(), sob.get_lib_dir(), sob.get_library(), sob.__version__


def build_blas(force: bool = False) -> Path:
    """The OpenBLAS product ops' library, built first if not cached (ImportError
    without the wheel, BuildError if it does not build)."""
    return build(force, *_blas_args())


def blas_library_path() -> Path:
    """Where the OpenBLAS ops' library for this TF and wheel lives, built or not
    (ImportError without the wheel)."""
    return library_path(*_blas_args())


def _blas_args() -> tuple:
    return BLAS_SOURCES, BLAS_PREFIX, blas_flags()


def _whole(path: Path) -> bool:
    """``path`` exists and is not damaged (integrity.py: a truncated library would
    kill the process at dlopen with SIGBUS).  A library built before size and hash
    were recorded is checked for truncation only."""
    if not path.is_file():
        return False
    if integrity.sidecar(path).exists():
        return integrity.check(path) is None
    try:
        with open(path, "rb") as f:
            head = f.read(64)
        size = path.stat().st_size
    except OSError:
        return False
    return integrity.elf_problem(head, size) is None


def _compile_to(path: Path, source=SOURCE, extra: tuple = ()) -> None:
    cxx = shlex.split(compiler())[0]
    if shutil.which(cxx) is None:
        raise BuildError(f"stitching needs a C++ compiler to build its TensorFlow op "
                         f"library, and {cxx!r} was not found (install g++ or set CXX)")
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        cmd = command(source, Path(tmp), extra)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = proc.stderr[-STDERR_TAIL:]
            names = ", ".join(f.name for f in _files(source))
            raise BuildError(f"building the op library {names} failed "
                             f"(exit {proc.returncode}):\n  {shlex.join(cmd)}\n{tail}")
        integrity.seal(path, Path(tmp).read_bytes())   # size and hash, then the file
        os.replace(tmp, path)  # atomic publish
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly",
                    "tf-nightly-cpu")


def tf_distributions() -> dict:
    """The TensorFlow distributions installed in this environment: name -> version."""
    from importlib import metadata
    found = {}
    for name in TF_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def check_tf_install(warn=print) -> None:
    """Warn when two TF distributions share this environment: they install into the same
    ``tensorflow/`` folder, and whichever was installed last overwrote some of the other's
    files (a mix that can fail to import, or lose ``__version__`` when one is removed)."""
    found = tf_distributions()
    if len(found) > 1:
        listed = ", ".join(f"{k}=={v}" for k, v in sorted(found.items()))
        warn(f"warning: {len(found)} TensorFlow distributions are installed together "
             f"({listed}); they share one tensorflow/ folder. Keep one: pip uninstall all "
             f"of them, then install the one you use (stitching needs no particular one).")


def main(argv=None) -> int:
    """The install step (``stitching-build``, or ``python -m stitching.runtime.build``):
    build what every process would otherwise build on first use, and print each
    product and where it lies.  Exit status 1 with the compiler's error if the op
    library does not build."""
    p = argparse.ArgumentParser(
        prog="stitching-build",
        description="Build stitching's install-time products into its cache "
                    "($STITCHING_CACHE_DIR, default ~/.cache/stitching): the TensorFlow op "
                    "library (needs g++ or $CXX and the installed TensorFlow's headers), "
                    "the OpenBLAS product ops (with scipy-openblas32), "
                    "this CPU's profile for the cost model, the shape-program interpreter "
                    "and the math helpers generated kernels call.  Run it again after "
                    "upgrading TensorFlow, Numba or stitching; each product is rebuilt "
                    "only if missing.")
    p.add_argument("--force", action="store_true", help="rebuild the op library even if cached")
    p.add_argument("--print-path", action="store_true",
                   help="print where the op library would live and exit")
    args = p.parse_args(argv)
    if args.print_path:
        print(library_path())
        return 0
    check_tf_install(lambda m: print(m, file=sys.stderr))
    try:
        lib = build(force=args.force)
    except BuildError as e:
        print(f"stitching-build: error: {e}", file=sys.stderr)
        return 1
    _, _, tf_version = _tf_flags()
    print(f"stitching-build: cache {cachedir.root()}")
    if cachedir.root() != cachedir.default_root():
        # products already built into the default root are reused, not rebuilt (their
        # file names hash every input of their build: _prebuilt)
        print(f"  (products already in the default cache {cachedir.default_root()} are "
              f"used from there)")
    _line("TensorFlow op library (TF " + tf_version + ")", lib, _built_here(lib))
    # The OpenBLAS product ops (blas.py), where the scipy-openblas32 wheel is installed.
    try:
        blas_flags()
    except ImportError:
        print(f"  OpenBLAS product ops: skipped ({BLAS_WHEEL} is not installed; matrix "
              f"products stay TF's)")
    else:
        try:
            blas_lib = build_blas(args.force)
            _line("OpenBLAS product ops", blas_lib, _built_here(blas_lib))
        except BuildError as e:
            print(f"stitching-build: warning: {e}", file=sys.stderr)
    # The machine's profile for the cost model (~0.5 s of measurement), like the
    # library an install-time product reused by every kernel cache (plan/profiles.py).
    from ..plan import profiles
    def profile_file():
        return next((f for f in (profiles.cache_path(), profiles.default_cache_path())
                     if os.path.exists(f)), None)
    before = profile_file()
    profiles.measured_cpu()
    _line("CPU profile for the cost model",
          profile_file() or "(kept in memory: the cache is not writable)", before is None)
    # The shape-program interpreter every kernel links (codegen/lower/shape_interp.py) is
    # built once per toolchain into the kernel cache; do it here, at install time.
    from ..compile import kernel
    kernel.interp_address()
    _line("shape-program interpreter", kernel._INTERP.stem, not kernel._INTERP.cache_hit)
    # So are the compiled math helpers kernels call (compile/helper_cache.py).
    from ..compile import helper_cache
    kernel.use_helper_cache()
    n = helper_cache.prebuild()
    _line(f"math helpers ({n} signatures)", helper_cache.enabled_dir(), None)
    return 0


def _line(what: str, where, fresh: bool | None) -> None:
    state = "" if fresh is None else (" (built)" if fresh else " (already built)")
    print(f"  {what}{state}: {where}")


if __name__ == "__main__":
    sys.exit(main())
