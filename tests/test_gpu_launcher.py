"""The GPU launcher (runtime/gpu/launcher.cc) and the op library's DEVICE_GPU kernel,
built on a machine without a GPU: both compile and link, the launcher refuses bad
manifests, layouts, plans and launches with clear messages (through ctypes), and the
CUDA build of the op library loads in CPU-only TensorFlow.  On a GPU,
tools/gpu_launcher_check.py runs the same launcher against a PyTorch stream.

Skipped, with the reason, where nvcc / cuda.h is not installed.
"""
import ctypes
import os
import subprocess
import sys

import pytest

os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from stitching.runtime import gpu_launcher as gl  # noqa: E402

pytestmark = pytest.mark.skipif(gl.cuda_home() is None,
                                reason="no CUDA toolkit here (cuda.h / nvcc not found)")
F = "float32"


@pytest.fixture(scope="module")
def launcher():
    return gl.Launcher(gl.build())


def softmax_kernel():
    from stitching.compile.cuda import compile_cuda_kernel
    from stitching.ir.builder import SpecBuilder
    b = SpecBuilder()
    x = b.input(F, (-1, 16))
    m = b.Max(x, axes=[1], keep_dims=True)
    e = b.Exp(b.Sub(x, m))
    return compile_cuda_kernel(b.build([b.Div(e, b.Sum(e, axes=[1], keep_dims=True)), m]))


def registered(launcher, shapes=((4, 16),)):
    """The softmax kernel registered with its plan for ``shapes`` (placeholder images:
    nothing is loaded until a launch)."""
    k = softmax_kernel()
    launcher.register(k)
    text, names, launch = gl.plan_text(k, shapes)
    for name in names:
        launcher.add_kernel(k, name, launch, "// no GPU here", "entry_" + name)
    launcher.set_plan(k.spec.hash, shapes, text)
    return k, text


def refused(fn, *args, match):
    with pytest.raises(gl.LauncherError, match=match):
        fn(*args)


def test_manifest_is_the_spec_signature_and_checked(launcher):
    k = softmax_kernel()
    assert gl.manifest(k) == "stitching-gpu 1\nin float32 2 -1 16\nout float32 2\n" \
                             "out float32 2\n"
    launcher.register(k)
    launcher.register(k)                      # idempotent
    reg = launcher.lib.stitching_gpu_register
    assert reg(k.spec.hash.encode(), b"stitching-gpu 1\nin float32 1 -1\nout float32 1\n")
    assert b"another signature" in launcher.lib.stitching_gpu_last_error()
    for bad, why in [(b"in float32 1 -1\nout float32 1", b"must start"),
                     (b"stitching-gpu 1\nin float8 1 -1\nout float32 1", b"known dtype"),
                     (b"stitching-gpu 1\nin float32 2 -1\nout float32 1", b"known dtype"),
                     (b"stitching-gpu 1\nin float32 1 -1", b"no outputs")]:
        assert reg(b"0" * 24, bad) == 1
        assert why in launcher.lib.stitching_gpu_last_error()
    assert reg(b"not-a-hash", b"stitching-gpu 1\nout float32 1") == 1


def test_plan_names_registered_kernels_with_their_scalars(launcher):
    k, text = registered(launcher)
    assert text.startswith("out 4 16\nout 4 1\nstep k_row_r")
    out = (ctypes.c_int64 * 4)()
    temp = ctypes.c_int64(-1)
    dims = gl.Launcher._dims([(4, 16)])
    assert launcher.lib.stitching_gpu_plan_info(k.spec.hash.encode(), dims, 2, out, 4,
                                                ctypes.byref(temp)) == 0
    assert list(out) == [4, 16, 4, 1] and temp.value == 0
    h = k.spec.hash
    step = text.splitlines()[2].split()
    refused(launcher.set_plan, h, [(5, 16)], text.replace(step[1], "k_nope", 1),
            match="k_nope, which is not registered")
    refused(launcher.set_plan, h, [(5, 16)], text.replace(" ".join(step),
                                                          " ".join(step[:-1])),
            match="scalars; the kernel takes")
    refused(launcher.set_plan, h, [(5, 16)], text.replace(
        " ".join(step), " ".join(step[:4] + ["2048"] + step[5:])), match="block in")
    refused(launcher.set_plan, h, [(5, 16)], "out 5 16\n", match="gives 1 output shapes")
    refused(launcher.set_plan, h, [(5, 16, 1)], text, match="input dims")
    layout = gl.kernel_args(k, "k_row_r1_v4", k.plan([(4, 16)]))
    assert layout.split()[:3] == ["i0!", "o0!", "o1"] and set(layout.split()[3:]) == {"s"}
    bad = launcher.lib.stitching_gpu_add_kernel(h.encode(), b"k_bad", b"x", 1, b"e", b"i1")
    assert bad and b"bad argument 'i1'" in launcher.lib.stitching_gpu_last_error()


def test_launch_checks_tensors_against_the_spec(launcher):
    k, _ = registered(launcher)
    h, ptr = k.spec.hash, [16]

    def launch(dtypes=(F,), shapes=((4, 16),), outs=(F, F), spec=h):
        launcher.launch(spec, list(dtypes), list(shapes), ptr, list(outs), [16] * len(outs))
    refused(launch, ("float64",), match="input 0 has dtype float64; the kernel expects "
                                        "float32")
    refused(launch, (F,), ((4, 16, 1),), match="input 0 has rank 3")
    refused(launch, (F,), ((4, 17),), match="input 0 dim 1 must be 16, got 17")
    refused(launch, (F,), ((4, 16),), (F,), match="got 1 inputs and 1 outputs")
    refused(launch, (F,), ((4, 16),), (F, "int32"), match="output 1 has dtype int32")
    refused(lambda: launch(spec="0" * 24), match="is not registered")
    refused(launch, (F,), ((9, 16),), match="no launch plan for input dims \\[9,16\\]")
    if not os.path.exists("/dev/nvidiactl"):     # no driver: the launch itself is refused
        refused(launch, match="CUDA driver")


@pytest.mark.slow    # nvcc builds the whole op library: ~25 s
def test_gpu_op_library_compiles_links_and_loads_without_a_gpu(tmp_path):
    """op.cc with GOOGLE_CUDA (StitchedKernelGpuOp over the launcher) against TF's
    headers: it compiles, links against libtensorflow_framework, and loads in CPU-only
    TF (the driver is opened only at a launch)."""
    pytest.importorskip("tensorflow")
    out = tmp_path / "stitching_ops_gpu.so"
    r = subprocess.run(gl.op_library_command(out), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    syms = subprocess.run(["nm", "-C", str(out)], capture_output=True, text=True).stdout
    assert "StitchedKernelGpuOp" in syms and "stitching_gpu_launch" in syms
    code = ("import tensorflow as tf, ctypes, sys\n"
            f"lib = tf.load_op_library({str(out)!r})\n"
            "assert hasattr(lib, 'stitched_kernel')\n"
            f"print(ctypes.CDLL({str(out)!r}).stitching_gpu_abi_version())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert r.returncode == 0 and r.stdout.strip() == str(gl.ABI_VERSION), r.stderr[-2000:]
