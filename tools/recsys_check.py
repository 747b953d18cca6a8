"""Recommender models through stitching, as a serving team would try them.

Three small but realistic Keras 3 models with string and int64 ids:

  two_tower  user tower (StringLookup and Hashing -> Embedding -> Dense stack) and
             item tower (IntegerLookup -> Embedding -> Dense stack), L2-normalized,
             scores = dot products, in-batch softmax loss
  dcn        DCN-v2 ranking: dict inputs (string and int64 ids, float features),
             embeddings concatenated with the normalized dense features, cross layers
             x0 * (W x + b) + x, a deep MLP, sigmoid output
  dlrm       bottom MLP on dense features, hashed int64 ids -> embeddings, pairwise
             dot interactions of the stacked vectors, top MLP

For each it checks, and prints the numbers of:

  infer   ``stitching.function`` at an unknown batch (batches 64, 7, 1) against stock
          ``tf.function``, and both against the model in float64 (same weights)
  train   20 steps of Keras ``fit`` with Adam (embedding gradients are IndexedSlices:
          Keras's sparse Adam update), stitched with ``stitching.keras.stitch``
          (``background_compile=False``: every step stitched) against stock Keras
          from the same initial weights: every step's loss, the final weights
  serve   ``model.export`` -> ``stitching.rewrite_saved_model`` -> the rewritten and
          the original SavedModel each loaded in a fresh process and served a dict
          of tensors (string ids included), batches 33, 5, 1 and 0, and rows with NaN
          and Inf dense features
  report  the lookups, hashing and embedding gathers stay TF's with a reason; no op
          of unknown rank; no op left without a reason ("left to TF by the planner")
  speed   interleaved stock / stitched calls at batch 1 and 256, and Keras train
          steps at batch 256, medians, with the load average (timings are printed,
          never asserted)

    python tools/recsys_check.py                      # all models, all checks
    python tools/recsys_check.py --models dcn --checks infer report

Exits 1 if a check fails (numbers past their tolerance, an error, a report line
that says nothing).  Takes a few minutes on a 2-core machine; set
STITCHING_CACHE_DIR to keep it out of ~/.cache/stitching.  The NaN rows of
``serve`` are printed, not checked: where TF runs oneDNN a Dense layer's ReLU is
oneDNN's in stock TF, which gives 0 for a NaN, where stitched keeps it
(docs/differences-from-tf-function.md).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

N_USERS, N_ITEMS = 200, 300
USER_VOCAB = [f"u{i}" for i in range(N_USERS)]
CATS = [f"c{i}" for i in range(12)]
MODELS = ("two_tower", "dcn", "dlrm")
CHECKS = ("infer", "train", "serve", "report", "speed")


# ---------------------------------------------------------------- models and data

def build(name: str):
    """A fresh model (its weights from a fixed seed); float inputs of keras's floatx."""
    import keras
    import tensorflow as tf
    L = keras.layers
    fx = keras.config.floatx()
    if name == "two_tower":
        keras.utils.set_random_seed(1)
        uid = keras.Input((), dtype="string", name="user_id")
        iid = keras.Input((), dtype="int64", name="item_id")
        city = keras.Input((), dtype="string", name="user_city")
        u = L.Embedding(N_USERS + 1, 32)(L.StringLookup(vocabulary=USER_VOCAB)(uid))
        c = L.Embedding(64, 8)(L.Hashing(num_bins=64)(city))
        u = L.Dense(32)(L.Dense(64, activation="relu")(L.Concatenate()([u, c])))
        i = L.IntegerLookup(vocabulary=np.arange(N_ITEMS, dtype="int64"))(iid)
        i = L.Dense(32)(L.Dense(64, activation="relu")(L.Embedding(N_ITEMS + 1, 32)(i)))
        u, i = L.UnitNormalization()(u), L.UnitNormalization()(i)
        scores = L.Lambda(lambda t: tf.matmul(t[0], t[1], transpose_b=True) * 20.0)([u, i])
        return keras.Model({"user_id": uid, "item_id": iid, "user_city": city}, scores)
    if name == "dcn":
        keras.utils.set_random_seed(2)
        ins = {"user_id": keras.Input((), dtype="string", name="user_id"),
               "item_id": keras.Input((), dtype="int64", name="item_id"),
               "category": keras.Input((), dtype="string", name="category"),
               "age": keras.Input((1,), dtype=fx, name="age"),
               "price": keras.Input((1,), dtype=fx, name="price")}
        u = L.Embedding(N_USERS + 1, 16)(L.StringLookup(vocabulary=USER_VOCAB)(ins["user_id"]))
        it = L.Embedding(1000, 16)(L.Hashing(num_bins=1000)(ins["item_id"]))
        c = L.Embedding(len(CATS) + 1, 8)(L.StringLookup(vocabulary=CATS)(ins["category"]))
        price = L.Lambda(lambda p: tf.math.log1p(p))(ins["price"])
        dense = L.BatchNormalization()(L.Concatenate()([ins["age"], price]))
        x0 = L.Concatenate()([u, it, c, dense])
        x = x0
        for _ in range(3):
            x = _layer(0)()([x0, x])
        d = L.Dense(32, activation="relu")(L.Dense(64, activation="relu")(x0))
        out = L.Dense(1, activation="sigmoid")(L.Concatenate()([x, d]))
        return keras.Model(ins, out)
    if name == "dlrm":
        keras.utils.set_random_seed(3)
        dense = keras.Input((8,), dtype=fx, name="dense_features")
        sparse = keras.Input((4,), dtype="int64", name="sparse")
        b = L.Dense(16, activation="relu")(L.Dense(64, activation="relu")(dense))
        feats = [b]
        for k in range(4):
            col = L.Lambda(lambda s, k=k: s[:, k])(sparse)
            feats.append(L.Embedding(500, 16)(L.Hashing(num_bins=500)(col)))
        t = L.Dense(32, activation="relu")(L.Dense(64, activation="relu")(_layer(1)()(feats)))
        return keras.Model({"dense_features": dense, "sparse": sparse}, L.Dense(1)(t))
    raise ValueError(f"unknown model {name!r} (one of {', '.join(MODELS)})")


