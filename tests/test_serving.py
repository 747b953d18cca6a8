"""Shipping rewritten models: a fresh process that imports stitching loads them.

Every load runs in a subprocess (a fresh interpreter), because what is under test is
what ``import stitching`` does to a process that never traced anything: registering
the StitchedKernel op with TensorFlow, and the compile-on-miss hook.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import stitching  # noqa: F401
from stitching.testing.models import frozen_softmax_graph_def, softmax_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code, env=None, timeout=240):
    e = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=e)


def _keras_cnn():
    import keras
    inp = keras.Input((12, 12, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inp)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("gelu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Softmax()(keras.layers.Dense(5)(h) * 2.0)
    model = keras.Model(inp, out)
    rng = np.random.default_rng(1)
    bn = model.layers[2]
    bn.moving_mean.assign(rng.standard_normal(8).astype(np.float32) * 0.1)
    bn.moving_variance.assign(rng.uniform(0.5, 2.0, 8).astype(np.float32))
    return model


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """Rewritten artifacts and the original's outputs on fixed inputs (as .npy)."""
    from stitching import cli
    from stitching.saved_model import rewrite_saved_model
    d = tmp_path_factory.mktemp("ship")
    rng = np.random.default_rng(0)
    # a Keras CNN, exported as Keras serves it
    model = _keras_cnn()
    model.export(str(d / "cnn_src"), verbose=False)
    reports = rewrite_saved_model(str(d / "cnn_src"), str(d / "cnn"))
    assert reports["serving_default"].to_dict()["kernels"] >= 1
    x_cnn = rng.standard_normal((2, 12, 12, 3)).astype(np.float32)
    np.save(d / "x_cnn.npy", x_cnn)
    np.save(d / "y_cnn.npy", model(x_cnn, training=False).numpy())
    # a frozen GraphDef, binary and text
    (d / "g.pb").write_bytes(frozen_softmax_graph_def().SerializeToString())
    assert cli.main([str(d / "g.pb"), str(d / "out.pb"), "--outputs", "y"]) == 0
    assert cli.main([str(d / "g.pb"), str(d / "out.pbtxt"), "--outputs", "y"]) == 0
    x_g = rng.standard_normal((3, 16)).astype(np.float32)
    np.save(d / "x_g.npy", x_g)
    np.save(d / "y_g.npy", softmax_reference(x_g))
    return d


_LOAD_ALL = """
    import sys, numpy as np
    {first}
    import tensorflow as tf
    {second}
    from google.protobuf import text_format
    d = {d!r}
    out = {{}}
    x, want = np.load(d + "/x_cnn.npy"), np.load(d + "/y_cnn.npy")
    m = tf.saved_model.load(d + "/cnn")
    sig = m.signatures["serving_default"]
    (got,) = sig(**{{list(sig.structured_input_signature[1])[0]: tf.constant(x)}}).values()
    out["signature"] = float(np.abs(got.numpy() - want).max())
    out["restored function"] = float(np.abs(m.serve(x).numpy() - want).max())
    import keras
    layer = keras.layers.TFSMLayer(d + "/cnn", call_endpoint="serving_default")
    (got,) = layer(x).values()
    out["tfsmlayer"] = float(np.abs(np.asarray(got) - want).max())
    x, want = np.load(d + "/x_g.npy"), np.load(d + "/y_g.npy")
    for name in ("out.pb", "out.pbtxt"):
        out["installed " + name] = stitching.install_kernels(d + "/" + name + ".kernels")
        gd = tf.compat.v1.GraphDef()
        data = open(d + "/" + name, "rb").read()
        text_format.Parse(data.decode(), gd) if name.endswith("txt") else gd.ParseFromString(data)
        run = tf.compat.v1.wrap_function(
            lambda a: tf.compat.v1.import_graph_def(gd, {{"x:0": a}}, ["y:0"], name=""),
            [tf.TensorSpec([None, 16], tf.float32)])
        out[name] = float(np.abs(run(tf.constant(x))[0].numpy() - want).max())
    with tf.Graph().as_default() as g:          # TF1: a Session over the frozen graph
        tf.compat.v1.import_graph_def(gd, name="")
        with tf.compat.v1.Session(graph=g) as sess:
            got = sess.run("y:0", {{"x:0": x}})
    out["session"] = float(np.abs(got - want).max())
    out["numba"] = "numba" in sys.modules
    # every kernel registered from the shipped spec-hash index: no schedule, no codegen
    out["codegen"] = [m for m in ("stitching.codegen.cpu.emitter", "stitching.schedule")
                      if m in sys.modules]
    from stitching.runtime import registry
    out["registered"] = sorted({{type(k).__name__ for k in registry._kernels.values()}})
    import os
    out["cache"] = sorted(os.listdir(os.environ["STITCHING_CACHE_DIR"] + "/kernels"))
    print("RESULT", __import__("json").dumps(out))
"""


def _result(r):
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("order", ["stitching_first", "tensorflow_first"])
def test_import_stitching_registers_the_op_for_every_loader(shipped, order, tmp_path):
    """tf.saved_model.load, TFSMLayer and import_graph_def of .pb and .pbtxt work in a
    fresh process after a plain `import stitching`, before or after TensorFlow's; on
    an empty kernel cache, from the kernels the artifacts ship, without Numba."""
    first, second = ("import stitching", "") if order == "stitching_first" else \
        ("", "import stitching")
    out = _result(_run(_LOAD_ALL.format(first=first, second=second, d=str(shipped)),
                       env={"STITCHING_CACHE_DIR": str(tmp_path / "empty")}))
    for key in ("signature", "restored function", "tfsmlayer", "out.pb", "out.pbtxt",
                "session"):
        assert out[key] < 1e-5, (key, out[key])
    assert not out["numba"], "loading shipped kernels imported Numba"
    assert out["codegen"] == [] and out["registered"] == ["ShippedKernel"], out
    assert out["installed out.pb"] >= 2       # a kernel and the shape interpreter
    assert len(out["cache"]) == 1             # one toolchain: the artifacts' = this one


