"""Load the op library and drive its kernel registry from Python.

Design
------
``load()`` builds (if needed) and loads the op library twice over the *same* dlopen
image: ``tf.load_op_library`` registers the op and kernel with TensorFlow, and ctypes
opens the same path to reach the C exports (``stitching_register`` & co.).  dlopen
returns the already-loaded image for a path it knows, so both views share the one
function-static registry inside the ``.so``; ``load()`` proves it by reopening with
``RTLD_NOLOAD``, which fails unless the image is already resident.

A compiled kernel is duck-typed (see ``register``).  The registry keys it by the exact
spec string a graph node carries, and holds the Python kernel object for the life of
the process, because the registry stores raw addresses of Numba cfuncs that would
dangle if the cfunc objects were collected.

``set_compiler(fn)`` installs a ctypes callback that the op calls on a registry miss
(from whatever TF thread constructs the kernel).  ctypes takes the GIL for the call;
this cannot deadlock while the thread that started the TF execution is blocked in TF,
because TF's Python bindings release the GIL around op and function execution (tested
in tests/test_runtime.py, eagerly and inside ``tf.function``).  The callback must not
run TensorFlow ops itself: TF may be holding internal locks while it builds kernels.
Registering kernels before running a graph (what ``stitched_kernel`` does for kernel
objects) remains the main path; the callback serves graphs loaded from files.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import threading

from ..compile import kernel
from . import autotune
from . import build as _build

# TF DataType enum values (tensorflow/core/framework/types.proto).
TF_DTYPE_ENUM = {"float32": 1, "float64": 2, "int32": 3, "int64": 9, "bool": 10,
                 "bfloat16": 14, "float16": 19}

# absl::StatusCode values the compiler callback may return.
_INVALID_ARGUMENT = 3
_INTERNAL = 13
_UNIMPLEMENTED = 12

_REGISTER_ERRORS = {-1: "null spec or function address", -2: "bad number of tensors",
                    -3: "bad rank", -4: "unsupported dtype", -5: "bad error list",
                    -6: "bad static dim", -7: "bad launch hint", -8: "bad shape program"}

_CompilerCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)

_load_lock = threading.Lock()
_reg_lock = threading.RLock()
_module = None          # the tf.load_op_library module
_lib = None             # ctypes view of the same image
_kernels: dict = {}     # exact spec string -> kernel object (kept alive forever)
_spec_by_id: dict = {}  # id(registered kernel) -> its spec string (ids stay unique:
                        # registered kernels are never freed)
_callbacks: list = []   # every compiler callback ever installed (kept alive forever)


class RegistrationError(ValueError):
    """A compiled kernel object that does not follow the runtime ABI."""


def no_autograph(fn):
    """Have ``tf.function``'s AutoGraph call ``fn`` as plain Python.

    AutoGraph re-creates converted functions in a namespace of its own, where our
    ``global`` writes (the loaded library) would land in the wrong module.  The marker
    is the one ``tf.autograph.experimental.do_not_convert`` sets; setting it directly
    keeps this module importable without TensorFlow.
    """
    fn.autograph_info__ = frozenset()
    return fn


# ---- loading ---------------------------------------------------------------------

@no_autograph
def load():
    """The loaded op module (``tf.load_op_library``); builds the library on first use."""
    global _module, _lib
    if _module is not None:  # fast path: every stitched_kernel call comes through here
        return _module
    # Outside the lock: a first ``import tensorflow`` runs stitching's import hook
    # (_autoload.py), which calls load() itself; under the lock that was a deadlock
    # (``import stitching; stitching.runtime.stats()`` hung).
    import tensorflow as tf
    with _load_lock:
        if _module is None:
            path = str(_build.build())
            module = tf.load_op_library(path)
            _lib = _open_same_image(path)
            autotune.install(_lib)
            # tiered compiles (compile/parallel.py, Tiers): a kernel's tier-2 code
            # replaces its tier-1 code in every kernel registered with it
            kernel.on_upgrade(_lib.stitching_upgrade_body)
            _module = module
            atexit.register(_uninstall_compiler)
    return _module


@no_autograph
def library():
    """ctypes handle on the op library's C exports (loads it first)."""
    load()
    return _lib