def _layers():
    import keras
    import tensorflow as tf

    class Cross(keras.layers.Layer):
        def build(self, shape):
            d = shape[0][-1]
            self.w = self.add_weight(shape=(d, d), initializer="glorot_uniform", name="w")
            self.b = self.add_weight(shape=(d,), initializer="zeros", name="b")

        def call(self, inputs):
            x0, x = inputs
            return x0 * (tf.matmul(x, self.w) + self.b) + x

    class Interaction(keras.layers.Layer):
        """DLRM's dot interaction: Z = X X^T of the stacked [B, F, D] vectors, its
        strict lower triangle beside the bottom MLP's output."""

        def call(self, feats):
            x = tf.stack(feats, axis=1)
            z = tf.matmul(x, x, transpose_b=True)
            f = len(feats)
            ii, jj = np.tril_indices(f, -1)
            tri = tf.gather(tf.reshape(z, [-1, f * f]), (ii * f + jj).astype("int32"), axis=1)
            return tf.concat([feats[0], tri], axis=1)

    return Cross, Interaction


_LAYERS = []


def _layer(i: int):
    """The custom layers (0: Cross, 1: Interaction), made once keras is imported."""
    if not _LAYERS:
        _LAYERS.extend(_layers())
    return _LAYERS[i]


def data(name: str, n: int, seed: int = 0) -> dict:
    """n rows of features; ids include some out of each vocabulary (the OOV bucket)."""
    r = np.random.default_rng(seed)
    if name == "two_tower":
        return {"user_id": np.array([f"u{k}" for k in r.integers(0, N_USERS + 20, n)], object),
                "item_id": r.integers(0, N_ITEMS + 10, n).astype("int64"),
                "user_city": np.array([f"city{k}" for k in r.integers(0, 40, n)], object)}
    if name == "dcn":
        cats = [CATS[k] if k < len(CATS) else "zz" for k in r.integers(0, len(CATS) + 2, n)]
        return {"user_id": np.array([f"u{k}" for k in r.integers(0, N_USERS + 20, n)], object),
                "item_id": r.integers(0, 5000, n).astype("int64"),
                "category": np.array(cats, object),
                "age": r.uniform(18, 80, (n, 1)).astype("float32") / 80.0,
                "price": r.exponential(20.0, (n, 1)).astype("float32")}
    return {"dense_features": r.lognormal(0, 1, (n, 8)).astype("float32"),
            "sparse": r.integers(0, 10 ** 6, (n, 4)).astype("int64")}


def labels(name: str, n: int, seed: int = 0):
    r = np.random.default_rng(seed + 100)
    if name == "two_tower":
        return np.zeros((n,), "float32")       # the in-batch loss ignores them
    if name == "dcn":
        return r.integers(0, 2, (n, 1)).astype("float32")
    return r.standard_normal((n, 1)).astype("float32")


