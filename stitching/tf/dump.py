"""Writing a graph dump: what stitching did to one traced function, on disk.

Like XLA's ``--xla_dump_to``: one directory per traced function under the dump root
(``Options(dump_dir=...)``, ``$STITCHING_DUMP_DIR`` or ``stitching-rewrite
--dump-dir``), named ``<seq>_<function>_<graph hash>`` so retraces and several
functions never collide (the sequence is per process; two processes tracing the same
graph get ``.1``, ``.2`` suffixes from an exclusive mkdir)::

    0003_block_1f2e3d4c/
      dump.json            everything below as data (schema: schema/dump-v1.schema.json)
      graph_before.pb      the GraphDef handed to stitching (and .pbtxt when small)
      graph_after.pb       the rewritten GraphDef, one StitchedKernel node per region
      passes/<NN>_<pass>.pb  the graph after each pass Options(dump_passes) names
      ir.txt               the IR the planner saw
      kernels/<k>/spec.json      the kernel's spec (exactly what the graph node carries)
      kernels/<k>/schedule.txt   the schedule stage's description
      kernels/<k>/source.py      the generated Numba source
      profile.json         measured calls/time/bytes per kernel (profiling on, after runs)

Only a dumping call pays for any of this: ``pipeline`` calls ``write`` when a dump
root is set, and the estimates here (cost model, bytes, FLOPs) are computed then,
not during planning.  This module writes dumps (it sits at the TF edge, where the
GraphDefs are); ``stitching.inspect`` reads them back.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import threading
import time
import warnings
from dataclasses import asdict

SCHEMA = "stitching-dump"
VERSION = 1
PROFILE_SCHEMA = "stitching-profile"
_PBTXT_MAX_BYTES = 4 << 20     # arbitrary: text copies of larger graphs are not readable

_seq = itertools.count()
_lock = threading.Lock()
WRITTEN: list = []             # (dump path, {label: kernel name}) written by this process


def dump_root(options) -> str | None:
    """Where to dump: ``options.dump_dir``, else ``$STITCHING_DUMP_DIR``, else None."""
    return getattr(options, "dump_dir", None) or os.environ.get("STITCHING_DUMP_DIR") or None


def make_dir(root: str, name: str, graph_bytes: bytes) -> str:
    """A fresh directory for one traced function (never an existing one)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._")[:60] or "function"
    digest = hashlib.sha256(graph_bytes).hexdigest()[:8]
    os.makedirs(root, exist_ok=True)
    with _lock:
        base = os.path.join(root, f"{next(_seq):04d}_{safe}_{digest}")
    path, k = base, 0
    while True:
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            k += 1
            path = f"{base}.{k}"


def labels_for(path: str, n: int) -> list:
    """StitchedKernel ``label`` attrs for a dumped function: unique per dump, so the
    op's profile counters (keyed by label) map back to this dump's kernels."""
    tag = os.path.basename(path)
    return [f"{tag}/kernel_{i}" for i in range(n)]


def write(path, *, name, options, graph_before, graph_after, ir, the_plan, regions,
          kernels, kernel_names, labels, failed, report) -> None:
    """Fill ``path`` (from ``make_dir``).  A failure warns and leaves a partial dump:
    dumping must never break the function it describes."""
    try:
        _write(path, name, options, graph_before, graph_after, ir, the_plan, regions,
               kernels, kernel_names, labels, failed, report)
        with _lock:
            WRITTEN.append((path, dict(zip(labels, kernel_names))))
        _profile_at_exit()
    except Exception as e:  # noqa: BLE001 — see above
        warnings.warn(f"stitching: could not write the dump {path}: "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)


def _write(path, name, options, graph_before, graph_after, ir, the_plan, regions,
           kernels, kernel_names, labels, failed, report):
    from ..plan import profiles
    files = {}
    for key, gd in (("graph_before", graph_before), ("graph_after", graph_after)):
        files[key] = _write_graph(path, key, gd)
    files["ir"] = _write_text(path, "ir.txt", ir.pretty() + "\n")
    profile = profiles.default()
    costs = _graph_costs(ir, profile)
    entries = [_kernel_entry(path, reg, kname, label, k, ir, profile, costs, info)
               for reg, kname, label, k, info in zip(regions, kernel_names, labels, kernels,
                                                     report.kernels)]
    doc = {
        "schema": SCHEMA, "version": VERSION,
        "function": name, "id": os.path.basename(path),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "stitching_version": _version(),
        "options": _options_dict(options),
        "device_profile": _profile_dict(profile),
        "files": files,
        "summary": {k: report.to_dict()[k] for k in (
            "memory_intensive_ops", "fused_ops", "kernels", "unique_kernels",
            "code_objects", "coverage", "compile_seconds")},
        "ir": _ir_dict(ir),
        "kernels": entries,
        "unfused": [{"node": n, "op": op, "reason": r} for n, op, r in report.unfused],
        "plan": _plan_dict(the_plan, failed, report),
        "notes": list(report.notes),
    }
    _write_text(path, "dump.json", json.dumps(doc, indent=1, allow_nan=False) + "\n")


