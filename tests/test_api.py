"""The public API as a new user meets it: what ``dir()`` shows, what is reachable after
a plain ``import stitching``, the install step's script."""
import ast
import inspect
import os
import subprocess
import sys

import pytest

import stitching

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = ["Options", "Report", "StitchedFunction", "function", "inspect", "install_kernels",
          "keras", "load_dump", "load_saved_model", "rewrite_graph_def",
          "rewrite_saved_model", "runtime", "write_tensorboard"]


def _run(code, timeout=240, **kw):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, *kw.get("flags", []), "-c", code], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dir_shows_the_public_api():
    shown = [n for n in dir(stitching) if not n.startswith("_")]
    assert set(PUBLIC) <= set(shown)
    assert set(stitching.__all__) <= set(shown)


def _public_members(obj):
    if not inspect.isclass(obj):
        return []
    return [(m, v) for m, v in vars(obj).items() if not m.startswith("_")
            and (callable(v) or isinstance(v, property))]


@pytest.mark.parametrize("module", ["stitching", "stitching.runtime", "stitching.inspect"])
def test_every_public_name_has_a_docstring(module):
    import importlib
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        missing += [f"{name}.{m}" for m, v in _public_members(obj)
                    if not (getattr(v, "__doc__", None) or "").strip()]
    assert not missing, f"{module}: no docstring: {missing}"


def test_options_documents_each_field():
    import dataclasses
    doc = stitching.Options.__doc__
    for f in dataclasses.fields(stitching.Options):
        assert f"\n        {f.name}: " in doc, f"Options.{f.name} is not described"


def test_runtime_stats_after_a_plain_import():
    """``import stitching; stitching.runtime.stats()`` as the docs write it: once an
    AttributeError, then a deadlock (load() imported TensorFlow under its lock, and TF's
    import hook called load())."""
    p = _run("import stitching; s = stitching.runtime.stats(); print(sorted(s))")
    assert p.returncode == 0, p.stderr
    assert "fallbacks" in p.stdout


def test_runtime_package_dir_lists_its_api():
    import stitching.runtime as rt
    assert {"stats", "pool_stats", "set_profiling", "load", "build_library"} <= set(dir(rt))
    with pytest.raises(AttributeError):
        rt.no_such_name


def test_build_module_runs_without_a_runpy_warning():
    """``python -m stitching.runtime.build``: the package must not import ``build``
    before runpy executes it as __main__."""
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m",
                        "stitching.runtime.build", "--print-path"], env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    assert "RuntimeWarning" not in p.stderr and p.stdout.strip().endswith(".so")


def test_build_is_a_console_script():
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    scripts = [ast.literal_eval(k.value) for node in ast.walk(tree)
               if isinstance(node, ast.Call) for k in node.keywords
               if k.arg == "entry_points"][0]["console_scripts"]
    assert "stitching-build=stitching.runtime.build:main" in scripts
    assert "stitching-rewrite=stitching.cli:main" in scripts


def test_a_pass_module_imported_before_tensorflow_still_registers_the_op():
    """Regression: importing ``stitching.tf.passes.remapper`` (``python -m
    stitching.profile`` did) before TF made TF's first import come from half-way through
    passmanager's; the hook that registers the op then hit the half-imported module and
    the op was not registered ("could not register the StitchedKernel op")."""
    code = ("import warnings; warnings.simplefilter('error', RuntimeWarning)\n"
            "import stitching.tf.passes.remapper\n"
            "from stitching import runtime\n"
            "assert runtime.library() is not None\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "could not register" not in r.stderr


def test_build_says_built_only_for_what_this_process_compiled(monkeypatch, capsys,
                                                              tmp_path):
    """stitching-build's "(built)" / "(already built)": the libraries are in the
    cache; with --force they are compiled again (here the compile copies the library
    that was there: the test is about the message, not g++)."""
    import shutil

    from stitching.runtime import build

    def lines():
        out = capsys.readouterr().out
        return [l for l in out.splitlines() if "op library" in l or "product ops" in l]

    build.build(), build.build_blas()          # in the cache, whoever built them
    monkeypatch.setattr(build, "built_here", set())     # ... not this "process"
    assert build.main([]) == 0
    got = lines()
    assert got and all("(already built)" in l for l in got), got
    kept = {lib.name: shutil.copy(lib, tmp_path) for lib in build.cache_dir().glob("*.so")}

    def compile_to(path, source=None, extra=()):
        # published as _compile_to does, by a rename: the library this process has
        # loaded keeps its inode (writing into it would crash the process later)
        shutil.copy(kept[path.name], tmp_path / "new.so")
        os.replace(tmp_path / "new.so", path)
    monkeypatch.setattr(build, "_compile_to", compile_to)
    assert build.main(["--force"]) == 0
    got = lines()
    assert got and all("(built)" in l for l in got), got