def loss(name: str):
    import keras
    import tensorflow as tf
    if name == "two_tower":
        def in_batch_softmax(y_true, y_pred):      # row i's positive is item i
            n = tf.shape(y_pred)[0]
            return keras.losses.sparse_categorical_crossentropy(tf.range(n), y_pred,
                                                                from_logits=True)
        return in_batch_softmax
    return "binary_crossentropy" if name == "dcn" else "mse"


def _tensors(d: dict) -> dict:
    import tensorflow as tf
    return {k: tf.constant(v) for k, v in d.items()}


def _float64_of(name: str, model):
    import keras
    old = keras.config.floatx(), keras.config.dtype_policy().name
    keras.config.set_floatx("float64")
    keras.config.set_dtype_policy("float64")
    try:
        m64 = build(name)
    finally:
        keras.config.set_floatx(old[0])
        keras.config.set_dtype_policy(old[1])
    m64.set_weights([w.astype("float64") if w.dtype == np.float32 else w
                     for w in model.get_weights()])
    return m64


# ---------------------------------------------------------------- the checks

class Check:
    def __init__(self):
        self.failures = []

    def expect(self, ok: bool, what: str):
        if not ok:
            self.failures.append(what)
            print(f"  FAIL {what}")


def _err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not a.size:
        return 0.0, 0.0
    fin = np.isfinite(a) & np.isfinite(b)
    d = np.abs(a - b)[fin]
    rel = d / np.maximum(np.abs(b[fin]), 1e-6)
    return float(d.max(initial=0.0)), float(rel.max(initial=0.0))


def _same_nonfinite(a, b) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(np.isinf(a), np.isinf(b))


def check_infer(name, model, chk):
    import stitching
    import tensorflow as tf
    fast = stitching.function(lambda x: model(x, training=False))
    stock = tf.function(fast.python_function, reduce_retracing=True)
    t0 = time.perf_counter()
    fast(_tensors(data(name, 64)))
    first = time.perf_counter() - t0
    chk.expect(fast.wait(timeout=600), f"{name} infer: kernels not ready")
    chk.expect(not fast.background_errors, f"{name} infer: {fast.background_errors}")
    for n in (64, 7, 1):
        x = _tensors(data(name, n, seed=n))
        a, b = fast(x).numpy(), stock(x).numpy()
        mx, rel = _err(a, b)
        print(f"  infer batch {n}: max abs {mx:.3g}, max rel {rel:.3g} vs stock")
        chk.expect(np.allclose(a, b, rtol=1e-4, atol=1e-5) and _same_nonfinite(a, b),
                   f"{name} infer batch {n}: stitched differs from stock (max abs {mx:.3g})")
    x = data(name, 256, seed=3)
    m64 = _float64_of(name, model)
    x64 = {k: v.astype("float64") if v.dtype == np.float32 else v for k, v in x.items()}
    ref = tf.function(lambda d: m64(d, training=False))(_tensors(x64)).numpy()
    xs = _tensors(x)
    es = np.abs(fast(xs).numpy().astype("float64") - ref)
    et = np.abs(stock(xs).numpy().astype("float64") - ref)
    print(f"  infer vs float64: stitched max {es.max():.3g} mean {es.mean():.3g}; "
          f"stock max {et.max():.3g} mean {et.mean():.3g}")
    # within float rounding of stock's own error (a few ulps on a sum's order)
    chk.expect(es.max() <= 2 * et.max() + 1e-6 and es.mean() <= 1.5 * et.mean() + 1e-9,
               f"{name} infer: less accurate than stock against float64")
    print(f"  first call (tiered: stock TF answers while the kernels compile): {first:.3f} s")
    return fast