def write_pass_graph(path, index: int, name: str, graph_def) -> None:
    """The graph after one pass (``Options(dump_passes)``, tf/passmanager.py):
    ``passes/<index>_<pass>.pb`` (and .pbtxt when small).  A failure warns."""
    try:
        os.makedirs(os.path.join(path, "passes"), exist_ok=True)
        _write_graph(path, os.path.join("passes", f"{index:02d}_{name}"), graph_def)
    except Exception as e:  # noqa: BLE001 -- dumping must never break the function
        warnings.warn(f"stitching: could not dump the graph after the {name!r} pass "
                      f"into {path}: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)


def _write_graph(path, key, gd) -> dict:
    data = gd.SerializeToString(deterministic=True)
    with open(os.path.join(path, key + ".pb"), "wb") as f:
        f.write(data)
    out = {"pb": key + ".pb"}
    if len(data) <= _PBTXT_MAX_BYTES:
        from google.protobuf import text_format
        out["pbtxt"] = _write_text(path, key + ".pbtxt", text_format.MessageToString(gd))
    return out


def _write_text(path, rel, text) -> str:
    full = os.path.join(path, rel)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w", encoding="utf-8") as f:
        f.write(text)
    return rel


def _version() -> str | None:
    """The installed distribution's version (None when run from a source tree that
    was never installed)."""
    from importlib import metadata
    try:
        return metadata.version("stitching")
    except metadata.PackageNotFoundError:
        return None


def _options_dict(options) -> dict:
    try:
        d = asdict(options)
    except TypeError:
        d = {}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()
            if isinstance(v, (str, int, float, bool, type(None)))
            or isinstance(v, tuple) and all(isinstance(x, str) for x in v)}  # exclude


def _profile_dict(p) -> dict:
    return {"name": p.name, "backend": p.backend, "measured": bool(p.measured),
            "bandwidth": float(p.bandwidth), "cache_bandwidth": float(p.cache_bandwidth),
            "transcendental_per_s": float(p.transcendental_per_s), "units": int(p.units),
            "vector_bytes": int(p.vector_bytes), "launch_s": float(p.launch_s)}


def _type_dict(t) -> dict:
    return {"dtype": t.dtype, "shape": None if t.shape is None else list(t.shape)}


def _ir_dict(ir) -> dict:
    return {"nodes": [{"name": n.name, "op": n.op, "inputs": [str(r) for r in n.inputs],
                       "control_inputs": list(n.control_inputs),
                       "outputs": [_type_dict(t) for t in n.outputs],
                       "origin": n.origin}
                      for n in ir],
            "outputs": [str(r) for r in ir.outputs]}


def _graph_costs(ir, profile):
    from ..plan.cost import GraphCosts
    try:
        order = ir.topo_order()
        return GraphCosts(ir, profile, order)
    except Exception:  # noqa: BLE001 — an estimate we cannot make is left out
        return None


