"""Memory-intensive patterns lifted from real model code, for tests and benchmarks.

Each :class:`Pattern` is the body of a function written the way model code writes it
(tf.nn / tf.math / Keras layers), with its weights (gamma, beta, bias, batch-norm
statistics) captured by closure as ``tf.Variable`` or ``tf.constant`` -- a traced Keras
model captures variables the same way, so the graph the fuser sees looks like the real
thing: resource placeholders read by ``ReadVariableOp`` next to the data inputs.

Every pattern has two sizes with the same non-batch dims where weights are involved:

* ``"large"``: >= 16 MB of input, so the run is bandwidth-bound and the comparison is
  about bytes moved (the papers' regime);
* ``"small"``: a few tens of KB, so the run is latency-bound and the comparison is about
  per-op overhead (a fused kernel must not lose there).

The leading dim of every input is the batch dim; ``input_signature`` leaves it unknown
(``None``) because that is how serving code traces, and a fuser that only works with
static shapes is not the product.

``expected_kernels`` is the number of stitched kernels the pattern should become: one for
all of them (the point of stitching is that a reduction and its element-wise consumers
share one kernel).

``make_fn(tf.float64)`` builds the same function with float64 weights (same values), so
tests can check a float32 run against a float64 one.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

SIZES = ("large", "small")
# Sizes named by the bytes of the largest input ("16m" = 16 MiB), derived from "large"
# by scaling its batch (leading) dim, or for NHWC patterns the batch and then the
# spatial dims, so that the largest input is within a few percent of the target.  They
# place the same pattern in L2 (1m), in the last-level cache (4m), just below the
# output pool's 32 MiB line (16m) and above it (64m): issue 31's four sizes.
MIB_SIZES = ("1m", "4m", "16m", "64m")

# Input kinds: how inputs() fills an input.
FLOAT = "float"      # standard normal data (activations, logits)
MASK01 = "mask01"    # 0/1 float attention mask, mostly ones (padding at the end)
BOOL = "bool"        # boolean key mask, mostly True


@dataclass
class Pattern:
    """One memory-intensive pattern.

    name, description, source: identification (``source`` says which models write it so).
    build: ``build(dtype) -> fn``: creates the weights in ``dtype`` and returns
        ``fn(*tensors)``; use :meth:`make_fn` / :attr:`fn` rather than calling it.
    shapes: per size, the concrete shape of each input (batch dim first).
    input_kinds: per input, one of FLOAT / MASK01 / BOOL.
    expected_kernels: stitched kernels this pattern should become.
    """
    name: str
    description: str
    build: Callable[[tf.DType], Callable]
    shapes: Mapping[str, Sequence[tuple]]
    input_kinds: Sequence[str]
    expected_kernels: int = 1
    source: str = ""
    _fn_cache: dict = field(default_factory=dict, repr=False, compare=False)

    # ---- the function

    def make_fn(self, dtype=tf.float32) -> Callable:
        """The pattern's body with weights in ``dtype``; built once per dtype."""
        dtype = tf.as_dtype(dtype)
        if dtype not in self._fn_cache:
            fn = self.build(dtype)
            fn.__name__ = self.name  # readable names in traced graphs and HLO
            self._fn_cache[dtype] = fn
        return self._fn_cache[dtype]

    @property
    def fn(self) -> Callable:
        """The float32 body (weights created on first access)."""
        return self.make_fn(tf.float32)

    # ---- inputs

    def shapes_for(self, size: str) -> Sequence[tuple]:
        """The input shapes at ``size``: "large", "small" or one of MIB_SIZES."""
        if size in self.shapes:
            return self.shapes[size]
        if size not in MIB_SIZES:
            raise ValueError(f"pattern {self.name}: unknown size {size!r}; "
                             f"known: {', '.join(SIZES + MIB_SIZES)}")
        return _scaled(self.shapes["large"], self.input_kinds, int(size[:-1]) << 20)

    def input_signature(self, size: str = "small", dtype=tf.float32) -> tuple:
        """TensorSpecs with the batch (leading) dim unknown."""
        dtype = tf.as_dtype(dtype)
        specs = []
        for shape, kind in zip(self.shapes_for(size), self.input_kinds):
            d = tf.bool if kind == BOOL else dtype
            specs.append(tf.TensorSpec((None,) + tuple(shape[1:]), d))
        return tuple(specs)

    def inputs(self, size: str = "small", dtype=np.float32, seed: int | None = None) -> tuple:
        """Deterministic numpy inputs (seeded from the pattern name)."""
        if seed is None:
            seed = zlib.crc32(f"{self.name}/{size}".encode())
        rng = np.random.default_rng(seed)
        out = []
        for shape, kind in zip(self.shapes_for(size), self.input_kinds):
            out.append(_make_input(rng, shape, kind, dtype))
        return tuple(out)

    def input_bytes(self, size: str) -> int:
        """Bytes of the data inputs (float32 / bool), weights not included."""
        total = 0
        for shape, kind in zip(self.shapes_for(size), self.input_kinds):
            total += int(np.prod(shape)) * (1 if kind == BOOL else 4)
        return total


