"""Whole stitched results remembered per traced graph, so a warm process skips the
pipeline.

A warm process (every kernel in the disk cache, the plan stored: plan/cache.py) still
ran the whole pipeline per trace: Grappler, the lift to IR, the plan's rebuild and
re-check, a schedule and generated source per kernel only to find its cached code,
then the rewrite passes -- ~0.2 s for a small Keras MLP's train and test steps, after
~0.2 s importing the planner, schedules and passes.  The stitched result is a pure
function of the traced GraphDef, the call's context (fetches, options, variable
shapes, Python scalars), the device profile and stitching's own code, so it is stored
under a key over all of them:

    $STITCHING_CACHE_DIR/kernels/<toolchain>/results/<key>.json

holding the rewritten GraphDef, the report, and per kernel spec what registering it
takes without code generation (the index entry a shipped model carries:
compile/shipped.py -- code name, shape program, error messages).  A hit parses the
GraphDef, dlopens each kernel's code from the compile cache (checked like any cache
entry: compile/integrity.py) and registers it; no planner, schedule or codegen module
is imported.  Anything missing or malformed -- a kernel object evicted, a spec whose
hash is not indexed, a file that does not parse -- is a miss, and the caller stitches
as before (and stores the new result).

The key's salt hashes every source file of the package (its size and modification
time) and TF's version (Grappler's output is part of the result): another stitching
or TF never reads an old result.
Two things in a traced graph are a process's, not the program's, numbered by
counters over the process, so the same step traced in two processes (or twice in one,
or after other functions) differs there:
- ``tf.custom_gradient`` names each gradient it registers ``CustomGradient-<uid>``
  (Keras's Adam traces one);
- the library's functions: a ``tf.function`` the step calls is ``__inference_g_<uid>``,
  a while loop's body ``while_body_<uid>``, and so on.
The key reads both kinds of names as their order of first appearance (``_canonical``),
and a hit renames them in the stored graph to the ones this trace has: a gradient taken
through the graph later finds this process's function, and a function the stitched
graph still calls is this process's (of the same contents: the key read them), never
another one that happens to have the stored name here.
Results with a kernel that failed to build are not stored (the failure may be
transient: a compile limit, a killed worker), nor are calls that dump (a dump is
written by the pipeline's run).

``probe`` answers "is this graph warm?" for tiered execution (keras.py, function.py):
the result when the cache holds it and every kernel loads, else None, never planning
or compiling anything.  A probe needs the trace, so tiering asks first whether a
*hint* (the function's name, signature and options, the model's variables: no trace)
was marked when a result was stored for it, and skips the probe where none was.
"""
from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import tensorflow as tf

from .. import cachedir
from ..options import attention_autotune_on
from ..report import KernelInfo, Report

FORMAT = 2
MAX_RESULT_BYTES = 256 << 20     # arbitrary: read as a file, never more (cachedir.read_file)
_SALT = None


def _salt() -> str:
    """Every source file of the package, by contents (``cachedir.sources_digest``), and
    TF's version; once per process."""
    global _SALT
    if _SALT is None:
        _SALT = hashlib.sha256(f"{FORMAT} {tf.__version__} {cachedir.sources_digest()}"
                               .encode()).hexdigest()
    return _SALT


def context(fetches, keep, options, resources, prof=None) -> str:
    """What a graph's plan depends on besides the graph, as text (``prof``: the
    device profile, where the caller has it)."""
    from ..plan import profiles
    from .passes import remapper
    prof = prof or profiles.default()
    # keep: a set's order; where dumps go, and what they hold, does not change the plan
    return (repr((list(fetches), sorted(keep),
                  replace(options, dump_dir=None, dump_passes=None)))
            + repr(sorted((resources or {}).items()))
            + remapper.table(prof).name                          # TF_ENABLE_ONEDNN_OPTS
            + _blas(options, prof)
            + ("" if attention_autotune_on() else "-attention-autotune"))


