"""The GPU harness's report path, which runs where there is no TensorFlow."""
import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(REPO, "tools", "gpu_results", "h100_large_2026-11-22.json")


def test_gpu_section_renders_from_a_recorded_run_without_tensorflow(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n<!-- suite:models -->\n## models\nkept\n<!-- /suite:models -->\n")
    code = textwrap.dedent(f"""
        import sys
        sys.argv = ["gpu_bench.py", "--render", {RUN!r}, "--markdown", {str(out)!r}]
        sys.path.insert(0, {os.path.join(REPO, "tools")!r})
        import gpu_bench
        rc = gpu_bench.main(sys.argv[1:])
        assert "tensorflow" not in sys.modules, "rendering imported TensorFlow"
        sys.exit(rc)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert "<!-- suite:gpu -->" in text and "<!-- /suite:gpu -->" in text
    assert "<!-- suite:models -->" in text and "kept" in text       # other sections stay
    rows = json.load(open(RUN))["rows"]
    section = text.split("<!-- suite:gpu -->")[1]
    assert all(f"| {r['pattern']} |" in section for r in rows)
    assert "geomean speedup:" in section and "row reductions: worst" in section
    # the verdicts are computed from the rows, not copied
    assert "**FAIL** geomean >= 1.3x torch.compile: 0.70x" in section