def _copy_model(shipped, tmp_path):
    import shutil
    dst = tmp_path / "model"
    shutil.copytree(shipped / "cnn", dst)
    return dst


_LOAD_ONE = """
    import sys, warnings, numpy as np
    warnings.simplefilter("always")
    import stitching, tensorflow as tf
    m = tf.saved_model.load({path!r})
    sig = m.signatures["serving_default"]
    x, want = np.load({d!r} + "/x_cnn.npy"), np.load({d!r} + "/y_cnn.npy")
    (got,) = sig(**{{list(sig.structured_input_signature[1])[0]: tf.constant(x)}}).values()
    print("RESULT", __import__("json").dumps(
        {{"err": float(np.abs(got.numpy() - want).max()), "numba": "numba" in sys.modules}}))
"""


def _rewrite_manifest(model, edit):
    """Edits the model's kernel manifest with ``edit`` (a dict -> None) and records the
    new manifest's SHA-256 in its graph, as a consistent edit would."""
    import hashlib
    from tensorflow.core.protobuf import saved_model_pb2
    path = model / "assets" / "stitching_kernels.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    data = json.dumps(manifest).encode()
    path.write_bytes(data)
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((model / "saved_model.pb").read_bytes())
    graph = sm.meta_graphs[0].graph_def
    nodes = [n for f in graph.library.function for n in f.node_def] + list(graph.node)
    sha = hashlib.sha256(data).hexdigest()
    for n in nodes:         # the initializer's op, which a loader running the init op runs
        if n.op == "StitchedKernelAssets":
            n.attr["manifest_sha256"].s = sha.encode()
    (model / "saved_model.pb").write_bytes(sm.SerializeToString())
    from google.protobuf import wrappers_pb2     # and the record tf.saved_model.load reads
    _edit_assets_record(model, lambda obj: obj.serialized_user_proto.Pack(
        wrappers_pb2.StringValue(value=sha)))


def _edit_assets_record(model, edit):
    """Applies ``edit`` to the model's KernelAssets object (its SavedObject proto)."""
    from tensorflow.core.protobuf import saved_model_pb2
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((model / "saved_model.pb").read_bytes())
    objs = [o for o in sm.meta_graphs[0].object_graph_def.nodes
            if o.registered_name == "stitching.KernelAssets"]
    assert len(objs) == 1
    edit(objs[0])
    (model / "saved_model.pb").write_bytes(sm.SerializeToString())


@pytest.mark.parametrize("damage", ["tampered", "missing", "other_toolchain",
                                    "other_version", "malformed_record"])
