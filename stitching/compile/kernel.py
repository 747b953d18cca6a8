"""compile_kernel: spec -> schedule -> source -> native code, cached twice.

    spec ─validate─► build_schedule ─cpu.emit─► source text
         └ in-process cache by spec.hash (one CompiledKernel per distinct spec)
    $STITCHING_CACHE_DIR/kernels/<toolchain>/k_<spec hash>_<source hash>
        .so  present: dlopen it, take the body's address (no Numba in this process)
             absent:  write .py; compile it into .so + .ll by the direct LLVM backend
                      (direct.py: the text translated to LLVM IR, no Numba front end)
                      or, where that backend is not chosen or cannot translate it,
                      import it (it defines ``body``) and compile that as a C callback
                      through Numba (native.build); dlopen the .so
    .../<toolchain>/interp.so: the shape-program interpreter, built the same way

The file name carries the hash of the generated text and the directory a hash of
the toolchain (Numba/llvmlite versions, the helper modules the kernels inline and
the CPU the code is generated for), so a changed emitter, helper or machine never
picks up stale machine code.  Files are written atomically (temp file + rename), so
concurrent processes at worst compile the same kernel twice.  Where no shared object
can be built (no compiler driver), a kernel runs from Numba's in-memory code, with a
warning: it works, but every process compiles it again.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np

from .. import cachedir
from ..ir import dtypes as dt
from ..ir.spec import KernelSpec, validate
from . import native

# codegen and schedule (~50 ms to import) are imported on first use, below: a process
# that only loads shipped kernels (shipped.py) never generates code.
LAUNCH_PARAMS = ("rows_per_task", "col_block")   # specialize.LAUNCH_PARAMS (tested equal)


def cpu():
    from ..codegen.cpu import emitter
    return emitter


def build_schedule(spec):
    from ..schedule import build_schedule as build
    return build(spec)


def compile_target(spec):
    from ..codegen.lower.specialize import compile_target as target
    return target(spec)


def canonical(text):
    from ..codegen.lower.emitter import canonical as canon
    return canon(text)


_log = logging.getLogger(__name__)
_lock = threading.RLock()
_kernels: dict = {}          # spec hash -> CompiledKernel
# spec hash -> (schedule, source) that uncached_code emitted to find the code's name:
# compile_kernel, which follows it for the same specs, takes them up (a warm process
# emitted each kernel twice, ~5 ms each)
_emitted: dict = {}

_BODY_T = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64,
                           ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                           ctypes.POINTER(ctypes.c_int64))
_INTERP_T = ctypes.CFUNCTYPE(ctypes.c_int64, *[ctypes.POINTER(ctypes.c_int64)] * 5)
MAX_PARAMS = 32
# The largest generated code compiled at all (docs/serving-trust.md): measured, the
# planner's largest kernels (1024 nodes of cheap element-wise ops) are ~64 KB and
# compile in ~6 s; heavy ops cost far more per byte (256 chained Exps: 24 KB, 23 s).
# Larger code from a graph file is a compile refused; parallel.py bounds the time and
# memory of what compiles.
MAX_CODE_BYTES = 256 << 10
BODY_SYMBOL = "stitching_body"        # what native.py exports each body cfunc as
INTERP_SYMBOL = "stitching_interp"    # and the shape-program interpreter


def cache_root() -> Path:
    return cachedir.root()


def _toolchain_tag() -> str:
    """The tag, memoized on disk: computing it imports llvmlite's binding and reads
    package metadata (~50-90 ms and ~5,000 objects, measured in a process that loads a
    model with shipped kernels and does nothing else with Numba).  The memo is keyed by
    what those answers depend on, read without importing them: the Python version, the
    numba and llvmlite installs (file sizes and times), the CPU as /proc/cpuinfo names
    it, the NUMBA_* variables, and the sources the tag hashes.  It lives in the default
    cache beside the op library (an install-time product, as the interpreter is), so a
    process with an empty STITCHING_CACHE_DIR uses it too."""
    key = _memo_key()
    memo = cachedir.default_root() / "kernels" / "toolchain-memo" / key if key else None
    try:
        tag = cachedir.read_file(memo, 64).decode("ascii", "replace") if memo else ""
        if len(tag) == 16 and all(c in "0123456789abcdef" for c in tag):
            return tag
    except OSError:
        pass
    tag = _compute_toolchain_tag()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            cachedir.write_atomic(memo, tag.encode())
        except OSError:        # a read-only default cache: computed again next time
            pass
    return tag


def _memo_key() -> str | None:
    """A hash of the toolchain tag's inputs, cheap to read; None where they cannot be
    read this way (then the tag is computed every time)."""
    import importlib.util
    h = hashlib.sha256(f"{sys.version}|{sys.executable}".encode())
    try:
        for name in ("numba", "llvmlite"):
            origin = Path(importlib.util.find_spec(name).origin)
            for f in (origin, *sorted(origin.parent.parent.glob(f"{name}-*.dist-info/RECORD"))):
                st = f.stat()
                h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
        cpu = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines()
               if ln.startswith(("model name", "flags", "vendor_id", "cpu family", "model\t"))]
    except (OSError, AttributeError, TypeError, ValueError):
        return None
    h.update("\n".join(sorted(set(cpu))).encode())
    h.update("|".join(os.environ.get(k, "") for k in ("NUMBA_ENABLE_AVX", "NUMBA_OPT",
                                                       "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")
                      ).encode())
    for name in _TAG_SOURCES:
        h.update((Path(__file__).parent.parent / name).read_bytes())
    return h.hexdigest()[:32]


_TAG_SOURCES = ("codegen/cpu/rt.py", "codegen/cpu/fastmath.py", "codegen/cpu/intrinsics.py",
                "codegen/lower/shape_program.py", "codegen/lower/shape_interp.py",
                "compile/native.py")


def toolchain_versions() -> dict:
    """The versions of what turns a kernel's source into native code (a shipped
    model's manifest records them, to say what differs where they do not match)."""
    from importlib.metadata import version

    import llvmlite
    return {"numba": version("numba"), "llvmlite": llvmlite.__version__,
            "python": "%d.%d" % sys.version_info[:2]}


