"""Whole models for end-to-end benchmarks: three keras.applications CNNs and four
Transformers built from Keras layers as users write them -- a BERT-style encoder, a
Llama-style and a GPT-2-style decoder and a ViT-style classifier (``weights=None`` /
random weights: nothing is downloaded, and random weights run exactly as fast as
trained ones).

Sizes are chosen for the project's 2-core CPU machine: real input resolutions (224x224)
and the batch sizes a server would use (1 and 8), but few enough models that the whole
suite stays under about ten minutes with three modes side by side.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf


def transformer_encoder(num_layers: int = 4, d_model: int = 256, heads: int = 4,
                        ff: int = 1024, seq_len: int = 128, *, epsilon: float = 1e-12,
                        name: str = "transformer_encoder"):
    """A BERT-style (post-LayerNorm) encoder over [batch, seq_len, d_model] embeddings.

    Built from keras.layers.MultiHeadAttention, LayerNormalization and
    Dense(activation="gelu"), as Keras users write it; the batch dim is unknown.
    Embedding lookup is left out (the input is already embedded), so the model is all
    matmuls plus the memory-intensive glue between them: attention softmax, residual
    adds, LayerNorms, bias + GELU.
    """
    import keras
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
    inp = keras.Input(shape=(seq_len, d_model), name="embeddings")
    x = inp
    for i in range(num_layers):
        attn = keras.layers.MultiHeadAttention(num_heads=heads, key_dim=d_model // heads,
                                               name=f"layer{i}_attention")(x, x)
        x = keras.layers.LayerNormalization(epsilon=epsilon, name=f"layer{i}_attn_ln")(x + attn)
        h = keras.layers.Dense(ff, activation="gelu", name=f"layer{i}_ff1")(x)
        h = keras.layers.Dense(d_model, name=f"layer{i}_ff2")(h)
        x = keras.layers.LayerNormalization(epsilon=epsilon, name=f"layer{i}_ff_ln")(x + h)
    return keras.Model(inp, x, name=name)


def llama_decoder(num_layers: int = 2, d_model: int = 256, heads: int = 8,
                  kv_heads: int = 2, ff: int = 688, seq_len: int = 128, *,
                  epsilon: float = 1e-6, name: str = "llama_decoder"):
    """A Llama-style (pre-RMSNorm) decoder over [batch, seq_len, d_model] embeddings:
    RMSNorm, rotary position embeddings (rotate-half: split, negate, concat), causal
    grouped-query attention (kv_heads K/V heads repeated to ``heads``), SwiGLU.

    Written with Keras layers and ``keras.ops`` the way Keras users write such blocks
    (keras_hub's Llama has the same structure), random weights; the batch dim is
    unknown.  Its layout ops (the rotary halves, head transposes, K/V repeats) are what
    stitching/schedule/layout.py folds into kernels.
    """
    import keras
    from keras import ops
    hd = d_model // heads
    inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    ang = np.arange(seq_len, dtype=np.float32)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], -1)[:, None, :]               # [T, 1, hd]
    cos, sin = np.cos(ang), np.sin(ang)
    mask = np.triu(np.full((seq_len, seq_len), -1e9, np.float32), 1)

    class RMSNorm(keras.layers.Layer):
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

        def call(self, x):
            v = ops.mean(ops.square(x), axis=-1, keepdims=True)
            return x * ops.rsqrt(v + epsilon) * self.w

    def rope(x):
        x1, x2 = ops.split(x, 2, axis=-1)
        return x * cos + ops.concatenate([-x2, x1], axis=-1) * sin

    class Attention(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.q = keras.layers.Dense(heads * hd, use_bias=False)
            self.k = keras.layers.Dense(kv_heads * hd, use_bias=False)
            self.v = keras.layers.Dense(kv_heads * hd, use_bias=False)
            self.o = keras.layers.Dense(d_model, use_bias=False)

        def call(self, x):
            q = rope(ops.reshape(self.q(x), (-1, seq_len, heads, hd)))
            k = rope(ops.reshape(self.k(x), (-1, seq_len, kv_heads, hd)))
            v = ops.reshape(self.v(x), (-1, seq_len, kv_heads, hd))
            k = ops.repeat(k, heads // kv_heads, axis=2)
            v = ops.repeat(v, heads // kv_heads, axis=2)
            q, k, v = (ops.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
            s = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * (1.0 / np.sqrt(hd)) + mask
            a = ops.matmul(ops.softmax(s, axis=-1), v)
            a = ops.reshape(ops.transpose(a, (0, 2, 1, 3)), (-1, seq_len, d_model))
            return self.o(a)

    inp = keras.Input(shape=(seq_len, d_model), name="embeddings")
    x = inp
    for i in range(num_layers):
        x = x + Attention(name=f"layer{i}_attention")(RMSNorm(name=f"layer{i}_ln1")(x))
        h = RMSNorm(name=f"layer{i}_ln2")(x)
        g = keras.layers.Dense(ff, use_bias=False, name=f"layer{i}_gate")(h)
        u = keras.layers.Dense(ff, use_bias=False, name=f"layer{i}_up")(h)
        x = x + keras.layers.Dense(d_model, use_bias=False, name=f"layer{i}_down")(
            ops.silu(g) * u)
    return keras.Model(inp, RMSNorm(name="final_ln")(x), name=name)


def gpt2_decoder(num_layers: int = 4, d_model: int = 256, heads: int = 4, ff: int = 1024,
                 seq_len: int = 128, *, epsilon: float = 1e-5, name: str = "gpt2_decoder"):
    """A GPT-2-style (pre-LayerNorm) decoder over [batch, seq_len, d_model] embeddings:
    causal keras.layers.MultiHeadAttention (``use_causal_mask=True``: Keras builds the
    lower-triangular mask in the graph), the tanh approximation of GELU as GPT-2 has
    it, a final LayerNorm.  Random weights; the batch dim is unknown."""
    import keras
    if d_model % heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
    inp = keras.Input(shape=(seq_len, d_model), name="embeddings")
    x = inp
    for i in range(num_layers):
        h = keras.layers.LayerNormalization(epsilon=epsilon, name=f"layer{i}_ln1")(x)
        x = x + keras.layers.MultiHeadAttention(
            num_heads=heads, key_dim=d_model // heads, name=f"layer{i}_attention")(
                h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization(epsilon=epsilon, name=f"layer{i}_ln2")(x)
        h = keras.layers.Dense(ff, name=f"layer{i}_ff1")(h)
        h = keras.layers.Activation(lambda t: keras.activations.gelu(t, approximate=True),
                                    name=f"layer{i}_gelu")(h)
        x = x + keras.layers.Dense(d_model, name=f"layer{i}_ff2")(h)
    return keras.Model(inp, keras.layers.LayerNormalization(epsilon=epsilon,
                                                            name="final_ln")(x), name=name)


def vit_encoder(num_layers: int = 4, d_model: int = 192, heads: int = 3, ff: int = 768,
                image: int = 224, patch: int = 16, classes: int = 1000, *,
                epsilon: float = 1e-6, name: str = "vit_encoder"):
    """A ViT-style classifier (ViT-Ti widths, fewer layers) over [batch, image, image, 3]
    pixels: a strided Conv2D patch embedding, a class token broadcast to the run-time
    batch and concatenated, learned position embeddings, pre-LayerNorm encoder blocks
    (keras.layers.MultiHeadAttention, exact GELU), a final LayerNorm and a Dense head on
    the class token.  Random weights; the batch dim is unknown."""
    import keras
    from keras import ops
    if d_model % heads or image % patch:
        raise ValueError(f"d_model={d_model} must divide by heads={heads} and "
                         f"image={image} by patch={patch}")
    tokens = (image // patch) ** 2

    class Tokens(keras.layers.Layer):
        """[class token; patches] + position embeddings."""
        def build(self, shape):
            self.cls = self.add_weight(shape=(1, 1, d_model), initializer="random_normal")
            self.pos = self.add_weight(shape=(1, tokens + 1, d_model),
                                       initializer="random_normal")

        def call(self, x):
            cls = ops.broadcast_to(self.cls, (ops.shape(x)[0], 1, d_model))
            return ops.concatenate([cls, x], axis=1) + self.pos

    inp = keras.Input(shape=(image, image, 3), name="pixels")
    x = keras.layers.Rescaling(1.0 / 127.5, offset=-1.0)(inp)
    x = keras.layers.Conv2D(d_model, patch, strides=patch, name="patch_embed")(x)
    x = Tokens(name="tokens")(keras.layers.Reshape((tokens, d_model))(x))
    for i in range(num_layers):
        h = keras.layers.LayerNormalization(epsilon=epsilon, name=f"layer{i}_ln1")(x)
        x = x + keras.layers.MultiHeadAttention(
            num_heads=heads, key_dim=d_model // heads, name=f"layer{i}_attention")(h, h)
        h = keras.layers.LayerNormalization(epsilon=epsilon, name=f"layer{i}_ln2")(x)
        h = keras.layers.Dense(ff, activation="gelu", name=f"layer{i}_ff1")(h)
        x = x + keras.layers.Dense(d_model, name=f"layer{i}_ff2")(h)
    x = keras.layers.LayerNormalization(epsilon=epsilon, name="final_ln")(x)
    return keras.Model(inp, keras.layers.Dense(classes, name="head")(x[:, 0]), name=name)


def rnn_encoder(seq_len: int = 50, features: int = 32, units: int = 64, classes: int = 10,
                name: str = "rnn_encoder"):
    """A recurrent classifier: LSTM and GRU over the sequence, LayerNorm, a
    bidirectional LSTM, a Dense head.  Each recurrent layer runs its cell in a
    ``tf.while_loop`` that reads the weights (tf/control_flow.py)."""
    import keras
    inp = keras.Input((seq_len, features), name="sequence")
    h = keras.layers.LSTM(units, return_sequences=True, name="lstm")(inp)
    h = keras.layers.GRU(units, return_sequences=True, name="gru")(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    h = keras.layers.Bidirectional(keras.layers.LSTM(units // 2), name="bilstm")(h)
    return keras.Model(inp, keras.layers.Dense(classes, name="head")(h), name=name)


@dataclass
class ModelCase:
    """A model at one input shape, for benchmarks.

    name: short id used on the command line (``--only``) and in tables.
    build: ``build() -> keras.Model`` (fresh random weights, seeded).
    input_shape: per-example shape (no batch dim).
    batch_sizes: the batch sizes to benchmark.
    kind: "cnn", "transformer" (sequences of embeddings) or "vit" (images into a
    Transformer); images are given pixel-like ranges.
    """
    name: str
    description: str
    build: Callable[[], object]
    input_shape: tuple
    batch_sizes: Sequence[int] = (1, 8)
    kind: str = "cnn"
    _model: object = field(default=None, repr=False, compare=False)

    @property
    def model(self):
        """The Keras model, built once."""
        if self._model is None:
            import keras
            keras.utils.set_random_seed(zlib.crc32(self.name.encode()) & 0x7FFFFFFF)
            self._model = self.build()
        return self._model

    def make_fn(self) -> Callable:
        """``fn(x)``: inference call of the model (training=False), for tf.function."""
        model = self.model

        def fn(x):
            return model(x, training=False)
        fn.__name__ = self.name.replace("-", "_")
        return fn

    def input_signature(self) -> tuple:
        return (tf.TensorSpec((None,) + tuple(self.input_shape), tf.float32),)

    def inputs(self, batch: int) -> tuple:
        rng = np.random.default_rng(zlib.crc32(f"{self.name}/{batch}".encode()))
        x = rng.standard_normal((batch,) + tuple(self.input_shape), dtype=np.float32)
        if self.kind in ("cnn", "vit"):
            # Images: keras.applications preprocessing expects pixel-like ranges.
            x = np.clip(127.5 + 60.0 * x, 0.0, 255.0).astype(np.float32)
        return (x,)


def _app(ctor_name):
    def build():
        import keras
        ctor = getattr(keras.applications, ctor_name)
        return ctor(weights=None, input_shape=(224, 224, 3))
    return build


TRANSFORMER_CONFIG = dict(num_layers=4, d_model=256, heads=4, ff=1024, seq_len=128)

MODELS: dict[str, ModelCase] = {}


def _register(case: ModelCase):
    MODELS[case.name] = case


_register(ModelCase("resnet50", "keras.applications.ResNet50, 224x224, weights=None",
                    _app("ResNet50"), (224, 224, 3)))
_register(ModelCase("mobilenet_v2", "keras.applications.MobileNetV2, 224x224, weights=None",
                    _app("MobileNetV2"), (224, 224, 3)))
_register(ModelCase("efficientnet_b0", "keras.applications.EfficientNetB0, 224x224, weights=None",
                    _app("EfficientNetB0"), (224, 224, 3)))
def _sequence_case(name: str, description: str, build, config: dict):
    """A Transformer over [batch, seq_len, d_model] embeddings, built from ``config``."""
    _register(ModelCase(name, description.format(**config), lambda: build(**config),
                        (config["seq_len"], config["d_model"]), kind="transformer"))


_sequence_case("transformer", "Keras Transformer encoder, post-LN, {num_layers} layers, "
               "d_model {d_model}, {heads} heads, ff {ff}, seq {seq_len}",
               transformer_encoder, TRANSFORMER_CONFIG)
LLAMA_CONFIG = dict(num_layers=2, d_model=256, heads=8, kv_heads=2, ff=688, seq_len=128)
_sequence_case("llama_decoder", "Llama-style decoder (RMSNorm, rotary embeddings, GQA, "
               "SwiGLU), {num_layers} layers, d_model {d_model}, {heads} heads / "
               "{kv_heads} KV heads, ff {ff}, seq {seq_len}", llama_decoder, LLAMA_CONFIG)
GPT2_CONFIG = dict(num_layers=4, d_model=256, heads=4, ff=1024, seq_len=128)
_sequence_case("gpt2_decoder", "GPT-2-style decoder, pre-LN, causal attention, tanh GELU, "
               "{num_layers} layers, d_model {d_model}, {heads} heads, ff {ff}, "
               "seq {seq_len}", gpt2_decoder, GPT2_CONFIG)
RNN_CONFIG = dict(seq_len=50, features=32, units=64)
_register(ModelCase(
    "rnn_encoder", "Keras LSTM {units} -> GRU {units} -> LayerNorm -> bidirectional LSTM "
    "{half}, seq {seq_len}, features {features}".format(half=RNN_CONFIG["units"] // 2,
                                                         **RNN_CONFIG),
    lambda: rnn_encoder(**RNN_CONFIG), (RNN_CONFIG["seq_len"], RNN_CONFIG["features"]),
    kind="transformer"))
VIT_CONFIG = dict(num_layers=4, d_model=192, heads=3, ff=768, image=224, patch=16)
_register(ModelCase(
    "vit_encoder",
    "ViT-style classifier (ViT-Ti widths), 224x224 / 16x16 patches, {num_layers} layers, "
    "d_model {d_model}, {heads} heads, ff {ff}, class token".format(**VIT_CONFIG),
    lambda: vit_encoder(**VIT_CONFIG), (224, 224, 3), kind="vit"))

CNN_MODELS = [m for m in MODELS.values() if m.kind == "cnn"]


def get(name: str) -> ModelCase:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"no model {name!r}; known: {', '.join(MODELS)}") from None


def all_models() -> list[ModelCase]:
    return list(MODELS.values())


def small_cnn(size: int = 16, channels: int = 8, classes: int = 10, name: str = "small_cnn"):
    """A MobileNet-like CNN small enough for tests (dumps, notebooks): Conv + BN + ReLU6,
    a depthwise block with a squeeze-excite gate and a residual add, global pooling,
    Dense + softmax.  Input [batch, size, size, 3]; batch unknown."""
    import keras
    L = keras.layers
    inp = keras.Input(shape=(size, size, 3), name="image")
    x = L.Conv2D(channels, 3, padding="same", use_bias=False, name="stem")(inp)
    x = L.BatchNormalization(name="stem_bn")(x)
    x = L.ReLU(6.0, name="stem_relu6")(x)
    h = L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw")(x)
    h = L.BatchNormalization(name="dw_bn")(h)
    h = L.Activation("swish", name="dw_swish")(h)
    s = L.GlobalAveragePooling2D(keepdims=True, name="se_pool")(h)
    s = L.Conv2D(max(1, channels // 4), 1, activation="relu", name="se_reduce")(s)
    s = L.Conv2D(channels, 1, activation="sigmoid", name="se_expand")(s)
    h = L.Multiply(name="se_gate")([h, s])
    x = L.Add(name="residual")([x, h])
    x = L.GlobalAveragePooling2D(name="pool")(x)
    out = L.Dense(classes, activation="softmax", name="logits")(x)
    return keras.Model(inp, out, name=name)


def frozen_softmax_graph_def(width: int = 16):
    """A small frozen GraphDef (placeholder ``x`` [None, width] -> ``y``, a softmax of
    ``3x - mean(x)``): the graph file the serving and untrusted-input tests rewrite,
    load and tamper with.  Its reference: ``softmax_reference``."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, width], name="x")
        tf.nn.softmax(x * 3.0 - tf.reduce_mean(x, -1, keepdims=True), name="y")
    return g.as_graph_def()


def softmax_reference(x):
    """``frozen_softmax_graph_def``'s output for a numpy ``x``, through eager TF."""
    return tf.nn.softmax(x * 3.0 - x.mean(-1, keepdims=True)).numpy()
