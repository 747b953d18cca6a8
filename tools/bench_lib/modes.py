"""The three ways to run one function: stock tf.function, XLA, stitching.

A mode that cannot be built or called becomes a failed Runner carrying the first line
of its error; the harness keeps going (stitching is being written while this runs).
"""
from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field

import tensorflow as tf

from .names import EXTRA_MODES, LABELS, MODES  # noqa: F401 - re-exported

# the modes that are stitching.function calls (with their Options)
STITCHED = ("stitching", "baseline", "stitching_default", "tf_gemm", "no_attn", "tf_conv")


def first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}".strip()


@dataclass
class Runner:
    mode: str
    fn: object = None            # the callable, None when building failed
    error: str | None = None     # first line of the error that made the mode fail
    first_call_s: float | None = None
    info: dict = field(default_factory=dict)   # kernel counts, notes

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, e: BaseException, where: str):
        self.error = f"{where}: {first_line(e)}"
        self.info["traceback"] = traceback.format_exc(limit=6)
        self.fn = None


def _stitching_options(planner: str | None, notes: list):
    """``stitching.Options(planner=...)`` when asked for and supported; None otherwise."""
    if not planner:
        return None
    import stitching
    try:
        Options = stitching.Options
    except (AttributeError, ImportError) as e:
        notes.append(f"--planner {planner} ignored: no stitching.Options ({first_line(e)})")
        return None
    import dataclasses
    import inspect
    fields = ({f.name for f in dataclasses.fields(Options)} if dataclasses.is_dataclass(Options)
              else set(inspect.signature(Options).parameters))
    if "planner" not in fields:
        notes.append(f"--planner {planner} ignored: stitching.Options has no planner")
        return None
    return Options(planner=planner)   # an unknown planner value fails the mode, loudly


def build(mode: str, fn, signature, planner: str | None = None) -> Runner:
    r = Runner(mode)
    try:
        if mode == "tf":
            r.fn = tf.function(fn, input_signature=signature)
        elif mode == "xla":
            r.fn = tf.function(fn, input_signature=signature, jit_compile=True)
        elif mode in STITCHED:
            import stitching
            import dataclasses
            notes = r.info.setdefault("notes", [])
            opts = _stitching_options("baseline" if mode == "baseline" else planner, notes)
            if mode == "tf_gemm":
                opts = dataclasses.replace(opts or stitching.Options(), blas_gemm=False)
            elif mode == "no_attn":
                opts = dataclasses.replace(opts or stitching.Options(), fused_attention=False)
            elif mode == "tf_conv":
                opts = dataclasses.replace(opts or stitching.Options(), conv1x1_gemm=False)
            if mode != "stitching_default":
                # a benchmark of stitched calls: the first call waits for the kernels,
                # whatever the default (tiered: stock TF until the kernels are ready)
                opts = dataclasses.replace(opts or stitching.Options(),
                                           background_compile=False)
            # stitching_default (compile suite): the options a user gets by default
            kwargs = {"options": opts} if opts is not None else {}
            r.fn = stitching.function(fn, input_signature=signature, **kwargs)
            if opts is not None:
                r.info["planner"] = planner
        else:
            raise ValueError(f"unknown mode {mode!r}")
    except Exception as e:
        r.fail(e, "build")
    return r


def wait_for_final_code() -> None:
    """Wait for the tier-2 compiles that stitched calls started (the tiered compile:
    a first call that waited runs tier-1 code, and a region computing a transcendental
    runs its original TF ops until its tier-2 code is in, compile/kernel.py), so that
    what is timed next is the optimized code every cache holds.  Nothing to wait for
    where stitching was never imported."""
    if "stitching.compile.parallel" in sys.modules:
        sys.modules["stitching.compile.parallel"].wait_upgrades()


def settle_autotune(runners: list[Runner], args, *, stall: int = 16,
                    most: int = 64) -> int:
    """Call the stitched runners until no autotuned kernel or attention of the process
    is still timing its ways (``stitching.runtime.autotune_pending()``: 12 calls per
    shape class, once no kernel runs tier-1 code), so that the timed repeats run the
    decided way.  Without this a fresh cache measured during the repeats: Llama at
    batch 8 read 0.77x stock TF once, 1.12-1.27x with its decisions cached.  Stops
    when nothing is pending, after ``stall`` rounds that decided nothing (a class
    pending for shapes no runner calls, or one that cannot measure), or ``most``
    rounds; returns the rounds run.  Classes left pending after a stall are not waited
    for again (``_STUCK``): the next rows of the process would each wait them out."""
    reg = sys.modules.get("stitching.runtime.registry")
    live = [r for r in runners if r.ok and r.mode in STITCHED]
    if reg is None or not live:
        return 0
    try:
        pending = set(reg.autotune_pending()) - _STUCK
    except (RuntimeError, OSError):     # the op library did not load: nothing tunes
        return 0
    rounds = idle = 0
    while pending and idle < stall and rounds < most:
        for r in live:
            if r.ok:
                try:
                    r.fn(*args)
                except Exception as e:
                    r.fail(e, "autotune")
        rounds += 1
        now = set(reg.autotune_pending()) - _STUCK
        idle = 0 if len(now) < len(pending) else idle + 1
        pending = now
    _STUCK.update(pending)
    return rounds


_STUCK: set = set()     # autotune classes a settle_autotune gave up on


def first_call(r: Runner, args) -> object:
    """Call once (trace + compile + run), timing it; returns the output or None."""
    if not r.ok:
        return None
    try:
        t0 = time.perf_counter()
        out = r.fn(*args)
        _block(out)
        r.first_call_s = time.perf_counter() - t0
        if r.mode != "tf" and r.mode != "xla":
            wait_for_final_code()
        return out
    except Exception as e:
        r.fail(e, "call")
        return None


def _block(out):
    # Eager CPU calls are synchronous; touching the outputs keeps that true if a
    # future TF makes them async.
    for t in tf.nest.flatten(out):
        if hasattr(t, "_numpy"):
            t._numpy()


def collect_counts(r: Runner, args, tf_runner: Runner | None = None):
    """Kernel counts for the row: memory-intensive TF ops (from the stock trace), XLA
    kernels (optimized HLO), stitched kernels (the report)."""
    from stitching.testing.counting import count_memory_intensive_ops, count_xla_kernels
    try:
        if r.mode == "tf":
            cf = r.fn.get_concrete_function(*args)
            r.info["memory_intensive_ops"] = count_memory_intensive_ops(cf)
        elif r.mode == "xla":
            hlo = r.fn.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
            r.info["xla"] = count_xla_kernels(hlo)
            r.info["kernels"] = r.info["xla"]["memory_kernels"]
        elif r.mode in STITCHED:
            rep = getattr(r.fn, "report", None)
            if rep is None:
                r.info.setdefault("notes", []).append("no report after the first call")
                return
            d = rep.to_dict()
            r.info["report"] = {k: d.get(k) for k in
                                ("memory_intensive_ops", "fused_ops", "kernels",
                                 "unique_kernels", "code_objects", "coverage", "unfused",
                                 "compile_seconds", "notes")}
            r.info["kernels"] = d.get("kernels")
            # what the plan is, for the ablation: the same multiset of kernel specs in
            # two modes means the same generated code, whatever the planner
            r.info["kernel_specs"] = sorted(k["spec_hash"] for k in d.get("kernel_details", []))
    except Exception as e:   # counting is information, not a reason to drop timings
        r.info.setdefault("notes", []).append(f"count failed: {first_line(e)}")
