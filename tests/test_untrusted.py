"""Graph files are untrusted input: every way one can be wrong is a clear error that
names the file or the node, never a wrong answer, a crash, or code run from the file.

    the file:   truncated/corrupt .pb, .pbtxt syntax error, empty, unknown op, a missing
                output, an output index out of range, an already rewritten graph
    a spec:     tampered ``spec`` attributes of a rewritten graph's StitchedKernel node
                (table below), and a fuzz test mutating specs at random: each run ends
                in an error naming the node, or in the result the (mutated) spec means,
                checked against a float64 NumPy interpreter of the op table
"""
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import stitching  # noqa: F401  (registers the op and the compile-on-miss hook)
from stitching import cli
from stitching.testing.models import frozen_softmax_graph_def

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE = "stitching/kernel_0"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("untrusted")
    (d / "g.pb").write_bytes(frozen_softmax_graph_def().SerializeToString())
    assert cli.main([str(d / "g.pb"), str(d / "out.pb"), "--outputs", "y"]) == 0
    return d


def _cli_error(capsys, *args):
    assert cli.main([str(a) for a in args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err          # one line, no traceback
    return err


@pytest.mark.parametrize("damage, expect", [
    (lambda b: b[:len(b) // 2], "not a binary GraphDef, or truncated or corrupt"),
    (lambda b: b"\xff\xfe\x00garbage" * 8, "not a binary GraphDef, or truncated or corrupt"),
    (lambda b: b"", "the file is empty"),
])
def test_a_damaged_binary_graph_def_is_refused(files, capsys, damage, expect):
    bad = files / "bad.pb"
    bad.write_bytes(damage((files / "g.pb").read_bytes()))
    err = _cli_error(capsys, bad, files / "o.pb", "--outputs", "y")
    assert str(bad) in err and expect in err


def test_a_text_graph_def_with_a_syntax_error(files, capsys):
    bad = files / "bad.pbtxt"
    bad.write_text('node { name: "x" op: "Placeholder"\n  node { name: ')
    err = _cli_error(capsys, bad, files / "o.pb", "--outputs", "x")
    assert f"{bad}: text GraphDef syntax error at 2:" in err


def test_missing_outputs_and_unknown_ops_name_the_node(files, capsys):
    err = _cli_error(capsys, files / "g.pb", files / "o.pb", "--outputs", "nope")
    assert "output 'nope' names no node in the graph" in err
    err = _cli_error(capsys, files / "g.pb", files / "o.pb", "--outputs", "y:7")
    assert "output 'y:7'" in err and "only has 1 outputs" in err
    gd = tf.compat.v1.GraphDef.FromString((files / "g.pb").read_bytes())
    n = gd.node.add()
    n.name, n.op = "z", "FooBarOp"
    n.input.append("y")
    (files / "unknown.pb").write_bytes(gd.SerializeToString())
    err = _cli_error(capsys, files / "unknown.pb", files / "o.pb", "--outputs", "z")
    assert "node 'z' has op 'FooBarOp', which this TensorFlow does not know" in err
    n.op, n.input[0] = "Identity", "nowhere"
    (files / "dangling.pb").write_bytes(gd.SerializeToString())
    err = _cli_error(capsys, files / "dangling.pb", files / "o.pb", "--outputs", "z")
    assert "node 'z' reads 'nowhere', which names no node" in err


def test_rewriting_a_rewritten_graph_is_refused(files, capsys):
    err = _cli_error(capsys, files / "out.pb", files / "twice.pb", "--outputs", "y")
    assert f"node '{NODE}' is a StitchedKernel" in err and "rewritten" in err
    assert not (files / "twice.pb").exists()


# ---- tampered specs ------------------------------------------------------------------

def _spec(files) -> dict:
    gd = tf.compat.v1.GraphDef.FromString((files / "out.pb").read_bytes())
    (node,) = [n for n in gd.node if n.op == "StitchedKernel"]
    return json.loads(node.attr["spec"].s)


def _run_with(files, spec, x, attrs=None, fallback=False):
    """Run the rewritten graph with its StitchedKernel's spec (and attrs) replaced;
    ``fallback``: the node keeps its original subgraph (which must not serve a spec
    that fails validation)."""
    gd = tf.compat.v1.GraphDef.FromString((files / "out.pb").read_bytes())
    (node,) = [n for n in gd.node if n.op == "StitchedKernel"]
    node.attr["spec"].s = spec if isinstance(spec, bytes) else \
        (spec if isinstance(spec, str) else json.dumps(spec)).encode()
    # as a deliberate edit would: the recorded hash made to match, so that what is
    # tested is the validation of the spec itself (the hash: its own test below)
    node.attr["spec_hash"].s = hashlib.sha256(node.attr["spec"].s).hexdigest()[:24].encode()
    if not fallback:
        node.attr.pop("fallback", None)   # the spec's own handling (fallback: test_serving)
    for k, fn in (attrs or {}).items():
        fn(node.attr[k])
    run = tf.compat.v1.wrap_function(
        lambda a: tf.compat.v1.import_graph_def(gd, {"x:0": a}, ["y:0"], name=""),
        [tf.TensorSpec([None, 16], tf.float32)])
    return run(tf.constant(x))[0].numpy()


def _edit(path, value):
    def apply(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
        return d
    return apply


def _first_op(d, op):
    return next(i for i, n in enumerate(d["nodes"]) if n["op"] == op)


TAMPERED = {
    "invalid JSON": (lambda d: json.dumps(d)[:-7], "spec is not valid JSON"),
    "binary junk": (lambda d: b"\xff\xfe\x80", "utf-8"),
    "unknown op": (lambda d: _edit(["nodes", 1, "op"], "Frobnicate")(d),
                   "op 'Frobnicate' is not a known op"),
    "code as an op name": (
        lambda d: _edit(["nodes", 1, "op"], "__import__('os').system('touch PWNED')")(d),
        "is not a known op"),
    "code as an attribute": (
        lambda d: _edit(["nodes", 0, "attrs", "value"], "__import__('os').system('touch "
                                                         "PWNED')")(d), "nodes[0] (Const)"),
    "code as a dtype": (lambda d: _edit(["inputs", 0, "dtype"], "eval('1')")(d),
                        "unsupported dtype"),
    "negative shape": (lambda d: _edit(["inputs", 0, "shape"], [-5, 16])(d),
                       "shape must be a list of at most 8 ints >= -1"),
    "absurd shape": (lambda d: _edit(["inputs", 0, "shape"], [1 << 60, 16])(d),
                     "shape must be a list"),
    "absurd rank": (lambda d: _edit(["inputs", 0, "shape"], [2] * 40)(d),
                    "shape must be a list of at most 8"),
    "huge static size": (lambda d: _edit(["inputs", 0, "shape"], [1 << 39, 16])(d),
                         "claims shape"),
    "input out of range": (lambda d: _edit(["nodes", 1, "args"], [-9, 0])(d),
                           "reference -9 is out of range"),
    "forward reference": (lambda d: _edit(["nodes", 1, "args"], [-1, 5])(d),
                          "reference 5 is out of range or not earlier"),
    "output out of range": (lambda d: _edit(["outputs"], [999])(d),
                            "output reference 999 must name a node"),
    "no outputs": (lambda d: _edit(["outputs"], [])(d),
                   "outputs must be a non-empty list"),
    "lying dtype": (lambda d: _edit(["nodes", 1, "dtype"], "float64")(d),
                    "claims dtype float64"),
    "unknown schedule key": (lambda d: _edit(["schedule", "os.system"], 1)(d),
                             "unknown schedule parameter"),
    "bool as size": (lambda d: _edit(["schedule", "rows_per_task"], True)(d),
                     "schedule.rows_per_task must be an int"),
    "extra key": (lambda d: _edit(["__class__"], "x")(d), "unknown spec keys"),
    "too many nodes": (lambda d: _edit(["nodes"], (d["nodes"] * 4097)[:4097])(d),
                       "nodes must be a non-empty list of at most 4096"),
    "NaN constant": (lambda d: json.dumps(d).replace('"value": 3.0', '"value": NaN'),
                     "non-standard JSON constant NaN"),
    # issue 44: served by the fallback before, with no warning
    "deep nesting": (lambda d: json.dumps(d)[:-1] + ', "x": ' + "[" * 100000 +
                     "]" * 100000 + "}", "spec nests deeper than 16 levels"),
    "NUL after the JSON": (lambda d: json.dumps(d).encode() + b"\0garbage",
                           "the spec holds a NUL byte at offset"),
    "version true": (lambda d: _edit(["version"], True)(d), "unsupported spec version"),
    "version 1.0": (lambda d: _edit(["version"], 1.0)(d), "unsupported spec version"),
    "the assets installer's marker": (lambda d: "stitching-assets\n" + "0" * 64 +
                                      "\n/tmp/stitching_kernels.json",
                                      "spec is not valid JSON"),
    "over the size limit": (lambda d: json.dumps(d)[:-1] + ', "pad": "' + "x" * (2 << 20)
                            + '"}', "limit 1048576"),
}


@pytest.mark.parametrize("fallback", [False, True], ids=["alone", "with_fallback"])
@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_a_tampered_spec_is_a_clear_error_naming_the_node(files, case, fallback, tmp_path,
                                                          monkeypatch):
    """Whether or not the node carries its original subgraph: the fallback serves
    kernels that cannot be *built* here, never specs that fail validation."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STITCHING_STRICT", raising=False)
    tamper, expect = TAMPERED[case]
    x = np.ones([2, 16], np.float32)
    with pytest.raises((tf.errors.InvalidArgumentError, tf.errors.NotFoundError)) as e:
        _run_with(files, tamper(_spec(files)), x, fallback=fallback)
    msg = str(e.value)
    assert NODE in msg and "StitchedKernel" in msg, msg
    assert expect in msg, msg
    assert not (tmp_path / "PWNED").exists()


def test_a_spec_that_does_not_match_its_recorded_hash_is_refused(files):
    """The rewrite records each spec's SHA-256 prefix (`spec_hash`); the op checks it
    before looking the spec up, so an edit is refused even where a kernel for the
    edited spec is registered -- here, one that differs only in a constant."""
    d = _spec(files)
    d["nodes"][_first_op(d, "Const")]["attrs"]["value"] = 5.0
    edited = json.dumps(d, sort_keys=True, separators=(",", ":"))
    x = np.ones([2, 16], np.float32)
    _run_with(files, edited, x)                  # registers the edited spec's kernel
    gd = tf.compat.v1.GraphDef.FromString((files / "out.pb").read_bytes())
    (node,) = [n for n in gd.node if n.op == "StitchedKernel"]
    assert node.attr["spec_hash"].s.decode() == \
        hashlib.sha256(node.attr["spec"].s).hexdigest()[:24]
    node.attr["spec"].s = edited.encode()        # the original hash left in place
    run = tf.compat.v1.wrap_function(
        lambda a: tf.compat.v1.import_graph_def(gd, {"x:0": a}, ["y:0"], name=""),
        [tf.TensorSpec([None, 16], tf.float32)])
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        run(tf.constant(x))
    assert NODE in str(e.value) and "does not match its spec_hash" in str(e.value)


@pytest.mark.parametrize("how", ["cleared", "removed"])
def test_a_spec_without_its_hash_is_refused(files, how):
    """Clearing or removing `spec_hash` does not let an edited spec run (issue 44)."""
    d = _spec(files)
    d["nodes"][_first_op(d, "Const")]["attrs"]["value"] = 5.0

    def drop(a):
        a.s = b""
    x = np.ones([2, 16], np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        if how == "cleared":
            _run_with(files, d, x, {"spec_hash": drop}, fallback=True)
        else:
            gd = tf.compat.v1.GraphDef.FromString((files / "out.pb").read_bytes())
            (node,) = [n for n in gd.node if n.op == "StitchedKernel"]
            node.attr["spec"].s = json.dumps(d).encode()
            del node.attr["spec_hash"]
            tf.compat.v1.wrap_function(
                lambda a: tf.compat.v1.import_graph_def(gd, {"x:0": a}, ["y:0"], name=""),
                [tf.TensorSpec([None, 16], tf.float32)])(tf.constant(x))
    assert NODE in str(e.value) and "has no spec_hash" in str(e.value)


def test_tampered_node_attributes_beside_a_valid_spec(files):
    x = np.ones([2, 16], np.float32)

    def tout_int(a):
        a.list.type[:] = [tf.int32.as_datatype_enum]
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as e:
        _run_with(files, _spec(files), x, {"Tout": tout_int})
    assert NODE in str(e.value)

    def tin_two(a):
        a.list.type.append(tf.float32.as_datatype_enum)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)) as e:
        _run_with(files, _spec(files), x, {"Tin": tin_two})
    assert NODE in str(e.value)


def test_a_valid_edit_of_a_spec_computes_what_the_edit_means(files):
    """The spec is the kernel: a graph whose Const 3.0 became 5.0 computes with 5.0."""
    d = _spec(files)
    d["nodes"][_first_op(d, "Const")]["attrs"]["value"] = 5.0
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    got = _run_with(files, d, x)
    want = tf.nn.softmax(x * 5.0 - x.mean(-1, keepdims=True)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- fuzz ----------------------------------------------------------------------------

def test_fuzzed_specs_give_a_clear_error_or_the_right_answer(files):
    """Random mutations of a real spec (tools/fuzz_specs.py: values, deleted keys and
    list items, numbers nudged, the text cut, flipped, NUL bytes, deep nesting; node
    attributes): each must fail with an error naming the node, compute what the
    mutated spec means, or fall back with a warning for a valid spec.  Trials run in
    a child process, so a crash or a hang is counted, not the end of the run."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import fuzz_specs
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    out = fuzz_specs.fuzz(150, 29, timeout=120, graph=str(files / "out.pb"))
    assert out["bugs"] == 0, out
    assert sum(out["counts"].values()) == 150
    counts = out["counts"]
    assert counts["error_names_node"] > 20 and counts["correct"] > 20, out   # both exercised


def test_a_region_without_outputs_is_refused_not_emitted():
    """Regression: fetching a missing output ('y:7', before the CLI checked fetches)
    made a Softmax region with no outputs, which the emitter wrote as a loop with an
    empty body (an IndentationError at compile time).  The spec check refuses such a
    kernel in memory too, with a reason the report shows."""
    import dataclasses

    from stitching.ir.spec import KernelSpec, SpecError, validate
    from stitching.tf.pipeline import stitch_graph_def
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        tf.nn.softmax(x * 3.0, name="y")
    res = stitch_graph_def(g.as_graph_def(), ["y:7"], name="no_outputs")
    text = res.report.summary()
    assert "nothing reads the region's values" in text and "IndentationError" not in text
    spec = KernelSpec.from_json(json.dumps({
        "version": 1, "inputs": [{"dtype": "float32", "shape": [-1, 16]}],
        "nodes": [{"op": "Exp", "args": [-1], "attrs": {}, "dtype": "float32",
                   "shape": [-1, 16]}], "outputs": [0]}))
    with pytest.raises(SpecError, match="at least one output"):
        validate(dataclasses.replace(spec, outputs=()))


# ---- the kernel cache: files opened as files, kernels that belong (issue 44) ---------

def _mul_spec(c: float, n: int = 1, op: str = "Mul"):
    """x * c (n == 1), or a chain of n ``op`` nodes after it: a spec whose code is
    its own (c) and as large as wanted (n)."""
    from stitching.ir import KernelSpec
    t = {"dtype": "float32", "shape": [-1, 16]}
    nodes = [{"op": "Const", "args": [], "attrs": {"dtype": "float32", "shape": [], "value": c},
              "dtype": "float32",
              "shape": []},
             {"op": "Mul", "args": [-1, 0], "attrs": {}, **t}]
    nodes += [{"op": op, "args": [i + 1], "attrs": {}, **t} for i in range(n - 1)]
    return KernelSpec.from_json(json.dumps({"version": 1, "inputs": [t], "nodes": nodes,
                                            "outputs": [len(nodes) - 1]}))


def _within(seconds, fn):
    """fn() on a thread: a hang (reading a FIFO, /dev/zero) fails the test, not the run."""
    import threading
    out = []

    def run():
        try:
            out.append((fn(), None))
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            out.append((None, e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "hung"
    if out[0][1] is not None:
        raise out[0][1]
    return out[0][0]


DAMAGE = {
    "object is /dev/zero": lambda so, seal, other: (so.unlink(), so.symlink_to("/dev/zero")),
    "object is a FIFO": lambda so, seal, other: (so.unlink(), os.mkfifo(so)),
    "seal is /dev/zero": lambda so, seal, other: (seal.unlink(), seal.symlink_to("/dev/zero")),
    "seal is a directory": lambda so, seal, other: (seal.unlink(), seal.mkdir()),
    "seal is a FIFO": lambda so, seal, other: (seal.unlink(), os.mkfifo(seal)),
    "symlink out of the cache": lambda so, seal, other: (
        __import__("shutil").copy(so, so.parent.parent / "elsewhere.so"), so.unlink(),
        so.symlink_to(so.parent.parent / "elsewhere.so")),
    # the SIGSEGV of issue 44: another kernel's whole, sealed object under this name
    # (a new file: this process has the old one mapped, as a later process would not)
    "another kernel with its seal": lambda so, seal, other: (
        so.unlink(), __import__("shutil").copy(other, so),
        __import__("shutil").copy(other.with_name(other.name + ".sha256"), seal)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_cache_entry_that_is_not_its_kernel_is_refused_and_rebuilt(damage, tmp_path,
                                                                     monkeypatch):
    from stitching.compile import integrity, kernel, native
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path / "cache"))
    kernel.clear_memory_cache()            # kernels of other tests' caches
    a, b = _mul_spec(3.0), _mul_spec(5.0, 2, "Neg")
    ka, kb = kernel.compile_kernel(a), kernel.compile_kernel(b)
    so = kernel.kernel_dir() / (ka.code_name + ".so")
    other = kernel.kernel_dir() / (kb.code_name + ".so")
    DAMAGE[damage](so, integrity.sidecar(so), other)
    kernel.clear_memory_cache()
    native._loaded.pop(str(so), None)
    integrity._verified.clear()
    with pytest.warns(RuntimeWarning, match="ignoring a damaged kernel cache entry"):
        k = _within(120, lambda: kernel.compile_kernel(a))
    x = np.arange(32, dtype=np.float32).reshape(2, 16)
    np.testing.assert_array_equal(k(x)[0], x * 3)
    assert not so.is_symlink() and so.is_file() and integrity.sidecar(so).is_file()
    assert integrity.check(so, code=ka.code_name) is None          # repaired


def test_files_are_read_as_files(tmp_path):
    from stitching import cachedir
    f = tmp_path / "f"
    f.write_bytes(b"12345")
    assert cachedir.read_file(f, 10) == b"12345"
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "in").symlink_to(f)
    for path, why in [(f, "more than the 4 expected"), (tmp_path / "fifo", "a FIFO"),
                      (tmp_path / "zero", "a symlink"), (tmp_path / "d", "a directory")]:
        with pytest.raises(cachedir.NotAFile, match=why):
            _within(10, lambda: cachedir.read_file(path, 4))
    with pytest.raises(cachedir.NotAFile, match="5 bytes, 3 recorded"):
        cachedir.read_file(f, 10, size=3)
    with pytest.raises(cachedir.NotAFile, match="leaves"):   # a symlink out of `within`
        cachedir.read_file(tmp_path / "d" / "in", 10, within=tmp_path / "d")
    assert cachedir.read_file(tmp_path / "d" / "in", 10, within=tmp_path) == b"12345"


# ---- kernel assets from a plain graph (issue 44's poisoning chain, in-process part) ---

def _planted_assets(tmp_path, saved_model: bool):
    """A directory of crafted kernel assets: kernel A's object (as a model ships it)
    offered under kernel B's code name, with a consistent manifest; (manifest path,
    object path, the manifest's sha)."""
    import hashlib as H

    from stitching.compile import integrity, kernel, shipped
    kernel.clear_memory_cache()            # kernels of other tests' caches
    ka, kb = kernel.compile_kernel(_mul_spec(7.0)), kernel.compile_kernel(_mul_spec(9.0))
    d = tmp_path / "evil" / "assets"
    d.mkdir(parents=True)
    data = integrity.with_identity(          # A's object as a model would ship it
        (kernel.kernel_dir() / (ka.code_name + ".so")).read_bytes(),
        {"code": ka.code_name, "kernels": {ka.spec.hash: shipped.entry_of(ka)}})
    (d / (kb.code_name + ".so")).write_bytes(data)
    manifest = {"version": 3, "abi": kernel.kernel_dir().name, "host": "?",
                "files": {kb.code_name + ".so": {"sha256": H.sha256(data).hexdigest(),
                                                  "size": len(data)}},
                "specs": {kb.spec.hash: kb.code_name}, "emitter": shipped.emitter_tag(),
                "kernels": {kb.spec.hash: shipped.entry_of(kb)}}
    text = json.dumps(manifest).encode()
    (d / "stitching_kernels.json").write_bytes(text)
    sha = H.sha256(text).hexdigest()
    if saved_model:
        (d.parent / "saved_model.pb").write_bytes(b"\x00graph records " + sha.encode())
    return d / "stitching_kernels.json", d / (kb.code_name + ".so"), sha


def test_the_assets_installer_does_not_run_for_a_plain_graph(tmp_path, monkeypatch):
    """The StitchedKernelAssets op is a registered op any graph can hold: pointing it
    at files of one's own installs nothing (the manifest is not a SavedModel's whose
    graph records its hash), and a StitchedKernel spec never reaches the installer."""
    from stitching import runtime
    from stitching.compile import shipped
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path / "cache"))
    shipped.clear()          # what models loaded earlier in this process installed
    manifest, so, sha = _planted_assets(tmp_path, saved_model=False)
    with pytest.warns(RuntimeWarning, match="is not a SavedModel whose graph records"):
        runtime.load().stitched_kernel_assets(paths=tf.constant([str(manifest), str(so)]),
                                             manifest_sha256=sha)
    assert not shipped.store().exists() and shipped._index == {}


def test_a_shipped_file_that_is_another_kernel_is_refused(tmp_path, monkeypatch):
    """Even inside a SavedModel whose graph records the manifest: kernel A's object
    offered under code name B (every hash consistent) is refused by its identity."""
    from stitching.compile import shipped
    from stitching.tf import kernel_assets
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path / "cache"))
    shipped.clear()          # what models loaded earlier in this process installed
    manifest, so, sha = _planted_assets(tmp_path, saved_model=True)
    try:
        with pytest.warns(RuntimeWarning, match="a kernel file that does not belong"):
            kernel_assets.install("\n".join([sha, str(manifest), str(so)]))
        assert shipped._index == {}
    finally:
        shipped.clear()


# ---- bounded work per graph file ------------------------------------------------------

def test_code_over_the_size_limit_is_not_compiled(monkeypatch):
    from stitching.compile import kernel, parallel
    monkeypatch.setattr(kernel, "MAX_CODE_BYTES", 2000)
    with pytest.raises(parallel.CompileLimitError, match="bytes of generated code"):
        parallel.compile_bounded(_mul_spec(11.0, 40, "Exp"))


def test_a_compile_over_the_time_limit_is_stopped_and_falls_back_with_a_warning(
        monkeypatch):
    """A kernel from a graph file whose code is large compiles in a worker that is
    killed at the time limit: the node gets its fallback (a warning), not minutes of
    compiling.  The worker here never answers, so the limit decides, not how fast
    this machine compiles (a real worker built this spec within the 1 s limit on a
    quiet Zen 5, and the test then failed)."""
    import time

    import stitching.tf as stf
    from stitching.compile import parallel

    def stalled_worker():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    monkeypatch.setattr(parallel, "_spawn", stalled_worker)
    monkeypatch.setenv("STITCHING_COMPILE_SECONDS", "1")
    spec = _mul_spec(13.0, 120, "Exp")               # ~12 KB of code: a worker's
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="more than 1 s"):
        with pytest.raises(parallel.CompileLimitError):
            stf._compile_spec(spec.to_json())
    assert time.monotonic() - t0 < 15


def test_a_process_stops_compiling_past_its_budget(monkeypatch):
    from stitching.compile import parallel
    monkeypatch.setattr(parallel, "_spent", 1e9)
    with pytest.raises(parallel.CompileLimitError, match="STITCHING_COMPILE_BUDGET"):
        parallel.compile_bounded(_mul_spec(17.0, 3, "Neg"))


def test_compile_workers_die_with_their_parent():
    """kill -9 of a process whose worker is compiling leaves no worker running."""
    import signal
    import time
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from stitching.compile import parallel
        p = parallel._spawn()
        print(p.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=ROOT))
    pid = int(parent.stdout.readline())
    time.sleep(1.0)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()

    def alive():
        try:
            with open(f"/proc/{pid}/status") as f:
                return "\tZ" not in next(ln for ln in f if ln.startswith("State:"))
        except (FileNotFoundError, StopIteration):
            return False
    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), "the compile worker outlived its parent"