def _compute_toolchain_tag() -> str:
    v = toolchain_versions()
    h = hashlib.sha256(f"{v['numba']}|{v['llvmlite']}|{sys.version_info[:2]}|"
                       f"{native.host_tag()}".encode())
    pkg = Path(__file__).parent.parent          # read as files: no Numba import here
    for name in _TAG_SOURCES:
        h.update((pkg / name).read_bytes())
    return h.hexdigest()[:16]


_TOOLCHAIN = None


def kernel_dir() -> Path:
    global _TOOLCHAIN
    if _TOOLCHAIN is None:
        _TOOLCHAIN = _toolchain_tag()
    return cache_root() / "kernels" / _TOOLCHAIN


def graph_seen(key: str) -> bool:
    """True if a graph with this key (pipeline._graph_key) was compiled with this
    toolchain before: its kernels are likely in the disk cache."""
    return (kernel_dir() / "graphs" / key).exists()


def cache_is_empty() -> bool:
    """No kernel of this toolchain in the disk cache yet (a new machine, container or
    cache directory): whatever is traced next compiles all of its kernels."""
    try:
        return not any(kernel_dir().glob("k_*.so"))
    except OSError:
        return True


def remember_graph(key: str) -> None:
    d = kernel_dir() / "graphs"
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / key).touch()
    except OSError:    # a read-only cache only costs the next process a prestart
        pass


def _user_dtype(name: str):
    if name == "bfloat16":
        try:
            import ml_dtypes
            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:          # storage is 16 bits either way
            return np.dtype(np.uint16)
    return np.dtype({"float16": np.float16, "bool": np.bool_}.get(name, name))


class CompileLimitError(RuntimeError):
    """A kernel over the compile limits: not built here (a node from a graph file
    runs its fallback, with a warning, or fails where it has none)."""


def check_code_size(name: str, text: str) -> None:
    if len(text) > MAX_CODE_BYTES:
        raise CompileLimitError(f"kernel {name}: {len(text)} bytes of generated code, "
                                f"more than the {MAX_CODE_BYTES} compiled")


# Tier-1 code's slowdown over tier 2 on the size-dependent part of a kernel's time,
# by kernel class (tools/compile_phases.py speed, the nine pattern kernels, AMD EPYC
# avx2, BENCHMARKS.md "compile phases"): measured, the worst of each class in three
# runs at 64 and 8192 rows -- without a transcendental LayerNorm's 3.33x (BN + ReLU6
# 1.48-1.76x), with one SwiGLU's 7.32x (its exp runs scalar at tier 1; softmax
# 3.26-3.73x).  Not measured on the AVX-512 profile: the same factors apply there.
TIER1_SLOWDOWN = {False: 3.4, True: 7.3}
# Sizes a dim unknown until run time is assumed to take for the estimate: the cost
# model's DEFAULT_DIM (launch-bound: tier 1 costs little there) and a large one
# (arbitrary: 4096, where the kernel's traffic dominates); a region holds if tier 1
# loses to TF at either.
TIER1_PROBE_DIMS = (None, 4096)


def tier1_estimate(spec) -> tuple:
    """(tier-1 seconds, TF's unfused seconds, the size its unknown dims took: None
    where it has none or at the planner's assumed size) for ``spec``'s region, by the
    cost model (plan/cost.py spec_times) at each of TIER1_PROBE_DIMS, the worst ratio:
    the kernel's fused time with its size-dependent part (all but one launch and
    task) times TIER1_SLOWDOWN of its class, against the time of its ops left to TF."""
    from ..ir.ops import OPS
    from ..plan import cost, profiles
    profile = profiles.default()
    slowdown = TIER1_SLOWDOWN[any(n.op in OPS and OPS[n.op].transcendental
                                  for n in spec.nodes)]
    fixed = profile.launch_s + profile.task_s
    worst = None
    for dim in TIER1_PROBE_DIMS:
        fused, unfused = cost.spec_times(_with_dims(spec, dim), profile)
        tier1 = min(fused, fixed) + slowdown * max(0.0, fused - fixed)
        if worst is None or tier1 / unfused > worst[0] / worst[1]:
            unknown = dim is not None and any(d < 0 for t in spec.inputs for d in t.shape)
            worst = (tier1, unfused, dim if unknown else None)
    return worst


