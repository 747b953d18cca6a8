"""``python -m stitching.profile``: the device profile the planner uses, and where each
number in it came from.

    python -m stitching.profile              # show it
    python -m stitching.profile --remeasure  # measure this machine again (about a second)
    python -m stitching.profile --json       # the same as JSON

The profile is what the cost model knows of the machine (plan/profiles.py): memory and
cache bandwidth, exp throughput, cores, caches, the vector ISA, and whether TF runs
oneDNN.  A pinned profile (``STITCHING_DEVICE_PROFILE=<name or file>``) is shown as
pinned; the measured one with its date, its spread and whether it is still provisional
(measured while the machine was busy: a later process measures again).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .plan import profiles

_THROUGHPUTS = (("bandwidth", "memory bandwidth, all cores", 1e9, "GB/s"),
                ("bw_per_lane", "memory bandwidth, one core", 1e9, "GB/s"),
                ("cache_bandwidth", "cache bandwidth, all cores", 1e9, "GB/s"),
                ("transcendental_per_s", "exp throughput, all cores", 1e6, "M/s"))


def _onednn(prof) -> tuple:
    """(on?, where that came from)."""
    if prof.tf_onednn is not None:
        return prof.tf_onednn, "the profile"
    try:
        from .tf.passes import remapper
    except ImportError:                      # no TensorFlow here
        return None, "no TensorFlow installed"
    return remapper.onednn_enabled(), "the running TF (IsMklEnabled)"


def describe(prof, measured=None) -> dict:
    """The profile ``prof`` the planner uses, as a JSON-able dict with each number's
    origin; ``measured``: this machine's measured profile, when it is the source."""
    pinned = measured is None
    # the throughputs are the class model's exactly where settled() substitutes them
    substituted = not pinned and profiles.settled(measured) is not measured
    rows = []
    for key, what, unit, unit_name in _THROUGHPUTS:
        if pinned:
            origin = "pinned"
        elif substituted and measured.provisional:
            origin = f"{measured.cpu_class} machine model (this machine's measurement " \
                     f"is provisional: {measured.spread.get(key, 0):.0%} spread)"
        elif substituted:
            origin = f"{measured.cpu_class} machine model (its calibration's; this " \
                     f"machine measured {getattr(measured, key) / unit:.1f} {unit_name})"
        else:
            origin = f"measured, median of {profiles.TRIALS} trials, " \
                     f"spread {measured.spread.get(key, 0):.0%}"
        rows.append({"number": key, "what": what, "value": getattr(prof, key),
                     "shown": f"{getattr(prof, key) / unit:.1f} {unit_name}",
                     "origin": origin})
    on, on_from = _onednn(prof)
    return {
        "profile": prof.name, "source": prof.source, "backend": prof.backend,
        "pinned_by": os.environ.get("STITCHING_DEVICE_PROFILE") or None,
        "cpu_class": prof.cpu_class, "isa": prof.isa, "vector_bytes": prof.vector_bytes,
        "cores": prof.units, "caches": prof.caches,
        "tf_onednn": on, "tf_onednn_from": on_from,
        "measured_at": (measured or prof).measured_at,
        "provisional": bool(measured and measured.provisional),
        "why_provisional": measured.why_provisional if measured else "",
        "attempts": int(measured.spread.get("attempts", 1)) if measured else 0,
        "calibration": "yes" if prof.tf_time_scale else "none",
        "numbers": rows,
    }


def _print(d: dict) -> None:
    print(f"device profile in use: {d['profile']} ({d['source'] or 'pinned, built in'})")
    if d["pinned_by"]:
        print(f"  pinned by STITCHING_DEVICE_PROFILE={d['pinned_by']}")
    if d["backend"] == "cpu":
        caches = " / ".join(f"{k.upper()} {v >> 10} KiB" for k, v in sorted(d["caches"].items()))
        onednn = {True: "on", False: "off", None: "unknown"}[d["tf_onednn"]]
        print(f"  CPU: class {d['cpu_class'] or '?'}, {d['isa'] or '?'} "
              f"({d['vector_bytes']}-byte vectors), {d['cores']} cores; {caches}")
        print(f"  TF oneDNN: {onednn} (from {d['tf_onednn_from']})")
    if d["measured_at"]:
        state = (f"PROVISIONAL after {d['attempts']} measurement(s): {d['why_provisional']}; "
                 f"a later process measures again" if d["provisional"] else "final")
        print(f"  measured {d['measured_at']}: {state}")
    for r in d["numbers"]:
        print(f"  {r['what']:28s} {r['shown']:>12s}   {r['origin']}")
    print(f"  calibration factors: {d['calibration']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stitching.profile",
                                 description="Show the device profile the planner uses.")
    ap.add_argument("--remeasure", action="store_true",
                    help="measure this machine again and store the result")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    spec = os.environ.get("STITCHING_DEVICE_PROFILE", "")
    if args.remeasure:
        profiles.measured_cpu(remeasure=True)
    measured = None
    if not spec or spec.lower() == "cpu":
        measured = profiles.measured_cpu()
    try:
        prof = profiles.default()
    except (ValueError, OSError) as e:
        print(f"stitching.profile: {e}", file=sys.stderr)
        return 2
    d = describe(prof, measured)
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        _print(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