def _nbytes(shape, kind) -> int:
    return int(np.prod(shape)) * (1 if kind == BOOL else 4)


def _scaled(shapes, kinds, target: int) -> list:
    """``shapes`` (the "large" ones) resized so the largest input has ~``target`` bytes.
    The batch dim scales (every input shares it); NHWC inputs (4-D, all with the same H
    and W) also scale H and W together for what a whole batch step cannot reach."""
    want = shapes[0][0] * target / max(_nbytes(s, k) for s, k in zip(shapes, kinds))
    if not _same_spatial(shapes):
        b = max(1, round(want))
        return [(b,) + tuple(s[1:]) for s in shapes]
    b = max(1, math.floor(want + 0.05))
    g = math.sqrt(want / b)                  # the rest of the factor from H x W
    h, w = (max(1, round(d * g)) for d in shapes[0][1:3])
    return [(b, h, w) + tuple(s[3:]) for s in shapes]


def _same_spatial(shapes) -> bool:
    return all(len(s) == 4 and s[1:3] == shapes[0][1:3] and s[1] > 1 for s in shapes)


def _make_input(rng, shape, kind, dtype):
    if kind == FLOAT:
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    # Masks: each row keeps a random-length prefix (at least half), like padded batches.
    t = shape[-1]
    lengths = rng.integers(t // 2, t + 1, size=shape[:-1])
    keep = np.arange(t) < lengths[..., None]
    if kind == BOOL:
        return keep
    if kind == MASK01:
        return keep.astype(dtype)
    raise ValueError(f"unknown input kind {kind!r}")


# ---- weights, deterministic per (pattern, name) so float32 and float64 agree

def _rng(tag: str):
    return np.random.default_rng(zlib.crc32(tag.encode()))


def _var(tag, values, dtype):
    """A tf.Variable, the way Keras layers hold weights."""
    return tf.Variable(np.asarray(values).astype(dtype.as_numpy_dtype), trainable=True,
                       name=tag.replace("/", "_"))


def _const(values, dtype):
    return tf.constant(np.asarray(values).astype(dtype.as_numpy_dtype))


def _gamma(tag, n):
    return 1.0 + 0.1 * _rng(tag).standard_normal(n)


def _small(tag, n):
    return 0.1 * _rng(tag).standard_normal(n)


def _variance(tag, n):
    return _rng(tag).uniform(0.5, 1.5, n)


# ---- sizes shared by several patterns

D = 1024          # hidden size of the row patterns (norms, softmax)
FF = 4096         # feed-forward width (GELU patterns)
C = 256           # channels of the NHWC patterns
ROWS = {"large": 8192, "small": 8}                       # 8192 x 1024 f32 = 32 MiB
FF_ROWS = {"large": 2048, "small": 8}                    # 2048 x 4096 f32 = 32 MiB
NHWC = {"large": (8, 56, 56, C), "small": (1, 7, 7, C)}  # 25.7 MB / 50 KB


def _rows(d, rows=ROWS, n=1):
    return {s: [(rows[s], d)] * n for s in SIZES}


def _nhwc(n=1):
    return {s: [NHWC[s]] * n for s in SIZES}


# ---- the patterns. Each builder is `build(dtype) -> fn`.

def _layernorm_manual(dtype):
    # Hand-written LayerNorm as in many TF2 codebases (mean, variance via
    # squared_difference, rsqrt), weights as Keras-style variables.
    gamma = _var("ln_manual/gamma", _gamma("ln_manual/gamma", D), dtype)
    beta = _var("ln_manual/beta", _small("ln_manual/beta", D), dtype)

    def fn(x):
        mean = tf.reduce_mean(x, axis=-1, keepdims=True)
        var = tf.reduce_mean(tf.math.squared_difference(x, mean), axis=-1, keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta
    return fn


def _layernorm_keras(dtype):
    import keras
    ln = keras.layers.LayerNormalization(epsilon=1e-6, dtype=dtype.name)
    ln.build((None, D))
    ln.gamma.assign(_gamma("ln_keras/gamma", D).astype(dtype.as_numpy_dtype))
    ln.beta.assign(_small("ln_keras/beta", D).astype(dtype.as_numpy_dtype))

    def fn(x):
        return ln(x)
    fn.layer = ln  # keep the layer (and its variables) alive with the function
    return fn


def _add_layernorm(dtype):
    # BERT's output block: dense_out + bias + residual, then the TF1 contrib layer_norm
    # formulation (tf.nn.moments + tf.nn.batch_normalization).
    bias = _var("add_ln/bias", _small("add_ln/bias", D), dtype)
    gamma = _var("add_ln/gamma", _gamma("add_ln/gamma", D), dtype)
    beta = _var("add_ln/beta", _small("add_ln/beta", D), dtype)

    def fn(x, residual):
        h = tf.nn.bias_add(x, bias) + residual
        mean, var = tf.nn.moments(h, axes=[-1], keepdims=True)
        return tf.nn.batch_normalization(h, mean, var, offset=beta, scale=gamma,
                                         variance_epsilon=1e-12)
    return fn


def _rmsnorm(dtype):
    # T5 / LLaMA RMSNorm.
    weight = _var("rms/weight", _gamma("rms/weight", D), dtype)

    def fn(x):
        ms = tf.reduce_mean(tf.square(x), axis=-1, keepdims=True)
        return x * tf.math.rsqrt(ms + 1e-6) * weight
    return fn


def _softmax_tf(dtype):
    def fn(x):
        return tf.nn.softmax(x, axis=-1)
    return fn


def _softmax_manual(dtype):
    def fn(x):
        m = tf.reduce_max(x, axis=-1, keepdims=True)
        e = tf.exp(x - m)
        return e / tf.reduce_sum(e, axis=-1, keepdims=True)
    return fn


HEADS, SEQ = 12, 128
ATTN = {"large": [(32, HEADS, SEQ, SEQ), (32, 1, 1, SEQ)],       # 25 MB of scores
        "small": [(1, HEADS, SEQ // 4, SEQ // 4), (1, 1, 1, SEQ // 4)]}


def _attention_softmax(dtype):
    # BERT attention: scores * 1/sqrt(d_head) + (1 - mask) * -10000, softmax over keys.
    scale = 1.0 / math.sqrt(64.0)

    def fn(scores, mask):
        adder = (1.0 - mask) * -10000.0
        return tf.nn.softmax(scores * scale + adder, axis=-1)
    return fn


def _log_softmax(dtype):
    def fn(x):
        return tf.nn.log_softmax(x, axis=-1)
    return fn


def _logsumexp(dtype):
    def fn(x):
        return tf.reduce_logsumexp(x, axis=-1)
    return fn


def _bias_gelu_erf(dtype):
    # BERT's original gelu: 0.5 * x * (1 + erf(x / sqrt(2))) after the FF dense.
    bias = _var("gelu_erf/bias", _small("gelu_erf/bias", FF), dtype)

    def fn(x):
        h = x + bias
        return 0.5 * h * (1.0 + tf.math.erf(h / math.sqrt(2.0)))
    return fn


def _bias_gelu_tanh(dtype):
    bias = _var("gelu_tanh/bias", _small("gelu_tanh/bias", FF), dtype)

    def fn(x):
        return tf.nn.gelu(tf.nn.bias_add(x, bias), approximate=True)
    return fn


def _bias_gelu_tanh_manual(dtype):
    # GPT-2's gelu, written out.
    bias = _const(_small("gelu_tanh_manual/bias", FF), dtype)

    def fn(x):
        h = x + bias
        return 0.5 * h * (1.0 + tf.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * tf.pow(h, 3))))
    return fn


def _bias_gelu_residual(dtype):
    bias = _var("gelu_res/bias", _small("gelu_res/bias", FF), dtype)

    def fn(x, residual):
        return tf.nn.gelu(tf.nn.bias_add(x, bias), approximate=False) + residual
    return fn


def _swiglu(dtype):
    # LLaMA MLP gate: silu(x W_gate) * (x W_up), after the two matmuls.
    def fn(gate, up):
        return tf.nn.silu(gate) * up
    return fn


def _bn_vars(tag, dtype):
    return (_var(f"{tag}/gamma", _gamma(f"{tag}/gamma", C), dtype),
            _var(f"{tag}/beta", _small(f"{tag}/beta", C), dtype),
            _var(f"{tag}/moving_mean", _small(f"{tag}/moving_mean", C), dtype),
            _var(f"{tag}/moving_variance", _variance(f"{tag}/moving_variance", C), dtype))


def _bn_swish(dtype):
    # EfficientNet block tail: inference batch norm as FusedBatchNormV3, then swish.
    gamma, beta, mean, var = _bn_vars("bn_swish", dtype)

    def fn(x):
        if x.dtype == tf.float64:
            # FusedBatchNormV3 has no float64 kernel; the float64 reference of this
            # pattern uses the same formula unfused.
            y = tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3)
        else:
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                x, gamma, beta, mean=mean, variance=var, epsilon=1e-3, is_training=False)
        return y * tf.sigmoid(y)
    return fn


def _bn_relu6(dtype):
    # MobileNetV2 block: inference batch norm written with tf.nn.batch_normalization, relu6.
    gamma, beta, mean, var = _bn_vars("bn_relu6", dtype)

    def fn(x):
        return tf.nn.relu6(tf.nn.batch_normalization(x, mean, var, beta, gamma, 1e-3))
    return fn


def _squeeze_excite(dtype):
    # The memory-intensive part of squeeze-and-excitation: global mean over H, W and a
    # sigmoid gate broadcast back over the map (the two tiny dense layers in between
    # are left out: they would be opaque ops splitting the pattern).
    def fn(x):
        s = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
        return x * tf.sigmoid(s)
    return fn


def _l2_normalize(dtype):
    def fn(x):
        return tf.math.l2_normalize(x, axis=-1, epsilon=1e-12)
    return fn


def _center_axis0(dtype):
    # A leading-axis (column) reduction feeding an element-wise consumer: centring
    # features over the batch, as in batch statistics or whitening.
    def fn(x):
        return x - tf.reduce_mean(x, axis=0, keepdims=True)
    return fn


DIEN_T = 256
DIEN = {"large": [(32768, DIEN_T), (32768, DIEN_T)],   # 32 MiB scores + 8 MiB mask
        "small": [(8, DIEN_T), (8, DIEN_T)]}


def _dien_masked_softmax(dtype):
    # DIEN/DIN attention over a user's behaviour sequence: padded keys replaced with a
    # huge negative via tf.where, then softmax.
    def fn(scores, key_mask):
        paddings = tf.ones_like(scores) * (-2.0 ** 32 + 1)
        return tf.nn.softmax(tf.where(key_mask, scores, paddings), axis=-1)
    return fn


PATTERNS: dict[str, Pattern] = {}


def _register(name, description, build, shapes, kinds, source="", expected_kernels=1):
    PATTERNS[name] = Pattern(name=name, description=description, build=build,
                             shapes=shapes, input_kinds=tuple(kinds),
                             expected_kernels=expected_kernels, source=source)


_register("layernorm_manual", "LayerNorm by hand: mean, squared_difference variance, rsqrt, gamma/beta",
          _layernorm_manual, _rows(D), [FLOAT], "TF2 model code")
_register("layernorm_keras", "keras.layers.LayerNormalization",
          _layernorm_keras, _rows(D), [FLOAT], "Keras models")
_register("add_layernorm", "bias + residual add, then tf.nn.moments / batch_normalization LayerNorm",
          _add_layernorm, _rows(D, n=2), [FLOAT, FLOAT], "BERT output block")
_register("rmsnorm", "RMSNorm: x * rsqrt(mean(x^2) + eps) * w",
          _rmsnorm, _rows(D), [FLOAT], "T5, LLaMA")
_register("softmax_tf", "tf.nn.softmax over the last axis",
          _softmax_tf, _rows(D), [FLOAT], "classifiers, attention")
_register("softmax_manual", "softmax by hand: max, exp, sum, div",
          _softmax_manual, _rows(D), [FLOAT], "model code")
_register("attention_softmax", "scores [B,H,T,T] * scale + (1-mask[B,1,1,T]) * -1e4, softmax",
          _attention_softmax, ATTN, [FLOAT, MASK01], "BERT attention")
_register("log_softmax", "tf.nn.log_softmax",
          _log_softmax, _rows(D), [FLOAT], "LM heads, losses")
_register("logsumexp", "tf.reduce_logsumexp over the last axis",
          _logsumexp, _rows(D), [FLOAT], "losses, CRF")
_register("bias_gelu_erf", "x + b, 0.5 x (1 + erf(x / sqrt 2))",
          _bias_gelu_erf, _rows(FF, FF_ROWS), [FLOAT], "BERT FF")
_register("bias_gelu_tanh", "tf.nn.bias_add + tf.nn.gelu(approximate=True)",
          _bias_gelu_tanh, _rows(FF, FF_ROWS), [FLOAT], "TF2 model garden")
_register("bias_gelu_tanh_manual", "x + b, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))",
          _bias_gelu_tanh_manual, _rows(FF, FF_ROWS), [FLOAT], "GPT-2")
_register("bias_gelu_residual", "tf.nn.gelu(bias_add(x, b)) + residual",
          _bias_gelu_residual, _rows(FF, FF_ROWS, n=2), [FLOAT, FLOAT], "MLP blocks")
_register("swiglu", "silu(gate) * up",
          _swiglu, _rows(FF, FF_ROWS, n=2), [FLOAT, FLOAT], "LLaMA MLP")
_register("bn_swish", "FusedBatchNormV3 (inference) then x * sigmoid(x), NHWC",
          _bn_swish, _nhwc(), [FLOAT], "EfficientNet")
_register("bn_relu6", "tf.nn.batch_normalization (inference) then relu6, NHWC",
          _bn_relu6, _nhwc(), [FLOAT], "MobileNetV2")
_register("squeeze_excite", "mean over H,W, sigmoid gate, broadcast multiply, NHWC",
          _squeeze_excite, _nhwc(), [FLOAT], "SE-ResNet, EfficientNet")
_register("l2_normalize", "tf.math.l2_normalize over the last axis",
          _l2_normalize, _rows(D), [FLOAT], "embedding / retrieval heads")
_register("center_axis0", "x - reduce_mean(x, axis=0): leading-axis reduction with a consumer",
          _center_axis0, _rows(D), [FLOAT], "feature whitening, batch stats")
_register("dien_masked_softmax", "tf.where(key_mask, scores, -2^32+1) then softmax",
          _dien_masked_softmax, DIEN, [FLOAT, BOOL], "DIN / DIEN attention")


def get(name: str) -> Pattern:
    try:
        return PATTERNS[name]
    except KeyError:
        raise KeyError(f"no pattern {name!r}; known: {', '.join(PATTERNS)}") from None


def all_patterns() -> list[Pattern]:
    return list(PATTERNS.values())