def _with_dims(spec, dim):
    """``spec`` with its unknown dims set to ``dim`` (None: as it is)."""
    from ..ir import SpecNode, TensorType
    if dim is None:
        return spec
    fix = lambda t: TensorType(t.dtype, tuple(dim if d < 0 else d for d in t.shape))  # noqa: E731
    return KernelSpec(tuple(fix(t) for t in spec.inputs),
                      tuple(SpecNode(n.op, n.args, n.attrs, fix(n.type)) for n in spec.nodes),
                      spec.outputs, spec.schedule, spec.same_dims)


def slow_at_tier1(spec) -> bool:
    """Whether ``spec``'s tier-1 code is expected to be slower than TF's own ops: a
    region with a window (has_window_at_tier1), or one whose tier1_estimate loses.
    Where the cost model cannot price the spec, the rule it replaced: a region
    computing a transcendental function holds (tier 1 runs it as scalar polynomials,
    TF's kernels vectorize)."""
    if has_window_at_tier1(spec):
        return True
    est = estimate_at_tier1(spec)
    if est is None:
        from ..ir.ops import OPS
        return any(n.op in OPS and OPS[n.op].transcendental for n in spec.nodes)
    return est[0] > est[1]


# A depthwise convolution's window at tier 1: KH x KW scalar multiply-adds per output
# element where TF's kernel (and tier 2) runs them in vectors.  Measured (BENCHMARKS.md
# "compile phases", depthwise windows hold at tier 1): MobileNetV2's eleven window
# kernels ran 2.4-4.8x their tier-2 time at batch 8 and 1.05-2.0x TF's estimated time
# for their ops at batch 1; EfficientNetB0's (with a sigmoid) 4.6-11.6x tier 2 and
# 1.8-2.6x TF; the model-level tier-1 calls 1.4-2.2x stock TF's under the same compile
# load (1.07-1.19x with this rule).  The cost model prices a window kernel's tier-2 time
# low (2.7x under on MobileNetV2), so no factor over it ranks these reliably: a region
# with a window always holds at tier 1 (its TF ops run until tier 2 is in).
def has_window_at_tier1(spec) -> bool:
    return any(n.op == "DepthwiseConv2D" for n in spec.nodes)


def estimate_at_tier1(spec):
    """tier1_estimate(spec), memoized per spec and device profile; None where the
    cost model cannot price the spec."""
    from ..plan import profiles
    key = (spec.hash, profiles.default().name)
    if key not in _tier1_estimates:
        try:
            _tier1_estimates[key] = tier1_estimate(spec)
        except Exception:  # noqa: BLE001 - an unpriced spec: slow_at_tier1's old rule
            _tier1_estimates[key] = None
    return _tier1_estimates[key]


_tier1_estimates: dict = {}    # (spec hash, device profile name) -> tier1_estimate