def test_a_bad_or_foreign_kernel_asset_falls_back_to_compiling(shipped, tmp_path, damage):
    """A shipped kernel that is not byte for byte the one the rewrite recorded, or is
    missing, or was built for another CPU/toolchain or by another version of the code
    generator, is not loaded: the kernel compiles from its spec (with a warning naming
    why) and the answer is right."""
    model = _copy_model(shipped, tmp_path)
    env = {"STITCHING_CACHE_DIR": str(tmp_path / "cache")}
    (so, *_) = sorted((model / "assets").glob("k_*.so"))
    if damage == "tampered":   # valid ELF, same size, different code
        data = bytearray(so.read_bytes())
        data[len(data) // 2] ^= 0xFF
        so.write_bytes(bytes(data))
        expect = "does not match the hash recorded at rewrite time"
    elif damage == "missing":
        so.unlink()
        expect = f"kernel file {so.name} is missing"
    elif damage == "other_version":     # another stitching's code generator
        _rewrite_manifest(model, lambda m: m.update(emitter="0" * 24))
        expect = "generated by another version of stitching"
    elif damage == "malformed_record":  # the KernelAssets record tf.saved_model.load reads
        from google.protobuf import wrappers_pb2
        _edit_assets_record(model, lambda obj: obj.serialized_user_proto.Pack(
            wrappers_pb2.Int32Value(value=3)))
        expect = "kernel assets record is malformed"
    else:                       # NUMBA_OPT is part of the toolchain key, like the CPU
        env["NUMBA_OPT"] = "2"
        expect = "built for another CPU or toolchain (NUMBA_ENABLE_AVX/NUMBA_OPT"
    r = _run(_LOAD_ONE.format(path=str(model), d=str(shipped)), env=env)
    out = _result(r)
    assert out["err"] < 1e-5 and out["numba"]      # compiled here
    assert expect in r.stderr, r.stderr[-3000:]


_TWO_LOADERS = """
    import json, sys, numpy as np
    import stitching, tensorflow as tf
    from stitching import runtime
    path, d, mode = {path!r}, {d!r}, {mode!r}
    x, want = np.load(d + "/x_cnn.npy"), np.load(d + "/y_cnn.npy")
    out = {{}}
    if mode == "session":     # TF1's loader runs the model's init op, as C++ loaders do
        with tf.Graph().as_default() as g, tf.compat.v1.Session(graph=g) as sess:
            mg = tf.compat.v1.saved_model.loader.load(sess, ["serve"], path)
            sig = mg.signature_def["serving_default"]
            got = sess.run(list(sig.outputs.values())[0].name,
                           {{list(sig.inputs.values())[0].name: x}})
    else:
        if mode == "python":   # the op's installer gone: only the Python way can install
            runtime.set_assets_installer(None)
        m = tf.saved_model.load(path)
        out["class"] = type(m.stitching_kernels).__name__
        sig = m.signatures["serving_default"]
        (got,) = sig(**{{list(sig.structured_input_signature[1])[0]: tf.constant(x)}}).values()
        got = got.numpy()
        if mode == "resave":
            tf.saved_model.save(m, {resaved!r}, signatures=dict(m.signatures))
    from stitching.runtime import registry
    out["err"] = float(np.abs(got - want).max())
    out["numba"] = "numba" in sys.modules
    out["registered"] = sorted({{type(k).__name__ for k in registry._kernels.values()}})
    print("RESULT", json.dumps(out))
"""


def test_both_loaders_install_the_shipped_kernels_and_a_resaved_model_ships_them(
        shipped, tmp_path):
    """``tf.saved_model.load`` where stitching is imported installs the kernels in Python
    (the registered KernelAssets class; the initializer function is neither traced nor
    run: ~20 ms of a load); TF1's Session loader, which runs the model's init op as
    C++ loaders do, installs them through the StitchedKernelAssets op; a
    loaded model saved again still ships them.  Each from an empty cache, without
    Numba, every kernel a shipped one."""
    resaved = tmp_path / "resaved"
    for mode, path in [("python", shipped / "cnn"), ("session", shipped / "cnn"),
                       ("resave", shipped / "cnn"), ("python", resaved)]:
        r = _run(_TWO_LOADERS.format(path=str(path), d=str(shipped), mode=mode,
                                     resaved=str(resaved)),
                 env={"STITCHING_CACHE_DIR": str(tmp_path / f"cache-{mode}-{path.name}")})
        out = _result(r)
        assert out["err"] < 1e-5, (mode, out)
        assert not out["numba"] and out["registered"] == ["ShippedKernel"], (mode, out)
        assert out.get("class", "KernelAssets") == "KernelAssets", (mode, out)
        assert "stitching:" not in r.stderr, (mode, r.stderr[-3000:])


def test_foreign_kernels_warning_names_what_differs_not_the_whole_cpu():
    """A model whose kernels were built by another Numba on this CPU is told apart
    from one built for another CPU: the warning names the versions, or the features
    that differ, never the ~1.5 KB feature list."""
    from stitching.compile import kernel, native
    from stitching.tf import kernel_assets
    host, versions = native.host_tag(), kernel.toolchain_versions()
    numba = dict(versions, numba="0.67.0")
    said = kernel_assets._built_elsewhere({"host": host, "toolchain": numba})
    assert said == f"numba 0.67.0 there, {versions['numba']} here"
    triple, cpu, features, *env = host.split("|")
    flipped = ",".join(("-" if f[0] == "+" else "+") + f[1:] if i == 0 else f
                       for i, f in enumerate(features.split(",")))
    said = kernel_assets._built_elsewhere(
        {"host": "|".join([triple, cpu, flipped, *env]), "toolchain": versions})
    first = features.split(",")[0]
    assert said == f"CPU features {flipped.split(',')[0]} there, {first} here", said
    said = kernel_assets._built_elsewhere({"host": "|".join([triple, "znver9", features,
                                                            *env])})
    assert said == f"CPU znver9, this one {cpu}"


def test_a_cache_that_cannot_be_written_still_serves_the_shipped_kernels(shipped,
                                                                        tmp_path):
    """A serving container's cache is often read-only (here: a path that is a file,
    which no directory can be made under): the shipped kernels go to a directory of
    the process's own, which it removes at exit, instead of every kernel compiling
    from its spec (Numba imported, seconds per process)."""
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = _run(_LOAD_ONE.format(path=str(shipped / "cnn"), d=str(shipped)),
             env={"STITCHING_CACHE_DIR": str(blocked), "TMPDIR": str(tmp)})
    out = _result(r)
    assert out["err"] < 1e-5 and not out["numba"], r.stderr[-3000:]
    assert "loads them from a temporary directory of its own" in r.stderr, r.stderr[-3000:]
    assert list(tmp.iterdir()) == [], "the process's own directory outlived it"


def test_the_asset_manifest_is_bound_to_the_graph(shipped, tmp_path):
    """Editing the manifest (to vouch for a replaced kernel) breaks the hash the graph
    recorded: nothing from the assets is used."""
    model = _copy_model(shipped, tmp_path)
    manifest = model / "assets" / "stitching_kernels.json"
    manifest.write_text(manifest.read_text().replace('"version": 3', '"version":  3'))
    assert manifest.read_text().count('"version":  3') == 1
    r = _run(_LOAD_ONE.format(path=str(model), d=str(shipped)),
             env={"STITCHING_CACHE_DIR": str(tmp_path / "cache")})
    out = _result(r)
    assert out["err"] < 1e-5 and out["numba"]
    assert "does not match the hash recorded in its graph" in r.stderr


def test_a_graph_def_sidecar_is_bound_to_its_graph(shipped, tmp_path):
    """The rewrite records the sidecar manifest's SHA-256 in the GraphDef, as a
    SavedModel records its own: a sidecar swapped for another valid one (the CNN's
    kernels, all hashes consistent) or edited is not installed; the graph's own is."""
    import shutil

    from stitching.tf.kernel_assets import MANIFEST, install_dir, recorded_manifest
    gd = tf.compat.v1.GraphDef.FromString((shipped / "out.pb").read_bytes())
    side = shipped / "out.pb.kernels"
    want = recorded_manifest(gd)
    assert want == __import__("hashlib").sha256((side / MANIFEST).read_bytes()).hexdigest()
    swapped = tmp_path / "out.pb.kernels"
    shutil.copytree(shipped / "cnn" / "assets", swapped)
    shutil.copy(shipped / "out.pb", tmp_path / "out.pb")
    with pytest.warns(RuntimeWarning, match="does not match the hash recorded in its graph"):
        assert install_dir(swapped) == 0
    edited = tmp_path / "edited"              # (a warning is given once per reason)
    shutil.copytree(side, edited)
    (edited / MANIFEST).write_text((edited / MANIFEST).read_text() + " ")
    with pytest.warns(RuntimeWarning, match="does not match the hash recorded in its graph"):
        assert install_dir(edited, graph=gd) == 0
    lone = tmp_path / "elsewhere"
    shutil.copytree(side, lone)
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        assert install_dir(lone) == 0        # no graph beside it, none given


def test_rewriting_a_rewritten_saved_model_is_refused(shipped, tmp_path, capsys,
                                                      monkeypatch):
    """Refused from its saved_model.pb, before loading it (which would install its
    kernels and print their warnings first)."""
    from stitching import cli

    def load(*a, **k):
        raise AssertionError("the rewritten model was loaded before it was refused")
    monkeypatch.setattr(tf.saved_model, "load", load)
    assert cli.main([str(shipped / "cnn"), str(tmp_path / "again")]) == 1
    err = capsys.readouterr().err.strip()
    assert "was rewritten by stitching already" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "again").exists()