ABI_VERSION = 10  # op.cc's kAbiVersion: the stitching_register signature (6: profiling
#                 exports, 7: autotune exports, 8: the assets installer's own callback,
#                 9: stitching_upgrade_body, _hold_body, _is_held, _body_of: tiered
#                 compiles, 10: stitching_tier1_body: no autotuning of tier-1 code)


def _open_same_image(path: str):
    """Open the image TF already loaded; fail loudly if it would be a second copy."""
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError as e:  # pragma: no cover - would mean dlopen made a second image
        raise RuntimeError(f"op library {path} is not the image TensorFlow loaded: {e}")
    lib = ctypes.CDLL(path)
    lib.stitching_register.restype = ctypes.c_int
    lib.stitching_register.argtypes = [
        ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
        ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    lib.stitching_set_compiler.restype = None
    lib.stitching_set_compiler.argtypes = [_CompilerCallback]
    lib.stitching_set_assets_installer.restype = None
    lib.stitching_set_assets_installer.argtypes = [_CompilerCallback]
    lib.stitching_set_compile_error.restype = None
    lib.stitching_set_compile_error.argtypes = [ctypes.c_char_p]
    lib.stitching_upgrade_body.restype = ctypes.c_int64
    lib.stitching_upgrade_body.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.stitching_hold_body.restype = None
    lib.stitching_hold_body.argtypes = [ctypes.c_void_p]
    lib.stitching_tier1_body.restype = None
    lib.stitching_tier1_body.argtypes = [ctypes.c_void_p]
    lib.stitching_is_held.restype = ctypes.c_int
    lib.stitching_is_held.argtypes = [ctypes.c_char_p]
    lib.stitching_body_of.restype = ctypes.c_void_p
    lib.stitching_body_of.argtypes = [ctypes.c_char_p]
    lib.stitching_num_registered.restype = ctypes.c_int64
    lib.stitching_num_registered.argtypes = []
    lib.stitching_is_registered.restype = ctypes.c_int
    lib.stitching_is_registered.argtypes = [ctypes.c_char_p]
    lib.stitching_abi_version.restype = ctypes.c_int
    lib.stitching_pool_stats.restype = None
    lib.stitching_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.stitching_fallback_count.restype = ctypes.c_int64
    lib.stitching_fallback_count.argtypes = []
    lib.stitching_last_fallback.restype = ctypes.c_char_p
    lib.stitching_last_fallback.argtypes = []
    lib.stitching_pool_trim.restype = None
    lib.stitching_pool_trim.argtypes = []
    lib.stitching_profile_enable.restype = None
    lib.stitching_profile_enable.argtypes = [ctypes.c_int]
    lib.stitching_profile_enabled.restype = ctypes.c_int
    lib.stitching_profile_enabled.argtypes = []
    lib.stitching_profile_read.restype = ctypes.c_int64
    lib.stitching_profile_read.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    lib.stitching_profile_reset.restype = None
    lib.stitching_profile_reset.argtypes = []
    lib.stitching_autotune_set_sink.restype = None
    lib.stitching_autotune_set_sink.argtypes = [autotune._Sink]
    lib.stitching_autotune_set.restype = ctypes.c_int
    lib.stitching_autotune_set.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_int64, ctypes.c_int64]
    lib.stitching_autotune_read.restype = ctypes.c_int64
    lib.stitching_autotune_read.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    lib.stitching_autotune_counts.restype = None
    lib.stitching_autotune_counts.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    if lib.stitching_abi_version() != ABI_VERSION:   # a library built from other sources
        raise RuntimeError(f"op library {path} implements kernel ABI "
                           f"{lib.stitching_abi_version()}, this stitching needs "
                           f"{ABI_VERSION}; rebuild it (python -m stitching.runtime.build)")
    return lib


# ---- registration ----------------------------------------------------------------