def _blas(options, prof) -> str:
    """Whether the products become OpenBLAS ops (tf/passes/blas.py): a graph stored
    with them must not be reused by a process without the library."""
    from ..runtime import blas
    from .passes import remapper
    if not options.blas_gemm or prof.backend != "cpu" or remapper.onednn(prof):
        return ""
    return "+blas" if blas.unavailable() is None else "-blas"


def key(graph_def, fetches, keep, options, resources, bodies, scalar_values) -> str | None:
    """The result key of one stitch_graph_def call, or None where results are not
    stored (a call that dumps)."""
    from ..plan import profiles
    from . import dump
    if dump.dump_root(options):
        return None
    prof = profiles.default()
    h = hashlib.sha256(_salt().encode())
    h.update(_canonical(graph_def).SerializeToString(deterministic=True))
    h.update(context(fetches, keep, options, resources, prof).encode())
    h.update(repr((bodies, sorted(scalar_values))).encode())
    h.update(prof.planning_key().encode())
    return h.hexdigest()[:32]


def _dir() -> Path:
    """This installation's results: a folder per salt (TF's version and stitching's
    sources), so what another version stored can be told apart and pruned
    (``python -m stitching.cache --prune``)."""
    from ..compile import kernel
    return kernel.kernel_dir() / "results" / _salt()[:SALT_DIR]


SALT_DIR = 16       # hex digits of the salt naming a results folder


def _path(key: str) -> Path:
    return _dir() / f"{key}.json"


def hint(*parts) -> str:
    """A key for "a result like this was stored" that needs no trace: a function's
    name, input signature, options and what else the caller knows of its state
    (``probed`` / ``mark``)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def probed(hint_key: str) -> bool:
    """Whether a result was stored for a trace with this ``hint`` (``mark``): only then
    is a probe worth its cost -- a miss traces the graph out and back in, ~0.3 s of a
    small Keras step's first call, for nothing."""
    return (_dir() / "hints" / hint_key).exists()


def mark(hint_key: str) -> None:
    """Record that a trace with this ``hint`` stored its result (best effort)."""
    cachedir.store(_dir() / "hints" / hint_key, b"")


def mark_if_held(hint_key: str, from_cache: bool, report) -> None:
    """``mark`` for a trace whose stitched graph the cache holds: it came from there, or
    its planning stored it (``Report.result_stored``).  A hint for a result never stored
    makes the next process probe, miss and plan anyway."""
    if from_cache or getattr(report, "result_stored", False):
        mark(hint_key)


def save(key: str, traced, graph_def, report: Report) -> bool:
    """Store the stitched result ``graph_def`` of the graph ``traced``, every kernel
    of it registered from Python in this process (best effort: a read-only cache only
    costs time).  False where a kernel cannot be indexed (registered from a shipped
    model, or not at all)."""
    from .. import runtime
    from .kernel_assets import specs_in
    entries = {}
    for text in specs_in(graph_def):
        k = runtime.registered_kernel(text)
        code = getattr(k, "code_name", None)
        if code is None:
            return False
        entries[k.spec.hash] = {
            "code": code, "program": [int(v) for v in k.shape_program],
            "errors": [str(e) for e in k.errors],
            "generic": getattr(k, "in_static_dims", None) is not None}
    doc = {"format": FORMAT, "kernels": entries, "report": _report_state(report),
           "gradients": _gradient_names(traced), "functions": _function_names(traced),
           "graph_def": base64.b64encode(graph_def.SerializeToString()).decode("ascii")}
    return cachedir.store(_path(key), json.dumps(doc).encode())


@dataclass
class Stored:
    """A stitched result from the cache (pipeline.StitchResult's two fields)."""
    graph_def: object
    report: Report


