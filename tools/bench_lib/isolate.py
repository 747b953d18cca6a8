"""Run a suite's rows in a worker process, so a crash cannot end the benchmark.

stitching runs native code (a C++ op calling Numba-compiled functions); a bug there is
a segfault, which no ``except`` catches.  The parent starts one worker for the whole
suite (TF is imported once), and the worker prints a START line before each row and
a ROW line (JSON) after it.  If the worker dies or goes silent for longer than
``row_timeout``, the parent records the row it was on, starts a new worker for the
rest, and re-runs that row once without the stitching mode, so its TF and XLA times
are still in the table and stitching shows as FAILED with the signal.
"""
from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

from .machine import REPO

START = "@@BENCH_START@@"
ROW = "@@BENCH_ROW@@"


def worker_main(config_json: str) -> None:
    """Entry point of the worker process (bench.py --_worker CONFIG)."""
    from . import suites
    cfg = json.loads(config_json)

    drop = cfg.get("drop_stitching") or {}
    # Test hook: die like a segfaulting kernel would, on this row, unless the parent
    # already dropped stitching for it (tests/test_zoo.py checks the recovery).
    crash_on = os.environ.get("STITCHING_BENCH_TEST_CRASH_ON")

    def on_start(key):
        print(START + key, flush=True)
        if key == crash_on and key not in drop:
            os.kill(os.getpid(), signal.SIGSEGV)

    def on_row(key, row):
        print(ROW + json.dumps(row, default=str), flush=True)

    suites.run_rows(cfg["suite"], cfg["keys"], mode_list=tuple(cfg["modes"]),
                    planner=cfg.get("planner"), repeats=cfg.get("repeats"),
                    warmup=cfg.get("warmup"), min_time=cfg.get("min_time"),
                    drop_stitching=drop, train_opts=cfg.get("train_opts"),
                    on_start=on_start, on_row=on_row)


def _describe_exit(code) -> str:
    if code is None:
        return "hung"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def run_isolated(suite, keys, *, mode_list, planner=None, repeats=None, warmup=None,
                 min_time=None, row_timeout=900, train_opts=None) -> list[dict]:
    rows = {}
    drop: dict[str, str] = {}
    failed_twice: dict[str, str] = {}
    todo = list(keys)
    while todo:
        cfg = {"suite": suite, "keys": todo, "modes": list(mode_list), "planner": planner,
               "repeats": repeats, "warmup": warmup, "min_time": min_time,
               "drop_stitching": drop, "train_opts": train_opts}
        done, current, status = _run_worker(cfg, rows, row_timeout)
        if current is None:          # finished (or died between rows)
            todo = [k for k in todo if k not in rows]
            if todo and status:
                for k in todo:
                    failed_twice[k] = f"worker {status} before this row"
                todo = []
            continue
        why = f"process {status} during this row"
        if current in drop:          # already retried without stitching: give up on it
            failed_twice[current] = why
        else:
            drop[current] = f"crash: {why} (TF/XLA re-run without stitching)"
        print(f"[bench] worker {status} on {current}", file=sys.stderr, flush=True)
        todo = [k for k in todo if k not in rows and k not in failed_twice]
    out = []
    for k in keys:
        if k in rows:
            out.append(rows[k])
        elif k in failed_twice:
            name, variant = k.rsplit("/", 1)
            row = {"suite": suite, "name": name, "modes": {
                m: {"ok": False, "error": f"crash: {failed_twice[k]}", "time": None,
                    "check": None, "first_call_s": None} for m in mode_list}}
            row.update({"size": variant} if suite == "patterns" else {"batch": int(variant[1:])})
            out.append(row)
    return out


def _run_worker(cfg, rows, row_timeout):
    """Run one worker until it exits; fills ``rows``.  Returns (rows done, key it was
    on when it died or None, exit description or None when it exited cleanly)."""
    cmd = [sys.executable, os.path.join(REPO, "tools", "bench.py"), "--_worker",
           json.dumps(cfg)]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env,
                         bufsize=1)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    current, done = None, 0
    last = time.monotonic()
    hung = False
    while True:
        if not sel.select(timeout=5.0):
            if time.monotonic() - last > row_timeout:
                hung = True
                p.kill()
                break
            if p.poll() is not None:
                break
            continue
        line = p.stdout.readline()
        if not line:
            break
        last = time.monotonic()
        line = line.rstrip("\n")
        if line.startswith(START):
            current = line[len(START):]
        elif line.startswith(ROW):
            row = json.loads(line[len(ROW):])
            key = f"{row['name']}/{row['size']}" if "size" in row else f"{row['name']}/b{row['batch']}"
            rows[key] = row
            done += 1
            current = None
        else:
            print(line, flush=True)   # a library printing to stdout: pass it on
    p.wait()
    sel.close()
    if hung:
        return done, current, f"hung (no progress for {row_timeout} s)"
    if p.returncode == 0:
        return done, None, None
    return done, current, _describe_exit(p.returncode)