class CompiledKernel:
    """A compiled kernel: addresses for the TF op, and a TF-free ``__call__``."""

    def __init__(self, spec, schedule, source, code, compile_seconds):
        self.spec = spec
        self.schedule = schedule
        self.source = source.text
        self.errors = list(source.errors)
        self._code = code                  # keeps the code alive; its address may
                                           # change once (tier 1 -> 2, _Code.upgrade)
        # the shape function: the shared interpreter, run on this kernel's program
        self.shape_program = np.array(source.program, np.int64)
        self.shape_address = interp_address()
        self.in_ranks = [len(t.shape) for t in spec.inputs]
        self.out_ranks = [len(t.shape) for t in spec.output_types]
        self.in_dtypes = [t.dtype for t in spec.inputs]
        self.out_dtypes = [t.dtype for t in spec.output_types]
        self.compile_seconds = compile_seconds
        self.cache_hits = code.cache_hit      # loaded, not compiled, in this process
        # the backend that built the code here ("llvm", "numba"; None: loaded from the
        # cache) and, where the direct backend was chosen but did not, why
        self.backend, self.backend_note = code.backend, code.backend_note
        self._shape = _INTERP_T(self.shape_address)
        self.generic = None                # hash of the generic spec whose code this is
        self.in_static_dims = None         # set when the code does not check them itself
        self.launch = launch_hint(spec)

    @property
    def body_address(self) -> int:
        """The body's address now: a tier-1 kernel's changes once its tier 2 is in
        (every copy ``serving`` made shares the code)."""
        return self._code.address

    @property
    def _body(self):
        """The body as a ctypes function (the code running now)."""
        return self._code.fn

    @property
    def hold_until_upgrade(self) -> bool:
        """Tier-1 code expected to be slower than the TF ops it replaces
        (slow_at_tier1, the cost model's estimate): the op runs a node's original ops
        until the upgrade."""
        return self._code.tier == 1 and slow_at_tier1(self.spec)

    @property
    def tier(self) -> int:
        """1: quick code running while the optimized code compiles (tiers: _Code);
        2: the optimized code every cache holds."""
        return self._code.tier

    def tier_state(self) -> tuple[bool, bool] | None:
        """(held at tier 1, tier 2 in) for a kernel that started at tier 1, None where
        it never did: held, its region ran its TF ops while tier 1 was all it had."""
        c = self._code
        if c.tier1_at is None:
            return None
        return slow_at_tier1(self.spec), c.tier2_at is not None

    def tiering(self) -> str | None:
        """Which code this kernel runs and ran, in words, where it started at tier 1
        (None: it never did): whether its region held (its TF ops ran) and when its
        tier-2 code came, counted from when tier 1 was ready."""
        state = self.tier_state()
        if state is None:
            return None
        held, _ = state
        c = self._code
        if has_window_at_tier1(self.spec):       # held whatever the estimate says
            why = ": a window's multiply-adds run scalar there"
        else:
            est = estimate_at_tier1(self.spec)
            at = "" if est is None or est[2] is None else \
                f" with its run-time dims at {est[2]}"
            why = "" if est is None else \
                f", estimated {est[0] * 1e6:.0f} µs vs TF's {est[1] * 1e6:.0f} µs{at}"
        what = (f"tier 1 held: its TF ops ran (tier 1 slower than TF{why})"
                if held else f"tier 1 ran{why}")
        if c.tier2_at is None:
            return f"{what}; tier 2 not in yet"
        return f"{what}; tier 2 in {c.tier2_at - c.tier1_at:.2f} s after tier 1"

    def upgrade(self) -> bool:
        """Switch a tier-1 kernel to its tier-2 code once that is in the disk cache;
        True if the kernel runs tier-2 code now (_Code.upgrade)."""
        return self._code.upgrade()

    @property
    def code_name(self) -> str:
        """The cache name of the native code this kernel runs (code_name): kernels of
        specs equal up to naming, or of one generic twin, share it."""
        return self._code.stem.name

    def serving(self, spec, schedule) -> "CompiledKernel":
        """This code registered for a concrete ``spec`` it was compiled generically
        for (specialize.py): same addresses, the concrete spec and its schedule.  The
        generic shape function accepts other sizes, so the spec's static input dims
        are checked by the op (``in_static_dims``) and by ``shapes``."""
        k = object.__new__(CompiledKernel)
        k.__dict__.update(self.__dict__)
        k.spec, k.schedule, k.generic = spec, schedule, self.spec.hash
        k.launch = launch_hint(spec)
        k.in_static_dims = [d for t in spec.inputs for d in t.shape]
        k.errors = list(self.errors)
        k._static_checks = []              # (position in the flat dims, rc)
        flat = 0
        for i, t in enumerate(spec.inputs):
            for d, n in enumerate(t.shape):
                if n >= 0:
                    k.errors.append(f"input {i} dim {d} must be {n}")
                    k._static_checks.append((flat, n, len(k.errors)))
                flat += 1
        return k

    def __repr__(self):
        return f"<CompiledKernel {self.spec.hash} {self.schedule.kind.value}>"

    def inspect_llvm(self):
        """Optimized LLVM IR of the body (the module its native code was made from)."""
        return self._code.llvm_ir()

    def inspect_asm(self):
        """Machine code of the body, as assembly."""
        return self._code.assembly()

    def shapes(self, in_shapes):
        """(rc, dims, out_shapes, units, cost, phases, temp_bytes) from the shape
        function."""
        if self.in_static_dims is not None:
            got = [d for s in in_shapes for d in s]
            for pos, want, rc in self._static_checks:
                if pos < len(got) and got[pos] != want:
                    return rc, None, [], 0, 0, 1, 0
        in_dims = np.array([d for s in in_shapes for d in s] + [0], np.int64)
        dims = np.zeros(MAX_PARAMS, np.int64)
        out_dims = np.zeros(sum(self.out_ranks) + 1, np.int64)
        sched = np.array(list(self.launch) + [1, 0], np.int64)
        p = lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))   # noqa: E731
        rc = self._shape(p(self.shape_program), p(in_dims), p(dims), p(out_dims), p(sched))
        shapes, o = [], 0
        for r in self.out_ranks:
            shapes.append(tuple(int(d) for d in out_dims[o:o + r]))
            o += r
        return int(rc), dims, shapes, int(sched[0]), int(sched[1]), int(sched[2]), \
            int(sched[3])

    def format_error(self, rc: int, in_shapes) -> str:
        what = self.errors[rc - 1] if 0 < rc <= len(self.errors) else f"error code {rc}"
        return f"{what}; input shapes: {', '.join(str(tuple(s)) for s in in_shapes)}"

    def __call__(self, *arrays):
        """Run on NumPy arrays (units one after another, this thread); returns outputs."""
        if len(arrays) != len(self.in_dtypes):
            raise TypeError(f"kernel takes {len(self.in_dtypes)} inputs, got {len(arrays)}")
        ins = [self._as_input(i, a) for i, a in enumerate(arrays)]
        rc, dims, out_shapes, units, _, phases, temp = self.shapes([a.shape for a in ins])
        if rc:
            raise ValueError(self.format_error(rc, [a.shape for a in ins]))
        outs = [np.empty(s, _user_dtype(d)) for s, d in zip(out_shapes, self.out_dtypes)]
        if units:
            scratch = np.empty(max(1, temp), np.uint8)     # split rows' partials
            ip = (ctypes.c_void_p * max(1, len(ins)))(*[a.ctypes.data for a in ins])
            op = (ctypes.c_void_p * (len(outs) + 1))(*[o.ctypes.data for o in outs],
                                                     scratch.ctypes.data)
            body = self._body              # one build for every phase of the call
            for phase in range(phases):
                dims[cpu().PHASE_SLOT] = phase
                body(0, units, ip, op, dims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
        return outs

    def _as_input(self, i, a):
        want = _user_dtype(self.in_dtypes[i])
        if not isinstance(a, np.ndarray):
            a = np.asarray(a, dtype=want)
        if a.dtype != want and not (a.dtype.itemsize == want.itemsize and
                                    dt.STORAGE[self.in_dtypes[i]] == a.dtype):
            raise TypeError(f"input {i} has dtype {a.dtype}, kernel expects "
                            f"{self.in_dtypes[i]}")
        if a.ndim != self.in_ranks[i]:
            raise ValueError(f"input {i} has rank {a.ndim}, kernel expects "
                             f"{self.in_ranks[i]}")
        # (np.ascontiguousarray makes a 0-d array 1-d: rank-0 inputs are contiguous)
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def launch_hint(spec) -> tuple:
    """(rows per unit, column block) the cost model chose for ``spec``, 0 where it left
    the choice to the shape function; passed to the shape function at run time."""
    return tuple(int(spec.schedule.get(k, 0)) for k in LAUNCH_PARAMS)


def _module_name(text: str, tag: str) -> str:
    return f"k_{tag}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def code_name(text: str) -> str:
    """The cache name of a CPU kernel's code: a hash of its canonical text (comments
    dropped, emitter-made names renumbered: cpu.canonical), so specs whose code is
    the same program up to naming compile once and share the shared object.  Measured:
    the Transformer block's two LayerNorms and two of ResNet50's BN kernels differed
    only in node numbering or the spec hash in the header: 5 -> 4 and 6 -> 5 compiles.

    Memoized per (text, backend mark): uncached_code names each code to probe the
    cache, and _compile_exact names it again (canonical() is ~0.25 ms a kernel)."""
    key = (text, _backend_mark())
    name = _code_names.get(key)
    if name is None:
        name = f"k_{hashlib.sha256((canonical(text) + key[1]).encode()).hexdigest()[:24]}"
        with _lock:
            if len(_code_names) >= _CODE_NAMES_MAX:
                _code_names.clear()
            _code_names[key] = name
    return name


_code_names: dict = {}        # (kernel text, backend mark) -> code_name (a pure function)
_CODE_NAMES_MAX = 1024        # arbitrary: a graph's distinct codes, a few graphs over


def _backend_mark() -> str:
    """What the code name adds for the backend that builds it: nothing for Numba (its
    cache names stay as they were), the direct backend's name and source hash for it
    (direct.py), so the two never share a shared object."""
    from . import direct
    return "" if direct.backend() == "numba" else f"\n# backend llvm {direct.tag()}"


class _Code:
    """A C entry point's native code: loaded from ``stem``.so, or built there first
    (direct.build from ``text`` where given and the direct backend is chosen, else
    native.build); where no shared object can be built, Numba's JIT code for it.
    ``source()`` gives (Python function, cfunc signature, cfunc options); it is called
    only to build through Numba, so a cache hit imports no Numba.  ``lean``: generated
    code, built through native._lean_pipeline()."""

    def __init__(self, stem: Path, symbol: str, source, lean: bool = True,
                 code: str | None = None, text: str | None = None, tier: int = 2):
        self.stem, self.symbol, self.cfunc, self.cache_hit = stem, symbol, None, False
        # which backend built it here: "llvm" or "numba" (None: loaded from the
        # cache); backend_note: why the direct backend did not, where it did not
        self.backend, self.backend_note = None, None
        # 1: quick code from _tier1_dir(), not the cache (upgrade); 2: stem's
        self.tier, self.built_at = 2, stem
        # time.monotonic() when tier-1 code started serving and when tier 2 replaced
        # it (None: never; the report's per-kernel tier line, CompiledKernel.tiering)
        self.tier1_at = self.tier2_at = None
        if self._load_cached(code):
            return
        if tier == 1 and text is not None:
            self._build(source, lean, text, tier)   # into this process's own directory
            return
        # Processes sharing the cache (a server's workers, pytest-xdist) that start
        # together want the same kernels: one builds each, the others wait for it and
        # load its object (4 cold processes of an MLP made 15 builds of 4 codes).
        with _claim(stem):
            if self._load_cached(code):     # built meanwhile
                return
            self._build(source, lean, text, tier)

    def _load_cached(self, code) -> bool:
        """Load ``stem``.so where the cache holds it whole: True if it did."""
        if not native.built(self.stem, code):
            return False
        try:
            self.address = native.load(self.stem, self.symbol, code)
        except native.NativeError as e:    # unreadable: built again
            _warn_native(e)
            return False
        self.cache_hit = True
        return True

    def _build(self, source, lean, text, tier) -> None:
        stem, symbol = self.stem, self.symbol
        if text is not None and self._build_direct(text, symbol, tier):
            return
        use_helper_cache()
        self.backend = "numba"
        pyfunc, sig, options = source()
        try:
            native.build(pyfunc, sig, options, stem, symbol, lean)
            self.address = native.load(stem, symbol)
        except (native.NativeError, OSError) as e:   # OSError: a read-only or full cache
            _warn_native(e)
            from numba import cfunc
            self.cfunc = cfunc(sig, **options)(pyfunc)
            self.address = self.cfunc.address

    @property
    def address(self) -> int:
        return self._address

    @address.setter
    def address(self, value: int) -> None:
        self._address = value
        self.fn = _BODY_T(value)        # what CompiledKernel.__call__ runs

    def upgrade(self) -> bool:
        """Tier 1 -> 2: where ``stem``.so (the optimized build, which a compile worker
        put in the cache) is there, load it, run it from now on, and tell the
        listeners (on_upgrade: the op's registry switches the kernels registered
        with the old address).  True if this code is tier 2 now."""
        with _upgrade_lock:
            if self.tier == 2:
                return True
            if not native.built(self.stem):
                return False
            old, self.address = self.address, native.load(self.stem, self.symbol)
            self.tier, self.built_at, self.text = 2, self.stem, None
            self.tier2_at = time.monotonic()
            # after the switch: a kernel registered from now on reads the new
            # address, one registered before is switched by the listener
            for fn in _upgrade_listeners:
                fn(old, self.address)
        return True

    def build_tier2(self) -> None:
        """Build the tier-2 code of this tier-1 code here, into the cache, and switch
        to it (upgrade)."""
        from . import direct
        with _claim(self.stem):
            if not native.built(self.stem):     # else another process's is there
                use_helper_cache()
                direct.build(self.text, self.stem, self.symbol, 2)
        self.upgrade()

    def _build_direct(self, text: str, symbol: str, tier: int = 2) -> bool:
        """Build through the direct LLVM backend where it is chosen (direct.py), at
        ``tier`` (1: into _tier1_dir(), never the cache); False (the reason kept in
        backend_note) where the Numba path must."""
        from ..codegen.cpu.llvm import Unsupported
        from . import direct
        if direct.backend() != "llvm":
            return False
        try:
            _write_source(self.stem.with_suffix(".py"), text)   # what was compiled
            at = self.stem if tier == 2 else _tier1_dir() / self.stem.name
            if not (tier == 1 and native.built(at)):    # a compile worker's tier 1
                from ..codegen.cpu.emitter import tier1_text
                # the helpers' code is linked in: their cache decided first.  Not
                # before: loading a worker's tier-1 object needs no Numba, whose
                # import (helper_cache's) cost the waiting first call 0.3-0.4 s CPU
                use_helper_cache()
                direct.build(tier1_text(text) if tier == 1 else text, at, symbol, tier)
            self.address = native.load(at, symbol)
            self.tier, self.built_at = tier, at
            self.text = text if tier == 1 else None       # for build_tier2
            if tier == 1:
                self.tier1_at = time.monotonic()
        except Unsupported as e:
            self.backend_note = f"built by Numba: the direct backend does not handle {e}"
            _log.info("kernel %s: %s", self.stem.name, self.backend_note)
            return False
        except (native.NativeError, OSError) as e:   # no linker, a read-only cache...
            self.backend_note = f"built by Numba: the direct backend failed ({e})"
            _warn_native(e)
            return False
        except Exception as e:  # noqa: BLE001 - a translator bug must not cost the kernel
            self.backend_note = (f"built by Numba: the direct backend failed "
                                 f"({type(e).__name__}: {e})")
            if self.backend_note not in _warned:
                _warned.add(self.backend_note)
                warnings.warn(f"stitching: kernel {self.stem.name} {self.backend_note}; "
                              "please report it", RuntimeWarning, stacklevel=3)
            return False
        self.backend = "llvm"
        return True

    def llvm_ir(self):
        if self.cfunc is not None:
            return self.cfunc._library.get_llvm_str()
        return native.llvm_ir(self.built_at)

    def assembly(self):
        if self.cfunc is not None:
            return self.cfunc._library.get_asm_str()
        return native.assembly(self.built_at)


# Past this a process stops waiting for another's build of a kernel and builds it
# itself (a stopped or hung peer must not stop it): arbitrary, well over the largest
# kernel's compile on a loaded machine (tens of seconds).
CLAIM_SECONDS = 300


def _claim(stem: Path):
    """The cache-wide claim on building ``stem``'s object (cachedir.locked): one of
    the processes sharing the cache builds it, the others wait, then load it."""
    return cachedir.locked(cachedir.slot_lock(kernel_dir(), stem.name),
                           timeout=CLAIM_SECONDS)


_warned = set()
_upgrade_lock = threading.Lock()
_upgrade_listeners: list = []     # fn(old address, new address), on_upgrade
_TIER1_DIR = None


def on_upgrade(fn) -> None:
    """Call ``fn(old address, new address)`` whenever a tier-1 kernel's code is
    replaced by its tier-2 code (the runtime's registry switches the op's kernels)."""
    with _upgrade_lock:
        if fn not in _upgrade_listeners:
            _upgrade_listeners.append(fn)


def set_tier1_dir(path: str) -> None:
    """A compile worker's tier-1 directory: its parent's (worker.py), named in the
    parent's tier-1 requests."""
    global _TIER1_DIR
    with _lock:
        _TIER1_DIR = Path(path)


def _tier1_dir() -> Path:
    """Where this process's tier-1 objects go: a directory of its own, made on first
    use (a compile worker: its parent's, set_tier1_dir), removed at exit (the objects
    stay mapped), so that no cache ever holds tier-1 code."""
    global _TIER1_DIR
    with _lock:
        if _TIER1_DIR is None:
            _TIER1_DIR = cachedir.private_dir("tier1")
        return _TIER1_DIR


_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EACCES,
                           errno.EPERM, errno.EDQUOT})


