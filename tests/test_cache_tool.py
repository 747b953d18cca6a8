"""``python -m stitching.cache``: it tells this installation's generation of the cache
from other TF, Numba and stitching versions' (named by what they were built from), and
``--prune`` removes only the latter (the upgrade audit: nothing listed or pruned them)."""
from stitching import cache
from stitching.compile import kernel
from stitching.plan import cache as plans
from stitching.tf import results


def _touch(path, data=b"x" * 100):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_the_cache_tool_lists_then_prunes_only_other_versions_entries(tmp_path,
                                                                     monkeypatch, capsys):
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path))
    (lib,) = [s for s in cache._libraries_in_use() if s.startswith("stitching_ops-")]
    here = kernel.kernel_dir()
    assert here.parent == tmp_path / "kernels"
    keep = [_touch(tmp_path / "ops" / f"{lib}.so"), _touch(tmp_path / "ops" / f"{lib}.so.sha256"),
            _touch(tmp_path / "ops" / "notes.txt"),                 # not a library: kept
            _touch(here / "k_0123.so"), _touch(results._dir() / "a.json"),
            _touch(tmp_path / "kernels" / "toolchain-memo" / "m"),
            _touch(tmp_path / "plans" / f"g_{plans._salt()}.json")]
    old = [_touch(tmp_path / "ops" / "stitching_ops-tf2.20.0-0123456789abcdef.so"),
           _touch(tmp_path / "ops" / "stitching_ops-tf2.20.0-0123456789abcdef.lock"),
           _touch(tmp_path / "kernels" / "0123456789abcdef" / "k_4567.so"),
           _touch(here / "results" / "0000000000000000" / "b.json"),
           _touch(here / "results" / "c.json"),                      # the folderless layout
           _touch(tmp_path / "plans" / "g_000000000000.json")]

    assert cache.main([]) == 0
    out = capsys.readouterr().out
    assert all(p.exists() for p in keep + old)                       # a listing removes nothing
    assert "another TensorFlow's or stitching's op library: 2 entries" in out, out
    assert "kernels of another Numba, llvmlite, CPU or runtime: kernels/0123456789abcdef" in out
    assert "stitched results of another TensorFlow or stitching: 2 entries" in out
    assert "a plan of another planner or device profile: plans/g_000000000000.json" in out
    assert "--prune removes" in out

    assert cache.main(["--prune"]) == 0
    assert "freed" in capsys.readouterr().out
    assert [p for p in old if p.exists()] == []
    assert [p for p in keep if not p.exists()] == []
