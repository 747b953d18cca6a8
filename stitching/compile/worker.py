"""Compile worker: ``python -m stitching.compile.worker`` (see parallel.py).

Reads specs from stdin, one per line (each a JSON string holding a spec's JSON text),
compiles each into the disk cache named by STITCHING_CACHE_DIR and answers each with
one JSON line: {"hash", "ok", "seconds"} and, on failure, "error".  A line
``{"spec": <the JSON string>, "tier": 1, "dir": <path>}`` asks for the kernel's tier-1
code instead (a tiered compile, parallel.py: Tiers), built into ``dir``, the parent's
own tier-1 directory, never the cache.  The parent sends
the next spec when an answer comes (work is handed out as workers free up) and closes
stdin when there is none left; the worker then exits.  Specs are parsed with
KernelSpec.from_json, which validates the whole structure; nothing in them is
evaluated.  Imports no TensorFlow.

A worker dies with its parent (``_die_with_parent``): a parent killed mid-compile
(kill -9) leaves no compile running on.  Its address space is capped at
``STITCHING_COMPILE_MEMORY_MB`` (set by the parent, parallel.py): a kernel whose
compile would take more fails with MemoryError in the worker, not in the parent.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

PARENT_ENV = "STITCHING_WORKER_PARENT"
MEMORY_ENV = "STITCHING_COMPILE_MEMORY_MB"
NICE_ENV = "STITCHING_WORKER_NICE"     # set for background compiles (parallel.py)


def main() -> int:
    _die_with_parent()
    _cap_memory()
    nice = int(os.environ.get(NICE_ENV, "0") or 0)
    if nice > 0:
        os.nice(nice)
    _lean_numba()
    from ..plan import profiles
    profiles.remeasure_provisional = False   # the parent's profile, as it planned with
    from ..ir.spec import KernelSpec
    from .kernel import compile_kernel, set_tier1_dir
    _warm_up()          # a worker may be started before its specs exist (parallel.prestart)
    for line in sys.stdin:
        t0 = time.perf_counter()
        out = {"hash": None, "ok": True}
        try:
            text, tier, tier1_dir = _request(json.loads(line))
            if tier1_dir:
                set_tier1_dir(tier1_dir)
            spec = KernelSpec.from_json(text)
            out["hash"] = spec.hash
            compile_kernel(spec, tier)
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles it again
            out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        out["seconds"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(out), flush=True)
    return 0


def _request(req) -> tuple:
    """(spec text, tier, tier-1 directory or None) of one request line (module note)."""
    tier, where = 2, None
    if isinstance(req, dict) and set(req) == {"spec", "tier", "dir"} and req["tier"] == 1 \
            and isinstance(req["dir"], str) and req["dir"]:
        req, tier, where = req["spec"], 1, req["dir"]
    if not isinstance(req, str):
        raise TypeError("expected a JSON string holding a spec, or "
                        "{\"spec\", \"tier\": 1, \"dir\"}")
    return req, tier, where


def _exit_now(code: int) -> None:
    """Leave without Python's finalization: with LLVM and Numba loaded it takes
    ~0.135 s of CPU (5 workers timed from stdin closed to exit: 126-146 ms), which
    a cold first call's remaining work (TF instantiating and running the rewritten
    graph) or the caller's first steps would share 2 cores with.  Nothing is left to
    flush: every answer was flushed when written, and cache files are written
    atomically (temp file + rename) before their answer."""
    sys.stdout.flush()
    os._exit(code)


def _die_with_parent() -> None:
    """Be killed when the parent process dies.  Not PR_SET_PDEATHSIG: it fires when
    the *thread* that started us exits, and parents spawn workers from short-lived
    threads too.  A daemon thread polls getppid() (reparenting means the parent is
    gone) every 0.2 s and ends this process at once; it runs mid-compile, since
    Numba's typing gives up the GIL every switch interval and LLVM runs without it."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if parent <= 0:
        return
    if os.getppid() != parent:         # the parent died before we got here
        os._exit(1)

    def watch():
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True, name="stitching-parent-watch").start()


def _cap_memory() -> None:
    mb = int(os.environ.get(MEMORY_ENV, "0") or 0)
    if mb > 0:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (mb << 20, mb << 20))


def _lean_numba() -> None:
    """Set a worker up before it imports Numba (the worker's own process: nothing
    else shares its Numba).

    SciPy is hidden: Numba probes SciPy's BLAS when it is imported (for np.dot and
    np.linalg), which imports scipy.linalg: 0.3 s of CPU of a worker's 0.9 s
    start-up.  Kernels never call linear algebra, and Numba takes the ImportError as
    "no BLAS": start-up 0.64 -> 0.44 s, and on a cold start the workers' start-up
    competes with tracing and planning for the same cores.

    Error-message highlighting is off: while typing a kernel, Numba formats a message
    for every overload it tries and rejects, each through colorama (a terminal
    wrapper set up and torn down per message): ~10% of a large kernel's compile in a
    profile (1809 messages for ResNet50's BN+add+relu+mean kernel), and sums over
    ResNet50's and EfficientNet-B0's kernels 2.2 -> 1.9-2.0 s and 3.3 -> 3.0 s.  The
    error text a worker reports back is then plain, too."""
    sys.modules.setdefault("scipy", None)
    os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")


def _warm_up() -> None:
    """Numba's first compile in a process sets up its target (~0.4 s); do it now.  The
    shape-program interpreter every kernel needs is built into the cache here when it
    is missing (not installed), so the parent loads it instead of building it; then a
    trivial function through native.py's compiler readies that path."""
    from . import helper_cache, native
    from .kernel import interp_address, use_helper_cache
    interp_address()
    native.compile_only(lambda x: x + 1, "int64(int64)", {})
    use_helper_cache()
    helper_cache.preload()


if __name__ == "__main__":
    _exit_now(main())