def _warn_native(e) -> None:
    """Once per kind of failure: a read-only or full cache fails every kernel's write,
    each under a temporary name of its own (27 warnings in one process)."""
    if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
        key = e.errno
        text = f"the kernel cache {kernel_dir()} cannot be written ({e.strerror})"
    else:
        key = text = str(e)
        if isinstance(e, native.NativeError):   # its command names a temporary dir
            key = text.split(":")[0]
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"stitching: {text}; kernels run from code compiled in this process, "
                      f"which the next process compiles again", RuntimeWarning,
                      stacklevel=3)


_INTERP = None
_shipped_interp = None     # stem of a shape interpreter a verified model shipped (shipped.py)


def offer_interp(stem: Path) -> None:
    """A shape interpreter shipped with a model whose manifest was verified: used when
    this cache has none (shipped.add)."""
    global _shipped_interp
    _shipped_interp = stem


def interp_address() -> int:
    """Address of the C entry point every generated kernel's shape function is
    (shape_interp.py): loaded from the kernel cache, built there on first use.

    Like the op library (runtime/build.py), it is an install-time product
    (``python -m stitching.runtime.build`` builds it): one in the default cache's
    directory for this toolchain is used when ``STITCHING_CACHE_DIR`` points
    elsewhere (the toolchain tag names every input of the build)."""
    global _INTERP
    with _lock:
        if _INTERP is None:
            def interp_source():
                from ..codegen.lower import shape_interp
                return shape_interp.run.py_func, shape_interp.SIG, shape_interp.OPTIONS
            stem = kernel_dir() / "interp"
            installed = cachedir.default_root() / "kernels" / stem.parent.name / "interp"
            for other in (installed, _shipped_interp):   # or one a verified model shipped
                if other is not None and not native.built(stem) and \
                        native.built(other, "interp"):
                    stem = other
                    break
            _INTERP = _Code(stem, INTERP_SYMBOL, interp_source, lean=False, code="interp")
        return _INTERP.address