def test_a_helper_cache_entry_that_is_not_a_file_is_removed(tmp_path, monkeypatch):
    """Numba reads its cache files itself: a FIFO among them would hang a compile."""
    from stitching.compile import helper_cache
    d = tmp_path / "helpers"
    d.mkdir()
    os.mkfifo(d / "x.nbi")
    (d / "y.nbc").mkdir()
    monkeypatch.setattr(helper_cache, "_read_only", False)
    assert helper_cache._only_files(d) and list(d.iterdir()) == []
    os.mkfifo(d / "x.nbi")
    monkeypatch.setattr(helper_cache, "_read_only", True)   # the installed cache: unused
    assert not helper_cache._only_files(d)


@pytest.mark.parametrize("what", ["a FIFO", "/dev/zero"])
def test_a_shipped_kernel_that_is_not_a_file_is_refused(tmp_path, monkeypatch, what):
    """Issue 44: a shipped .so that is a FIFO never returned; one linked to /dev/zero
    read until MemoryError.  Refused before a byte is read, with a warning."""
    from stitching.compile import shipped
    from stitching.tf import kernel_assets
    monkeypatch.setenv("STITCHING_CACHE_DIR", str(tmp_path / "cache"))
    manifest, so, sha = _planted_assets(tmp_path, saved_model=True)
    so.unlink()
    os.mkfifo(so) if what == "a FIFO" else so.symlink_to("/dev/zero")
    try:
        with pytest.warns(RuntimeWarning, match="cannot be read, or is not the file"):
            _within(30, lambda: kernel_assets.install("\n".join([sha, str(manifest), str(so)])))
        assert shipped._index == {}
    finally:
        shipped.clear()