@no_autograph
def register(kernel, spec: str | None = None) -> bool:
    """Register a compiled kernel under ``spec`` (default ``kernel.spec.to_json()``).

    ``kernel`` needs: ``spec`` (with ``to_json()``), ``body_address``,
    ``shape_address``, ``in_ranks``, ``out_ranks``, ``in_dtypes``, ``out_dtypes``
    (dtype names) and ``errors`` (list of str).  Optional ``hold_until_upgrade``:
    its nodes run their original ops until its code is upgraded (tiered compiles).  Idempotent per spec string: returns
    True if this call registered it, False if the spec was already registered.
    """
    canonical = spec is None
    if canonical:
        spec = spec_of(kernel)
    if not isinstance(spec, str):
        raise RegistrationError("spec must be a str")
    lib = library()
    with _reg_lock:
        if spec in _kernels:
            return False
        args = _abi_arguments(kernel)
        if getattr(kernel, "tier", 2) == 1:
            lib.stitching_tier1_body(args[0])    # not autotuned until its upgrade
        if getattr(kernel, "hold_until_upgrade", False):
            lib.stitching_hold_body(args[0])     # tier-1 code slower than TF's ops
        rc = lib.stitching_register(spec.encode("utf-8"), *args)
        if rc < 0:
            raise RegistrationError(f"op library rejected the kernel: "
                                    f"{_REGISTER_ERRORS.get(rc, rc)}")
        _kernels[spec] = kernel
        if canonical:
            _spec_by_id[id(kernel)] = spec
        return rc == 0


def spec_of(kernel) -> str:
    """``kernel.spec.to_json()``, memoized for registered kernels (eager calls repeat)."""
    spec = _spec_by_id.get(id(kernel))
    if spec is not None and _kernels.get(spec) is kernel:
        return spec
    return kernel.spec.to_json()


def _abi_arguments(kernel) -> tuple:
    """Validate a duck-typed kernel and convert it to stitching_register's arguments."""
    in_ranks, out_ranks = _int_list(kernel.in_ranks, "in_ranks"), \
        _int_list(kernel.out_ranks, "out_ranks")
    in_dtypes = [_dtype_enum(d) for d in kernel.in_dtypes]
    out_dtypes = [_dtype_enum(d) for d in kernel.out_dtypes]
    if len(in_ranks) != len(in_dtypes) or len(out_ranks) != len(out_dtypes):
        raise RegistrationError("in/out ranks and dtypes have different lengths")
    if not out_ranks:
        raise RegistrationError("a kernel needs at least one output")
    body, shape = int(kernel.body_address), int(kernel.shape_address)
    if not body or not shape:
        raise RegistrationError("body_address and shape_address must be nonzero")
    errors = [str(m).encode("utf-8", "replace") for m in kernel.errors]
    # Optional: the spec's static input dims, for kernels whose own shape function
    # is generic over them (codegen/lower/specialize.py); the op checks them.
    static = getattr(kernel, "in_static_dims", None)
    if static is not None:
        static = [int(d) for d in static]
        if len(static) != sum(in_ranks) or any(d < -1 for d in static):
            raise RegistrationError("in_static_dims must hold one int >= -1 per input dim")
        static = (ctypes.c_int64 * max(1, len(static)))(*static)
    # Optional: the launch hint (rows per unit, column block; 0 = the shape function
    # chooses) the op passes to the shape function on every call.
    launch = getattr(kernel, "launch", None)
    if launch is not None:
        launch = [int(v) for v in launch]
        if len(launch) != 2 or any(v < 0 for v in launch):
            raise RegistrationError("launch must be two ints >= 0 (rows per unit, "
                                    "column block)")
        launch = (ctypes.c_int64 * 2)(*launch)
    # Optional: a shape program (codegen/lower/shape_program.py); shape_address is then the
    # interpreter that runs it.  The op keeps its own copy.
    program = getattr(kernel, "shape_program", None)
    n_program = 0
    if program is not None:
        program = [int(v) for v in program]
        if not program:
            raise RegistrationError("shape_program must not be empty")
        n_program = len(program)
        program = (ctypes.c_int64 * n_program)(*program)

    def ints(xs):
        return (ctypes.c_int * max(1, len(xs)))(*xs)
    return (body, shape, len(in_ranks), ints(in_ranks), ints(in_dtypes),
            len(out_ranks), ints(out_ranks), ints(out_dtypes),
            (ctypes.c_char_p * max(1, len(errors)))(*errors), len(errors), static, launch,
            program, n_program)


def _int_list(xs, what) -> list:
    xs = list(xs)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs):
        raise RegistrationError(f"{what} must be non-negative ints, got {xs!r}")
    return xs