def test_without_import_stitching_tf_names_the_op(shipped):
    r = _run(f"""
        import tensorflow as tf
        tf.saved_model.load({str(shipped / 'cnn')!r})
    """)
    assert r.returncode != 0
    # (StitchedKernelAssets, the kernels' loader, or StitchedKernel itself)
    assert "Op type not registered 'StitchedKernel" in r.stderr


def test_import_stitching_without_tensorflow_stays_tf_free():
    """A machine without TF (the GPU machines): no import, no hook, no error."""
    r = _run("""
        import sys
        class NoTF:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "tensorflow":
                    raise ModuleNotFoundError("No module named 'tensorflow'")
        sys.meta_path.insert(0, NoTF())
        import stitching, stitching.ir
        assert "tensorflow" not in sys.modules
        assert not any(type(f).__name__ == "_TensorFlowWatcher" for f in sys.meta_path)
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_import_stitching_does_not_import_tensorflow():
    r = _run("""
        import sys, stitching, stitching.ir
        assert "tensorflow" not in sys.modules and "numba" not in sys.modules
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_rewrite_keeps_signatures_variables_and_assets(tmp_path):
    """Every signature keeps its input and output names, dtypes, shapes and structure;
    `--signature` rewrites only the one it names and keeps the others; variables and
    the original's assets come along."""
    from stitching import cli
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a\nb\n")

    class M(tf.Module):
        def __init__(self):
            self.g = tf.Variable(np.linspace(0.5, 1.5, 8).astype(np.float32), name="g")
            self.steps = tf.Variable(3, dtype=tf.int64, name="steps")
            self.vocab = tf.saved_model.Asset(str(vocab))

        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x"),
                                      tf.TensorSpec([None, 8], tf.float32, name="bias")])
        def norm(self, x, bias):
            m = tf.reduce_mean(x, -1, keepdims=True)
            return {"y": (x - m) * self.g + bias, "peak": tf.reduce_max(x, -1)}

        @tf.function(input_signature=[tf.TensorSpec([4, 8], tf.float64, name="z")])
        def act(self, z):
            return {"out": tf.nn.relu(z) * 2.0 + tf.cast(self.steps, tf.float64)}

    m = M()
    src, dst = tmp_path / "src", tmp_path / "dst"
    tf.saved_model.save(m, str(src), signatures={"norm": m.norm, "act": m.act})
    assert cli.main([str(src), str(dst), "--signature", "norm",
                     "--report", str(tmp_path / "r.json")]) == 0
    assert list(json.loads((tmp_path / "r.json").read_text())) == ["norm"]
    a, b = tf.saved_model.load(str(src)), tf.saved_model.load(str(dst))
    for key in ("norm", "act"):
        sa, sb = a.signatures[key], b.signatures[key]
        assert sa.structured_input_signature == sb.structured_input_signature
        assert sa.structured_outputs.keys() == sb.structured_outputs.keys()
        for k, t in sa.structured_outputs.items():
            assert (t.dtype, t.shape.as_list()) == \
                (sb.structured_outputs[k].dtype, sb.structured_outputs[k].shape.as_list())
    ops = lambda sig: {n.op for f in sig.graph.as_graph_def().library.function  # noqa: E731
                       for n in f.node_def} | {n.op for n in sig.graph.as_graph_def().node}
    assert "StitchedKernel" in ops(b.signatures["norm"])
    assert "StitchedKernel" not in ops(b.signatures["act"])     # not selected: as it was
    rng = np.random.default_rng(0)
    x, bias = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2))
    for k, v in a.signatures["norm"](x=x, bias=bias).items():
        np.testing.assert_allclose(b.signatures["norm"](x=x, bias=bias)[k], v, rtol=1e-6,
                                   atol=1e-6)
    # the object's own function, now calling the stitched signature, keeps its
    # parameter names: a call by keyword works as on the original
    for k, v in a.norm(x=x, bias=bias).items():
        np.testing.assert_allclose(b.norm(x=x, bias=bias)[k], v, rtol=1e-6, atol=1e-6)
    z = rng.standard_normal((4, 8))
    np.testing.assert_allclose(b.signatures["act"](z=z)["out"], a.signatures["act"](z=z)["out"])
    for name in ("g", "steps"):       # the variables, restored from the new checkpoint
        va, vb = getattr(a, name), getattr(b, name)
        assert va.dtype == vb.dtype and va.numpy().tolist() == vb.numpy().tolist()
    assert (dst / "assets" / "vocab.txt").read_text() == "a\nb\n"


_BROADCAST = """
    import json, numpy as np
    import stitching, tensorflow as tf
    a, b = np.load({d!r} + "/a.npy"), np.load({d!r} + "/b.npy")
    out = {{}}
    for name in ("fallback", "no_fallback", "saved_function"):
        m = tf.saved_model.load({d!r} + "/" + name)
        got = m.signatures["serving_default"](a=tf.constant(a), b=tf.constant(b))["y"]
        out[name] = float(np.abs(got.numpy() - np.load({d!r} + "/want.npy")).max())
    print("RESULT", json.dumps(out))
"""


def test_a_loaded_model_answers_calls_its_kernels_were_not_built_for(tmp_path):
    """Regression: a call whose inputs broadcast where the trace had the batch unknown
    (b of batch 1 against a of batch 4) runs the region's original ops, which give
    TF's answer.  In a fresh process that loaded the SavedModel, the original function
    named by the string attr was not found (the loader registers every library
    function under a new name), so the rewritten model refused a call the original
    serves.  Rewritten with a fallback (the default), without one, and a module whose
    stitching.function was saved directly."""
    from stitching.saved_model import rewrite_saved_model

    def body(a, b):
        x = a * 2.0 + b
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return {"y": tf.nn.gelu((x - mean) * tf.math.rsqrt(var + 1e-5))}

    sig = [tf.TensorSpec([None, 64], tf.float32, name="a"),
           tf.TensorSpec([None, 64], tf.float32, name="b")]

    class Plain(tf.Module):
        @tf.function(input_signature=sig)
        def serve(self, a, b):
            return body(a, b)

    class Stitched(tf.Module):
        @stitching.function(input_signature=sig)
        def serve(self, a, b):
            return body(a, b)

    m = Plain()
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"serving_default": m.serve})
    rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "fallback"))
    rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "no_fallback"),
                        options=stitching.Options(fallback=False))
    st = Stitched()
    tf.saved_model.save(st, str(tmp_path / "saved_function"),
                        signatures={"serving_default": st.serve})
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 64)).astype(np.float32)
    b = rng.standard_normal((1, 64)).astype(np.float32)
    for name, value in (("a", a), ("b", b), ("want", m.serve(a, b)["y"].numpy())):
        np.save(tmp_path / f"{name}.npy", value)
    out = _result(_run(_BROADCAST.format(d=str(tmp_path)),
                       env={"STITCHING_CACHE_DIR": str(tmp_path / "cache")}))
    assert all(err < 1e-5 for err in out.values()), out


