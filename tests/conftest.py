import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Each test session gets its own kernel cache unless the caller chose one, so tests
# never depend on what an earlier run left on disk.
if "STITCHING_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["STITCHING_CACHE_DIR"] = tempfile.mkdtemp(prefix="stitching-test-cache-")
