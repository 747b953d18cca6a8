"""Numbers and table cells shared by every table: the suites' own (train.py,
serving.py) and output.py's.  At the bottom of bench_lib: imports nothing of it."""
from __future__ import annotations

import math


def med(row, mode):
    m = row["modes"].get(mode)
    return m["time"]["median_s"] if m and m.get("time") else None


def speedup(row, mode, base):
    a, b = med(row, base), med(row, mode)
    return a / b if a and b else None


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _ms(s):
    if s is None:
        return "-"
    ms = s * 1e3
    return f"{ms:.1f}" if ms >= 100 else f"{ms:.2f}" if ms >= 10 else f"{ms:.3f}"


def _time_cell(row, mode):
    m = row["modes"].get(mode)
    if m is None:
        return "-"
    if not m.get("time"):
        return "FAILED"
    t = m["time"]
    half_iqr = (t["q3_s"] - t["q1_s"]) / 2 / t["median_s"] * 100
    return f"{_ms(t['median_s'])} ±{half_iqr:.0f}%"


def _x(v):
    return f"{v:.2f}x" if v else "-"


def _int(v):
    return "-" if v is None else str(v)


def _verdict(ok, text):
    return ("PASS" if ok else "FAIL") + "  " + text