_TWO = """
import json, os, warnings, numpy as np, tensorflow as tf
import stitching
from stitching.compile import kernel
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    m = tf.saved_model.load({d!r} + "/m")
    x = np.load({d!r} + "/x.npy")
    a, b = m.a(x).numpy(), m.b(x).numpy()
print("RESULT", json.dumps({{
    "a": float(abs(a - np.load({d!r} + "/a.npy")).max()),
    "b": float(abs(b - np.load({d!r} + "/b.npy")).max()),
    "warnings": [str(x.message)[:200] for x in w if "stitching" in str(x.message)],
    "compiled": sorted(p.name for p in kernel.kernel_dir().glob("k_*.so"))}}))
"""


def test_a_module_with_two_stitched_functions_ships_both_kernel_sets(tmp_path):
    """Regression: tf.saved_model.save copies each stitched function's manifest as an
    asset of the same name; the second became assets/stitching_kernels.json_1, which
    the loader refused ("not a SavedModel's assets/stitching_kernels.json"), so that
    function's kernels compiled at load.  Both sets load now: nothing compiles."""
    sig = [tf.TensorSpec([None, 16], tf.float32)]

    class M(tf.Module):
        def __init__(self):
            super().__init__()
            self.g = tf.Variable(tf.ones([16]) * 1.5)

        @stitching.function(input_signature=sig)
        def a(self, x):
            m, v = tf.nn.moments(x, axes=[-1], keepdims=True)
            return (x - m) * tf.math.rsqrt(v + 1e-5) * self.g

        @stitching.function(input_signature=sig)
        def b(self, x):
            return tf.nn.softmax(x * 3.0) + self.g

    m = M()
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "a.npy", m.a(x).numpy())
    np.save(tmp_path / "b.npy", m.b(x).numpy())
    tf.saved_model.save(m, str(tmp_path / "m"))
    assets = sorted(os.listdir(tmp_path / "m" / "assets"))
    assert "stitching_kernels.json_1" in assets, assets         # TF's renamed copy
    out = _result(_run(_TWO.format(d=str(tmp_path)),
                       env={"STITCHING_CACHE_DIR": str(tmp_path / "cache")}))
    assert out["a"] < 1e-5 and out["b"] < 1e-5, out
    assert out["warnings"] == [] and out["compiled"] == [], out


@pytest.mark.slow
def test_transformer_saved_model_round_trip_in_a_fresh_process(tmp_path):
    """The Bars' Transformer: exported by Keras, rewritten, loaded in a fresh process
    with an empty kernel cache (kernels from the assets, no Numba), against Keras'
    output (float32, within float rounding of the fused arithmetic)."""
    from stitching.testing.models import transformer_encoder
    from stitching.saved_model import rewrite_saved_model
    model = transformer_encoder(num_layers=2, d_model=64, heads=2, ff=128, seq_len=32)
    model.export(str(tmp_path / "src"), verbose=False)
    reports = rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"))
    assert reports["serving_default"].to_dict()["kernels"] >= 4
    x = np.random.default_rng(3).standard_normal((2, 32, 64)).astype(np.float32)
    np.save(tmp_path / "x_cnn.npy", x)
    np.save(tmp_path / "y_cnn.npy", model(x, training=False).numpy())
    r = _run(_LOAD_ONE.format(path=str(tmp_path / "dst"), d=str(tmp_path)),
             env={"STITCHING_CACHE_DIR": str(tmp_path / "cache")})
    out = _result(r)
    assert out["err"] < 2e-4 and not out["numba"], out


def test_a_failed_registration_never_breaks_import_tensorflow(tmp_path):
    """No C++ compiler and no prebuilt op library: `import stitching; import tensorflow`
    still works (a warning says why the op is missing); TF then names the op."""
    r = _run("""
        import warnings
        warnings.simplefilter("always")
        import stitching
        import tensorflow as tf
        print("ok", tf.constant(2.0).numpy())
    """, env={"HOME": str(tmp_path), "STITCHING_CACHE_DIR": str(tmp_path / "c"),
              "CXX": "no-such-compiler-here"})
    assert r.returncode == 0 and "ok 2.0" in r.stdout, r.stderr[-3000:]
    assert "could not register the StitchedKernel op" in r.stderr
    assert "no-such-compiler-here" in r.stderr


_NO_NUMBA = """
    import sys, json, warnings, numpy as np
    warnings.simplefilter("always")
    seen = []
    warnings.showwarning = lambda m, *a, **k: seen.append(str(m))
    class NoNumba:      # a serving machine without Numba (or llvmlite)
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("numba", "llvmlite"):
                raise ModuleNotFoundError(f"No module named {{name!r}}")
    sys.meta_path.insert(0, NoNumba())
    import stitching, tensorflow as tf
    d, out = {d!r}, {{}}
    m = tf.saved_model.load({model!r})
    sig = m.signatures["serving_default"]
    x, want = np.load(d + "/x_cnn.npy"), np.load(d + "/y_cnn.npy")
    (got,) = sig(**{{list(sig.structured_input_signature[1])[0]: tf.constant(x)}}).values()
    out["savedmodel"] = float(np.abs(got.numpy() - want).max())
    gd = tf.compat.v1.GraphDef.FromString(open(d + "/out.pb", "rb").read())
    run = tf.compat.v1.wrap_function(
        lambda a: tf.compat.v1.import_graph_def(gd, {{"x:0": a}}, ["y:0"], name=""),
        [tf.TensorSpec([None, 16], tf.float32)])
    x, want = np.load(d + "/x_g.npy"), np.load(d + "/y_g.npy")
    out["graphdef"] = float(np.abs(run(tf.constant(x))[0].numpy() - want).max())
    out.update(stitching.runtime.stats())
    out["warnings"] = [w for w in seen if "kernels cannot be built" in w]
    print("RESULT", json.dumps(out))
"""


