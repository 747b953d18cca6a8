"""Timing modes side by side, and checking their outputs against stock TF.

Modes are timed round-robin, one repeat of each in turn, so a noisy neighbour on this
shared 2-core machine slows all modes alike instead of whichever happened to run
during the noise.  The order is shuffled every repeat (seeded), not rotated: a
rotation keeps each mode's predecessor fixed, and a mode run right after another
pays for what that one leaves behind (its pool threads still spinning, its data in
the caches).  With the rotation, 'stitching' always ran after 'xla', and the 16
patterns rows where the full and the baseline planner give the very same kernels
measured 0.95x geomean (down to 0.82x) in the 'stitching' slot against the
'baseline' slot.  A repeat of a fast function
is a loop of n calls (n calibrated so a repeat lasts about ``min_time``), so
perf_counter resolution and per-repeat jitter do not dominate microsecond timings;
the reported time is per call.

Before the repeats, the warm-up waits for the tier-2 code and then calls the stitched
modes until no autotuned op is still timing its ways (``modes.settle_autotune``), so
that a fresh cache's measuring calls are not timed.

Each repeat starts with untimed calls (at least ``lead_time`` of them, at least one):
what a mode inherits from the one before is not over after one call.  logsumexp
8192x1024 stitched, per call in a loop, measured 1.4 ms in steady state but 2.4-3.5,
2.2-3.0, 1.9-2.5, 1.6-2.1 ms over the first four calls after 5 calls of stock TF or
XLA (or after a 30 ms pause), a cost that a 20 ms repeat of ~14 calls charged the
fastest mode ~25% for and a 250 ms TF repeat ~2%.  The lead-in takes it out of every
mode alike.
"""
from __future__ import annotations

import math
import random
import time

import numpy as np
import tensorflow as tf

from .modes import STITCHED, Runner, first_line, settle_autotune, wait_for_final_code


def _stats(samples):
    a = np.asarray(samples, dtype=np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median_s": float(med), "q1_s": float(q1), "q3_s": float(q3),
            "min_s": float(a.min()), "max_s": float(a.max()), "n": int(a.size)}


def _calls(seconds: float, one: float) -> int:
    """How many calls of ``one`` seconds last about ``seconds`` (1 to 1000)."""
    return max(1, min(1000, math.ceil(seconds / max(one, 1e-7))))


def time_modes(runners: list[Runner], args, *, repeats: int, warmup: int,
               min_time: float = 0.02, lead_time: float = 0.015) -> dict:
    """{mode: stats} for the runners that are ok; a runner failing here is marked failed."""
    live = [r for r in runners if r.ok]
    inner, lead = {}, {}
    for r in list(live):
        try:
            for _ in range(warmup):
                r.fn(*args)
        except Exception as e:
            r.fail(e, "warm-up")
            live.remove(r)
    wait_for_final_code()
    settled = settle_autotune(live, args)
    for r in live:
        if r.mode in STITCHED:
            r.info["autotune_settle_rounds"] = settled
    live = [r for r in live if r.ok]
    for r in list(live):
        try:
            t0 = time.perf_counter()
            r.fn(*args)
            one = time.perf_counter() - t0
            inner[r.mode] = _calls(min_time, one)
            lead[r.mode] = _calls(lead_time, one)
        except Exception as e:
            r.fail(e, "warm-up")
            live.remove(r)
    samples = {r.mode: [] for r in live}
    order = list(live)
    rng = random.Random(len(live) * 1000 + repeats)     # the same orders every run
    for rep in range(repeats):
        rng.shuffle(order)
        for r in order:
            if not r.ok:
                continue
            n = inner[r.mode]
            f = r.fn
            try:
                for _ in range(lead[r.mode]):
                    f(*args)
                t0 = time.perf_counter()
                for _ in range(n):
                    f(*args)
                samples[r.mode].append((time.perf_counter() - t0) / n)
            except Exception as e:
                r.fail(e, "timing")
    out = {}
    for r in live:
        if r.ok and samples[r.mode]:
            out[r.mode] = _stats(samples[r.mode])
            out[r.mode]["calls_per_repeat"] = inner[r.mode]
    return out


def to_numpy(out) -> list:
    return [np.asarray(t) for t in tf.nest.flatten(out)]


def nbytes(values) -> int:
    return int(sum(np.asarray(v).nbytes for v in tf.nest.flatten(values)))


def compare(ref: list, got: list, rtol: float, atol_rel: float) -> dict:
    """allclose(got, ref) with atol = atol_rel * max|ref| (scale-aware: a ResNet's
    softmax and a logsumexp differ by orders of magnitude)."""
    if got is None:
        return {"ok": None}
    try:
        if len(ref) != len(got):
            return {"ok": False, "why": f"{len(got)} outputs, stock TF has {len(ref)}"}
        worst_abs, worst_rel, ok = 0.0, 0.0, True
        for a, b in zip(ref, got):
            if a.shape != b.shape:
                return {"ok": False, "why": f"shape {b.shape} != {a.shape}"}
            if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
                ok &= bool(np.array_equal(a, b))
                continue
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            scale = float(np.max(np.abs(a64))) if a64.size else 0.0
            atol = atol_rel * max(scale, 1e-30)
            diff = np.abs(a64 - b64)
            if not np.all(np.isfinite(b64) == np.isfinite(a64)):
                ok = False
            fin = np.isfinite(diff)
            if fin.any():
                worst_abs = max(worst_abs, float(diff[fin].max()))
                worst_rel = max(worst_rel, float((diff[fin] / (np.abs(a64[fin]) + atol)).max()))
            ok &= bool(np.allclose(b64, a64, rtol=rtol, atol=atol, equal_nan=True))
        return {"ok": ok, "max_abs_err": worst_abs, "max_rel_err": worst_rel}
    except Exception as e:
        return {"ok": False, "why": first_line(e)}
