"""Every third-party import is declared in setup.py, so a fresh virtual environment has it.

A machine that happens to hold a package hides a missing declaration (issue 25: networkx
was imported by the tests and declared nowhere, and CI's Python had it).  This test reads
the sources with ``ast`` (nothing is imported) and setup.py's literal requirement lists.

Rules:
- an import anywhere in ``stitching/``, ``tests/``, ``tools/`` or a notebook's code cells must
  be provided by a distribution that setup.py names, in ``install_requires`` or an extra;
- a *module-level* import in the TF-free layers of ``stitching/`` (everything but
  ``stitching/tf`` and ``stitching/testing``) must be in ``install_requires``: those layers
  are imported on the GPU machines with the core install only.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("stitching", "tests", "tools", "notebooks")
# Layers that may import optional packages at module level (they need TF anyway).
OPTIONAL_LAYERS = ("stitching/tf/", "stitching/testing/",
                   "stitching/keras.py", "stitching/saved_model.py", "stitching/cli.py")

# Import name -> distribution, for names that differ.  Only what the sources use (and the
# usual suspects), so a new import of an unlisted package is checked by its own name.
PROVIDED_BY = {
    "google": "protobuf",
    "tensorflow": "tensorflow-cpu",
    "yaml": "pyyaml",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "cv2": "opencv-python",
    "mpl_toolkits": "matplotlib",
}
# Packages that numba-cuda installs under numba's namespace are imported as `numba.cuda`.


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0])


def _setup_keywords() -> dict:
    """setup()'s install_requires and extras_require, read from setup.py's AST."""
    tree = ast.parse((REPO / "setup.py").read_text())
    names = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name)}

    def literal(node):
        # Resolve module-level names and `A + B` of list literals (e.g. TF + [...]).
        if isinstance(node, ast.Name):
            return literal(names[node.id])
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return literal(node.left) + literal(node.right)
        if isinstance(node, ast.Dict):
            return {ast.literal_eval(k): literal(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.List):
            return [literal(e) for e in node.elts]
        return ast.literal_eval(node)

    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "setup")
    return {k.arg: literal(k.value) for k in call.keywords
            if k.arg in ("install_requires", "extras_require")}


def declared() -> tuple[set[str], set[str]]:
    """(core, every) distribution names setup.py declares."""
    kw = _setup_keywords()
    core = {_requirement_name(r) for r in kw["install_requires"]}
    every = set(core)
    for reqs in kw["extras_require"].values():
        every |= {_requirement_name(r) for r in reqs}
    return core, every


def _sources():
    """(relative path, source text) of every Python file and notebook code cell."""
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*")):
            rel = path.relative_to(REPO).as_posix()
            if path.suffix == ".py":
                yield rel, path.read_text()
            elif path.suffix == ".ipynb":
                cells = json.loads(path.read_text())["cells"]
                code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
                # IPython magics and shell escapes are not Python.
                lines = [ln for ln in "\n".join(code).splitlines()
                         if not ln.lstrip().startswith(("%", "!"))]
                yield rel, "\n".join(lines)


def _local_names() -> set[str]:
    """Modules of this repository (the package, test helpers, tools run as scripts)."""
    local = {"stitching"}
    for root in ROOTS:
        for path in (REPO / root).rglob("*"):
            if path.suffix == ".py":
                local.add(path.stem)
            elif path.is_dir():
                local.add(path.name)
    return local


def third_party_imports():
    """[(top-level name, file, module-level?)] for every absolute import not stdlib/local."""
    std = set(sys.stdlib_module_names)
    local = _local_names()
    found = []
    for rel, text in _sources():
        tree = ast.parse(text, filename=rel)
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top in std or top in local or top == "__future__":
                    continue
                found.append((top, rel, id(node) in top_level))
    return found


def test_setup_py_declares_every_third_party_import():
    _, every = declared()
    missing = sorted({(top, rel) for top, rel, _ in third_party_imports()
                      if _norm(PROVIDED_BY.get(top, top)) not in every})
    assert not missing, ("imported but not declared in setup.py (a fresh virtual "
                         f"environment lacks them): {missing}")


def test_tf_free_layers_import_only_core_dependencies_at_module_level():
    core, _ = declared()
    bad = sorted({(top, rel) for top, rel, module_level in third_party_imports()
                  if module_level and rel.startswith("stitching/")
                  and not rel.startswith(OPTIONAL_LAYERS)
                  and _norm(PROVIDED_BY.get(top, top)) not in core})
    assert not bad, f"module-level imports of optional packages in core layers: {bad}"


def test_the_scanner_finds_real_imports():
    # The scanner must find real imports (else the tests above pass vacuously): the
    # sources import numpy, networkx and tensorflow, and numpy at module level in core.
    names = {top for top, _, _ in third_party_imports()}
    assert {"numpy", "networkx", "tensorflow", "numba"} <= names
    core, every = declared()
    assert "networkx" in core and "tensorflow-cpu" in every and "tensorflow-cpu" not in core


@pytest.mark.parametrize("req,name", [("tensorflow-cpu==2.21.0", "tensorflow-cpu"),
                                      ("ml_dtypes>=0.4", "ml-dtypes"),
                                      ("numba-cuda>=0.20", "numba-cuda"),
                                      ("numpy", "numpy")])
def test_requirement_names_are_normalized(req, name):
    assert _requirement_name(req) == name


def test_tensorflow_is_an_extra_per_package_with_a_range_never_core():
    """A user's own TF is never replaced: TF is in no core or test requirement, and each
    TF package has an extra of its own over a range of minors (2.20 and 2.21 at least)."""
    kw = _setup_keywords()
    assert not any("tensorflow" in r for r in kw["install_requires"])
    extras = kw["extras_require"]
    assert not any("tensorflow" in r for r in extras["test"])
    for extra, dist in (("tf", "tensorflow"), ("tf-cpu", "tensorflow-cpu")):
        (req,) = [r for r in extras[extra] if _requirement_name(r) == dist]
        bounds = dict(re.findall(r"(>=|<)\s*([\d.]+)", req[len(dist):]))
        low, high = (tuple(int(x) for x in bounds[k].split(".")) for k in (">=", "<"))
        assert low <= (2, 20) and high > (2, 21), req
        assert not [r for r in extras[extra] if "tensorflow" in r and r != req]


def test_the_build_step_warns_when_two_tensorflows_share_the_environment(monkeypatch):
    from importlib import metadata

    from stitching.runtime import build
    installed = {"tensorflow": "2.21.0", "tensorflow-cpu": "2.21.0"}

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]
    monkeypatch.setattr(metadata, "version", version)
    said = []
    build.check_tf_install(said.append)
    assert len(said) == 1 and "tensorflow-cpu==2.21.0" in said[0] and "Keep one" in said[0]
    del installed["tensorflow-cpu"]
    said.clear()
    build.check_tf_install(said.append)
    assert said == []