def test_kernels_that_cannot_be_built_fall_back_to_the_original_subgraph(shipped, tmp_path):
    """Native-segment fallback: a machine without Numba, kernels not shipped (assets
    removed, GraphDef sidecar not installed): every StitchedKernel runs its region's
    original nodes (kept in the graph's library), counted with the reason;
    STITCHING_STRICT=1 makes it the error it would otherwise be."""
    model = _copy_model(shipped, tmp_path)
    for so in (model / "assets").glob("k_*.so"):
        so.unlink()
    code = _NO_NUMBA.format(d=str(shipped), model=str(model))
    env = {"STITCHING_CACHE_DIR": str(tmp_path / "cache")}
    out = _result(_run(code, env=env))
    assert out["savedmodel"] < 1e-5 and out["graphdef"] < 1e-5, out
    assert out["fallbacks"] >= 2 and "No module named" in out["last_fallback"], out
    # one Python warning for the process, however many nodes fell back
    assert len(out["warnings"]) == 1 and "No module named" in out["warnings"][0], out
    r = _run(code, env=dict(env, STITCHING_STRICT="1"))
    assert r.returncode != 0 and "No module named" in r.stderr
    assert "stitching/kernel_" in r.stderr


def test_the_spec_hash_index_takes_only_checked_well_formed_entries(shipped):
    """compile/shipped.py: entries of another code generator (emitter hash), entries
    whose code was not installed, malformed entries, and entries the kernel file
    they name does not vouch for (its identity) are not indexed."""
    import json as _json

    from stitching.compile import shipped as S
    manifest = _json.loads((shipped / "cnn" / "assets" / "stitching_kernels.json").read_text())
    entries, emitter = manifest["kernels"], manifest["emitter"]
    # {code: (sha, identity)} as kernel_assets installs them: each file vouches for
    # the entries of the specs it serves
    codes = {e["code"]: ("0" * 64, {"code": e["code"], "kernels": {
        k: x for k, x in entries.items() if x["code"] == e["code"]}})
        for e in entries.values()}
    try:
        S.clear()
        assert S.add(entries, "0" * 24, codes) == (0, [])             # another generator
        assert S.add(entries, emitter, {}) == (0, [])                  # nothing installed
        bad = {k: dict(e, program=["1; import os"]) for k, e in entries.items()}
        assert S.add(bad, emitter, codes)[0] == 0
        bad = {k: dict(e, code="../../etc/passwd") for k, e in entries.items()}
        assert S.add(bad, emitter, dict(codes, **{"../../etc/passwd": ("0" * 64, {})}))[0] == 0
        silent = {c: (sha, {"code": c, "kernels": {}}) for c, (sha, _) in codes.items()}
        taken, refused = S.add(entries, emitter, silent)               # not vouched for
        assert taken == 0 and sorted(refused) == sorted(entries)
        assert S.add(entries, emitter, codes) == (len(entries), []) and len(entries) >= 1
    finally:
        S.clear()


