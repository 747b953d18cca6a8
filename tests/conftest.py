import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The CUDA tests run under Numba's simulator unless NUMBA_ENABLE_CUDASIM=0 (a GPU).
# Numba reads the flag once, when numba itself is first imported, so it is set here,
# before any test module imports numba.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
# Each test session gets its own kernel cache unless the caller chose one, so tests
# never depend on what an earlier run left on disk.
if "STITCHING_CACHE_DIR" not in os.environ:
    import tempfile
    os.environ["STITCHING_CACHE_DIR"] = tempfile.mkdtemp(prefix="stitching-test-cache-")

# The planner's cost model sees schedules through a hook the schedule stage fills on
# import (plan/cost.py: use_scheduler), as every driver does; tests that plan without
# the pipeline get the same cost model.
import stitching.schedule  # noqa: E402,F401