def use_helper_cache() -> None:
    """Keep the math helpers' compiled code on disk (helper_cache.py): in this cache's
    ``helpers`` directory for this toolchain, or, while that holds nothing, in the
    one the install step filled in the default cache (read-only)."""
    from . import helper_cache
    if helper_cache.decided():
        return
    own = kernel_dir() / "helpers"
    installed = cachedir.default_root() / "kernels" / own.parent.name / "helpers"
    if installed != own and not own.exists() and installed.is_dir():
        helper_cache.enable(installed, read_only=True)
    else:
        helper_cache.enable(own)


def _load_module(text: str, name: str):
    """Import ``text`` as the kernel module ``name`` (written to the cache first)."""
    modname = f"stitching_kernel_{name}"
    if modname in sys.modules:
        return sys.modules[modname]
    path = kernel_dir() / f"{name}.py"
    try:
        _write_source(path, text)
    except OSError as e:
        return _module_in_memory(text, modname, path, e)
    mspec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(mspec)
    # Registered before running it: Numba names the module of each cfunc, and a
    # cache hit re-imports that module by name to rebuild the function environment.
    sys.modules[modname] = module
    try:
        mspec.loader.exec_module(module)      # compiles, or loads Numba's cache
    except BaseException:
        del sys.modules[modname]
        raise
    return module


