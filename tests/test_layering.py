"""Imports run one way, down the pipeline, and TensorFlow only at the edge.

    cachedir ─► ir ─► plan ─► schedule ─► codegen (lower ─► cpu | cuda) ─► compile
             ─► runtime ─► report, options ─► tf ─► inspect, profile
             ─► the front doors (keras, saved_model, cli) ─► the facade (__init__) ─► testing

Inside ``tf`` the floors run the same way:

    opnames, graph_file, tfgraph, dim_sources ─► frontend, passmanager ─► passes/
             ─► pipeline (the driver), results, dump, tensorboard, kernel_assets
             ─► function

and of the passes only ``passes/lift.py`` reaches the frontend (a graph enters it once).

A module may import only modules of its own stage or of earlier ones, lazy (function
level) imports included; a later stage that an earlier one needs is reached through an
interface the earlier one owns (plan/cost.py's ``use_scheduler``; the planner's
``legal`` callback).  No import cycle between files either.  TensorFlow is imported only
by ``stitching/tf``, ``stitching/testing``, the front doors and the op's loader
(``stitching/runtime``).  ``tools/`` has no import cycle, and ``tools/bench_lib`` has
floors of its own (shared helpers, suites, output).  The sources are read with
``ast``: nothing is imported.  The graph algorithms are networkx's.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parent.parent / "stitching"

# Stage of each top-level part of the package, in pipeline order.
# ``__init__`` is the package's facade (the public API, loaded lazily; ``_autoload``
# registers the op when TensorFlow is imported); ``testing``
# drives that API as a user would, so it comes last.
STAGES = ["cachedir", "ir", "plan", "schedule", "codegen", "compile", "runtime",
          ("report", "options"), "tf", ("inspect", "profile", "cache"), ("keras", "saved_model", "cli"),
          ("__init__", "_autoload"), "testing"]
RANK = {name: i for i, s in enumerate(STAGES)
        for name in (s if isinstance(s, tuple) else (s,))}
# Inside codegen: the shared lowering first, then the backends, side by side.
CODEGEN = {"lower": 0, "cpu": 1, "cuda": 1}
# Inside tf: floors; a module imports its own floor or lower ones.
TF_FLOORS = {"opnames": 0, "graph_file": 0, "tfgraph": 0, "dim_sources": 0,
             "frontend": 1, "passmanager": 1,
             "passes": 2,
             # scalars reads control-flow bodies (their names, their stitched copies)
             "pipeline": 3, "control_flow": 3, "scalars": 3, "dump": 3, "tensorboard": 3,
             "kernel_assets": 3, "results": 3, "__init__": 3,
             "function": 4}
TF_EDGE = ("stitching.tf", "stitching.testing", "stitching.runtime",
           "stitching.keras", "stitching.saved_model", "stitching.cli")
TOOLS = PKG.parent / "tools"
# tools/bench_lib: shared helpers at the bottom, the suites above them, output on top.
BENCH_FLOORS = {"names": 0, "machine": 0, "cells": 0,
                "measure": 1, "modes": 1,
                "suites": 2, "train": 2, "serving": 2, "short": 2, "isolate": 2,
                "output": 3, "__init__": 3}


def _module_name(path: Path, root: Path = PKG.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _tool_modules() -> dict:
    """tools/ as its scripts see it: tools/ is on sys.path (``import bench_lib``)."""
    return {_module_name(p, TOOLS): p for p in sorted(TOOLS.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict):
    """Absolute names this module imports (a ``from P import m`` of a submodule m is
    an import of P.m), every import statement, module or function level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                sub = f"{target}.{a.name}"
                yield sub if sub in modules else target


def import_graph(modules: dict | None = None) -> nx.DiGraph:
    modules = _modules() if modules is None else modules
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            g.add_edge(name, target)
    return g


