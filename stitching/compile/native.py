"""Kernels as shared objects: compiled once by Numba, loaded without it.

    Python function ─Numba, ahead-of-time target (no JIT)─► optimized LLVM IR + the
        cfunc wrapper ─llvmlite, position independent─► object
        ─system compiler driver, -shared─► <stem>.so + <stem>.ll (the IR)
    <stem>.so ─dlopen (ctypes)─► address of ``symbol``

Why: loading a kernel from Numba's own disk cache needs Numba in the process -- its
import and the target set-up cost ~0.6 s before the first kernel, then ~70 ms per
kernel -- and the TF op only ever needs an address.  A shared object loads in about a
millisecond, so a process that finds its kernels in the cache (a warm start, or a cold
one whose kernels the compile workers built) imports no Numba at all.

``build`` runs Numba's own cfunc compiler (typing, lowering, the cfunc wrapper, the
same optimization pipeline) on a target context whose code generator is Numba's
ahead-of-time one (``AOTCPUCodegen``, the pycc back end), set up for this CPU: host
name and features, as the JIT would use.  That target does not JIT the code, so the
machine code is generated once, here, as a position-independent object -- not once by
Numba's JIT and again for the file (for a large column kernel that second pass alone
measured 0.36 s).  This leans on Numba internals (``ccallback.CFunc``, the AOT code
generator); should they change, ``build`` raises NativeError and kernel.py falls back
to an ordinary JIT cfunc with a warning.

Numba's cfunc wrapper is kept: on an error status (which the kernels, built with
``error_model='numpy'``, do not return) it reports through the Python C API under the
GIL, like Numba does.  Its two helpers from Numba's extension module are defined here,
in the object itself (``_GIL_IR``), so a kernel needs nothing from Numba at run time;
code that would need more of Numba's runtime (its exception machinery, NRT) is refused.
Everything else it references is libc or the Python C API, both in every Python
process; the .so is loaded RTLD_NOW, so a missing symbol is an error at load, never at
a call.

The cache key (kernel.py's toolchain tag) includes ``host_tag()``: the CPU the code
was generated for, so a cache shared between machines never runs code built for
another CPU.  Files are written atomically (temp file + rename), each ``.so`` with its
size and hash beside it and its code name inside it (its identity), both checked
before it is loaded (compile/integrity.py).
"""
from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

from .. import cachedir
from . import integrity

_lock = threading.Lock()
_loaded: dict = {}          # path -> CDLL: kernels are never unloaded

# numba_gil_ensure/release as Numba's helperlib defines them (PyGILState_STATE is an
# enum: i32); linked into every kernel and made internal.
_GIL_IR = """
declare i32 @PyGILState_Ensure()
declare void @PyGILState_Release(i32)
define void @numba_gil_ensure(ptr %state) {
  %s = call i32 @PyGILState_Ensure()
  store i32 %s, ptr %state
  ret void
}
define void @numba_gil_release(ptr %state) {
  %s = load i32, ptr %state
  call void @PyGILState_Release(i32 %s)
  ret void
}
"""

_NUMBA_RUNTIME = ("numba_", "NRT_")     # symbols of Numba's extension modules


class NativeError(RuntimeError):
    """A kernel could not be turned into a shared object (names the step and why)."""


def _host_cpu() -> tuple:
    """(CPU name, features) code is generated for, as Numba picks them: the host's,
    unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise."""
    import llvmlite.binding as llvm
    features = os.environ.get("NUMBA_CPU_FEATURES")
    if not features:
        try:
            features = llvm.get_host_cpu_features().flatten()
        except RuntimeError:
            features = ""
    return os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name(), features


def host_tag() -> str:
    """The CPU code is generated for, and the environment variables that change the
    code Numba generates for it."""
    import llvmlite.binding as llvm
    env = [os.environ.get(k, "") for k in ("NUMBA_ENABLE_AVX", "NUMBA_OPT")]
    return "|".join([llvm.get_process_triple(), *_host_cpu(), *env])


def _target_machine(triple: str, cpu: str, features: str):
    """The machine object code is generated with: position independent, for ``cpu``."""
    import llvmlite.binding as llvm
    return llvm.Target.from_triple(triple).create_target_machine(
        cpu=cpu, features=features, opt=3, reloc="pic", codemodel="default")