def check_train(name, chk, steps=20, batch=64):
    import keras
    import stitching
    import stitching.keras
    import tensorflow as tf
    x, y = data(name, steps * batch, seed=5), labels(name, steps * batch)
    w0 = build(name).get_weights()

    class Losses(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_train_batch_end(self, batch, logs=None):
            self.seen.append(float(logs["loss"]))

    def fit(stitched):
        m = build(name)
        m.set_weights(w0)
        m.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(name))
        if stitched:
            stitching.keras.stitch(m, stitching.Options(background_compile=False))
        rec = Losses()
        t0 = time.perf_counter()
        m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), epochs=1, verbose=0,
              callbacks=[rec])
        return m, np.array(rec.seen), time.perf_counter() - t0

    ms, ls, ts = fit(False)
    mf, lf, tf_ = fit(True)
    rel = float(np.max(np.abs(ls - lf) / np.maximum(np.abs(ls), 1e-12)))
    wd = max(float(np.max(np.abs(a - b))) for a, b in zip(ms.get_weights(), mf.get_weights()))
    print(f"  train {steps} steps: loss {ls[0]:.4f} -> {ls[-1]:.4f} stock, {lf[0]:.4f} -> "
          f"{lf[-1]:.4f} stitched; max rel loss diff {rel:.3g}; max weight diff {wd:.3g} "
          f"(fit {ts:.1f} s stock, {tf_:.1f} s stitched with its compile)")
    chk.expect(rel < 1e-4, f"{name} train: losses differ from stock Keras ({rel:.3g})")
    chk.expect(wd < 1e-3, f"{name} train: weights after fit differ ({wd:.3g})")
    return mf


SERVE = r"""
import json, sys, time
t0 = time.perf_counter()
import stitching
import numpy as np, tensorflow as tf
path, xs, out = sys.argv[1], sys.argv[2], sys.argv[3]
x = dict(np.load(xs, allow_pickle=True))
sig = tf.saved_model.load(path).signatures["serving_default"]
got = {}
for n in (33, 5, 1, 0):
    got[f"y{n}"] = list(sig(**{k: tf.constant(v[:n]) for k, v in x.items()}).values())[0].numpy()
    if n == 33:
        first = time.perf_counter() - t0
bad = {k: v.copy() for k, v in x.items()}
for k, v in bad.items():
    if v.dtype.kind == "f":
        v[0], v[1] = np.nan, np.inf
got["nan"] = list(sig(**{k: tf.constant(v[:4]) for k, v in bad.items()}).values())[0].numpy()
np.savez(out, **got)
print(json.dumps({"load_and_first_call_s": first}))
"""


def check_serve(name, model, chk, workdir):
    import stitching
    root = os.path.join(workdir, name)
    shutil.rmtree(root, ignore_errors=True)
    model.export(os.path.join(root, "src"), verbose=False)
    reports = stitching.rewrite_saved_model(os.path.join(root, "src"), os.path.join(root, "dst"))
    xs = os.path.join(root, "x.npz")
    np.savez(xs, **data(name, 33, seed=9))
    script = os.path.join(root, "serve.py")
    with open(script, "w") as f:
        f.write(SERVE)
    outs = {}
    for which in ("src", "dst"):
        out = os.path.join(root, f"y_{which}.npz")
        r = subprocess.run([sys.executable, script, os.path.join(root, which), xs, out],
                           capture_output=True, text=True, timeout=600)
        chk.expect(r.returncode == 0, f"{name} serve {which}: exit {r.returncode}: "
                   f"{r.stderr.strip().splitlines()[-1:] if r.stderr.strip() else ''}")
        if r.returncode:
            return reports
        t = json.loads(r.stdout.strip().splitlines()[-1])["load_and_first_call_s"]
        print(f"  serve {'rewritten' if which == 'dst' else 'original'}: fresh process, "
              f"import + load + first call {t:.2f} s")
        outs[which] = np.load(out)
    for k in ("y33", "y5", "y1", "y0"):
        a, b = outs["dst"][k], outs["src"][k]
        mx, rel = _err(a, b)
        print(f"  serve {k[1:]} rows: shape {a.shape}, max abs {mx:.3g}, max rel {rel:.3g}")
        chk.expect(a.shape == b.shape and np.allclose(a, b, rtol=1e-4, atol=1e-5)
                   and _same_nonfinite(a, b), f"{name} serve batch {k[1:]}: differs from stock")
    a, b = outs["dst"]["nan"].ravel()[:4], outs["src"]["nan"].ravel()[:4]
    print(f"  serve NaN/Inf rows: rewritten {np.round(a, 5)}, stock {np.round(b, 5)}"
          f"{'' if _same_nonfinite(a, b) else ' (NaN where stock dropped it: see docstring)'}")
    return reports