def _write_source(path: Path, text: str) -> None:
    """Put the kernel module's text at ``path``, unless the same text is there (a
    damaged or stale file is replaced: it would not compile, or not to this kernel)."""
    try:
        if cachedir.read_file(path, MAX_CODE_BYTES + 1) == text.encode():
            return
    except OSError:         # absent, or not a file (replaced below)
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    cachedir.write_atomic(path, text.encode())


def _module_in_memory(text: str, modname: str, path: Path, error: OSError):
    """The kernel module built from ``text`` without a file, where the cache cannot be
    written (read-only, full): the kernel is then compiled in this process only (the
    text is our own generated code; nothing here comes from a graph unvalidated)."""
    _warn_native(error)
    import types
    module = types.ModuleType(modname)
    module.__file__ = str(path)
    sys.modules[modname] = module
    try:
        exec(compile(text, str(path), "exec"), module.__dict__)   # noqa: S102
    except BaseException:
        del sys.modules[modname]
        raise
    return module


def is_cached(spec: KernelSpec) -> bool:
    """True if compiling ``spec`` (validated) needs no Numba compile: it is in memory,
    or the shared object of the code serving it is in the disk cache.  A spec that
    cannot be scheduled counts as cached (there is nothing to compile; compile_kernel
    raises the reason)."""
    return uncached_code(spec) is None


