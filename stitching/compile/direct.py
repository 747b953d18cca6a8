"""Kernels through the direct LLVM backend (codegen/cpu/llvm.py): no Numba front end.

    module text ─llvm.translate─► IR module (body + calls of the math helpers)
        ─parse, helpers' modules linked in─► one LLVM module
        ─optimize: LLVM's O3 module pipeline, once (loop vectorizer on)─► optimized
        ─native.export_module: object code without loop strength reduction, link─►
         <stem>.so

The helpers are Numba's own compiled code for them, loaded from the helper cache the
install step fills (helper_cache.py) and linked in as the Numba path links them, so
LLVM inlines and vectorizes the same math (tests/test_llvm_backend.py compares outputs
bit for bit).  A helper built from several others (fastmath.BIG_HELPERS, which the
Numba path inlines at Numba-IR level) is called with ``alwaysinline`` at the call
site: LLVM's inline budget would otherwise keep it a call and the loop scalar.

What LLVM does is cut to what these kernels need (issue 39; BENCHMARKS.md, "compile
phases"): Numba runs its per-function O3 pipeline on every new function, then a cheap
module pass (inlining, for its reference-count pruning) and then the full O3 module
pipeline; the kernels carry no reference counts and the module pipeline simplifies
every function again, so here that pipeline runs alone, once.  Code generation skips
loop strength reduction (native.py says why).  The machine code is not the Numba
path's byte for byte, but the same vector loops: element-wise math is never reordered
or contracted (no fast-math flags but the reductions' own), and the reductions'
accumulators are vectorized at the same width and interleave, so outputs stayed
bit-identical to the Numba path's on every kernel compared (tests/test_llvm_backend.py,
``tools/compile_phases.py speed``), at the same kernel-alone speed within noise.

Which backend builds kernels: ``STITCHING_CPU_BACKEND`` (``llvm``, the default, or
``numba``; docs/tuning.md).  A kernel whose text leaves the direct backend's language
is built by Numba instead, and its CompiledKernel says why (``backend_note``).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from . import native

# codegen/cpu/llvm.py (and llvmlite's IR layer) are imported when a kernel is built: a
# process that only loads cached kernels names them with tag() and stops there.
BACKENDS = ("llvm", "numba")
_SOURCES = ("codegen/cpu/llvm.py", "compile/direct.py")


def backend() -> str:
    """The CPU backend chosen by STITCHING_CPU_BACKEND (default llvm)."""
    name = os.environ.get("STITCHING_CPU_BACKEND", "").strip().lower() or "llvm"
    if name not in BACKENDS:
        raise ValueError(f"STITCHING_CPU_BACKEND must be one of {', '.join(BACKENDS)}, "
                         f"got {name!r}")
    return name


_TAG = None


def tag() -> str:
    """A hash of the direct backend's own sources: part of the cache name of every
    kernel it builds, so an edit to the translator never reuses its old objects."""
    global _TAG
    if _TAG is None:
        h = hashlib.sha256()
        for name in _SOURCES:
            h.update((Path(__file__).parent.parent / name).read_bytes())
        _TAG = h.hexdigest()[:12]
    return _TAG


class _NumbaCalls:
    """``h.<name>`` calls as the Numba path makes them: an intrinsic's own IR
    generator run on the translator's builder; a helper function (a Numba
    dispatcher) compiled or loaded once per process and argument types, called with
    Numba's calling convention, its library linked into the kernel's."""

    _resolved: dict = {}        # (name, argument types) -> ("intrinsic" | "function", ...)

    def __init__(self):
        from numba.core import callconv, registry
        self.typing = registry.cpu_target.typing_context
        base = registry.cpu_target.target_context
        # as the kernels' cfunc options ask (cpu/rt.py BODY_OPTIONS): no exceptions
        self.context = base.subtarget(error_model=callconv.create_error_model("numpy", base))
        self.libraries: list = []

    def _resolve(self, name, argtypes):
        key = (name, tuple(argtypes))
        hit = self._resolved.get(key)
        if hit is not None:
            return hit
        from numba.core.dispatcher import Dispatcher
        from numba.core.errors import TypingError
        from numba.core.extending import _Intrinsic

        from ..codegen.cpu import fastmath, llvm, rt
        obj = getattr(rt, name, None)
        if isinstance(obj, _Intrinsic):
            try:
                sig, codegen = obj._defn(self.typing, *argtypes)
            except TypingError as e:
                raise llvm.Unsupported(f"h.{name}{tuple(argtypes)}: {e}") from None
            hit = ("intrinsic", sig, codegen)
        elif isinstance(obj, Dispatcher):
            try:
                obj.compile(tuple(argtypes))
            except TypingError as e:
                raise llvm.Unsupported(f"h.{name}{tuple(argtypes)}: {e}") from None
            cres = obj.overloads[tuple(argtypes)]
            big = any(obj is d for d in fastmath.BIG_HELPERS)
            hit = ("function", cres.signature, (cres, big))
        else:
            raise llvm.Unsupported(f"h.{name} is not a helper this backend can call")
        self._resolved[key] = hit
        return hit

    def type_call(self, name, argtypes):
        return self._resolve(name, argtypes)[1].return_type

    def emit_call(self, name, builder, argtypes, args):
        kind, sig, impl = self._resolve(name, argtypes)
        ctx = self.context
        args = [ctx.cast(builder, a, t, s) for a, t, s in zip(args, argtypes, sig.args)]
        if kind == "intrinsic":
            return impl(ctx, builder, sig, args), sig.return_type
        cres, big = impl
        fn = ctx.declare_function(builder.module, cres.fndesc)
        if cres.library not in self.libraries:
            self.libraries.append(cres.library)
        status, out = ctx.call_conv.call_function(builder, fn, sig.return_type, sig.args,
                                                  args, attrs=("alwaysinline",) if big else None)
        # The helper's status is never an error (error_model='numpy', no raise); the
        # check stays, as Numba's lowering writes it, because the shape of the code
        # around the call steers LLVM's scalar passes before vectorization (without it,
        # sigmoid's two divisions were not merged into one: swiglu's loop 3
        # instructions longer).  Inlined, the status is a constant and the branch goes.
        from numba.core import cgutils
        with cgutils.if_unlikely(builder, status.is_error):
            builder.ret_void()
        return out, sig.return_type


def build(text: str, stem: Path, symbol: str, tier: int = 2) -> None:
    """Compile kernel module ``text`` through the direct backend into ``stem``.so
    exporting ``symbol``; raises llvm.Unsupported (nothing written) where it cannot.
    ``tier`` 2: the code every cache holds (optimize, no LSR); 1: the quick code a
    kernel runs while its tier 2 compiles (quick_optimize; compile/parallel.py: Tiers)."""
    from numba.core.compiler_lock import global_compiler_lock

    from ..codegen.cpu import llvm
    if tier not in (1, 2):
        raise ValueError(f"tier must be 1 or 2, got {tier!r}")
    codegen = native.aot_codegen()
    with global_compiler_lock:      # Numba's compiles (helpers, libraries) are not reentrant
        calls = _NumbaCalls()
        module = llvm.translate(text, calls, symbol, calls.context)
        module.triple = codegen._llvm_module.triple
        module.data_layout = codegen._data_layout
        mod = _parse(module, symbol)
        for lib in dict.fromkeys(calls.libraries):
            mod.link_in(lib._get_module_for_linking(), preserve=True)
        if tier == 2:
            optimize(mod, codegen)
        else:
            quick_optimize(mod, codegen, symbol)
    if tier == 2:
        native.export_module(mod, symbol, codegen.magic_tuple(), stem, symbol, lsr=False)
    else:
        _export_quick(mod, symbol, codegen.magic_tuple(), stem)


def _parse(module, symbol: str):
    """The translator's llvmlite IR module as an LLVM module, verified."""
    import llvmlite.binding as ll
    from numba.core import cgutils
    try:
        mod = ll.parse_assembly(cgutils.normalize_ir_text(str(module)))
        mod.verify()
    except RuntimeError as e:       # the IR did not verify: a translator bug
        raise native.NativeError(f"direct backend IR of {symbol} is invalid: {e}") from e
    return mod