def test_rewrite_graph_def_in_memory_matches_the_original():
    """``stitching.rewrite_graph_def``: the Python API of ``stitching-rewrite`` for a
    GraphDef held in memory: one kernel for a softmax-of-a-scaled-sum, outputs equal to
    the original graph's, and bad outputs refused naming them."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        tf.nn.softmax(x * 0.5 + 1.0, name="y")
    gd = g.as_graph_def()
    new_gd, report = stitching.rewrite_graph_def(gd, ["y"])
    assert report.to_dict()["kernels"] == 1
    assert sum(n.op == "StitchedKernel" for n in new_gd.node) == 1
    xv = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)

    def run(graph_def):
        f = tf.compat.v1.wrap_function(
            lambda a: tf.compat.v1.import_graph_def(graph_def, {"x:0": a}, ["y:0"], name=""),
            [tf.TensorSpec([None, 64], tf.float32)])
        return f(tf.constant(xv))[0].numpy()
    np.testing.assert_allclose(run(new_gd), run(gd), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="output 'nope' names no node"):
        stitching.rewrite_graph_def(gd, ["nope"])
    with pytest.raises(ValueError, match="StitchedKernel"):       # already rewritten
        stitching.rewrite_graph_def(new_gd, ["y"])


# ---- untrusted graphs and tampered models (issue 44) -----------------------------------

def _sha(data: bytes) -> str:
    import hashlib
    return hashlib.sha256(data).hexdigest()


def _retamper(model, edit):
    """Edit the model's kernel manifest with ``edit(manifest, assets dir)`` and record
    the new manifest hash in saved_model.pb, as a tamperer who knows the format would:
    every hash the model holds stays consistent."""
    path = model / "assets" / "stitching_kernels.json"
    old = _sha(path.read_bytes())
    m = json.loads(path.read_text())
    edit(m, model / "assets")
    text = json.dumps(m).encode()
    path.write_bytes(text)
    pb = model / "saved_model.pb"
    data = pb.read_bytes()
    assert old.encode() in data
    pb.write_bytes(data.replace(old.encode(), _sha(text).encode()))


def _swap_codes(m, assets):
    (h1, e1), (h2, e2) = [(h, e) for h, e in sorted(m["kernels"].items())][:2]
    assert e1["code"] != e2["code"]
    e1["code"], e2["code"] = e2["code"], e1["code"]
    m["specs"][h1], m["specs"][h2] = e1["code"], e2["code"]


def _replace_file(m, assets):
    a, b = sorted(n for n in m["files"] if n.startswith("k_"))[:2]
    data = (assets / b).read_bytes()
    (assets / a).write_bytes(data)
    m["files"][a] = {"sha256": _sha(data), "size": len(data)}


@pytest.mark.parametrize("tamper, expect", [
    (_swap_codes, "is not vouched for by the kernel file it names"),
    (_replace_file, "a kernel file that does not belong"),
], ids=["index_swaps_two_code_names", "a_kernel_file_replaced_by_another"])
def test_a_tampered_model_with_consistent_hashes_is_correct_with_a_warning(
        shipped, tmp_path, tamper, expect):
    """Issue 44: both crashed (SIGSEGV) when every hash, saved_model.pb's included, was
    updated to match.  A shipped file carries its identity: the kernels that do not
    belong compile from their specs, with a warning, and the answer is right."""
    model = _copy_model(shipped, tmp_path)
    _retamper(model, tamper)
    r = _run(_LOAD_ONE.format(path=str(model), d=str(shipped)),
             env={"STITCHING_CACHE_DIR": str(tmp_path / "cache")})
    out = _result(r)
    assert out["err"] < 1e-5, out
    assert expect in r.stderr, r.stderr[-3000:]


_PLANT = """
    import hashlib, json, sys, warnings
    warnings.simplefilter("always")
    import numpy as np, tensorflow as tf
    import stitching
    from stitching.compile import shipped
    manifest, so, sha = sys.argv[1:4]
    out = {{}}
    # 1. a StitchedKernel spec holding the assets installer's payload
    gd = tf.compat.v1.GraphDef.FromString(open({d!r} + "/out.pb", "rb").read())
    (node,) = [n for n in gd.node if n.op == "StitchedKernel"]
    node.attr["spec"].s = ("stitching-assets\\n" + sha + "\\n" + manifest + "\\n" + so).encode()
    node.attr["spec_hash"].s = hashlib.sha256(node.attr["spec"].s).hexdigest()[:24].encode()
    run = tf.compat.v1.wrap_function(
        lambda a: tf.compat.v1.import_graph_def(gd, {{"x:0": a}}, ["y:0"], name=""),
        [tf.TensorSpec([None, 16], tf.float32)])
    try:
        run(tf.constant(np.load({d!r} + "/x_g.npy")))
        out["spec"] = "ran"
    except tf.errors.InvalidArgumentError as e:
        out["spec"] = str(e)
    # 2. a plain graph holding the installer's op, pointed at the crafted files
    g = tf.Graph()
    with g.as_default():
        op = stitching.runtime.load().stitched_kernel_assets(
            paths=tf.constant([manifest, so]), manifest_sha256=sha)
        with tf.compat.v1.Session(graph=g) as s:
            s.run(op)
    out["shipped"] = shipped.store().exists()
    print("RESULT", json.dumps(out))
"""

_VICTIM = """
    import json, warnings
    warnings.simplefilter("always")
    import numpy as np, tensorflow as tf
    import stitching
    d = {d!r}
    out = {{}}
    m = tf.saved_model.load({model!r})                    # the untouched model
    sig = m.signatures["serving_default"]
    x, want = np.load(d + "/x_cnn.npy"), np.load(d + "/y_cnn.npy")
    (got,) = sig(**{{list(sig.structured_input_signature[1])[0]: tf.constant(x)}}).values()
    out["savedmodel"] = float(np.abs(got.numpy() - want).max())
    gd = tf.compat.v1.GraphDef.FromString(open(d + "/out.pb", "rb").read())
    run = tf.compat.v1.wrap_function(                     # its kernel from the cache
        lambda a: tf.compat.v1.import_graph_def(gd, {{"x:0": a}}, ["y:0"], name=""),
        [tf.TensorSpec([None, 16], tf.float32)])
    x, want = np.load(d + "/x_g.npy"), np.load(d + "/y_g.npy")
    out["graphdef"] = float(np.abs(run(tf.constant(x))[0].numpy() - want).max())
    out["fallbacks"] = stitching.runtime.stats()["fallbacks"]
    print("RESULT", json.dumps(out))
