"""Compile worker: ``python -m stitching.codegen.worker`` (see parallel.py).

Reads specs from stdin, one per line (each a JSON string holding a spec's JSON text),
compiles each into the disk cache named by STITCHING_CACHE_DIR and answers each with
one JSON line: {"hash", "ok", "seconds"} and, on failure, "error".  The parent sends
the next spec when an answer comes (work is handed out as workers free up) and closes
stdin when there is none left; the worker then exits.  Specs are parsed with
KernelSpec.from_json, which validates the whole structure; nothing in them is
evaluated.  Imports no TensorFlow.
"""
from __future__ import annotations

import json
import sys
import time


def main() -> int:
    _hide_scipy()
    from ..ir.spec import KernelSpec
    from .kernel import compile_kernel
    _warm_up()          # a worker may be started before its specs exist (parallel.prestart)
    for line in sys.stdin:
        t0 = time.perf_counter()
        out = {"hash": None, "ok": True}
        try:
            text = json.loads(line)
            if not isinstance(text, str):
                raise TypeError("expected a JSON string holding a spec")
            spec = KernelSpec.from_json(text)
            out["hash"] = spec.hash
            compile_kernel(spec)
        except Exception as e:  # noqa: BLE001 - reported; the parent compiles it again
            out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        out["seconds"] = round(time.perf_counter() - t0, 3)
        print(json.dumps(out), flush=True)
    return 0


def _hide_scipy() -> None:
    """Numba probes SciPy's BLAS when it is imported (for np.dot and np.linalg), which
    imports scipy.linalg: 0.3 s of CPU of a worker's 0.9 s start-up.  Kernels never
    call linear algebra, so a worker blocks the import (Numba takes the ImportError
    as "no BLAS"): start-up 0.64 -> 0.44 s, and on a cold start the workers' start-up
    competes with tracing and planning for the same cores."""
    sys.modules.setdefault("scipy", None)


def _warm_up() -> None:
    """Numba's first compile in a process sets up its target (~0.4 s); do it now.  The
    shape-program interpreter every kernel needs is built into the cache here when it
    is missing (not installed), so the parent loads it instead of building it; then a
    trivial function through native.py's compiler readies that path."""
    from . import native
    from .kernel import interp_address
    interp_address()
    native.compile_only(lambda x: x + 1, "int64(int64)", {})


if __name__ == "__main__":
    sys.exit(main())