def optimize(mod, codegen) -> None:
    """LLVM's default module pipeline at Numba's level (O3), loop vectorizer on, SLP
    off (Numba's defaults, NUMBA_OPT / NUMBA_LOOP_VECTORIZE / NUMBA_SLP_VECTORIZE
    honoured), run once over the kernel with its helpers linked in."""
    import llvmlite.binding as ll
    from numba.core import config
    pto = ll.create_pipeline_tuning_options(speed_level=min(int(config.OPT), 3))
    pto.loop_vectorization = bool(config.LOOP_VECTORIZE)
    pto.slp_vectorization = bool(config.SLP_VECTORIZE)
    pb = ll.create_pass_builder(codegen._tm, pto)
    pb.getModulePassManager().run(mod, pb)


# Tier 1 (compile/parallel.py, "Tiers"): code that runs soon, not fast.  LLVM's module
# pipeline and code generation are ~85% of a tier-2 compile and scale with the IR; what
# tier 1 keeps is what turns the translator's IR into straight-line scalar code at all:
# the big helpers inlined (alwaysinline), the local variables' stack slots into registers
# (SROA), the constant folding and dead branches of the status checks gone
# (instcombine, simplifycfg), the unused helpers dropped.  No loop passes, no
# vectorizer: measured over the transformer's and llama's 10 codes (load 3.2), LLVM's
# time per kernel 106 ms at tier 2, 10 ms with this pipeline and the object at
# codegen level 0, 18 ms at level 1 (kept: level 0's register allocator spills every
# value of the loops, level 1's does not).  Arbitrary beyond that measurement.
QUICK_CODEGEN_LEVEL = 1


