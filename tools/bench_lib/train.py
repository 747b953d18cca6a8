"""The train suite: one custom training step per model (stitching.testing.train), three ways.

    tf          tf.function(step)
    xla         tf.function(step, jit_compile=True) (a FAILED cell where XLA cannot
                compile the step)
    stitching   stitching.function(step)

Each mode trains its own copy of the model from the same initial weights on the same
batch.  Correctness: the first ``CHECK_STEPS`` steps' losses of each mode against stock
TF's (relative error, bar 1e-4: the issue's float32 bar for 20-step losses).  Timing:
bench.py's interleaved, shuffled repeats (measure.time_modes; a repeat is a loop of
steps lasting about ``--min-time``), median per step.  Kernels per step: memory-intensive
TF ops of the traced step (tf), XLA's memory-intensive kernels in the optimized HLO
(xla), stitched kernels from the report (stitching), split into forward / backward /
optimizer by node name (stitching.testing.train.phase_of; a stitched kernel holding ops
of two phases is 'mixed').  Coverage: the fraction of the backward pass's and of the
optimizer update's memory-intensive ops that are inside stitched kernels.

Peak memory: the peak of TF's CPU allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``, read by
``tf.config.experimental.get_memory_info``) over ``--steps``-long runs of steps after two
untimed steps, in a fresh process per mode and measurement (``tools/bench.py
--_train_memory``); every buffer of the step goes through it: TF's tensors, stitched
kernels' outputs (kernel outputs under 32 MiB; none here is larger, so the op's own
output pool is not used) and their temp buffers.  The cell is the median of
``--memory-runs`` processes with the range.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import numpy as np
import tensorflow as tf

from . import measure, modes
from .cells import _int
from .machine import REPO

CHECK_STEPS = 5
LOSS_RTOL = 1e-4
_MEM = "@@TRAIN_PEAK@@"


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def case_keys(only=None) -> list[str]:
    from stitching.testing import train as T
    names = list(only) if only else list(T.CASES)
    return [f"{n}/b{T.get(n).batch}" for n in names]


def _build(mode, name, planner):
    from stitching.testing import train as T
    step = T.make_step(name)
    r = modes.build(mode, step.fn, None, planner)
    return r, step


def run_row(name, *, mode_list, planner=None, repeats=5, warmup=2, min_time=0.1,
            memory_runs=3, memory_steps=10) -> dict:
    from stitching.testing import train as T
    case = T.get(name)
    built = [_build(m, name, planner) for m in mode_list]
    runners = [r for r, _ in built]
    steps = {r.mode: s for r, s in built}
    losses = {}
    for r, s in built:
        first = modes.first_call(r, [s.x, s.y])
        if r.ok:
            try:
                losses[r.mode] = [float(first)] + [float(r.fn(s.x, s.y))
                                                   for _ in range(CHECK_STEPS - 1)]
            except Exception as e:   # noqa: BLE001 - a failing mode is a FAILED cell
                r.fail(e, "steps")
    counts = {r.mode: _counts(r, steps[r.mode]) for r in runners if r.ok}
    ref = losses.get("tf")
    # Every mode's timed calls get its own (x, y): the runners share one argument list
    # in time_modes, and the batches are equal by construction.
    times = _time(runners, steps, repeats, warmup, min_time)
    row = {"suite": "train", "name": name, "batch": case.batch,
           "description": case.description, "modes": {}}
    for r in runners:
        m = {"ok": r.ok, "error": r.error, "first_call_s": r.first_call_s,
             "time": times.get(r.mode), "losses": losses.get(r.mode)}
        m.update(counts.get(r.mode) or {})
        if r.mode != "tf" and r.mode in losses:
            m["check"] = _loss_check(ref, losses[r.mode])
        if r.error and "traceback" in r.info:
            m["traceback"] = r.info["traceback"]
        row["modes"][r.mode] = m
    for mode in mode_list:
        if memory_runs and row["modes"][mode]["ok"]:
            row["modes"][mode]["peak"] = peak_memory(name, mode, memory_runs, memory_steps,
                                                     planner)
    _log("  " + name + ": " + ", ".join(
        f"{k} {v['time']['median_s'] * 1e3:.2f} ms" if v.get("time") else f"{k} FAILED"
        for k, v in row["modes"].items()))
    return row


def _time(runners, steps, repeats, warmup, min_time):
    # time_modes calls every runner with the same args; wrap each so it steps its own
    # model on its own (equal) batch.
    wrapped = []
    for r in runners:
        if not r.ok:
            continue
        s = steps[r.mode]
        w = modes.Runner(r.mode, fn=(lambda f, x, y: lambda: f(x, y))(r.fn, s.x, s.y))
        wrapped.append((r, w))
    out = measure.time_modes([w for _, w in wrapped], [], repeats=repeats, warmup=warmup,
                             min_time=min_time)
    for r, w in wrapped:
        if not w.ok:
            r.error, r.info["traceback"] = w.error, w.info.get("traceback")
    return out


def _loss_check(ref, got) -> dict:
    if not ref:
        return {"ok": None, "why": "no stock TF losses"}
    rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, ref))
    ok = bool(np.all(np.isfinite(got))) and rel <= LOSS_RTOL
    return {"ok": ok, "max_rel_err": rel, "max_abs_err": max(abs(a - b) for a, b in
                                                             zip(got, ref)),
            "steps": len(got)}


def _counts(r, step) -> dict:
    """Kernels per step and per phase, and the coverage of each phase."""
    from stitching.testing import train as T
    from stitching.testing.counting import count_memory_intensive_ops, count_xla_kernels
    from stitching.tf.opnames import is_memory_intensive
    scope = step.optimizer_scope
    try:
        if r.mode == "tf":
            cf = r.fn.get_concrete_function(step.x, step.y)
            phases = {p: 0 for p in T.PHASES}
            for n in cf.graph.as_graph_def().node:
                if is_memory_intensive(n.op):
                    phases[T.phase_of(n.name, scope)] += 1
            return {"kernels": count_memory_intensive_ops(cf), "phase_kernels": phases}
        if r.mode == "xla":
            hlo = r.fn.experimental_get_compiler_ir(step.x, step.y)(stage="optimized_hlo")
            return {"kernels": count_xla_kernels(hlo)["memory_kernels"]}
        rep = r.fn.report.to_dict()
        ph = T.phase_counts(rep, scope)
        return {"kernels": rep["kernels"], "coverage": rep["coverage"],
                "phase_kernels": {p: ph[p]["kernels"] for p in (*T.PHASES, "mixed")},
                "phase_coverage": {p: ph[p]["coverage"] for p in T.PHASES},
                "unfused": rep["unfused"]}
    except Exception as e:   # noqa: BLE001 - counts are information
        return {"count_error": modes.first_line(e)}


# ---- peak memory, fresh processes

def peak_memory(name, mode, runs, steps, planner=None) -> dict:
    peaks = []
    for _ in range(runs):
        env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, os.path.join(REPO, "tools", "bench.py"), "--suite", "train",
               "--_train_memory", f"{name}:{mode}", "--steps", str(steps)]
        if planner:
            cmd += ["--planner", planner]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        got = [ln[len(_MEM):] for ln in p.stdout.splitlines() if ln.startswith(_MEM)]
        if p.returncode or not got:
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            return {"error": f"memory child exited {p.returncode}: {tail}"}
        peaks.append(int(got[-1]))
    return {"median_bytes": int(statistics.median(peaks)), "min_bytes": min(peaks),
            "max_bytes": max(peaks), "runs": runs}


def memory_child(spec: str, steps: int, planner=None) -> None:
    """In a fresh process with TF's BFC allocator: two untimed steps (trace, compile),
    reset the allocator's statistics, ``steps`` steps, print the peak."""
    name, mode = spec.split(":")
    r, s = _build(mode, name, planner)
    for _ in range(2):
        float(r.fn(s.x, s.y))
    tf.config.experimental.reset_memory_stats("CPU:0")
    for _ in range(steps):
        loss = r.fn(s.x, s.y)
    float(loss)
    print(_MEM + str(tf.config.experimental.get_memory_info("CPU:0")["peak"]), flush=True)