def compiler() -> str:
    """The system C++ compiler driver (``CXX``, default g++): it links kernels' objects
    into shared objects here, and builds the op library (runtime/build.py)."""
    return os.environ.get("CXX", "g++")


_LD: dict = {}       # compiler driver -> the linker it runs (None: link through it)


def link_command(out: Path, obj: Path) -> list:
    """The command linking kernel object ``obj`` into shared object ``out``.

    The linker the compiler driver would run, called directly where the driver names
    it (``-print-prog-name=ld``; gcc and clang both answer): the driver's own start-up
    (~3 ms of a 6 ms link on this project's machines) is then saved for every kernel.
    Otherwise, or when ``CXX`` carries flags of its own, the driver links, with
    -nostdlib: no start files or C++ runtime.  Either way libc and the Python C API
    resolve from the process at load time."""
    driver = shlex.split(compiler())
    key = tuple(driver)
    if key not in _LD:
        _LD[key] = _driver_ld(driver) if len(driver) == 1 else None
    if _LD[key]:
        return [_LD[key], "-shared", "--eh-frame-hdr", "-o", str(out), str(obj)]
    return [*driver, "-shared", "-nostdlib", "-o", str(out), str(obj)]


def _driver_ld(driver: list) -> str | None:
    import shutil
    try:
        r = subprocess.run([*driver, "-print-prog-name=ld"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = r.stdout.strip()
    return shutil.which(name) if r.returncode == 0 and name else None


def build(pyfunc, sig, options: dict, stem: Path, symbol: str, lean: bool = True) -> None:
    """Compile ``pyfunc`` as a C callback of signature ``sig`` (``@cfunc`` options)
    and write ``stem``.so exporting it as ``symbol``, and ``stem``.ll (its IR).
    ``lean``: through _lean_pipeline() (generated kernels), else Numba's default."""
    try:
        lib, wrapper = _compile(pyfunc, sig, options, None if lean else _default_pipeline())
        text, target = lib.get_llvm_str(), lib.codegen.magic_tuple()
    except Exception as e:  # noqa: BLE001 - a typing error, or Numba internals moved
        raise NativeError(f"compiling {symbol} ahead of time failed: "
                          f"{type(e).__name__}: {e}") from e
    export_ir(text, wrapper, target, stem, symbol)


def compile_only(pyfunc, sig, options: dict) -> None:
    """Compile without writing anything (a worker's warm-up)."""
    _compile(pyfunc, sig, options)


def _compile(pyfunc, sig, options, pipeline=None):
    """(the CodeLibrary, the cfunc wrapper's name): Numba's cfunc compiler on the AOT
    target, nothing JIT-compiled; ``pipeline``: a Numba compiler class, default
    _lean_pipeline()."""
    from numba.core import sigutils
    from numba.core.compiler_lock import global_compiler_lock
    args, ret = sigutils.normalize_signature(sig)
    cf = _aot_cfunc_class()(pyfunc, (args, ret), {}, dict(options),
                            pipeline_class=pipeline or _lean_pipeline())
    with global_compiler_lock, _memo_scalar_typing():
        cres = cf._compile_uncached()
        cres.library.finalize()             # the optimization pipeline; no codegen
    return cres.library, cres.fndesc.llvm_cfunc_wrapper_name


# Typing an operator on scalars is a pure function of the operand types, but Numba
# works it out afresh at every use, and again when lowering it (lower_binop types
# each operator once more): each of ``+``'s ~40 templates is tried in turn, NumPy's
# ufunc loop matching among them, ~0.3 ms a use on this machine, and a kernel has
# hundreds of uses of a handful of (operator, types) pairs.  While _compile runs,
# the answers for builtin operators on plain scalars are kept and reused.  The same
# signature comes back (and the implementation key Numba records beside it on the
# interned function type stays), so lowering picks the same implementation and the
# machine code is unchanged (tests/test_codegen_cpu.py compares it).
_SCALAR_OPS: dict = {}          # (function type, typing context, argument types) -> sig
_memo_on = False                # only inside _compile (under Numba's compiler lock)
_MEMO_INSTALLED = False


def _pure_scalar_call(func, args, kws) -> bool:
    """Whether typing ``func(*args)`` depends on nothing but the argument types: a
    builtin operator (not item access) or min/max/abs/bool/range, no keywords, all
    arguments numbers or booleans (a literal's value is part of its type)."""
    import operator

    from numba.core import types
    if kws or type(func) is not types.Function:
        return False
    key = func.typing_key
    pure = (getattr(key, "__module__", None) == "_operator" and key is not operator.getitem
            ) or key in (min, max, abs, bool, range)
    return pure and all(isinstance(a, (types.Number, types.Boolean, types.IntegerLiteral,
                                       types.BooleanLiteral)) for a in args)


class _memo_scalar_typing:
    """Context manager: typing of pure scalar calls memoized while it is entered
    (the compiler lock held)."""

    def __enter__(self):
        global _memo_on, _MEMO_INSTALLED
        if not _MEMO_INSTALLED:
            _install_memo()
            _MEMO_INSTALLED = True
        self.was, _memo_on = _memo_on, True

    def __exit__(self, *exc):
        global _memo_on
        _memo_on = self.was


def _install_memo() -> None:
    """Wrap Numba's ``Function.get_call_type`` (typing and lowering both call it) so
    that, while _memo_on, pure scalar calls are answered from _SCALAR_OPS; outside
    _compile it behaves as Numba's own."""
    from numba.core import types
    get_call_type = types.Function.get_call_type

    def memo_get_call_type(self, context, args, kws):
        if not _memo_on or not _pure_scalar_call(self, args, kws):
            return get_call_type(self, context, args, kws)
        key = (self, context, tuple(args))
        sig = _SCALAR_OPS.get(key)
        if sig is None:
            sig = get_call_type(self, context, args, kws)   # raises where none fits
            _SCALAR_OPS[key] = sig
        return sig
    types.Function.get_call_type = memo_get_call_type


def _default_pipeline():
    from numba.core.compiler import Compiler
    return Compiler


_LEAN = None


def _lean_pipeline():
    """Numba's nopython pipeline less the passes that only rewrite Python constructs
    generated code never contains.

    Kernel modules (cpu/emitter.py) and the shape interpreter are plain loops over scalars:
    no closures, ``with`` blocks, ``literal_unroll``, ``literally``, array
    expressions or dead constant branches, and every variable is assigned values of
    one type.  So from Numba's default pipeline this keeps bytecode analysis, IR
    processing, inlining of ``inline="always"`` helpers (fastmath's big_helper), type
    inference, legalization and lowering, and drops with-lifting, closure inlining,
    semantic-constant and generic rewrites, dead-branch pruning, literal handling, the
    typed array-expression rewrites and SSA reconstruction (with its phi stripping:
    without SSA a variable assigned twice gets its types unified, which here are
    one).  Most of the dropped time is the variable-lifetime analysis each of those
    passes reruns, and typing and lowering the extra SSA variables.  ResNet50's five
    kernels, compiled in one process: 3.3-4.3 s -> 2.75-2.8 s (keeping SSA: 3.0-4.4
    s), with the same machine code: tests/test_codegen_cpu.py compares the
    assembly of representative kernels with the default pipeline's; of the 383
    kernels the test suite generates, 382 compared identical when this was written
    and one differed in block order and register choice only (the same
    instructions), and compiling all 83 of one sample took 23.3 s with the default
    pipeline against 18.1 s.  Callees (fastmath helpers) still compile with the
    default.
    The shape interpreter (compiled once, at install) is not generated code: its
    loops compile to slightly different code without SSA, so it keeps the default."""
    global _LEAN
    if _LEAN is None:
        from numba.core import typed_passes as T
        from numba.core import untyped_passes as U
        from numba.core.compiler import CompilerBase
        from numba.core.compiler_machinery import PassManager

        class LeanPipeline(CompilerBase):
            def define_pipelines(self):
                pm = PassManager("stitching")
                pm.add_pass(U.TranslateByteCode, "analyzing bytecode")
                pm.add_pass(U.FixupArgs, "fix up args")
                pm.add_pass(U.IRProcessing, "processing IR")
                pm.add_pass(U.InlineInlinables, "inline inlinable functions")
                pm.add_pass(T.NopythonTypeInference, "nopython frontend")
                pm.add_pass(T.IRLegalization, "ensure IR is legal prior to lowering")
                pm.add_pass(T.AnnotateTypes, "annotate types")
                pm.add_pass(T.NativeLowering, "native lowering")
                pm.add_pass(T.NoPythonBackend, "nopython mode backend")
                pm.finalize()
                return [pm]
        _LEAN = LeanPipeline
    return _LEAN


_AOT_CFUNC = None


def aot_codegen():
    """Numba's ahead-of-time code generator for this CPU (the one _compile uses): the
    direct backend (direct.py) builds its code libraries with it."""
    return _aot_cfunc_class()._targetdescr.target_context.codegen()


def _aot_cfunc_class():
    """Numba's CFunc on Numba's CPU target with the AOT code generator for this CPU."""
    global _AOT_CFUNC
    if _AOT_CFUNC is None:
        from numba.core import codegen, registry
        from numba.core.ccallback import CFunc

        class HostAOTCodegen(codegen.AOTCPUCodegen):
            # the JIT's choice of CPU features (AOT's default is the CPU model's)
            def _customize_tm_features(self):
                return self._get_host_cpu_features()

        base = registry.cpu_target

        class Target:
            options = base.options
            typing_context = base.typing_context
            target_context = base.target_context.subtarget(
                _internal_codegen=HostAOTCodegen("stitching", cpu_name="host"),
                aot_mode=True)

        class AOTCFunc(CFunc):
            _targetdescr = Target()
        _AOT_CFUNC = AOTCFunc
    return _AOT_CFUNC


def export_ir(text: str, wrapper: str, target: tuple, stem: Path, symbol: str) -> None:
    """Object code for the optimized module ``text`` (for ``target``: triple, CPU name,
    features), its C entry ``wrapper`` exported as ``symbol``, linked into ``stem``.so."""
    import llvmlite.binding as llvm
    try:
        mod = llvm.parse_assembly(text)
    except RuntimeError as e:
        raise NativeError(f"generating the object code of {symbol} failed: "
                          f"{type(e).__name__}: {e}") from e
    export_module(mod, wrapper, target, stem, symbol)


def export_module(mod, wrapper: str, target: tuple, stem: Path, symbol: str,
                  lsr: bool = True) -> None:
    """export_ir for an optimized llvmlite module ``mod`` (changed in place);
    ``lsr``: whether code generation runs LLVM's loop strength reduction
    (emit_object)."""
    try:
        _prepare(mod, wrapper, symbol)
        obj = emit_object(mod, target, lsr)
    except NativeError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the step named
        raise NativeError(f"generating the object code of {symbol} failed: "
                          f"{type(e).__name__}: {e}") from e
    _link(obj, _ir_file_text(mod, lsr), stem, symbol)


def _prepare(mod, wrapper: str, symbol: str) -> None:
    """``wrapper`` renamed ``symbol``, the GIL helpers linked in; refuses code that
    needs Numba's runtime."""
    import llvmlite.binding as llvm
    mod.get_function(wrapper).name = symbol
    mod.link_in(llvm.parse_assembly(_GIL_IR))
    for name in ("numba_gil_ensure", "numba_gil_release"):
        mod.get_function(name).linkage = "internal"
    mod.verify()
    runtime = sorted(f.name for f in mod.functions if f.is_declaration
                     and f.name.startswith(_NUMBA_RUNTIME))
    if runtime:
        raise NativeError(f"{symbol} calls Numba's runtime ({', '.join(runtime)}), "
                          f"which only a process with Numba loaded has")


# Loop strength reduction is the costliest pass of code generation for the direct
# backend's kernels (LLVM 22's -time-passes: 44% of the largest transformer kernel's
# emission; the transformer's and llama's 10 codes emit in 0.29 s without it, 0.52 s
# with it), and x86's addressing modes (base + index * scale) leave it little to gain
# in loops that index several arrays by one induction variable: the pattern kernels'
# innermost vector loops keep one more integer instruction at most (three in the
# streamed-output copy), and ran within 1% kernel alone (BENCHMARKS.md, compile
# phases).  It is an LLVM command-line option, global to the
# process, so it is switched off around one emission, and this module's emissions
# take turns (_emit_lock; kernel.py builds one kernel at a time in a process anyway).
# Numba's own JIT (helpers, at most) could still emit inside that window: other code,
# never other results.
_LSR_MARK = "; stitching: code generated without loop strength reduction\n"
_emit_lock = threading.Lock()


def emit_object(mod, target: tuple, lsr: bool = True) -> bytes:
    """Machine code (an ELF object) for ``mod``, for ``target`` (triple, CPU, features)."""
    return _emit(mod, target, lsr, "object")


def _emit(mod, target: tuple, lsr: bool, kind: str):
    import llvmlite.binding as llvm
    tm = _target_machine(*target)
    emit = tm.emit_object if kind == "object" else tm.emit_assembly
    with _emit_lock:        # every emission: none with LSR runs inside another's window
        if lsr:
            return emit(mod)
        llvm.set_option("", "-disable-lsr=true")
        try:
            return emit(mod)
        finally:
            llvm.set_option("", "-disable-lsr=false")


def _ir_file_text(mod, lsr: bool) -> str:
    """The .ll kept beside a kernel: its IR, marked when generated without LSR, so that
    assembly() regenerates the same code."""
    return ("" if lsr else _LSR_MARK) + str(mod)


def _link(obj: bytes, ir_text: str, stem: Path, symbol: str) -> None:
    """``obj`` linked into ``stem``.so (sealed, written atomically), ``ir_text`` beside
    it as ``stem``.ll."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=stem.parent, prefix=".link-") as tmp:
        o, so = Path(tmp) / "k.o", Path(tmp) / "k.so"
        o.write_bytes(obj)
        cmd = link_command(so, o)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeError(f"linking {symbol} failed: {shlex.join(cmd)}: {e}") from e
        if r.returncode:
            how = (f"killed by {signal.Signals(-r.returncode).name}" if r.returncode < 0
                   and -r.returncode in signal.valid_signals() else f"exit {r.returncode}")
            raise NativeError(f"linking {symbol} failed ({how}): {shlex.join(cmd)}: "
                              f"{r.stderr.strip()[-1000:]}")
        cachedir.write_atomic(stem.with_suffix(".ll"), ir_text.encode())
        # the identity inside, then size and hash, then the object: a reader checks
        # each against the others
        data = integrity.with_identity(so.read_bytes(), {"code": stem.name})
        so.write_bytes(data)
        integrity.seal(stem.with_suffix(".so"), data)
        cachedir.clear_for_file(stem.with_suffix(".so"))
        os.replace(so, stem.with_suffix(".so"))


def built(stem: Path, code: str | None = None) -> bool:
    """``stem``.so is there, whole and the code its name says (compile/integrity.py);
    a damaged or foreign one counts as absent, with a warning, and is built again."""
    path = stem.with_suffix(".so")
    if not os.path.lexists(path):
        return False
    reason = integrity.check(path, code=code or stem.name)
    if reason is not None:
        _warn_once(f"stitching: ignoring a damaged kernel cache entry ({reason}); "
                   f"building it again")
    return reason is None


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        import warnings
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def load(stem: Path, symbol: str, code: str | None = None, sha256: str | None = None) -> int:
    """Address of ``symbol`` in ``stem``.so (loaded once per process), which must be
    kernel ``code`` (default: the stem's name) and, given ``sha256``, that content."""
    path = str(stem.with_suffix(".so"))
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            # never dlopen a damaged, foreign or not-a-file object
            reason = integrity.check(Path(path), code=code or stem.name, sha256=sha256)
            if reason is not None:
                raise NativeError(f"not loading kernel object {reason}")
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
            except OSError as e:
                raise NativeError(f"loading kernel object {path} failed: {e}") from e
            _loaded[path] = lib
    try:
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    except AttributeError:
        raise NativeError(f"kernel object {path} has no symbol {symbol}") from None


def llvm_ir(stem: Path) -> str | None:
    """The LLVM IR ``stem``.so was generated from, if it was kept."""
    try:
        return stem.with_suffix(".ll").read_text()
    except OSError:
        return None


def assembly(stem: Path) -> str | None:
    """Machine code of ``stem``.so as assembly, regenerated from its IR for this CPU."""
    text = llvm_ir(stem)
    if text is None:
        return None
    import llvmlite.binding as llvm
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    mod = llvm.parse_assembly(text)
    return _emit(mod, (mod.triple, *_host_cpu()), not text.startswith(_LSR_MARK), "assembly")