def _stage(module: str) -> tuple:
    """(stage, floor inside it or -1, codegen backend or None)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    sub = parts[2] if len(parts) > 2 else None
    if top == "tf":
        return RANK[top], TF_FLOORS[sub or "__init__"], None
    inner = CODEGEN.get(sub, -1) if top == "codegen" and sub else -1
    return RANK[top], inner, (sub if inner >= 0 else None)


def _allowed(src: str, dst: str) -> bool:
    (rs, cs, bs), (rd, cd, bd) = _stage(src), _stage(dst)
    if rd != rs:
        return rd < rs
    if cs < 0 or cd < 0:        # outside codegen's subpackages, or codegen/__init__
        return True
    if bs is None:              # tf's floors
        return cd <= cs
    return cd < cs or bs == bd  # lower before the backends; no backend to backend


def test_every_part_of_the_package_has_a_stage():
    for module in _modules():
        _stage(module)          # KeyError names a part not placed in STAGES


def test_imports_run_down_the_pipeline():
    g = import_graph()
    bad = sorted((s, d) for s, d in g.edges if d.startswith("stitching") and d in g
                 and not _allowed(s, d))
    assert not bad, "imports against the pipeline's direction:\n" + "\n".join(
        f"  {s} -> {d}" for s, d in bad)


def _cycles(g, modules) -> list:
    internal = g.subgraph(n for n in g if n in modules)
    # A package's __init__ re-exporting its own modules is not a cycle of design (a
    # module importing from its package's __init__ still counts).
    edges = [(s, d) for s, d in internal.edges if not d.startswith(s + ".")]
    return list(nx.simple_cycles(nx.DiGraph(edges)))


def test_no_import_cycles_between_files():
    cycles = _cycles(import_graph(), _modules())
    assert not cycles, f"import cycles: {cycles}"


def test_passes_reach_the_frontend_only_through_the_lift():
    """A graph enters the frontend once: the lift pass; no other pass, and not the
    driver, calls into it (the shapes they need come from tfgraph.py through the
    pass manager's context)."""
    g = import_graph()
    bad = sorted(s for s, d in g.edges if d == "stitching.tf.frontend"
                 and (s.startswith("stitching.tf.passes.") or s == "stitching.tf.pipeline")
                 and s != "stitching.tf.passes.lift")
    assert not bad, f"the frontend reached outside the lift pass: {bad}"


def test_tools_have_no_import_cycles():
    modules = _tool_modules()
    cycles = _cycles(import_graph(modules), modules)
    assert not cycles, f"import cycles in tools/: {cycles}"


def test_bench_lib_imports_run_down_its_floors():
    modules = _tool_modules()
    floors = {}
    for m in modules:
        if m == "bench_lib" or m.startswith("bench_lib."):
            floors[m] = BENCH_FLOORS[m.partition(".")[2] or "__init__"]  # KeyError: place it
    bad = sorted((s, d) for s, d in import_graph(modules).edges if s in floors
                 and d in modules and (d not in floors or floors[d] > floors[s]))
    assert not bad, "tools/bench_lib imports against its floors:\n" + "\n".join(
        f"  {s} -> {d}" for s, d in bad)


def test_tensorflow_only_at_the_edge():
    g = import_graph()
    bad = sorted((s, d) for s, d in g.edges
                 if d.split(".")[0] in ("tensorflow", "keras") and not s.startswith(TF_EDGE))
    assert not bad, f"TensorFlow imported away from the TF edge: {bad}"


@pytest.mark.parametrize("src,dst,ok", [
    ("stitching.plan.cost", "stitching.schedule", False),       # a later stage
    ("stitching.compile.kernel", "stitching.runtime.build", False),
    ("stitching.codegen.cuda.emitter", "stitching.codegen.cpu.emitter", False),  # sideways
    ("stitching.codegen.cpu.emitter", "stitching.codegen.lower.emitter", True),
    ("stitching.codegen.lower.emitter", "stitching.codegen.cpu.rt", False),
    ("stitching.runtime.build", "stitching.compile.native", True),
    ("stitching.schedule", "stitching.plan.cost", True),
    ("stitching.tf.pipeline", "stitching.compile", True),
    ("stitching.compile.kernel", "stitching.cachedir", True),
    ("stitching.tf.pipeline", "stitching.tf.passes.gemm", True),       # tf's floors
    ("stitching.tf.passes.gemm", "stitching.tf.pipeline", False),
    ("stitching.tf.passes.gemm", "stitching.tf.passmanager", True),
    ("stitching.tf.frontend", "stitching.tf.passes.lift", False),
    ("stitching.tf.pipeline", "stitching.tf.function", False),
    ("stitching.keras", "stitching.tf.function", True),                # the front doors
    ("stitching.tf.function", "stitching.keras", False),
])
def test_the_rule_itself(src, dst, ok):
    assert _allowed(src, dst) is ok