def quick_optimize(mod, codegen, keep: str) -> None:
    """The tier-1 pipeline (note above) over the kernel with its helpers linked in;
    ``keep``: the kernel's entry, which is not inlined anywhere."""
    import llvmlite.binding as ll
    pb = ll.create_pass_builder(codegen._tm, ll.create_pipeline_tuning_options(0))
    for fn in mod.functions:        # every helper inlined: no general inliner here
        if not fn.is_declaration and fn.name != keep and \
                not any(b"noinline" in a for a in fn.attributes):
            fn.add_function_attribute("alwaysinline")
    pm = ll.create_new_module_pass_manager()
    pm.add_always_inliner_pass()
    pm.add_sroa_pass()
    pm.add_instruction_combine_pass()
    pm.add_simplify_cfg_pass()
    pm.add_global_dead_code_eliminate_pass()
    pm.run(mod, pb)


_TIER1_MARK = "; stitching: tier-1 code (direct.quick_optimize), never cached\n"


def _export_quick(mod, symbol: str, target: tuple, stem: Path) -> None:
    """native.export_module for tier-1 code: machine code at QUICK_CODEGEN_LEVEL."""
    try:
        native._prepare(mod, symbol, symbol)
        obj = _emit_quick(mod, target)
    except native.NativeError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with the step named
        raise native.NativeError(f"generating the tier-1 code of {symbol} failed: "
                                 f"{type(e).__name__}: {e}") from e
    native._link(obj, _TIER1_MARK + str(mod), stem, symbol)


def _emit_quick(mod, target: tuple) -> bytes:
    """Tier-1 machine code: QUICK_CODEGEN_LEVEL, no loop strength reduction (native.py)."""
    import llvmlite.binding as ll
    triple, cpu, features = target
    tm = ll.Target.from_triple(triple).create_target_machine(
        cpu=cpu, features=features, opt=QUICK_CODEGEN_LEVEL, reloc="pic",
        codemodel="default")
    with native._emit_lock:
        ll.set_option("", "-disable-lsr=true")
        try:
            return tm.emit_object(mod)
        finally:
            ll.set_option("", "-disable-lsr=false")