def probe(key: str | None, traced) -> Stored | None:
    """The result stored under ``key`` for the graph ``traced``, every kernel of it
    registered in this process, or None (nothing stored, or anything of it
    unusable)."""
    if key is None:
        return None
    t0 = time.perf_counter()
    try:
        doc = json.loads(cachedir.read_file(_path(key), MAX_RESULT_BYTES))
    except (OSError, ValueError):
        return None
    from google.protobuf.message import DecodeError

    from ..compile.native import NativeError
    from ..runtime.registry import RegistrationError
    try:
        if doc.get("format") != FORMAT:
            return None
        graph_def = tf.compat.v1.GraphDef.FromString(base64.b64decode(doc["graph_def"]))
        stored, names = doc["gradients"], _gradient_names(traced)
        stored_fns, fns = doc["functions"], _function_names(traced)
        if len(stored) != len(names) or len(stored_fns) != len(fns):
            return None
        if stored != names:
            graph_def = _renamed(graph_def, dict(zip(stored, names)))
        if stored_fns != fns:
            graph_def = _functions_renamed(graph_def, dict(zip(stored_fns, fns)))
        report = _report_from(doc["report"])
        if not _register_all(graph_def, doc["kernels"]):
            return None
    except (KeyError, TypeError, ValueError, AttributeError, DecodeError, NativeError,
            RegistrationError):
        return None
    report.compile_seconds = time.perf_counter() - t0
    report.from_result_cache = True
    report.notes.append("stitched graph, plan and kernels reused from the result cache "
                        "(the traced graph, options and stitching are unchanged)")
    return Stored(graph_def, report)


def _register_all(graph_def, entries) -> bool:
    """Register every kernel ``graph_def`` runs from its index entry and the compile
    cache's code; False (a miss) where one is not indexed or its code is not there.
    The spec is parsed and validated as any spec from a graph (ir/spec.py)."""
    from .. import runtime
    from ..compile import kernel, native, shipped
    from ..ir.spec import KernelSpec
    from . import ensure_runtime
    from .kernel_assets import specs_in
    ensure_runtime()
    todo = []
    for text in specs_in(graph_def):
        if runtime.is_registered(text):
            continue
        spec = KernelSpec.from_json(text)
        e = shipped.well_formed_entry(spec.hash, entries.get(spec.hash))
        if e is None or not native.built(kernel.kernel_dir() / e["code"]):
            return False
        todo.append((text, spec, e))
    for text, spec, e in todo:     # every one is there: load them
        body = native.load(kernel.kernel_dir() / e["code"], kernel.BODY_SYMBOL)
        runtime.register(shipped.ShippedKernel(spec, e, body, kernel.interp_address()),
                         text)
    return True


GRADIENT_ATTR = "_gradient_op_type"


def _nodes(graph_def):
    yield from graph_def.node
    for f in graph_def.library.function:
        yield from f.node_def


def _gradient_names(graph_def) -> list:
    """The custom gradients' names (``GRADIENT_ATTR``) in order of first appearance."""
    seen = {}
    for n in _nodes(graph_def):
        if GRADIENT_ATTR in n.attr:
            seen.setdefault(n.attr[GRADIENT_ATTR].s.decode("utf-8", "replace"), None)
    return list(seen)


