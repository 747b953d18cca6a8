"""The notebooks run top to bottom (nbclient + ipykernel), on small models, and each
shows at least one picture.  The committed copies carry no outputs."""
import json
import os
import pathlib
import re
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def _run(name, tmp_path, env=None):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # the kernel's own environment: inline figures even where MPLBACKEND says Agg
    kernel_env = dict(os.environ, **(env or {}), TMPDIR=str(tmp_path),   # its dumps
                      MPLBACKEND="module://matplotlib_inline.backend_inline")
    t = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}
                            ).execute(env=kernel_env)
    seconds = time.perf_counter() - t
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    return nb, images, seconds


@pytest.mark.parametrize("name", ["tour.ipynb", "inspect_graph_dump.ipynb"])
def test_committed_notebooks_hold_no_outputs(name):
    nb = json.loads((NOTEBOOKS / name).read_text())
    for c in nb["cells"]:
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None


def test_notebooks_use_public_api_only():
    for path in NOTEBOOKS.glob("*.ipynb"):
        for c in json.loads(path.read_text())["cells"]:
            src = "".join(c["source"])
            assert "._" not in src and "import _" not in src, (path.name, src)


@pytest.mark.slow    # the whole tour notebook with matplotlib: ~15 s
def test_tour_runs_with_pictures(tmp_path):
    nb, images, _ = _run("tour.ipynb", tmp_path)
    assert len(images) >= 2                    # timing chart, graph
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
    assert "same result as tf.function" in text and "def " in text


def test_inspect_notebook_runs_on_demo_and_on_another_dump(tmp_path, tiered):
    """Tiered, as a user runs it (the first call runs stock TF while the kernels
    compile): the demo's profiled calls still run its kernels, so the table has the
    measured times the docs show."""
    nb, images, _ = _run("inspect_graph_dump.ipynb", tmp_path)
    assert len(images) >= 2                    # graph, roofline
    html = [o for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {})]
    assert html and "kernel_0" in html[0]["data"]["text/html"]
    head, *rows = re.findall(r"<tr>(.*?)</tr>", html[0]["data"]["text/html"])
    col = re.findall(r"<th>(.*?)</th>", head).index("measured_us")
    measured = [re.findall(r"<td[^>]*>(.*?)</td>", r)[col] for r in rows]
    assert measured and all(m != "–" for m in measured), measured
    # the costliest first: by the fastest call
    col = re.findall(r"<th>(.*?)</th>", head).index("fastest_us")
    fastest = [float(re.findall(r"<td[^>]*>(.*?)</td>", r)[col].replace(",", ""))
               for r in rows]
    assert fastest == sorted(fastest, reverse=True), fastest

    # any dump: one of a CNN, made here, with no profile
    import tensorflow as tf
    import stitching
    from stitching.testing.models import small_cnn
    model = small_cnn()
    f = stitching.function(lambda v: model(v, training=False),
                           options=stitching.Options(dump_dir=str(tmp_path / "cnn")))
    f(tf.zeros([1, 16, 16, 3]))
    nb, images, _ = _run("inspect_graph_dump.ipynb", tmp_path,
                         {"STITCHING_NOTEBOOK_DUMP": f.report.dump_path})
    assert len(images) >= 2
    html = "".join(o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
                   if "text/html" in o.get("data", {}))
    assert "Relu6" in html                     # the CNN's kernels, not the demo's