def _dtype_enum(name) -> int:
    if name not in TF_DTYPE_ENUM:
        raise RegistrationError(f"unsupported dtype {name!r}; supported: "
                                f"{', '.join(TF_DTYPE_ENUM)}")
    return TF_DTYPE_ENUM[name]


@no_autograph
def registered_kernel(spec: str):
    """The kernel object registered from Python under ``spec``, or None."""
    return _kernels.get(spec)


@no_autograph
def body_of(spec: str) -> int | None:
    """The address of the code the kernel registered under ``spec`` runs now (a
    tier-1 kernel's changes at its upgrade), or None."""
    return library().stitching_body_of(spec.encode("utf-8"))


@no_autograph
def is_held(spec: str) -> bool:
    """Whether the kernel registered under ``spec`` holds: its nodes run their
    original ops until its tier-1 code is upgraded."""
    return library().stitching_is_held(spec.encode("utf-8")) == 1


@no_autograph
def is_registered(spec: str) -> bool:
    """Whether a kernel for this exact spec string is registered in this process."""
    return bool(library().stitching_is_registered(spec.encode("utf-8")))


@no_autograph
def num_registered() -> int:
    """How many kernels are registered in this process."""
    return int(library().stitching_num_registered())


@no_autograph
def stats() -> dict:
    """{"fallbacks": StitchedKernel nodes that run their original subgraph because
    their kernel could not be built (tf/passes/original.py), "last_fallback": why, for the
    latest; autotune (Options(autotune=True), runtime/autotune.py):
    "autotune_measured": decisions made by measuring in this process,
    "autotune_cached": (node, shape class) decisions taken from the cache instead,
    "autotune_timed_calls": calls run while measuring, "autotune_native_calls": calls
    served by the native segment because it measured faster; and, once the OpenBLAS
    ops' library is loaded, StitchedAttention's, which the attention pass marks for
    timing against its unfused products (runtime/blas.py tune_counts):
    "attention_autotune_cached", "..._timed_calls", "..._unfused_calls",
    "..._untuned"}."""
    lib = library()
    out = {"fallbacks": int(lib.stitching_fallback_count()),
           "last_fallback": (lib.stitching_last_fallback() or b"").decode("utf-8",
                                                                          "replace"),
           **autotune.counts(lib)}
    for more in STATS:
        out.update(more())
    return out


# More counters for stats(): runtime/blas.py adds its attention counters when its
# library loads (it imports this module; this one does not import it).
STATS: list = []


@no_autograph
def autotune_decisions() -> dict:
    """{(spec hash, shape class): {"choice": "kernel" | "native" | None (still
    measuring), "kernel_us", "native_us" (medians), "source": "measured" | "cache"}}
    of this process's autotuned kernels."""
    return autotune.decisions(_read_text(library().stitching_autotune_read))


def autotune_pending() -> list:
    """The (spec hash, shape class) pairs of this process still being measured, sorted:
    each autotuned kernel or ``StitchedAttention`` times its ways on its first 12 calls
    of a shape class, once no kernel runs tier-1 code (docs/tuning.md).  Time a
    function after this is empty for its shapes, or its timings include those calls."""
    return sorted(k for k, v in autotune_decisions().items() if v["choice"] is None)


_POOL_FIELDS = ("hits", "misses", "held_bytes", "idle_bytes", "idle_cap_bytes",
                "min_bytes")


def pool_stats() -> dict:
    """Counters of the op's output pool (large outputs reuse cached buffers instead of
    fresh, page-faulting ones; see op.cc).  ``held_bytes`` is memory the pool holds,
    live and idle; the idle part is capped by ``STITCHING_OUTPUT_POOL_MB`` (read once
    per process; 0 disables the pool).  ``min_bytes``: smaller outputs come from TF's
    allocator (``STITCHING_OUTPUT_POOL_MIN_MB``, default 32)."""
    out = (ctypes.c_int64 * len(_POOL_FIELDS))()
    library().stitching_pool_stats(out)
    return dict(zip(_POOL_FIELDS, (int(v) for v in out)))


def pool_trim() -> None:
    """Return the output pool's idle buffers to the OS."""
    library().stitching_pool_trim()


def set_profiling(on: bool) -> None:
    """Count calls, time and bytes per StitchedKernel label from now on (or stop).
    ``STITCHING_PROFILE=1`` turns it on for the whole process; off, an op pays one
    relaxed atomic load per call."""
    library().stitching_profile_enable(1 if on else 0)