def _renamed(graph_def, names: dict):
    """A copy of ``graph_def`` with the custom gradients' names mapped by ``names``."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for n in _nodes(out):
        if GRADIENT_ATTR in n.attr:
            old = n.attr[GRADIENT_ATTR].s.decode("utf-8", "replace")
            n.attr[GRADIENT_ATTR].s = names.get(old, old).encode("utf-8")
    return out


def _canonical(graph_def):
    """``graph_def`` with the process's numbering taken out, for the key: custom
    gradients ``G0, G1, ...`` and library functions ``F0, F1, ...`` by order of first
    appearance, the library listed in that order."""
    grads = _gradient_names(graph_def)
    if grads:
        graph_def = _renamed(graph_def, {n: f"G{i}" for i, n in enumerate(grads)})
    fns = _function_names(graph_def)
    if fns:
        graph_def = _functions_renamed(graph_def, {n: f"F{i}" for i, n in enumerate(fns)})
        order = {f"F{i}": i for i in range(len(fns))}
        ordered = sorted(graph_def.library.function,
                         key=lambda f: order[f.signature.name])
        del graph_def.library.function[:]
        graph_def.library.function.extend(ordered)
        ordered = sorted(graph_def.library.gradient,
                         key=lambda g: (g.function_name, g.gradient_func))
        del graph_def.library.gradient[:]
        graph_def.library.gradient.extend(ordered)
    return graph_def


def _func_refs(attr_values):
    """The function names the attribute values ``attr_values`` refer to (``func`` and
    ``list.func``, and the attributes of those in turn), as the AttrValue messages that
    hold them (``.func`` messages, whose ``name`` is the reference)."""
    todo = list(attr_values)
    while todo:
        v = todo.pop()
        if v.HasField("func"):
            yield v.func
            todo.extend(v.func.attr.values())
        elif v.HasField("list"):
            for f in v.list.func:
                yield f
                todo.extend(f.attr.values())


def _function_names(graph_def) -> list:
    """The library functions' names in order of first reference: the graph's nodes in
    order, each function's body read where it is first referenced (depth first), then
    any the graph never references (a gradient's), by name."""
    library = {f.signature.name: f for f in graph_def.library.function}
    if not library:
        return []
    seen = {}
    stack = [iter(graph_def.node)]
    while stack:
        node = next(stack[-1], None)
        if node is None:
            stack.pop()
            continue
        refs = [node.op] + [f.name for f in _func_refs(node.attr.values())]
        for name in refs:
            if name in library and name not in seen:
                seen[name] = None
                stack.append(iter(library[name].node_def))
    return list(seen) + sorted(n for n in library if n not in seen)


def _functions_renamed(graph_def, names: dict):
    """A copy of ``graph_def`` with its library functions' names, and every reference
    to them (a node's op, a function-valued attribute, a gradient entry), mapped by
    ``names``."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    for f in out.library.function:
        f.signature.name = names.get(f.signature.name, f.signature.name)
    for n in _nodes(out):
        n.op = names.get(n.op, n.op)
        for ref in _func_refs(n.attr.values()):
            ref.name = names.get(ref.name, ref.name)
    for g in out.library.gradient:
        g.function_name = names.get(g.function_name, g.function_name)
        g.gradient_func = names.get(g.gradient_func, g.gradient_func)
    return out


# ---- the report as JSON data, and back

def _report_state(rep: Report) -> dict:
    """``rep`` as JSON data, for ``save`` (which encodes it at once): the report's own
    values, not copies (no deep copy: only new containers are changed here, and the
    encoder reads the values as they are; the copy was a fifth of EfficientNetB0's
    cold save)."""
    d = {f.name: getattr(rep, f.name) for f in fields(rep)}
    d["kernels"] = [{f.name: getattr(k, f.name) for f in fields(k)} for k in rep.kernels]
    for k in d["kernels"]:
        k["counted"] = sorted(k["counted"]) if k["counted"] is not None else None
    d["bodies"] = [[name, _report_state(r) if r is not None else None, why]
                   for name, r, why in rep.bodies]
    d["tiering"], d["dump_path"] = "", None       # per process
    d["code_tiers"] = []            # live kernels of this process (a cached one's: tier 2)
    return d


def _report_from(d: dict) -> Report:
    if not isinstance(d, dict):
        raise TypeError("a report is an object")
    names = {f.name for f in fields(Report)}
    rep = Report(**{k: v for k, v in d.items() if k in names})
    rep.kernels = [KernelInfo(**dict(k, ops=[tuple(o) for o in k["ops"]],
                                     counted=frozenset(k["counted"])
                                     if k["counted"] is not None else None))
                   for k in rep.kernels]
    rep.unfused = [tuple(u) for u in rep.unfused]
    rep.boundaries = [tuple(b) for b in rep.boundaries]
    rep.bodies = [(name, _report_from(r) if r is not None else None, why)
                  for name, r, why in rep.bodies]
    return rep
