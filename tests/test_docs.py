"""Docs that cannot rot.

* Every ```python and ```bash block of README.md and docs/*.md runs (a file's blocks in
  order, in one temporary directory, Python blocks in one namespace as a notebook's
  cells).  A block that cannot run here says why in its info string:
  ```` ```python skip: needs a GPU ````.  A ```` ```text output ```` block right after a
  Python block is that block's printed output, compared with what it prints (times
  and the machine-dependent launch unit masked).
* Every speed-up ("1.43x") and time ("1.79 s", "12.15 ms") quoted in those files is a
  figure of BENCHMARKS.md.
* The API reference (docs/api, Sphinx autodoc) builds with warnings as errors.
* docs/limits.md's op list is the op table's (tools/limits_ops.py writes it).
"""
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
from contextlib import redirect_stdout
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
RUNNABLE = ("python", "bash", "sh", "shell")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.M | re.S)


def blocks(path: Path) -> list:
    """[(line, language, info, code)] of the fenced blocks of ``path``."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        info = m.group(1).strip()
        lang = info.split(" ", 1)[0].lower() if info else ""
        out.append((text[:m.start()].count("\n") + 1, lang, info, m.group(2)))
    return out


def _skip_reason(info: str) -> str | None:
    m = re.search(r"\bskip:\s*(.*)", info)
    return m.group(1).strip() if m else None


def test_every_code_block_is_runnable_or_says_why_not():
    for path in DOCS:
        for line, lang, info, _ in blocks(path):
            if lang in RUNNABLE and "skip" in info:
                assert _skip_reason(info), f"{path.name}:{line}: 'skip:' needs a reason"
            assert lang, f"{path.name}:{line}: a fenced block without a language " \
                         f"(use text for output)"


def _normalize(text: str) -> str:
    text = re.sub(r"\d+\.\d+", "#", text)                 # times
    text = re.sub(r"unit = [^\n]*", "unit = #", text)     # depends on the machine's cores
    # which device profile planned: this machine's (measured, with its CPU's name and
    # maybe provisional) or a pinned machine model (the test suite pins one)
    text = re.sub(r"cost model's device profile: [^\n]*", "cost model's device profile: #",
                  text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _shims(tmp: Path) -> str:
    """PATH with the console scripts, where this checkout is not pip-installed."""
    bin_dir = tmp / "_bin"
    bin_dir.mkdir()
    for script, module in (("stitching-build", "stitching.runtime.build"),
                           ("stitching-rewrite", "stitching.cli")):
        if shutil.which(script) is None:
            (bin_dir / script).write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
            (bin_dir / script).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_examples_run(path, tmp_path, monkeypatch):
    todo = [b for b in blocks(path) if b[1] in RUNNABLE or "output" in b[2]]
    if not any(b[1] in RUNNABLE and not _skip_reason(b[2]) for b in todo):
        pytest.skip(f"{path.name}: no runnable example")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STITCHING_NO_HINTS", "1")
    # the examples run as a user runs them: tiered (the suite turns it off elsewhere)
    monkeypatch.delenv("STITCHING_BACKGROUND_COMPILE", raising=False)
    env = dict(os.environ, PATH=_shims(tmp_path), PYTHONPATH=str(REPO),
               TF_CPP_MIN_LOG_LEVEL="2")
    namespace = {"__name__": "__docs__"}
    printed = None
    for line, lang, info, code in todo:
        where = f"{path.name}:{line}"
        if "output" in info and lang == "text":
            assert printed is not None, f"{where}: an output block after no Python block"
            assert _normalize(printed) == _normalize(code), \
                f"{where}: the documented output differs from the real one:\n{printed}"
            continue
        if _skip_reason(info):
            printed = None
            continue
        if lang == "python":
            buf = io.StringIO()
            with redirect_stdout(buf):
                exec(compile(textwrap.dedent(code), where, "exec"), namespace)  # noqa: S102
            printed = buf.getvalue()
        else:
            p = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, f"{where} failed:\n{p.stdout}\n{p.stderr}"
            printed = None


# ---- figures ----------------------------------------------------------------------------

FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(x\b| s\b| ms\b| µs\b)")


def test_quoted_figures_come_from_benchmarks():
    """A speed-up or a time in the docs must be one BENCHMARKS.md reports (its latest
    run of each suite), so no doc keeps a number the code no longer earns."""
    bench = (REPO / "BENCHMARKS.md").read_text()
    known = {m.group(1) + m.group(2).strip() for m in FIGURE.finditer(bench)}
    known |= {m.group(1) + "s" for m in re.finditer(r"(\d+\.\d+)s\b", bench)}
    known |= {m.group(1) + "ms" for m in re.finditer(r"\| (\d+\.\d+) ", bench)}
    known |= {m.group(1) + "s" for m in re.finditer(r"\| (\d+\.\d+) ", bench)}
    stray = []
    for path in DOCS:
        prose = FENCE.sub("", path.read_text())      # outputs of examples are checked above
        for m in FIGURE.finditer(prose):
            fig = m.group(1) + m.group(2).strip()
            if fig not in known:
                stray.append(f"{path.name}: {m.group(0)}")
    assert not stray, f"figures not in BENCHMARKS.md: {stray}"


# ---- API reference ----------------------------------------------------------------------

def test_api_reference_builds_without_warnings(tmp_path):
    import importlib.util
    if importlib.util.find_spec("sphinx") is None:
        if os.environ.get("CI"):
            pytest.fail("sphinx is not installed: CI installs the docs extra "
                        "(pip install -e '.[test,docs]')")
        pytest.skip("sphinx is not installed here (pip install -e '.[docs]'); CI builds it")
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b",
                        "html", str(REPO / "docs" / "api"), str(tmp_path / "html")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    page = (tmp_path / "html" / "index.html").read_text()
    for name in ("stitching.function", "stitching.Options", "stitching.keras.stitch",
                 "stitching.runtime.stats", "autotune_margin"):
        assert name in page, name


# ---- the op list ------------------------------------------------------------------------

def test_limits_lists_the_op_table():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import limits_ops
    finally:
        sys.path.remove(str(REPO / "tools"))
    text = (REPO / "docs" / "limits.md").read_text()
    assert limits_ops.section() in text, \
        "docs/limits.md's op list is stale: run python tools/limits_ops.py"


def test_every_environment_variable_is_in_the_tuning_table():
    used = set()
    for path in list((REPO / "stitching").rglob("*.py")) + list((REPO / "stitching").rglob("*.cc")):
        text = path.read_text()
        if path.suffix == ".cc":     # C++: what getenv reads, not macros
            text = " ".join(re.findall(r"getenv\(\s*\"(STITCHING_\w+)\"", text))
        used |= set(re.findall(r"\bSTITCHING_[A-Z_]+[A-Z]\b", text))
    used |= {"STITCHING_TEST_MACHINE"}                  # tests/conftest.py
    table = (REPO / "docs" / "tuning.md").read_text()
    missing = sorted(v for v in used if f"`{v}`" not in table)
    assert not missing, f"docs/tuning.md does not list: {missing}"


def test_every_options_field_is_in_the_tuning_table():
    import dataclasses

    import stitching
    table = (REPO / "docs" / "tuning.md").read_text()
    missing = [f.name for f in dataclasses.fields(stitching.Options)
               if f"| `{f.name}` |" not in table]
    assert not missing, f"docs/tuning.md's Options table does not list: {missing}"


# ---- links ------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path) -> set:
    """The anchors a Markdown page has: GitHub's slug of each heading, and <a id>s."""
    text = path.read_text()
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for title in re.findall(r"^#+\s+(.*)$", FENCE.sub("", text), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_relative_links_in_the_docs_resolve():
    pages = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
    broken = []
    for page in pages:
        for target in _LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):          # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such anchor)")
    assert not broken, "\n".join(broken)