def check_report(name, report, chk, where):
    import stitching  # noqa: F401
    text = report.summary()
    print(f"  report ({where}): {text.splitlines()[1].strip()}")
    types = {}
    for node, op, why in report.unfused:
        types.setdefault(op, set()).add(why.split(":")[0])
    for op, whys in sorted(types.items()):
        print(f"    not fused {op}: {'; '.join(sorted(whys))[:160]}")
    for node, op, why in report.unfused:
        chk.expect("unknown rank" not in why, f"{name} report ({where}): {op} {node}: {why}")
        chk.expect(why and "by the planner" not in why,
                   f"{name} report ({where}): {op} {node} left without a reason ({why!r})")
    gathers = [u for u in report.unfused if u[1] == "GatherV2"]
    chk.expect(bool(gathers) and all("run-time indices" in u[2] for u in gathers),
               f"{name} report ({where}): embedding gathers without their reason")
    fused = {op for k in report.kernels for _, op in k.ops}
    chk.expect(not fused & {"LookupTableFindV2", "StringToHashBucketFast", "AsString"},
               f"{name} report ({where}): a lookup or hash in a kernel")


def check_speed(name, model, fast, chk, calls=200):
    import tensorflow as tf
    stock = tf.function(fast.python_function, reduce_retracing=True)
    print(f"  speed: load average {' '.join(f'{v:.2f}' for v in os.getloadavg())} "
          f"on {os.cpu_count()} CPUs")
    for n in (1, 256):
        x = _tensors(data(name, n, seed=n))
        fast(x)
        fast.wait()
        stock(x)
        fast(x)
        s, f = (t * 1e6 for t in _interleaved({"stock": lambda: stock(x),
                                                "stitched": lambda: fast(x)}, calls))
        print(f"  speed batch {n}: stock {s:.0f} us, stitched {f:.0f} us: {s / f:.2f}x "
              f"(medians of {calls} interleaved calls)")
    _train_speed(name, calls)


def _interleaved(calls: dict, n: int) -> tuple:
    """Median seconds of each of ``calls`` ({label: no-argument call}, stock first),
    over ``n`` rounds that alternate which runs first, so load meets both alike."""
    times = {k: [] for k in calls}
    for i in range(n):
        for label in (list(calls) if i % 2 else list(calls)[::-1]):
            t = time.perf_counter()
            calls[label]()
            times[label].append(time.perf_counter() - t)
    return tuple(float(np.median(v)) for v in times.values())


def _train_speed(name, steps, batch=256):
    """Keras train steps (Adam), stock and stitched, interleaved step by step: a whole
    ``fit`` per sample measured the machine's load more than the step."""
    import keras  # noqa: F401
    import stitching
    import stitching.keras
    import tensorflow as tf
    ds = tf.data.Dataset.from_tensor_slices(
        (data(name, batch * 8, seed=1), labels(name, batch * 8))).batch(batch).cache().repeat()
    fns = {}
    for label in ("stock", "stitched"):
        m = build(name)
        m.compile(optimizer="adam", loss=loss(name))
        if label == "stitched":
            stitching.keras.stitch(m, stitching.Options(background_compile=False))
        m.fit(ds, steps_per_epoch=2, verbose=0)
        fn, it = m.make_train_function(), iter(ds)
        fn(it)
        fns[label] = (fn, it)
    s, f = (t * 1e3 for t in _interleaved(
        {k: (lambda fn, it: lambda: fn(it))(*fns[k]) for k in ("stock", "stitched")}, steps))
    print(f"  speed train step batch {batch}: stock {s:.2f} ms, stitched {f:.2f} ms: "
          f"{s / f:.2f}x (medians of {steps} interleaved steps)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    ap.add_argument("--workdir", help="where the SavedModels go (default: a temporary "
                    "directory, removed)")
    args = ap.parse_args(argv)
    import tensorflow as tf  # noqa: F401
    import stitching  # noqa: F401
    chk = Check()
    workdir = args.workdir or tempfile.mkdtemp(prefix="recsys_check-")
    try:
        for name in args.models:
            print(f"== {name}")
            model = build(name)
            fast = None
            if {"infer", "report", "speed"} & set(args.checks):
                fast = check_infer(name, model, chk)
            if "report" in args.checks:
                check_report(name, fast.report, chk, "stitching.function")
            if "train" in args.checks:
                mf = check_train(name, chk)
                if "report" in args.checks:
                    check_report(name, mf.stitching_report.train, chk, "train step")
            if "serve" in args.checks:
                reports = check_serve(name, model, chk, workdir)
                if "report" in args.checks:
                    check_report(name, reports["serving_default"], chk, "rewritten SavedModel")
            if "speed" in args.checks:
                check_speed(name, model, fast, chk)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"{len(chk.failures)} failure(s)" + "".join(f"\n  {f}" for f in chk.failures))
    return 1 if chk.failures else 0


if __name__ == "__main__":
    sys.exit(main())
