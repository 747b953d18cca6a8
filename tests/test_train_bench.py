"""The train suite of tools/bench.py on a tiny model: losses checked against stock TF,
kernels and coverage per phase, the table and BENCHMARKS.md section.  No timing is
asserted (only that each mode has one)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

META = {"date": "d", "cpu": "c", "cores": 2, "python": "p", "tensorflow": "t",
        "numba": "n", "stitching_rev": "r", "tf_intra_op_threads": 2}


@pytest.fixture(scope="module")
def tiny_row():
    from bench_lib import train
    return train.run_row("tiny", mode_list=("tf", "stitching"), repeats=1, warmup=0,
                         min_time=0.0, memory_runs=0)


def test_train_row_checks_losses_and_splits_kernels_by_phase(tiny_row):
    from stitching.testing import train as T
    tf_m, st = tiny_row["modes"]["tf"], tiny_row["modes"]["stitching"]
    assert tf_m["ok"] and st["ok"], (tf_m.get("error"), st.get("error"))
    assert tf_m["time"] and st["time"]
    assert len(st["losses"]) == len(tf_m["losses"]) == 5
    assert st["check"]["ok"] is True and st["check"]["max_rel_err"] <= 1e-4
    # every phase is present in the step; TF's per-phase ops add up to its total
    assert all(tf_m["phase_kernels"][p] > 0 for p in T.PHASES)
    assert sum(tf_m["phase_kernels"].values()) == tf_m["kernels"]
    assert sum(st["phase_kernels"].values()) == st["kernels"] > 0
    assert 0 < st["phase_coverage"]["backward"] <= 1
    assert 0 < st["phase_coverage"]["optimizer"] <= 1


def test_train_table_targets_and_markdown(tiny_row, tmp_path):
    from bench_lib import output, train
    head, body = train.train_table([tiny_row])
    cells = dict(zip(head, body[0]))
    assert cells["model"] == "tiny"
    assert cells["losses vs TF"].startswith("stitching ")
    assert "MISMATCH" not in cells["losses vs TF"]
    results = {"train": [tiny_row]}
    lines = output.targets(results, None)
    assert any(l.startswith(("PASS", "FAIL")) and "no step slower" in l for l in lines)
    assert any(l.startswith("PASS") and "outputs equal" in l for l in lines)
    md = tmp_path / "B.md"
    md.write_text("<!-- suite:models -->\n## models\nkept\n<!-- /suite:models -->\n")
    output.write_markdown(str(md), results, META)
    text = md.read_text()
    assert "<!-- suite:train -->" in text and "| tiny |" in text and "kept" in text


def test_a_wrong_loss_is_a_mismatch(tiny_row):
    import copy

    from bench_lib import output, train
    row = copy.deepcopy(tiny_row)
    bad = [l * (1 + 1e-3) for l in row["modes"]["tf"]["losses"]]
    row["modes"]["stitching"]["check"] = train._loss_check(row["modes"]["tf"]["losses"], bad)
    assert row["modes"]["stitching"]["check"]["ok"] is False
    assert output.mismatch_lines([row])
    assert "MISMATCH" in dict(zip(*[train.train_table([row])[0],
                                    train.train_table([row])[1][0]]))["losses vs TF"]


@pytest.mark.slow
def test_bench_train_suite_end_to_end_with_peak_memory(tmp_path):
    out = tmp_path / "t.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench.py"), "--suite",
                        "train", "--only", "tiny", "--repeats", "1", "--memory-runs", "1",
                        "--steps", "2", "--json", str(out)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    row = json.loads(out.read_text())["results"]["train"][0]
    for mode in ("tf", "xla", "stitching"):
        assert row["modes"][mode]["peak"]["median_bytes"] > 0
    assert "== train ==" in p.stdout