"""


def test_a_graph_cannot_plant_kernels_for_a_later_model(shipped, tmp_path):
    """Issue 44's poisoning chain.  A plain graph offers a kernel file under another
    kernel's code name (manifest consistent), through a StitchedKernel spec holding the
    installer's payload and through a StitchedKernelAssets node of its own: nothing is
    installed.  Then a plant that did land in the compile cache (as a graph writing
    files could leave it: another kernel's whole, sealed object under the victim's
    code name) is refused by the untouched models loaded next: correct answers, with
    a warning, no fallback."""
    import shutil

    from stitching.compile import integrity
    cache = tmp_path / "cache"
    side = json.loads((shipped / "out.pb.kernels" / "stitching_kernels.json").read_text())
    (victim,) = set(side["specs"].values())              # out.pb's kernel code name
    cnn = json.loads((shipped / "cnn" / "assets" / "stitching_kernels.json").read_text())
    other = sorted(n for n in cnn["files"] if n.startswith("k_"))[0]
    evil = tmp_path / "evil" / "assets"          # laid out as a SavedModel's assets
    evil.mkdir(parents=True)
    shutil.copy(shipped / "cnn" / "assets" / other, evil / f"{victim}.so")
    data = (evil / f"{victim}.so").read_bytes()
    manifest = dict(cnn, files={f"{victim}.so": {"sha256": _sha(data), "size": len(data)}})
    text = json.dumps(manifest).encode()
    (evil / "stitching_kernels.json").write_bytes(text)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_PLANT.format(d=str(shipped))),
                        str(evil / "stitching_kernels.json"), str(evil / f"{victim}.so"),
                        _sha(text)], capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
                                STITCHING_CACHE_DIR=str(cache)))
    out = _result(r)
    assert "spec is not valid JSON" in out["spec"] and "stitching/kernel_0" in out["spec"]
    assert not out["shipped"], "a plain graph installed kernel files"
    assert "is not a SavedModel whose graph records" in r.stderr, r.stderr[-3000:]
    assert not list(cache.rglob("k_*.so")), "a plain graph put a kernel into the cache"
    # the plant a graph that writes files could leave in the compile cache
    here = cache / "kernels" / cnn["abi"]
    here.mkdir(parents=True, exist_ok=True)
    shutil.copy(shipped / "cnn" / "assets" / other, here / f"{victim}.so")
    integrity.seal(here / f"{victim}.so", (here / f"{victim}.so").read_bytes())
    r = _run(_VICTIM.format(d=str(shipped), model=str(shipped / "cnn")),
             env={"STITCHING_CACHE_DIR": str(cache)})
    out = _result(r)
    assert out["savedmodel"] < 1e-5 and out["graphdef"] < 1e-5, out
    assert out["fallbacks"] == 0, out
    assert "a kernel file that does not belong" in r.stderr, r.stderr[-3000:]


def test_a_saved_model_with_control_flow_in_its_signature_is_rewritten(tmp_path):
    """A signature whose function holds a tf.cond (and one with a tf.while_loop): the
    function that calls the stitched branches is renamed with them (saving refused two
    definitions of one name, the original's and the edited one); both branches and the
    loop answer as the original does, stitched."""
    from stitching.saved_model import rewrite_saved_model

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
        def cond(self, x):
            y = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.nn.relu(x * 2.0 + 1.0),
                        lambda: tf.tanh(x - 1.0) * 3.0)
            return {"y": tf.exp(y) / (1.0 + y * y)}

        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
        def loop(self, x):
            _, y = tf.while_loop(lambda i, v: i < 3,
                                 lambda i, v: (i + 1, tf.tanh(v * 1.5 + 0.1)), [0, x])
            return {"y": y}
    m = M()
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"cond": m.cond, "loop": m.loop})
    rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"))
    src, dst = (tf.saved_model.load(str(tmp_path / d)) for d in ("src", "dst"))
    rng = np.random.default_rng(3)
    for key in ("cond", "loop"):
        fns = dst.signatures[key].graph.as_graph_def().library.function
        assert any(n.op == "StitchedKernel" for f in fns for n in f.node_def), key
        for shift in (1.0, -1.0):                  # both branches
            x = tf.constant(rng.standard_normal((5, 16)).astype(np.float32) + shift)
            np.testing.assert_allclose(dst.signatures[key](x=x)["y"],
                                       src.signatures[key](x=x)["y"], rtol=1e-6, atol=1e-6)


def test_signature_input_keys_that_are_not_identifiers_are_kept(tmp_path):
    """A SignatureDef input key is what a TF Serving client sends ("my-input.0"); the
    rewritten model keeps it, not TF's Python-identifier form of it (my_input_0)."""
    from tensorflow.core.protobuf import saved_model_pb2
    from stitching.saved_model import rewrite_saved_model

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="my-input.0"),
                                      tf.TensorSpec([None, 16], tf.float32, name="b")])
        def f(self, x, b):
            return {"out-1": tf.nn.softmax(x * 3.0 - b)}
    m = M()
    tf.saved_model.save(m, str(tmp_path / "src"), signatures={"serving_default": m.f})
    rewrite_saved_model(str(tmp_path / "src"), str(tmp_path / "dst"))

    def keys(d):
        sm = saved_model_pb2.SavedModel.FromString((tmp_path / d / "saved_model.pb").read_bytes())
        sd = sm.meta_graphs[0].signature_def["serving_default"]
        return sorted(sd.inputs), sorted(sd.outputs)
    assert keys("dst") == keys("src") == (["b", "my-input.0"], ["out-1"])
    x = tf.constant(np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32))
    src, dst = (tf.saved_model.load(str(tmp_path / d)) for d in ("src", "dst"))
    feed = {"my-input.0": x, "b": x * 0.5}
    np.testing.assert_allclose(dst.signatures["serving_default"](**feed)["out-1"],
                               src.signatures["serving_default"](**feed)["out-1"],
                               rtol=1e-6, atol=1e-7)


def test_the_shipped_kernels_tag_ignores_the_cuda_backend(monkeypatch):
    """The tag that binds shipped CPU kernels to the sources that generate them covers
    the CPU emitter and the shared lowering, not the CUDA backend (a GPU-only change
    made every shipped model's kernels compile again)."""
    from pathlib import Path
    from stitching import cachedir
    from stitching.compile import shipped
    read, real = [], Path.read_bytes

    def recording(self):
        read.append(self.as_posix())
        return real(self)
    monkeypatch.setattr(Path, "read_bytes", recording)
    monkeypatch.setattr(cachedir, "_DIGESTS", {})       # read the sources again
    tag = shipped.emitter_tag()
    assert len(tag) == 24
    assert any("/codegen/cpu/" in p for p in read) and any("/codegen/lower/" in p for p in read)
    assert not any("/codegen/cuda/" in p for p in read)


def test_rewriting_a_keras2_saved_model_says_what_the_output_serves(tmp_path):
    """A tf_keras ``model.save(..., save_format='tf')`` holds keras_metadata.pb: users
    load it back with tf_keras.models.load_model or call it as ``loaded(x)``, and
    neither runs the rewritten signatures (load_model gave an object without
    ``predict``; ``loaded(x)`` ran stock TF, silently).  The rewrite says so."""
    import warnings

    from stitching.saved_model import rewrite_saved_model

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
        def f(self, x):
            return {"y": tf.nn.softmax(x * 2.0)}

    m = M()
    src = tmp_path / "src"
    tf.saved_model.save(m, str(src), signatures={"serving_default": m.f})
    with warnings.catch_warnings():
        warnings.simplefilter("error")              # a plain SavedModel: no warning
        rewrite_saved_model(str(src), str(tmp_path / "plain"))
    (src / "keras_metadata.pb").write_bytes(b"")   # what tf_keras's save writes beside it
    with pytest.warns(UserWarning, match=r"Keras 2 \(tf_keras\) SavedModel.*"
                      r"signatures\['serving_default'\].*tf_keras.models.load_model"):
        rewrite_saved_model(str(src), str(tmp_path / "dst"))
