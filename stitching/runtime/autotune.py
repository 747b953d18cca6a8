"""Autotune decisions: kept on disk beside the kernels, handed to the op.

The op measures (op.cc, ``Tuner``): a StitchedKernel node marked for autotuning
(``Options(autotune=True)``, tf/passes/autotune.py) times its kernel and its native segment
on its first calls per shape class and keeps the faster (a StitchedAttention node, where
TF's GEMM is oneDNN's, the same against its unfused products, through the same Tuner:
tf/passes/attention.py; "kernel" is then the fused op, "native" the unfused function,
and the hash one of what it computes) (never while the kernel runs
tier-1 code, compile/parallel.py "Tiers": what it will run is its tier-2 code).  This
module is the memory of those decisions, so that a second process does not measure
again:

    op builds a tuned node ──"load\\t<hash>"──▶ read <hash>.json ──▶ stitching_autotune_set
    op decides            ──"decided\\t..."───▶ merge into <hash>.json (temp + rename)

    $STITCHING_CACHE_DIR/autotune/<device>/<spec hash>.json
    {"version": 3, "spec_hash": "<24 hex>", "device": "<device>",
     "classes": {"<log2 input bytes>": {"choice": "kernel" | "native",
                                        "kernel_us": float, "native_us": float}}}

Keyed by spec hash + shape class + device: ``device`` names what a timing depends on
besides the spec and the size -- the CPU (model and flags), the cores this process may
use, TF's intra-op thread count and the switches that choose OpenBLAS's and TF's
kernels (OPENBLAS_CORETYPE, TF_ENABLE_ONEDNN_OPTS) -- and is part of the path, so another machine's
timings are never read.  A file that does not parse, or an entry that is not exactly
the format above (a wrong hash or device, an unknown choice, a negative or non-finite
time, a class out of range), counts as missing: that class is measured again and the
file rewritten.  The op calls ``_sink`` through ctypes (holding the GIL) from a TF
thread; nothing may escape it.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import platform
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from .. import cachedir
from ..plan.profiles import usable_cores

VERSION = 3   # 2: measured on tier-2 code only (a version-1 decision may have timed the
#               quick tier-1 code of a tiered compile, ~3x slower: measured again);
#            3: a StitchedAttention measures only once no kernel runs tier-1 code (a
#               version-2 decision may have timed its unfused function's softmax on
#               tier-1 code, 2.4-3.3x slower, and chosen the fused op wrongly)
CHOICES = {"kernel": 1, "native": 2}
NAMES = {v: k for k, v in CHOICES.items()}
N_CLASSES = 64                 # op.cc's kTuneClasses
_HEX = set("0123456789abcdef")

_Sink = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)
_lock = threading.Lock()
_sinks: list = []              # installed callbacks, kept alive forever
_errors: list = []             # what the sink could not do (kept for tests and reports)


def shape_class(input_bytes: int) -> int:
    """The op's shape class of a call: floor(log2(bytes of all its inputs))."""
    return min(N_CLASSES - 1, max(0, int(input_bytes).bit_length() - 1))