# ---- rendering (no TF needed beyond this module's import)

def _mib(p):
    if not p:
        return "-"
    if "error" in p:
        return "FAILED"
    lo, hi = p["min_bytes"] / 2**20, p["max_bytes"] / 2**20
    f = "{:.1f}" if hi >= 10 else "{:.2f}"
    rng = f" ({f.format(lo)}-{f.format(hi)})" if p.get("runs", 1) > 1 else ""
    return f.format(p["median_bytes"] / 2**20) + rng


def _phase_cell(m):
    pk = m.get("phase_kernels")
    if not pk:
        return _int(m.get("kernels"))
    parts = "/".join(str(pk.get(p, 0)) for p in ("forward", "backward", "optimizer"))
    mixed = pk.get("mixed")
    return f"{m.get('kernels')} ({parts}" + (f" +{mixed} mixed)" if mixed else ")")


def _pct(v):
    return "-" if v is None else f"{100 * v:.0f}%"


def train_table(rows):
    from .cells import _time_cell, _x, speedup
    head = ["model", "batch", "TF ms", "XLA ms", "stitched ms", "st vs TF", "st vs XLA",
            "XLA vs TF", "kernels TF (fwd/bwd/opt)", "XLA kernels",
            "stitched kernels (fwd/bwd/opt)", "bwd cov", "opt cov",
            "peak MiB TF", "peak MiB XLA", "peak MiB stitched", "losses vs TF"]
    body = []
    for r in rows:
        ms = r["modes"]
        st = ms.get("stitching") or {}
        pc = st.get("phase_coverage") or {}
        body.append([
            r["name"], str(r.get("batch")),
            _time_cell(r, "tf"), _time_cell(r, "xla"), _time_cell(r, "stitching"),
            _x(speedup(r, "stitching", "tf")), _x(speedup(r, "stitching", "xla")),
            _x(speedup(r, "xla", "tf")),
            _phase_cell(ms.get("tf") or {}), _int((ms.get("xla") or {}).get("kernels")),
            _phase_cell(st), _pct(pc.get("backward")), _pct(pc.get("optimizer")),
            _mib((ms.get("tf") or {}).get("peak")), _mib((ms.get("xla") or {}).get("peak")),
            _mib(st.get("peak")), _loss_cell(r)])
    return head, body