def uncached_code(spec: KernelSpec):
    """(the spec compiled for ``spec``, its generated source, the code's cache name
    ``code_name``) if that code is neither in memory nor in the disk cache, else None
    (as ``is_cached``)."""
    if _final(spec.hash):
        return None
    try:
        target = compile_target(spec)
        if _final(target.hash):
            return None
        # specs that differ only in static sizes share one target (their generic
        # twin): emitted once, for the first of them (EfficientNetB0's 45 specs have
        # ~30 targets)
        with _lock:
            hit = _emitted.get(target.hash)
        if hit is not None:
            sched, source = hit
        else:
            sched = build_schedule(target)
            source = cpu().emit(sched)
    except Exception:  # noqa: BLE001 - compile_kernel reports it
        return None
    text = source.text
    name = code_name(text)
    with _lock:                 # compile_kernel takes it up instead of emitting again
        _emitted[target.hash] = (sched, source)
    return None if native.built(kernel_dir() / name) else (target, text, name)


def _final(key: str) -> bool:
    """A kernel for spec hash ``key`` is in memory, running its tier-2 code."""
    k = _kernels.get(key)
    return k is not None and k.tier == 2


def compile_kernel(spec: KernelSpec, tier: int = 2) -> CompiledKernel:
    """Compiled kernel for a spec (raises ScheduleError if it is not one kernel).

    The code may be that of the spec's shape-generic twin (specialize.py), shared by
    every spec that differs from it only in static sizes.  ``tier`` 1: code not in
    the disk cache is built quickly, not optimized, outside the cache (direct.py's
    tier 1; the Numba backend has no tier 1): the kernel's ``upgrade()`` switches it
    to its tier-2 code once a compile worker put that in the cache
    (parallel.compile_kernels does both)."""
    spec = validate(spec)
    key = spec.hash
    with _lock:
        k = _kernels.get(key)
        if k is not None:
            # its tier 2 may be in the cache by now; or it is asked for here (a compile
            # worker asked for a kernel's tier 1, then its tier 2: parallel.py)
            if k.tier == 1 and not k.upgrade() and tier == 2:
                k._code.build_tier2()
            return k
        target = compile_target(spec)
        if target.hash == key:
            k = _compile_exact(spec, tier)
        else:
            base = _kernels.get(target.hash) or _compile_exact(target, tier)
            _kernels[target.hash] = base
            k = base.serving(spec, build_schedule(spec))
        _kernels[key] = k
        return k


def _compile_exact(spec: KernelSpec, tier: int = 2) -> CompiledKernel:
    t0 = time.perf_counter()
    sched, source = _emitted.pop(spec.hash, None) or (None, None)
    if source is None:
        sched = build_schedule(spec)
        source = cpu().emit(sched)
    name = code_name(source.text)
    check_code_size(name, source.text)

    def body_source():
        module = _load_module(source.text, name)
        return module.body, module.h.BODY_SIG, module.h.BODY_OPTIONS

    code = _Code(kernel_dir() / name, BODY_SYMBOL, body_source, text=source.text, tier=tier)
    return CompiledKernel(spec, sched, source, code, time.perf_counter() - t0)


def in_memory(specs) -> set:
    """The hashes of those of ``specs`` whose code this process holds already (built
    or loaded for an earlier graph: the spec's own kernel, or the shape-generic code
    that serves it, as another batch size's trace left it)."""
    held = set()
    with _lock:
        for s in specs:
            if s.hash not in _kernels:
                try:
                    if compile_target(s).hash not in _kernels:
                        continue
                except Exception:   # noqa: BLE001 - compile_kernel reports it
                    continue
            held.add(s.hash)
    return held


def clear_memory_cache() -> None:
    """Forget in-process kernels (tests); modules stay imported."""
    with _lock:
        _kernels.clear()
        _emitted.clear()