def _kernel_entry(path, reg, kname, label, k, ir, profile, costs, info) -> dict:
    spec = reg.spec
    d = os.path.join("kernels", _safe(kname))
    files = {"spec": _write_text(path, os.path.join(d, "spec.json"),
                                 json.dumps(spec.to_dict(), indent=1) + "\n")}
    sched = getattr(k, "schedule", None)
    desc = sched.describe() if hasattr(sched, "describe") else ""
    if desc:
        files["schedule"] = _write_text(path, os.path.join(d, "schedule.txt"), desc + "\n")
    if getattr(k, "source", None):
        files["source"] = _write_text(path, os.path.join(d, "source.py"), k.source)
    return {
        "name": kname, "label": label, "spec_hash": spec.hash,
        "code_name": getattr(k, "code_name", None),
        "nodes": list(reg.nodes),
        # the TF op type as the report names it (the IR's where no TF node has the name)
        "ops": [{"node": m, "op": op if op != "?" else ir[m].op, "ir_op": ir[m].op}
                for m, op in info.ops],
        "inputs": [{"ref": str(r), **_type_dict(ir.type_of(r))} for r in reg.inputs],
        "outputs": [{"ref": str(r), **_type_dict(ir.type_of(r))} for r in reg.outputs],
        "kind": str(getattr(getattr(sched, "kind", None), "value", "") or ""),
        "schedule_summary": desc.splitlines()[0] if desc else "",
        "files": files,
        "estimate": _estimate(spec, reg, ir, profile, costs),
    }


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _estimate(spec, reg, ir, profile, costs) -> dict:
    """The cost model's view of one kernel (unknown dims at cost.DEFAULT_DIM)."""
    from ..ir import OPS, Kind
    from ..plan import cost
    unfused_bytes = unfused_s = None
    factor = 1.0
    if costs is not None:
        idx = [costs.index[m] for m in reg.nodes if m in costs.index]
        unfused_bytes = int(sum(costs.io_bytes[i] for i in idx))
        unfused_s = costs.unfused_s(idx)
        factor = costs.kernel_factor(idx)         # calibrated as the planner saw it
    launch = cost.choose_launch(spec, profile, factor=factor)
    ks = launch.shape
    fused_s = launch.time_s
    flops = 0
    for n in spec.nodes:
        info = OPS.get(n.op)
        # reshapes, identities and casts move or relabel data: no arithmetic
        if info is None or not n.args or info.kind in (Kind.LAYOUT, Kind.SOURCE) \
                or n.op in _NO_FLOP:
            continue
        size = (cost.elems(spec.type_of(n.args[0])) if info.kind == Kind.REDUCTION
                else cost.elems(n.type))
        flops += size
    return {"fused_us": round(fused_s * 1e6, 3),
            "unfused_us": None if unfused_s is None else round(unfused_s * 1e6, 3),
            "launch": launch.describe(), "tasks": int(launch.tasks),
            "bytes_fused": int(ks.io_bytes) if ks else None,
            "bytes_unfused": unfused_bytes,
            "flops": int(flops), "transcendentals": int(ks.transcendentals) if ks else 0,
            "shapes_known": bool(ks.rows_known) if ks else False}


_NO_FLOP = frozenset({"Identity", "Reshape", "Cast", "StopGradient", "Snapshot"})


def _plan_dict(the_plan, failed, report) -> dict:
    return {"planner_decisions": list(report.explanation),
            "refused_merges": [{"node": n, "reason": r} for n, r in the_plan.boundaries],
            "skipped": [{"nodes": list(nodes), "reason": r} for nodes, r in the_plan.skipped],
            "failed": [{"nodes": list(reg.nodes), "reason": why} for reg, why in failed]}


def read_graph(path: str):
    """A GraphDef from a dump's ``.pb`` file."""
    import tensorflow as tf
    gd = tf.compat.v1.GraphDef()
    with open(path, "rb") as f:
        gd.ParseFromString(f.read())
    return gd


# ---- profile ------------------------------------------------------------------------

_at_exit = False


def _profile_at_exit():
    """With $STITCHING_PROFILE on, the measured times land in the dumps when the
    process ends, without a write_profile call."""
    global _at_exit
    from ..plan.profiles import _PROFILING_ON
    if _at_exit or os.environ.get("STITCHING_PROFILE", "").lower() not in _PROFILING_ON:
        return
    import atexit
    _at_exit = True
    atexit.register(lambda: _quietly(write_profiles))


def _quietly(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 — the process is ending; the dump stays without it
        pass


def write_profiles(paths=None) -> list:
    """Write ``profile.json`` into the dumps this process wrote (or those in ``paths``),
    from the op's counters (runtime.profile).  Returns the files written."""
    from .. import runtime
    counters = runtime.profile()
    with _lock:
        written = list(WRITTEN)
    want = None if paths is None else {os.path.abspath(p) for p in paths}
    out = []
    for path, by_label in written:
        if want is not None and os.path.abspath(path) not in want:
            continue
        kernels = {by_label[lbl]: dict(c, label=lbl)
                   for lbl, c in counters.items() if lbl in by_label}
        if by_label and not any(c.get("calls") for c in kernels.values()):
            warnings.warn(
                f"profile.json of {path}: none of its {len(by_label)} kernel(s) ran "
                "while profiling was on (a stitched function's first calls run stock TF "
                "while its kernels compile: call f.wait() before the profiled calls)",
                RuntimeWarning, stacklevel=3)
        doc = {"schema": PROFILE_SCHEMA, "version": VERSION,
               "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "kernels": kernels}
        out.append(os.path.join(path, _write_text(
            path, "profile.json", json.dumps(doc, indent=1) + "\n")))
    return out