@lru_cache(maxsize=1)
def device() -> str:
    """What a measured time depends on besides spec and size, as a short hash."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        cpu = " ".join(fields.get(k, "").strip() for k in ("model name", "flags"))
    except OSError:
        pass
    cores = usable_cores()
    threads = os.environ.get("TF_NUM_INTRAOP_THREADS", "")
    # which kernels OpenBLAS and TF run: a StitchedAttention's decision (OpenBLAS's
    # products against oneDNN's) turned on them (BENCHMARKS.md attention@amd_avx512_zen5)
    kernels = "|".join(os.environ.get(k, "") for k in ("OPENBLAS_CORETYPE",
                                                         "TF_ENABLE_ONEDNN_OPTS"))
    text = f"{platform.machine()}|{cpu}|{cores}|{threads}|{kernels}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path(spec_hash: str) -> Path:
    return cachedir.root() / "autotune" / device() / f"{spec_hash}.json"


def _valid_hash(h) -> bool:
    return isinstance(h, str) and 8 <= len(h) <= 64 and set(h) <= _HEX


def _valid_entry(e) -> bool:
    if not isinstance(e, dict) or e.get("choice") not in CHOICES:
        return False
    for k in ("kernel_us", "native_us"):
        v = e.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                not math.isfinite(v) or v < 0:
            return False
    return True


def read(spec_hash: str) -> dict:
    """{class: entry} of the valid decisions on disk for ``spec_hash`` (empty when the
    file is missing or bad; a bad entry is left out)."""
    try:
        doc = json.loads(cachedir.read_file(path(spec_hash), 1 << 20))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != VERSION or \
            doc.get("spec_hash") != spec_hash or doc.get("device") != device() or \
            not isinstance(doc.get("classes"), dict):
        return {}
    out = {}
    for k, e in doc["classes"].items():
        if isinstance(k, str) and k.isdigit() and int(k) < N_CLASSES and _valid_entry(e):
            out[int(k)] = {"choice": e["choice"], "kernel_us": float(e["kernel_us"]),
                           "native_us": float(e["native_us"])}
    return out


def write(spec_hash: str, cls: int, choice: str, kernel_us: float, native_us: float):
    """Adds one decision to the spec's file (its other valid entries kept), atomically;
    the read and the write under a lock between processes too (two processes writing
    32 decisions each to one spec's file at once kept 35 of the 64)."""
    target = path(spec_hash)
    with _lock, cachedir.locked(cachedir.slot_lock(target.parent, target.name)):
        classes = read(spec_hash)
        classes[cls] = {"choice": choice, "kernel_us": round(kernel_us, 3),
                        "native_us": round(native_us, 3)}
        doc = {"version": VERSION, "spec_hash": spec_hash, "device": device(),
               "classes": {str(k): v for k, v in sorted(classes.items())}}
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _handle(msg: str, lib) -> None:
    kind, _, rest = msg.partition("\t")
    if kind == "load":
        if not _valid_hash(rest):
            return
        for cls, e in read(rest).items():
            lib.stitching_autotune_set(rest.encode(), cls, CHOICES[e["choice"]],
                                       int(e["kernel_us"] * 1e3), int(e["native_us"] * 1e3))
    elif kind == "decided":
        h, cls, choice, k_ns, n_ns = rest.split("\t")
        if _valid_hash(h) and int(choice) in NAMES:
            write(h, int(cls), NAMES[int(choice)], int(k_ns) / 1e3, int(n_ns) / 1e3)


def install(lib) -> None:
    """Makes this module the op's autotune sink (registry.load calls it)."""
    def sink(raw) -> int:
        try:                     # nothing may escape a ctypes callback
            _handle(raw.decode("utf-8"), lib)
            return 0
        except BaseException as e:  # noqa: BLE001 - a failed write costs a re-measure
            try:
                _errors.append(f"{type(e).__name__}: {e}")
            except BaseException:  # noqa: BLE001
                pass
            return 1
    cb = _Sink(sink)
    _sinks.append(cb)
    lib.stitching_autotune_set_sink(cb)


def uninstall(lib) -> None:
    """At exit: TF threads must not call into a finalizing interpreter."""
    lib.stitching_autotune_set_sink(_Sink())


def decisions(text: str) -> dict:
    """{(spec hash, class): {"choice", "kernel_us", "native_us", "source"}} from the op's
    decision table (``stitching_autotune_read``; choice None while a class is still
    being measured)."""
    out = {}
    for line in text.splitlines():
        h, cls, choice, k_ns, n_ns, source = line.split("\t")
        out[(h, int(cls))] = {"choice": NAMES.get(int(choice)),
                              "kernel_us": int(k_ns) / 1e3, "native_us": int(n_ns) / 1e3,
                              "source": source}
    return out


_COUNTS = ("autotune_measured", "autotune_cached", "autotune_timed_calls",
           "autotune_native_calls")


def counts(lib) -> dict:
    out = (ctypes.c_int64 * 4)()
    lib.stitching_autotune_counts(out)
    return dict(zip(_COUNTS, (int(v) for v in out)))