def _loss_cell(row):
    cells = []
    for mode, m in row["modes"].items():
        c = m.get("check")
        if not c:
            continue
        if c.get("ok") is False:
            cells.append(f"MISMATCH {mode} {c.get('max_rel_err', float('nan')):.1e}")
        elif c.get("ok"):
            cells.append(f"{mode} {c['max_rel_err']:.0e}")
    return ", ".join(cells) or "-"


BARS = {"transformer": 1.2, "cnn": 1.1}


def target_lines(rows) -> list[str]:
    from .cells import _verdict, speedup
    out = []
    for name, bar in BARS.items():
        r = next((r for r in rows if r["name"] == name), None)
        if r is None:
            continue
        s = speedup(r, "stitching", "tf")
        out.append(_verdict(s is not None and s >= bar,
                            f"train: {name} step stitched vs TF {s or 0:.2f}x (bar {bar}x)"))
    sp = [(speedup(r, "stitching", "tf"), r["name"]) for r in rows]
    out.append(_verdict(all(s and s >= 1.0 for s, _ in sp),
                        "train: no step slower than TF: " +
                        ", ".join(f"{n} {s:.2f}x" if s else f"{n} n/a" for s, n in sp)))
    mem = []
    for r in rows:
        a = ((r["modes"].get("tf") or {}).get("peak") or {}).get("median_bytes")
        b = ((r["modes"].get("stitching") or {}).get("peak") or {}).get("median_bytes")
        if a and b:
            mem.append((r["name"], a, b))
    if mem:
        out.append(_verdict(all(b <= a for _, a, b in mem),
                            "train: stitched peak memory <= TF's (median): " + ", ".join(
                                f"{n} {b / 2**20:.1f} vs {a / 2**20:.1f} MiB"
                                for n, a, b in mem)))
    return out


def method_text() -> str:
    return " ".join(__doc__.split("\n\n", 2)[2].split())