def profiling() -> bool:
    """Whether the op's per-kernel timing is on (``set_profiling``,
    ``STITCHING_PROFILE=1``)."""
    return bool(library().stitching_profile_enabled())


def _read_text(read) -> str:
    """A table the op writes as text (``read(buf, cap)`` returns the length it needs;
    op.cc CopyOut): sized first, read again if it grew in between (rows may appear
    between the two calls)."""
    for _ in range(4):
        need = int(read(None, 0))
        buf = ctypes.create_string_buffer(need + 256)
        if int(read(buf, need + 256)) < need + 256:
            break
    return buf.value.decode("utf-8", "replace")


def profile() -> dict:
    """label -> {"calls", "seconds", "bytes", "min_seconds"} counted since the start (or
    ``profile_reset``); ``bytes``: the kernel's inputs plus outputs, summed over calls;
    ``min_seconds``: the fastest call (0 before any), steadier than the mean on a machine
    other processes load."""
    out = {}
    for line in _read_text(library().stitching_profile_read).splitlines():
        label, calls, nanos, nbytes, fastest = line.rsplit("\t", 4)
        out[label] = {"calls": int(calls), "seconds": int(nanos) * 1e-9, "bytes": int(nbytes),
                      "min_seconds": int(fastest) * 1e-9}
    return out


def profile_reset() -> None:
    """Zero every profile counter (labels stay known)."""
    library().stitching_profile_reset()


# ---- compile on miss -------------------------------------------------------------

@no_autograph
def set_compiler(fn) -> None:
    """Install ``fn(spec_json: str) -> kernel`` as the compiler for registry misses.

    The op calls it (through ctypes, holding the GIL) when it meets a spec nobody
    registered, typically in a graph loaded from a file; the result is registered under
    the exact string given.  Exceptions become the TF error's message: ValueError ->
    InvalidArgument, NotImplementedError -> Unimplemented, anything else -> Internal.
    ``fn=None`` removes the compiler.
    """
    lib = library()
    if fn is None:
        lib.stitching_set_compiler(_CompilerCallback())
        return
    cb = _CompilerCallback(_make_trampoline(fn, lib))
    _callbacks.append(cb)  # a TF thread may still be inside an older one
    lib.stitching_set_compiler(cb)


@no_autograph
def set_assets_installer(fn) -> None:
    """Install ``fn(payload: str) -> None`` as what the StitchedKernelAssets op (the
    initializer of a SavedModel that ships kernels) calls with the manifest hash its
    graph records and the asset paths, one a line.  A callback of its own: no
    StitchedKernel spec reaches it.  ``fn=None`` removes it."""
    lib = library()
    if fn is None:
        lib.stitching_set_assets_installer(_CompilerCallback())
        return
    cb = _CompilerCallback(_make_trampoline(fn, lib))
    _callbacks.append(cb)
    lib.stitching_set_assets_installer(cb)


def _make_trampoline(fn, lib):
    def trampoline(spec_bytes) -> int:
        # Nothing may escape a ctypes callback: ctypes would print it and return 0,
        # which the op would read as success.
        try:
            spec = spec_bytes.decode("utf-8")
            kernel = fn(spec)
            if kernel is not None:     # None: nothing to register (the assets installer)
                register(kernel, spec=spec)
            return 0
        except BaseException as e:  # noqa: BLE001 - reported through TF instead
            try:
                msg = f"{type(e).__name__}: {e}"
                lib.stitching_set_compile_error(msg.encode("utf-8", "replace"))
            except BaseException:  # noqa: BLE001
                pass
            return _status_code(e)
    return trampoline


def _status_code(e: BaseException) -> int:
    if isinstance(e, NotImplementedError):
        return _UNIMPLEMENTED
    if isinstance(e, ValueError):
        return _INVALID_ARGUMENT
    return _INTERNAL


def _uninstall_compiler() -> None:
    """At exit, stop TF threads from calling into a finalizing interpreter."""
    if _lib is not None:
        _lib.stitching_set_compiler(_CompilerCallback())
        _lib.stitching_set_assets_installer(_CompilerCallback())
        autotune.uninstall(_lib)
